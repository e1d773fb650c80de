"""The benchmark harness: runs, peers (transformers, OpenAI endpoints), replay, reports."""
