"""Speculative decoding on hybrid models through the engine: output equals plain decoding
token for token in both checkpoint modes (greedy and seeded; n-gram drafters, a draft model,
eagle3 and mtp heads), with drafts rejected at many positions."""
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from hybrid_models import save_hf_model  # noqa: E402

from speculant.engine.engine import Engine  # noqa: E402
from speculant.engine.sampling_params import SamplingParams, SpecParams  # noqa: E402

TOKENIZER_VOCAB = 49152  # the default model's tokenizer, copied into the test folders
NUM_OUTPUT_TOKENS = 16
SPEC = dict(spec_type=["ngram_mod", "suffix"], spec_options={"ngram_mod": {"n_match": 4}})


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next"])
def folder(request, tmp_path_factory, default_tokenizer_dir):
    path = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(path, request.param, hidden=128, seed=1, vocab_size=TOKENIZER_VOCAB)
    with torch.no_grad():  # outputs confined to ~16 tokens: they repeat, so n-grams draft
        model.lm_head.weight[NUM_OUTPUT_TOKENS:] = 0
    model.save_pretrained(path)
    for name in os.listdir(default_tokenizer_dir):
        shutil.copy(os.path.join(default_tokenizer_dir, name), path)
    return str(path)


def engine(folder, **options) -> Engine:
    defaults = dict(model=folder, dtype="float32", kv_cache_tokens=4096, max_num_seqs=8)
    return Engine(**{**defaults, **options})


def prompts(n: int) -> list[list[int]]:
    """Repetitive token-id prompts: n-gram drafters find continuations, the random model
    disagrees with many of them."""
    return [([100 + i, 200, 300 + 7 * i, 400, 500] * 6)[: 20 + 3 * i] for i in range(n)]


def generate(eng: Engine, batch: int, spec: bool, ignore_eos: bool = True) -> list[list[int]]:
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=ignore_eos,
                            spec=SpecParams(enabled=spec))
    return [s.token_ids[s.num_prompt:] for s in eng.run_to_completion(prompts(batch), params)]


