"""Draft-model speculation: one shared draft context, parallel drafting, exactness, vocab checks."""
import json
import os
import shutil

import pytest

from conftest import REPO, TEST_THREADS, decode_all, dev_prompts, save_tiny_hf_model
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams, SpecParams
from speculant.speculators.draft_model import DraftModelSpeculator
from speculant.speculators.vocab_check import IncompatibleVocabError, check_vocab_compatible
from speculant.models.tokenizer import Tokenizer, _hf_folder_files

PROMPTS = ["Write a limerick about a cat.", "Explain what a CPU cache is.",
           "List the planets of the solar system.", "What is photosynthesis?"]


def run(engine, prompts, spec, max_tokens=32):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, spec=spec)
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return decode_all(engine, chats, params)


@pytest.fixture(scope="module")
def self_draft_engine():
    engine = Engine(model="default", spec_type=["draft"], spec_options={"draft": {"model": "default"}},
                    max_num_seqs=4, num_threads=TEST_THREADS, kv_cache_tokens=8192)
    # These tests are about the draft model's mechanics. A draft as large as its target costs
    # about a plain step per drafted token, so the chain's pricing (tested in test_chain) may
    # rightly never ask it, depending on the machine's timings (seen once in CI: 0 drafts in
    # 31 steps). Every proposal verified instead.
    engine.chain.probe_interval = 0
    return engine


def test_target_as_its_own_draft_accepts_nearly_everything_and_is_exact(self_draft_engine):
    plain = run(self_draft_engine, PROMPTS[:2], SpecParams(enabled=False))
    spec = run(self_draft_engine, PROMPTS[:2], SpecParams())
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    drafted = sum(s.spec.num_draft_tokens for s in spec)
    accepted = sum(s.spec.num_accepted_tokens for s in spec)
    # Same weights and kernels: a rejection can only come from a near-tie flipped by a different
    # batch shape in the target's verification forward, which is batch-invariant here.
    assert drafted > 0 and accepted / drafted > 0.97


@pytest.mark.parametrize("filters", [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0),
                                     dict(temperature=0.7, top_k=40)])
def test_coupled_drafts_of_the_target_itself_are_accepted_when_sampling(self_draft_engine,
                                                                        filters):
    """Sampling (sample-and-match), each draft token is drawn with the target's filters and the
    uniform the target will use at its position (coupled.py): a draft that is the target lands
    on the target's own draws, so nearly every token is accepted (a greedy draft would be
    accepted with the target's probability of its argmax), and the output is plain decoding's."""
    tok = self_draft_engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    plain = decode_all(self_draft_engine, chats, SamplingParams(
        max_tokens=32, seed=5, spec=SpecParams(enabled=False), **filters))
    spec = decode_all(self_draft_engine, chats, SamplingParams(max_tokens=32, seed=5, **filters))
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    drafted = sum(s.spec.num_draft_tokens for s in spec)
    accepted = sum(s.spec.num_accepted_tokens for s in spec)
    assert drafted > 0 and accepted / drafted > 0.97


def test_parallel_drafting_one_forward_per_draft_position(self_draft_engine):
    """Draft forwards per round equal draft positions, not sequences x positions."""
    from speculant.speculators.base import DraftParams, DraftRequest

    spec: DraftModelSpeculator = self_draft_engine.speculator("draft")
    tok = self_draft_engine.tokenizer
    histories = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    for i, h in enumerate(histories):
        spec.begin(100 + i, h)
    try:
        before = spec.num_draft_forwards
        drafts = spec.draft([DraftRequest(100 + i, h, DraftParams(n_max=6))
                             for i, h in enumerate(histories)])
        assert sorted(len(d) for d in drafts.values()) == [6, 6, 6, 6]
        # One forward catches all four up and yields position 1; five more, one per position.
        assert spec.num_draft_forwards - before == 6
        assert spec.catch_up_seconds > 0  # the prompts' rows of that first forward
        # Next round after the target accepted 2 tokens of each: rollback, catch-up, draft again.
        before = spec.num_draft_forwards
        grown = [h + drafts[100 + i].token_ids[:3] for i, h in enumerate(histories)]
        again = spec.draft([DraftRequest(100 + i, h, DraftParams(n_max=3)) for i, h in enumerate(grown)])
        assert len(again) == 4  # (a draft ends early only at EOS)
        assert spec.num_draft_forwards - before == max(len(d) for d in again.values())
    finally:
        for i in range(len(histories)):
            spec.end(100 + i)


