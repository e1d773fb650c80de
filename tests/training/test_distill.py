"""speculant distill: a tiny run yields a draft the engine loads (greedy output exact); the export
path reproduces the target's forward; bad arguments fail clearly."""
import argparse
import dataclasses
import json
import os

import pytest
import torch

from conftest import TEST_THREADS
from speculant.training.distill import (EMBED_SHARD, LAYERS_SHARD, TrainableDraft, add_distill_args,
                               distill_loss, pack_rows, run_distill, save_draft, select_layers,
                               simulated_acceptance)

PROMPTS = [  # two to train on, one held out (qa is judged, so never trained on)
    {"id": "t1", "category": "gsm8k", "mode": "chat", "turns": ["What is 12 + 30? Explain."]},
    {"id": "t2", "category": "code_completion", "mode": "completion", "turns": ["def add(a, b):\n"]},
    {"id": "h1", "category": "qa", "mode": "chat", "turns": ["Who wrote Hamlet?"]},
]
TINY = ["--layers", "1", "--steps", "3", "--max-new-tokens", "8", "--batch-size", "1",
        "--seq-len", "64", "--eval-prompts", "1", "--threads", str(TEST_THREADS)]


def distill(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_distill_args(parser)
    return run_distill(parser.parse_args(list(argv)))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return str(path)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, prompts_file):
    out = str(tmp_path_factory.mktemp("draft"))
    assert distill("--out", out, "--prompts", prompts_file, *TINY) == 0
    with open(os.path.join(out, "recipe.json")) as f:
        return out, json.load(f)


def test_tiny_run_writes_a_draft_and_its_recipe(tiny_draft):
    out, recipe = tiny_draft
    for name in ("config.json", LAYERS_SHARD, EMBED_SHARD, "tokenizer.json", "recipe.json"):
        assert os.path.exists(os.path.join(out, name)), name
    assert recipe["data"]["train_categories"] == ["code_completion", "gsm8k"]
    assert recipe["data"]["heldout_categories"] == ["qa"]
    assert recipe["train"]["steps"] == 3 and recipe["draft"]["init_from_target_layers"] == [0]
    assert 0.0 <= recipe["heldout"]["agreement"] <= 1.0 and recipe["heldout"]["positions"] > 0


def test_tiny_run_records_its_restricted_head_for_the_engine(tiny_draft):
    """--train-vocab N (default 8192) is written to config.json; the draft speculator reads it."""
    from speculant.speculators.draft_model import trained_head_tokens

    out, recipe = tiny_draft
    assert recipe["lm_head_tokens"] == 8192 and trained_head_tokens(out) == 8192
    assert trained_head_tokens(os.path.dirname(out)) == 0  # no config.json: whole vocabulary


def test_restricted_head_loss_equals_the_loss_over_the_head_tokens():
    """With a restricted head, KL renormalizes p_tgt over the top-k tokens inside the head and CE
    skips targets outside it; rows with no top-k token inside are left out."""
    torch.manual_seed(0)
    vocab, head = 10, torch.tensor([1, 3, 4, 7])
    column_of = torch.full((vocab,), -1, dtype=torch.long)
    column_of[head] = torch.arange(4)
    logq = torch.log_softmax(torch.randn(3, 4), -1)  # [n, head]
    topk_ids = torch.tensor([[3, 2, 7], [1, 4, 9], [0, 2, 5]])  # row 2: nothing in the head
    topk_lp = torch.log_softmax(torch.randn(3, 3), -1)
    next_ids = torch.tensor([3, 9, 0])
    kl, ce = distill_loss(logq, topk_ids, topk_lp, next_ids, torch.ones(3, dtype=torch.bool), column_of)
    expected_kl = 0.0
    for row, inside in ((0, [0, 2]), (1, [0, 1])):
        p = torch.softmax(topk_lp[row, inside], -1)
        cols = column_of[topk_ids[row, inside]]
        expected_kl += (p * (p.log() - logq[row, cols])).sum()
    torch.testing.assert_close(kl, expected_kl)
    torch.testing.assert_close(ce, -logq[0, column_of[3]])  # rows 1 and 2: target outside


def test_engine_loads_the_draft_and_greedy_output_is_exact(tiny_draft):
    from speculant.engine.engine import Engine
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    engine = Engine(model="default", spec_type=["draft"],
                    spec_options={"draft": {"model": tiny_draft[0]}}, num_threads=TEST_THREADS, kv_cache_tokens=4096, max_num_seqs=2)
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
             for p in ("Name three colors.", "What is a CPU?")]
    runs = []
    for spec in (SpecParams(enabled=False), SpecParams()):
        seqs = [engine.add_request(c, SamplingParams(max_tokens=16, temperature=0.0, spec=spec))
                for c in chats]
        while engine.has_unfinished():
            engine.step()
        runs.append(seqs)
    assert [s.output_ids for s in runs[1]] == [s.output_ids for s in runs[0]]
    assert sum(s.spec.num_draft_tokens for s in runs[1]) > 0


