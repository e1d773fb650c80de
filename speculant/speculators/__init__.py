"""Speculators (drafters): the interface (`base`), the registry, every drafter kind, the chain."""