def test_catch_up_share_counts_rows_that_yield_no_draft_position():
    from speculant.engine.forward_batch import SeqChunk
    from speculant.speculators.draft_model import _catch_up_share

    assert _catch_up_share([SeqChunk(0, 0, [1], 1), SeqChunk(1, 5, [2], 1)]) == 0.0  # drafting
    assert _catch_up_share([SeqChunk(0, 0, [1] * 30, 1), SeqChunk(1, 5, [2, 3], 1)]) == 30 / 32
    assert _catch_up_share([SeqChunk(0, 0, [1] * 10, 0)]) == 1.0  # a long catch-up, no logits


def test_long_catch_up_restarts_the_draft_context_on_its_last_tokens(self_draft_engine):
    """More than context_tokens pending: the draft evaluates only the last context_tokens of the
    history (positions from 0); a short catch-up afterwards extends that context."""
    from speculant.speculators.base import DraftParams, DraftRequest

    spec: DraftModelSpeculator = self_draft_engine.speculator("draft")
    window = spec.config.context_tokens
    tok = self_draft_engine.tokenizer
    history = tok.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 90))
    assert len(history) > 2 * window
    spec.begin(200, history)
    try:
        [first] = spec.draft([DraftRequest(200, history, DraftParams(n_max=4))]).values()
        assert spec._offset[200] == len(history) - window
        assert len(spec._cached[200]) == window + len(first) - 1  # the last draft is not fed
        grown = history + first.token_ids[:2] + [tok.encode(" cat")[0]]
        [second] = spec.draft([DraftRequest(200, grown, DraftParams(n_max=4))]).values()
        assert spec._offset[200] == len(history) - window  # extended, not restarted
        assert spec._cached[200][:window + 3] == grown[len(history) - window:]
        assert len(second) == 4
    finally:
        spec.end(200)


def test_a_draft_may_ask_for_a_shorter_catch_up_window(self_draft_engine):
    """DraftParams.context_tokens below the drafter's own window (the chain's shadow probes
    and first asks): the draft restarts on that many last tokens; a later ordinary draft
    extends that context instead of re-reading the longer window."""
    from speculant.speculators.base import DraftParams, DraftRequest

    spec: DraftModelSpeculator = self_draft_engine.speculator("draft")
    tok = self_draft_engine.tokenizer
    history = tok.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 40))
    assert len(history) > spec.config.context_tokens > 64
    spec.begin(201, history)
    try:
        spec.draft([DraftRequest(201, history, DraftParams(n_max=1, context_tokens=64))])
        assert spec._offset[201] == len(history) - 64 and len(spec._cached[201]) == 64
        grown = history + tok.encode(" The quick")
        spec.draft([DraftRequest(201, grown, DraftParams(n_max=2))])
        assert spec._offset[201] == len(history) - 64  # extended, not restarted on 256
        assert spec._cached[201][:64 + 2] == grown[len(history) - 64:][:66]
    finally:
        spec.end(201)
    with pytest.raises(ValueError, match="context_tokens"):
        DraftParams(context_tokens=-1)


def test_float_drafts_load_as_q8_0_unless_told_otherwise(tmp_path, default_tokenizer_dir):
    """A draft's precision changes how often it is right, never the output: an HF folder's
    float weights are packed as Q8_0 by default (dtype auto); a GGUF keeps its own blocks and an
    explicit dtype wins."""
    from speculant.models.loader import default_model_path
    from speculant.speculators.draft_model import draft_dtype

    folder = tmp_path / "tiny"
    save_tiny_hf_model(folder, default_tokenizer_dir, "llama")
    assert draft_dtype(str(folder), "auto") == "q8_0"
    assert draft_dtype(str(folder), "float32") == "float32"
    assert draft_dtype(default_model_path(), "auto") == "auto"


