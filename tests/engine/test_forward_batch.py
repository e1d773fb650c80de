"""build_forward_batch lays a ragged batch out as flat tensors: every field holds what its
chunks say, whatever else is in the batch."""
import torch

from speculant.engine.forward_batch import SeqChunk, build_forward_batch
from speculant.engine.kv_cache import KVCache


def test_fields_of_a_ragged_batch_with_prompt_chunks_and_feature_rows():
    cache = KVCache(1, 1, 8, num_blocks=64, block_size=4)
    for s in (0, 1):
        cache.allocate(s)
    cache.reserve(0, 6)
    cache.set_length(0, 6)  # sequence 0 decodes at position 6; sequence 1 starts its prompt
    chunks = [SeqChunk(0, 6, [11, 12, 13], num_logits=3, num_feature_rows=1),
              SeqChunk(1, 0, [21, 22, 23, 24, 25], num_logits=1, num_prompt_tokens=9)]
    b = build_forward_batch(cache, chunks, hidden_layers=(2,))
    assert b.token_ids.tolist() == [11, 12, 13, 21, 22, 23, 24, 25]
    assert b.positions.tolist() == [6, 7, 8, 0, 1, 2, 3, 4]
    assert b.positions_i32().dtype == torch.int32
    assert b.positions_i32().tolist() == b.positions.tolist()
    assert b.slot_mapping.tolist() == cache.slots(0, 6, 3) + cache.slots(1, 0, 5)
    assert b.token_seq.dtype == torch.int32 and b.token_seq.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert b.logits_indices.tolist() == [0, 1, 2, 7]
    assert b.cu_num_tokens == [0, 3, 8] and b.cu_num_logits == [0, 3, 4]
    assert b.hidden_rows.tolist() == [2, 3, 4, 5, 6, 7] and b.cu_num_hidden == [0, 1, 6]
    assert b.prompt_lens.tolist() == [0, 9]
    tables = [cache.block_table(0), cache.block_table(1)]
    width = max(len(t) for t in tables)
    assert b.block_tables.dtype == torch.int32
    assert b.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]


def test_a_decode_batch_has_no_prompt_lengths_and_every_hidden_row():
    cache = KVCache(1, 1, 8, num_blocks=16, block_size=4)
    for s in (3, 5):
        cache.allocate(s)
        cache.reserve(s, 5)
        cache.set_length(s, 5)
    b = build_forward_batch(cache, [SeqChunk(3, 5, [7]), SeqChunk(5, 5, [8, 9], num_logits=2)],
                            hidden_layers=(1,))
    assert b.prompt_lens is None and b.hidden_rows is None and b.cu_num_hidden == [0, 1, 3]
    assert b.token_ids.tolist() == [7, 8, 9] and b.positions_i32().tolist() == [5, 5, 6]
    assert b.block_tables.shape == (2, 2) and b.logits_indices.tolist() == [0, 1, 2]