def test_restricted_lm_head_proposes_only_its_tokens_and_output_stays_exact(tiny_draft):
    """draft.lm_head_tokens=N: the draft scores only the N tokens the target generated most in
    the distill data (draft_vocab.json), proposes nothing else, and greedy output is unchanged."""
    from speculant.engine.engine import Engine
    from speculant.engine.sampling_params import SamplingParams, SpecParams
    from speculant.speculators.draft_vocab import read_ranking

    ranking = read_ranking(tiny_draft[0])
    assert ranking, "distill wrote no draft vocabulary"
    engine = Engine(model="default", spec_type=["draft"],
                    spec_options={"draft": {"model": tiny_draft[0], "lm_head_tokens": 16}}, num_threads=TEST_THREADS,
                    kv_cache_tokens=4096, max_num_seqs=2)
    drafter = engine.speculator("draft")
    allowed = set(drafter.head_ids.tolist())
    assert len(allowed) == 16 and set(ranking[:15]) <= allowed  # (EOS is always kept)
    assert drafter.model.lm_head.out_features == 16
    proposed = []
    original_draft = drafter.draft

    def spy(requests):
        drafts = original_draft(requests)
        proposed.extend(t for d in drafts.values() for t in d.token_ids)
        return drafts

    drafter.draft = spy
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}])
    runs = []
    for spec in (SpecParams(enabled=False), SpecParams()):
        seq = engine.add_request(chat, SamplingParams(max_tokens=16, temperature=0.0, spec=spec))
        while engine.has_unfinished():
            engine.step()
        runs.append(seq.output_ids)
    assert runs[1] == runs[0]
    assert proposed and set(proposed) <= allowed


def test_rerun_reuses_the_cached_data(tiny_draft, prompts_file, capsys):
    out, _ = tiny_draft
    assert distill("--out", out, "--prompts", prompts_file, *TINY, "--steps", "1") == 0
    recipe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert recipe["data"]["cached"] is True and recipe["train"]["steps"] == 1


def test_time_budget_stops_training_cleanly(tiny_draft, prompts_file, capsys):
    out, _ = tiny_draft
    assert distill("--out", out, "--prompts", prompts_file, *TINY, "--steps", "0",
                   "--time-budget-min", "0.01") == 0
    recipe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert recipe["train"]["stopped_by"] == "time budget" and recipe["train"]["steps"] >= 1
    assert os.path.exists(os.path.join(out, LAYERS_SHARD))


def test_export_reproduces_the_truncated_target_forward(tmp_path):
    """Draft = target layers 0..1, exported; speculant and transformers both load it and match a
    2-layer truncated target (float32 weights: no activation quantization in the reference)."""
    import transformers

    from speculant.engine.forward_batch import SeqChunk, build_forward_batch
    from speculant.models.loader import load_model
    from speculant.models.llama import Model

    target = load_model("default", dtype="float32")
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 30, 4093, 198, 1780, 314, 260, 3575, 282, 4649]

    def forward(loaded, num_layers):
        config = dataclasses.replace(loaded.config, num_layers=num_layers)
        model = Model(config, loaded.weights)
        cache = model.new_kv_cache(4, 16)
        cache.allocate(0)
        return model.forward(build_forward_batch(cache, [SeqChunk(0, 0, ids, len(ids))]), cache).logits

    reference = forward(target, 2)  # [len(ids), vocab]
    draft = TrainableDraft.from_target(target.weights, target.config, [0, 1])
    with torch.no_grad():
        n = len(ids)
        trainable = draft.logits(draft.hidden(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long)))
    save_draft(draft, str(tmp_path), "default")
    exported = forward(load_model(str(tmp_path)), 2)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(trainable, reference, atol=2e-3, rtol=0)
    torch.testing.assert_close(exported, reference, atol=0.1, rtol=0)  # fp16 storage
    torch.testing.assert_close(hf_logits, exported, atol=2e-3, rtol=0)
    assert torch.equal(exported.argmax(-1), reference.argmax(-1))


def test_restore_embeddings_rewrites_the_frozen_shard(tiny_draft):
    from safetensors.torch import load_file

    out = tiny_draft[0]
    before = load_file(os.path.join(out, EMBED_SHARD))
    os.remove(os.path.join(out, EMBED_SHARD))
    assert distill("--out", out, "--restore-embeddings") == 0
    after = load_file(os.path.join(out, EMBED_SHARD))
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])


@pytest.mark.parametrize("argv, error, match", [
    # the prompts file must exist
    (["--prompts", "/nonexistent/prompts.jsonl"], FileNotFoundError, "prompts file not found"),
    # a draft cannot have more layers than the target it is cut from
    (["--layers", "31"], ValueError, "only 30 layers"),
    (["--layers", "0"], ValueError, "--layers must be >= 1"),
    # every prompt is in a judged category: nothing to train on
    (["--exclude-categories", "gsm8k,code_completion,qa"], ValueError, "no prompts outside"),
])
def test_bad_arguments_fail_clearly(tmp_path, prompts_file, argv, error, match):
    with pytest.raises(error, match=match):
        distill("--out", str(tmp_path), "--prompts", prompts_file, *argv)


@pytest.mark.parametrize("agree, n_max, expected", [
    ([], 4, (0, 0)),
    ([False, False], 4, (2, 0)),  # every step: nothing accepted, the target adds a token
    ([True] * 4, 4, (1, 4)),  # one step accepts the whole draft
    ([True] * 6, 4, (2, 5)),  # 4 accepted + bonus, then 1 accepted
    ([True, False, True, True], 8, (2, 3)),  # a miss ends the step; the correction skips it
])
def test_simulated_greedy_acceptance(agree, n_max, expected):
    assert simulated_acceptance(agree, n_max) == expected


def test_rows_pack_windows_without_exceeding_seq_len():
    assert pack_rows([(0, 3), (10, 14), (20, 22), (30, 38)], 8) == [[(0, 3), (10, 14)],
                                                                   [(20, 22)], [(30, 38)]]


def test_spaced_layers_keep_the_first_and_the_last():
    from speculant.models.config import ModelConfig

    config = ModelConfig("llama", 30, 64, 128, 4, 2, 16, 100, 512, 1e4, 1e-5, True)
    assert select_layers(config, 4, "spaced") == [0, 10, 19, 29]
    assert select_layers(config, 3, "first") == [0, 1, 2]
    assert select_layers(config, 30, "spaced") == list(range(30))
