"""Model families, their configuration, weight loading and tokenizers."""
