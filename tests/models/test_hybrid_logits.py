"""Hybrid families against Hugging Face transformers: random weights at a realistic width
(hidden 256, 4-6 layers), fp32 logits within 1e-3 on prompts of 1-600 tokens, alone, split into
chunks, and batched with other sequences' chunks and decode rows in one forward."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from hybrid_models import VOCAB, Runner, hf_logits, load_ours, save_hf_model  # noqa: E402

from speculant.engine.forward_batch import SeqChunk  # noqa: E402

TOL = 1e-3
VARIANTS = {
    # name: (family, transformers config overrides)
    "lfm2": ("lfm2", dict(num_layers=6, full_attn_idxs=[1, 3, 5])),
    "qwen3_next_dense": ("qwen3_next", dict(num_layers=4)),
    "qwen3_next_moe": ("qwen3_next", dict(num_layers=4, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=128, mlp_only_layers=[2],
                                          shared_expert_intermediate_size=256)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(folder, family, seed=0, **overrides)
    return hf, load_ours(folder)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_dev(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("length", [1, 17, 600])
def test_one_prompt_in_one_forward_matches_transformers(pair, length):
    """Every position's logits of a lone prompt."""
    hf, ours = pair
    ids = tokens(length, seed=length)
    runner = Runner(ours)
    runner.add(0)
    got = runner.run([SeqChunk(0, 0, ids, num_logits=length)]).logits
    assert max_dev(got, hf_logits(hf, ids)) < TOL


def test_prompt_split_into_chunks_then_decoded_matches_transformers(pair):
    """A 600-token prompt in chunks of 1, 63, 200 and 336 (state carried across forwards), then
    6 tokens decoded one per forward."""
    hf, ours = pair
    ids = tokens(606, seed=5)
    runner = Runner(ours)
    runner.add(0)
    got, start = [], 0
    for n in (1, 63, 200, 336, 1, 1, 1, 1, 1, 1):
        got.append(runner.run([SeqChunk(0, start, ids[start:start + n], num_logits=n)]).logits)
        start += n
    assert start == len(ids) and max_dev(torch.cat(got), hf_logits(hf, ids)) < TOL


def test_sequences_of_different_lengths_batched_match_transformers(pair):
    """Four sequences in the same forwards: whole prompts, a prompt split across two steps,
    multi-token decode rows and single-token rows side by side (ragged batch)."""
    hf, ours = pair
    seqs = {0: tokens(131, seed=10), 1: tokens(300, seed=11), 2: tokens(6, seed=12),
            3: tokens(45, seed=13)}
    steps = [  # per step: seq -> tokens in its chunk
        {0: 127, 1: 100, 2: 1, 3: 40},
        {0: 4, 1: 200, 2: 5, 3: 1},
        {3: 4},
    ]
    runner = Runner(ours)
    for s in seqs:
        runner.add(s)
    done = {s: 0 for s in seqs}
    got = {s: [] for s in seqs}
    for step in steps:
        chunks = [SeqChunk(s, done[s], seqs[s][done[s]:done[s] + n], num_logits=n)
                  for s, n in step.items()]
        out = runner.run(chunks)
        for row, chunk in enumerate(chunks):
            rows = slice(out_rows(out, chunks, row), out_rows(out, chunks, row + 1))
            got[chunk.seq_id].append(out.logits[rows])
            done[chunk.seq_id] += len(chunk.token_ids)
    for s, ids in seqs.items():
        assert done[s] == len(ids)
        assert max_dev(torch.cat(got[s]), hf_logits(hf, ids)) < TOL, f"sequence {s}"


def out_rows(out, chunks, row: int) -> int:
    # every chunk asks for all its logits: row offsets are chunk-length prefix sums
    return sum(len(c.token_ids) for c in chunks[:row])


def test_hidden_states_returned_for_the_layers_asked(pair):
    """batch.hidden_layers selects which layers' residual streams come back, [T, hidden]."""
    from speculant.engine.forward_batch import build_forward_batch

    _, ours = pair
    runner = Runner(ours)
    runner.add(0)
    batch = build_forward_batch(runner.kv, [SeqChunk(0, 0, tokens(9, seed=1), 1)],
                                hidden_layers=(0, 2))
    out = ours.forward(batch, runner.kv, runner.states.batch([0]))
    assert sorted(out.hidden_states) == [0, 2]
    assert out.hidden_states[2].shape == (9, ours.config.hidden_size)
    # a chunk wanting its newest rows only gets those rows of the full capture
    runner.add(1)
    batch = build_forward_batch(runner.kv, [SeqChunk(1, 0, tokens(9, seed=1), 1,
                                                     num_feature_rows=3)], hidden_layers=(2,))
    newest = ours.forward(batch, runner.kv, runner.states.batch([1])).hidden_states[2]
    assert torch.equal(newest, out.hidden_states[2][6:])
