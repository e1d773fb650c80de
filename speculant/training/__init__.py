"""Training drafters from the target's own outputs: distilled draft models (and heads)."""