@pytest.mark.parametrize("mode", ["per_step", "reeval"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_plain(folder, mode, batch):
    """ngram_mod,suffix drafts on a hybrid target: same tokens as plain decoding, with both
    accepted and rejected draft tokens along the way."""
    plain = generate(engine(folder), batch, spec=False)
    eng = engine(folder, spec_ckpt_mode=mode, **SPEC)
    # rows keep the prior's price: whether a draft is worth verifying then depends on the text
    # only, not on how fast this machine ran the last steps (a fitted price once left 1 draft)
    eng.cost.min_observations = 10**9
    assert eng.state_rounds.mode == mode
    assert generate(eng, batch, spec=True) == plain
    stats = {name: s for name, s in eng.speculator_stats().items()}
    drafted = sum(s.num_draft_tokens for s in stats.values())
    accepted = sum(s.num_accepted_tokens for s in stats.values())
    assert 0 < accepted < drafted, (accepted, drafted)
    if mode == "reeval":
        assert eng.state_rounds.num_reruns > 0


@pytest.mark.parametrize("mode", ["per_step", "reeval"])
def test_sequences_stopping_mid_round_equal_plain(folder, mode):
    """EOS honoured: sequences stop inside a round's accepted tokens, batch of 8."""
    plain = generate(engine(folder), 8, spec=False, ignore_eos=False)
    assert any(len(out) < 60 for out in plain)  # some stop at EOS, not at max_tokens
    eng = engine(folder, spec_ckpt_mode=mode, **SPEC)
    assert generate(eng, 8, spec=True, ignore_eos=False) == plain
    assert eng.cache.states.num_free_slots == eng.cache.states.num_slots


def test_state_slots_follow_the_kv_cache(folder):
    """Finished sequences give their state slot back; slots grow past the initial count."""
    # a cache that holds 20 sequences' K/V and their states (admission budgets both)
    eng = engine(folder, spec_type=["suffix"], max_num_seqs=20, kv_cache_tokens=65536)
    generate(eng, batch=1, spec=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.run_to_completion([[5, 6, 7]] * 20, params)
    assert eng.cache.states.num_free_slots == eng.cache.states.num_slots > 16


def test_unknown_checkpoint_mode_refused():
    with pytest.raises(ValueError, match="spec_ckpt_mode must be auto or one of"):
        Engine(model="default", spec_ckpt_mode="sometimes")


@pytest.mark.parametrize("mode", ["per_step", "reeval"])
def test_seeded_sampling_equals_plain(folder, mode):
    """Temperature 0.8 with a seed (sample-and-match): the same tokens as plain decoding."""
    def run(eng, spec):
        params = SamplingParams(max_tokens=50, temperature=0.8, seed=123, ignore_eos=True,
                                spec=SpecParams(enabled=spec))
        return [s.token_ids[s.num_prompt:] for s in eng.run_to_completion(prompts(4), params)]

    assert run(engine(folder, spec_ckpt_mode=mode, **SPEC), True) == run(engine(folder), False)


def test_auto_mode_picks_by_the_memory_of_step_states(folder):
    """LFM2's conv windows (2 KB a row here) fit beside the KV cache: per_step. Qwen3-Next's
    DeltaNet states (58 KB a row, 17 rows x 8 sequences = 7.9 MB) do not: reeval."""
    eng = engine(folder, **SPEC)
    expected = {"lfm2": "per_step", "qwen3_next": "reeval"}[eng.model_config.architecture]
    assert eng.state_rounds.mode == expected


def model_drafter_options(kind: str, folder: str, tmp_path) -> dict:
    """A draft model (the default SmolLM2: same tokenizer) or a random eagle3 / mtp head built
    for this hybrid target (drafting from its captured hidden states)."""
    if kind == "draft":
        return {"model": "default"}
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model
    from speculant.models.mtp_head import MtpHead

    target = load_model(folder).config
    head = (Eagle3Head.random(target, torch.arange(0, 64), seed=1, aux_layer_ids=(1, 2, 3))
            if kind == "eagle3" else MtpHead.random(target, seed=1))
    head.save(str(tmp_path), dtype=torch.float32)
    return {"head": str(tmp_path), "kv_dtype": "float32"}


@pytest.mark.parametrize("kind", ["draft", "eagle3", "mtp"])
@pytest.mark.parametrize("mode", ["per_step", "reeval"])
def test_model_drafters_on_a_hybrid_target_equal_plain(folder, kind, mode, tmp_path):
    """Model drafters (mostly rejected here: random target) leave the output unchanged."""
    plain = generate(engine(folder), 4, spec=False)
    eng = engine(folder, spec_type=[kind], spec_ckpt_mode=mode,
                 spec_options={kind: model_drafter_options(kind, folder, tmp_path)})
    # every proposal verified: priced by their calibrated probabilities (~1/vocab from random
    # weights), none of these drafters' tokens would be
    eng.chain.probe_interval = 0
    assert generate(eng, 4, spec=True) == plain
    assert eng.speculator_stats()[kind].num_draft_tokens > 0


def test_admission_budgets_state_memory_like_kv_blocks(folder):
    """Each hybrid sequence holds blocks for its live state and its checkpoints: a cache that
    could hold many sequences' K/V admits fewer at once, and all of it comes back."""
    eng = engine(folder, spec_type=["suffix"], max_num_seqs=16, kv_cache_tokens=4096)
    cache = eng.cache
    assert cache.seq_overhead_blocks >= 1
    before = cache.num_free_blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request([5, 6, 7], params) for _ in range(16)]
    eng.step()
    admitted = len(eng.status().running)
    assert admitted <= before // (1 + cache.seq_overhead_blocks)
    while eng.has_unfinished():
        eng.step()
    assert all(s.is_finished for s in seqs) and cache.num_free_blocks == before
