"""The engine core: scheduling, sequences, the paged KV cache, forward batches, sampling and verification."""
