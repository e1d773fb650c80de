"""Speculative greedy output equals plain greedy output, token for token, for every speculator.

The default suite runs a sample (the shortest code_edit and summarization prompts, 64 tokens); the
full issue-3 check (all 13 code_edit and 40 summarization prompts, 256 tokens) is marked slow.
"""
import pytest

from conftest import decode_all, dev_prompts
from speculant.data.prompt_set import first_turn_prompt
from speculant.engine.sampling_params import SamplingParams, SpecParams
from speculant.speculators.registry import registered_names, speculator_class

MODEL_FREE = [n for n in registered_names()
             if n != "synthetic" and not speculator_class(n).is_model_based]


def generate(engine, prompts, spec: SpecParams, max_tokens, batch):
    return decode_all(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, spec=spec),
                      batch)


def check_exact(engine, prompts, types, max_tokens, batch, plain=None):
    plain = plain or [s.output_ids for s in
                      generate(engine, prompts, SpecParams(enabled=False), max_tokens, batch)]
    spec = generate(engine, prompts, SpecParams(types=types), max_tokens, batch)
    for p, s in zip(plain, spec):
        assert s.output_ids == p, f"{types}: speculative output diverged from plain"
    return spec


def shortest_prompts(engine, per_category):
    """The shortest code_edit and summarization prompts: copy-heavy, and quick to prefill."""
    prompts = []
    for cat in ("code_edit", "summarization"):
        recs = sorted(dev_prompts([cat], None), key=lambda r: len(r.turns[0]))[:per_category]
        prompts += [first_turn_prompt(r, engine.tokenizer) for r in recs]
    return prompts


@pytest.fixture(scope="module")
def sample(default_engine):
    """Prompts and their plain greedy outputs, computed once for the module."""
    prompts = shortest_prompts(default_engine, 1)  # one code_edit, one summarization
    plain = generate(default_engine, prompts, SpecParams(enabled=False), 64, batch=4)
    return prompts, [s.output_ids for s in plain]


@pytest.mark.parametrize("types", [[n] for n in MODEL_FREE] + [MODEL_FREE])
def test_speculative_equals_plain_batch1(default_engine, sample, types):
    prompts, plain = sample
    spec = check_exact(default_engine, prompts, types, 64, batch=1, plain=plain)
    assert sum(s.spec.num_steps for s in spec) > 0


def test_chain_equals_plain_batch4_and_drafts_get_accepted(default_engine, sample):
    prompts, plain = sample
    spec = check_exact(default_engine, prompts, MODEL_FREE, 64, batch=4, plain=plain)
    assert sum(s.spec.num_accepted_tokens for s in spec) > 0  # copy-heavy prompts: drafts land


def test_chain_equals_plain_through_model_free_rests_and_probes(default_engine, monkeypatch):
    """The model-free speculators resting, probing and drafting in turn (as their ledger
    account makes them where they lose: model_free_rest.py) change no output at batch 4, and
    rounds both rest and draft."""
    from speculant.speculators import model_free_rest as mf

    prompts = shortest_prompts(default_engine, 2)  # 4 sequences: bucket 4, where rests apply
    plain = [s.output_ids for s in
             generate(default_engine, prompts, SpecParams(enabled=False), 48, batch=4)]
    modes = iter(range(10**6))
    seen = []

    def mode(requests, bucket):
        m = (mf.MF_DRAFT, mf.MF_REST, mf.MF_PROBE)[next(modes) % 3]
        seen.append(m)
        return m
    monkeypatch.setattr(default_engine.chain, "_model_free_mode", mode)
    spec = check_exact(default_engine, prompts, MODEL_FREE, 48, batch=4, plain=plain)
    assert mf.MF_REST in seen and mf.MF_PROBE in seen
    assert sum(s.spec.num_draft_tokens for s in spec) > 0


def test_sampling_with_match_verification_equals_plain_sampling(default_engine, sample):
    """Sample-and-match consumes one uniform per emitted token: same seed, same text as plain."""
    prompts = sample[0][::2]
    outs = {}
    for label, spec in (("plain", SpecParams(enabled=False)), ("spec", SpecParams(types=MODEL_FREE))):
        params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=11, spec=spec)
        outs[label] = [s.output_ids for s in decode_all(default_engine, prompts, params, batch=1)]
    assert outs["spec"] == outs["plain"]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("types", [[n] for n in MODEL_FREE] + [MODEL_FREE])
def test_full_exactness_all_code_edit_and_summarization(default_engine, types, batch):
    recs = dev_prompts(["code_edit", "summarization"], None)
    prompts = [first_turn_prompt(r, default_engine.tokenizer) for r in recs]
    check_exact(default_engine, prompts, types, max_tokens=256, batch=batch)


@pytest.fixture(scope="module")
def feature_engine(tmp_path_factory):
    """eagle3 (the shipped head, else a random one), mtp (a random module) and the model-free
    chain in one engine: what issue 12's exactness check runs."""
    import os

    import torch

    from conftest import TEST_THREADS
    from speculant.engine.engine import Engine
    from speculant.models.loader import load_model
    from speculant.models.mtp_head import MtpHead
    from speculant.speculators.eagle3 import Eagle3Speculator
    from speculant.speculators.feature_drafter import REPO_DIR

    loaded = load_model("default", "auto")
    target = loaded.config
    options = {}
    shipped = os.path.join(REPO_DIR, "drafts",
                           Eagle3Speculator.shipped_heads[os.path.basename(loaded.files.path)])
    if not os.path.isfile(os.path.join(shipped, "config.json")):
        from speculant.models.eagle3_head import Eagle3Head

        shipped = str(tmp_path_factory.mktemp("eagle3"))
        Eagle3Head.random(target, torch.arange(0, target.vocab_size, 5), seed=2).save(shipped)
    options["eagle3"] = {"head": shipped}
    mtp = str(tmp_path_factory.mktemp("mtp"))
    MtpHead.random(target, seed=2).save(mtp)
    options["mtp"] = {"head": mtp}
    return Engine(model="default", spec_type=["ngram_mod", "suffix", "eagle3", "mtp"],
                  spec_options=options, max_num_seqs=8, num_threads=TEST_THREADS,
                  kv_cache_tokens=65536)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("types", [["eagle3"], ["mtp"], ["ngram_mod", "suffix", "eagle3"]])
def test_full_exactness_feature_drafters(feature_engine, types, batch):
    """Issue 12: every dev prompt of mt_bench, qa, translation, math_reasoning and
    summarization, 256 tokens: speculative == plain."""
    recs = dev_prompts(["mt_bench", "qa", "translation", "math_reasoning", "summarization"], None)
    prompts = [first_turn_prompt(r, feature_engine.tokenizer) for r in recs]
    check_exact(feature_engine, prompts, types, max_tokens=256, batch=batch)