def test_windowed_draft_on_a_long_prompt_is_exact_and_still_accepted(self_draft_engine):
    long_prompt = "Repeat this text: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    plain = run(self_draft_engine, [long_prompt], SpecParams(enabled=False))
    spec = run(self_draft_engine, [long_prompt], SpecParams())
    assert spec[0].output_ids == plain[0].output_ids
    assert spec[0].spec.num_accepted_tokens > spec[0].spec.num_draft_tokens // 2


def test_random_draft_accepts_little_and_output_stays_exact(tmp_path, default_tokenizer_dir):
    save_tiny_hf_model(tmp_path, default_tokenizer_dir, "llama", seed=3)
    engine = Engine(model="default", spec_type=["draft"], spec_options={"draft": {"model": str(tmp_path)}},
                    max_num_seqs=4, num_threads=TEST_THREADS, kv_cache_tokens=8192)
    # every proposal verified: left to price them, the chain verifies none of a random draft's
    # tokens (their probabilities are ~1/vocab, calibration.py)
    engine.chain.probe_interval = 0
    plain = run(engine, PROMPTS[:2], SpecParams(enabled=False))
    spec = run(engine, PROMPTS[:2], SpecParams())
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    stats = engine.speculator_stats()["draft"]
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.2


def test_incompatible_vocabulary_is_refused_naming_the_first_mismatch(tmp_path, default_tokenizer_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_tokenizer_dir}/{name}", tmp_path / name)
    tok_json = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    a = next(t for t, i in vocab.items() if i == 100)
    b = next(t for t, i in vocab.items() if i == 101)
    vocab[a], vocab[b] = 101, 100  # same tokens, two ids swapped: the first mismatch is 100
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok_json))
    target = Tokenizer(_hf_folder_files(default_tokenizer_dir))
    draft = Tokenizer(_hf_folder_files(str(tmp_path)))
    with pytest.raises(IncompatibleVocabError, match="token 100"):
        check_vocab_compatible(target, draft)
    check_vocab_compatible(target, target)


def test_draft_lifecycle_misuse_is_loud(self_draft_engine):
    spec: DraftModelSpeculator = self_draft_engine.speculator("draft")
    spec.begin(999, [1, 2, 3])
    with pytest.raises(ValueError, match="999"):
        spec.begin(999, [1, 2, 3])
    spec.end(999)
    with pytest.raises(ValueError, match="999"):
        spec.accept(999, 1, False)


@pytest.mark.parametrize("ranking, n, vocab, always, expected", [
    ([7, 3, 9], 2, 10, frozenset(), [3, 7]),  # the n most frequent, returned sorted
    ([7, 3, 9], 3, 10, frozenset({2}), [2, 3, 7]),  # EOS always kept, inside the budget
    ([7, 12, 3], 3, 10, frozenset(), [0, 3, 7]),  # ids beyond the vocabulary skipped, then id order fills
    ([], 2, 10, frozenset(), [0, 1]),  # no ranking: id order
])
def test_head_token_ids(ranking, n, vocab, always, expected):
    from speculant.speculators.draft_vocab import head_token_ids

    assert head_token_ids(ranking, n, vocab, always).tolist() == expected


def test_rank_tokens_orders_by_count_then_id():
    import torch

    from speculant.speculators.draft_vocab import rank_tokens

    ids, counts = rank_tokens(torch.tensor([5, 1, 5, 2, 1, 5, 0]), 8)
    assert ids == [5, 1, 0, 2] and counts == [3, 2, 1, 1]


def test_restricted_head_without_a_vocabulary_file_is_a_clear_error(tmp_path):
    from speculant.speculators.draft_vocab import read_ranking

    with pytest.raises(FileNotFoundError, match="draft_vocab.json"):
        read_ranking(str(tmp_path))


SHIPPED_DRAFT = os.path.join(REPO, "drafts", "smollm2-135m-draft-4l")


@pytest.fixture(scope="module")
def shipped_draft_engine():
    """The trained draft shipped in drafts/ (its embedding shard rebuilt by `make`), int8 weights,
    in a chain with the model-free speculators, as `speculant bench` runs it."""
    return Engine(model="default", spec_type=["ngram_mod", "suffix", "draft"],
                  spec_options={"draft": {"model": SHIPPED_DRAFT, "dtype": "q8_0"}},
                  max_num_seqs=8, num_threads=TEST_THREADS, kv_cache_tokens=16384)


