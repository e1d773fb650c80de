"""Prompt sets: reading the dev prompts schema and turning records into prompts."""