def held_out_prompts(engine, per_category):
    """Prompts of the categories the draft was never trained on, first turns."""
    from speculant.data.prompt_set import first_turn_prompt

    recs = []
    for cat in ("mt_bench", "qa", "translation"):
        recs += dev_prompts([cat], None)[:per_category]
    return [first_turn_prompt(r, engine.tokenizer) for r in recs]


def generate_batched(engine, prompts, spec, max_tokens, batch):
    return decode_all(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, spec=spec),
                      batch)


@pytest.mark.parametrize("types", [["draft"], ["ngram_mod", "suffix", "draft"]])
def test_shipped_draft_is_exact_at_batch_1_and_8(shipped_draft_engine, types):
    engine = shipped_draft_engine
    prompts = held_out_prompts(engine, 3)[:8]
    plain = [s.output_ids for s in generate_batched(engine, prompts, SpecParams(enabled=False), 40, 8)]
    for batch in (1, 8):
        spec = generate_batched(engine, prompts, SpecParams(types=types), 40, batch)
        for i, (p, s) in enumerate(zip(plain, spec)):
            assert s.output_ids == p, f"{types} batch {batch}: prompt {i} diverged from plain"


def test_shipped_draft_learned_to_agree_with_the_target(shipped_draft_engine):
    """Forced to propose one token every step on held-out prompts, the trained draft agrees with
    the target far more often than an untrained one (its recipe measured 0.0008 at init, ~0.24
    after training; a random guess among the 8192 head tokens: 1e-4)."""
    engine = shipped_draft_engine
    engine.reset_stats()
    engine.chain.probe_interval = 0  # a draft every step: verified, or scored where priced out
    generate_batched(engine, held_out_prompts(engine, 3)[:8], SpecParams(types=["draft"], n_max=1),
                     48, 8)
    stats = engine.speculator_stats()["draft"]
    num_judged = stats.num_drafts + stats.num_scored
    first_matched = (stats.accepted_per_pos[:1] or [0])[0] + stats.num_scored_first_matched
    assert num_judged >= 100 and first_matched / num_judged > 0.1


def test_no_further_draft_forward_once_the_run_cannot_pay(self_draft_engine):
    """p_min_run above what the run can reach: the first token, and no forward for a second."""
    from speculant.speculators.base import DraftParams, DraftRequest

    spec: DraftModelSpeculator = self_draft_engine.speculator("draft")
    tok = self_draft_engine.tokenizer
    history = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    lengths = {}
    for p_min_run in (0.0, 1.0):
        spec.begin(200, history)
        try:
            before = spec.num_draft_forwards
            draft = spec.draft([DraftRequest(200, history, DraftParams(n_max=4, p_min_run=p_min_run))])
            lengths[p_min_run] = (len(draft[200]), spec.num_draft_forwards - before)
        finally:
            spec.end(200)
    assert lengths[0.0] == (4, 4)
    # a first token of probability exactly 1 would leave need = 1 and one more forward
    assert lengths[1.0] in ((1, 1), (2, 2))


def test_draft_with_no_model_finds_the_draft_shipped_for_the_default_model():
    """Issue 18's command names `--spec-type draft` alone: the default model's shipped draft
    loads, as `eagle3` finds its head, and speculative output stays plain output."""
    engine = Engine(model="default", spec_type=["draft"], max_num_seqs=2,
                    num_threads=TEST_THREADS, kv_cache_tokens=4096)
    draft = engine.chain.speculators["draft"]
    assert os.path.samefile(draft.config.model, SHIPPED_DRAFT)
    prompts = PROMPTS[:2]
    spec = run(engine, prompts, SpecParams())
    plain = run(engine, prompts, SpecParams(enabled=False))
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]


def test_draft_with_no_model_and_none_shipped_names_the_flag():
    from speculant.speculators.base import SpeculatorContext

    with pytest.raises(ValueError, match="needs a draft model: --draft-model PATH.*this target"):
        DraftModelSpeculator.from_context(SpeculatorContext(vocab_size=49152), None)
