"""The n-gram drafters: ngram_simple, ngram_map_k, ngram_map_k4v, ngram_mod, ngram_cache."""
import random

import pytest

from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest, SpeculatorContext
from speculant.speculators.registry import speculator_class
from speculant.speculators.ngram_cache import build_table, load_table, prune_table, save_table
from speculant.speculators.ngram_match import NgramIndex, common_prefix_len

CTX = SpeculatorContext(vocab_size=100)
MODEL_FREE = ["ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache", "suffix"]
SMALL = {  # configs small enough for toy sequences
    "ngram_simple": dict(size_n=2, size_m=3),
    "ngram_map_k": dict(size_n=2, size_m=3),
    "ngram_map_k4v": dict(size_n=2, size_m=2),
    "ngram_mod": dict(n_match=3, n_max=5, n_min=1, pool_size=1 << 16),
    "ngram_cache": dict(),
    "suffix": dict(),
}


def make(name, **cfg):
    cls = speculator_class(name)
    return cls(CTX, cls.config_class(**{**SMALL[name], **cfg}))


def draft(spec, history, seq_id=0, n_max=16, n_min=0, p_min=0.0):
    out = spec.draft([DraftRequest(seq_id, list(history), DraftParams(n_max, n_min, p_min))])
    return out.get(seq_id)


def draft_ids(name, history, cfg=None, **params):
    """Draft of a fresh speculator whose prompt is the whole history but its last token."""
    spec = make(name, **(cfg or {}))
    spec.begin(0, history[:-1])
    d = draft(spec, history, **params)
    return None if d is None else d.token_ids


# ---- shared helpers ------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], 3),  # identical
    ([1, 2, 3], [1, 2], 2),  # prefix
    ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2),  # differs in the middle
    ([7], [8], 0),  # differs at once
    ([], [1], 0),  # empty
])
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b) == expected


def test_ngram_index_truncate_undoes_extend():
    """Extending then truncating an index leaves it as if the dropped tokens never came."""
    rng = random.Random(0)
    tokens = [rng.randrange(4) for _ in range(200)]
    index = NgramIndex(3)
    index.extend(tokens)
    index.truncate(tokens, 120)
    fresh = NgramIndex(3)
    fresh.extend(tokens[:120])
    assert index.last == fresh.last and index.prev == fresh.prev


@pytest.mark.parametrize("tokens, key, limit, expected", [
    ([1, 2, 1, 2, 1, 2], (1, 2), 10, [4, 2, 0]),  # all occurrences, newest first
    ([1, 2, 1, 2, 1, 2], (1, 2), 3, [2, 0]),  # only those starting at or before the limit
    ([1, 2, 3], (2, 1), 10, []),  # absent key
])
def test_ngram_index_occurrences(tokens, key, limit, expected):
    index = NgramIndex(2)
    index.extend(tokens[:2])
    index.extend(tokens)  # grown in two steps
    assert list(index.occurrences(key, limit)) == expected


# ---- ngram_simple ----------------------------------------------------------------------------

@pytest.mark.parametrize("history, params, expected", [
    # copies what followed the most recent earlier occurrence of the last 2 tokens
    ([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2], {}, [5, 6, 9]),
    # no earlier occurrence of the key: no draft
    ([1, 2, 3, 4, 5], {}, None),
    # the request's n_max caps the draft
    ([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2], {"n_max": 2}, [5, 6]),
    # drafts shorter than the request's n_min are dropped
    ([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2], {"n_min": 4}, None),
    # the continuation may run into the key itself (a repeating pattern)
    ([7, 8, 1, 7, 8], {}, [1, 7, 8]),
    # history no longer than the key: nothing to match
    ([1, 2], {}, None),
])
def test_ngram_simple(history, params, expected):
    assert draft_ids("ngram_simple", history, **params) == expected


# ---- ngram_map_k / ngram_map_k4v -----------------------------------------------------------------

@pytest.mark.parametrize("history, cfg, expected", [
    # the value (3 tokens) after the earlier occurrence of the key
    ([1, 2, 3, 4, 5, 0, 0, 1, 2], {}, [3, 4, 5]),
    # an occurrence not followed by a full value before the key does not count
    ([1, 2, 3, 1, 2], {}, None),
    # min_hits=2: two earlier occurrences are needed; the most recent one is drafted
    ([1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 0, 1, 2], {"min_hits": 2}, [6, 7, 8]),
    # min_hits=3 with only two earlier occurrences: no draft
    ([1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 0, 1, 2], {"min_hits": 3}, None),
])
def test_ngram_map_k(history, cfg, expected):
    assert draft_ids("ngram_map_k", history, cfg) == expected


def test_ngram_map_k_shrinks_value_after_rejection():
    """After a draft of which 1 token was accepted (then rejected), the key drafts 1 token."""
    spec = make("ngram_map_k")
    h1 = [1, 2, 3, 4, 5, 0, 0, 1, 2]
    spec.begin(0, h1[:-1])
    assert draft(spec, h1).token_ids == [3, 4, 5]
    spec.accept(0, 1, False)
    h2 = h1 + [3, 9, 0, 0, 1, 2]  # target accepted 3, put 9 where 4 was drafted
    assert draft(spec, h2).token_ids == [3]


def test_ngram_map_k_cut_draft_does_not_shrink():
    """A draft cut shorter before verification (all verified tokens accepted) keeps its length."""
    spec = make("ngram_map_k")
    h1 = [1, 2, 3, 4, 5, 0, 0, 1, 2]
    spec.begin(0, h1[:-1])
    assert draft(spec, h1).token_ids == [3, 4, 5]
    spec.accept(0, 1, False)
    h2 = h1 + [3, 4, 5, 0, 1, 2]  # the target's next token agreed with the draft's second
    assert draft(spec, h2).token_ids == [3, 4, 5]


@pytest.mark.parametrize("history, expected_ids, expected_probs", [
    # (3,4) follows the key 3 times, (5,6) once: 3 >= 2*1, draft (3,4), P(first right) = 3/4
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 0, 1, 2], [3, 4], [0.75, 1.0]),
    # (3,4) twice, (5,6) twice: no value dominates, no draft
    ([1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 1, 2, 5, 6, 0, 1, 2], None, None),
    # values sharing a first token: P(first) = 1, P(second | first) = 3/4
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 6, 1, 2, 3, 4, 0, 1, 2], [3, 4], [1.0, 0.75]),
])
def test_ngram_map_k4v(history, expected_ids, expected_probs):
    spec = make("ngram_map_k4v")
    spec.begin(0, history[:-1])
    d = draft(spec, history)
    if expected_ids is None:
        assert d is None
        return
    assert d.token_ids == expected_ids
    assert d.token_probs == pytest.approx(expected_probs)
    survive, expected = 1.0, 0.0
    for p in expected_probs:
        survive *= p
        expected += survive
    assert d.expected_accepted == pytest.approx(expected)


def test_ngram_map_k4v_drafts_dominant_value_not_most_recent():
    """The most frequent value is drafted even when the latest occurrence continued otherwise."""
    history = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 0, 1, 2]
    assert draft_ids("ngram_map_k4v", history) == [3, 4]


# ---- ngram_mod -----------------------------------------------------------------------------

OTHER_MOD = [1, 2, 3, 4, 5, 6, 7, 8]  # prompt of another sequence, in the shared pool


@pytest.mark.parametrize("history, cfg, params, expected", [
    # follows the pool from the last 3 tokens, up to n_max=5 tokens
    ([0, 1, 2, 3], {}, {}, [4, 5, 6, 7, 8]),
    # the chain ends at an empty slot: (6,7,8) was never followed
    ([0, 4, 5, 6], {}, {}, [7, 8]),
    # chains shorter than the configured n_min are dropped
    ([0, 4, 5, 6], {"n_min": 3}, {}, None),
    # a request allowing fewer tokens than n_min still drafts (n_min is capped at n_max)
    ([0, 1, 2, 3], {"n_min": 5}, {"n_max": 2}, [4, 5]),
    # unknown 3-gram: nothing
    ([9, 9, 9], {}, {}, None),
])
def test_ngram_mod(history, cfg, params, expected):
    spec = make("ngram_mod", **cfg)
    spec.begin(0, OTHER_MOD)
    spec.begin(1, history[:-1])
    d = draft(spec, history, seq_id=1, **params)
    assert (d and d.token_ids) == expected


def test_ngram_mod_hash_is_llama_cpp_lcg():
    """An n-gram's slot is llama.cpp's: (t0*A^2 + t1*A + t2) mod 2^64 mod pool size, A the LCG
    factor; the rolling hash over the history agrees with it at every position."""
    spec = make("ngram_mod")
    tokens = list(range(10, 60))  # no 3-gram repeats
    spec.begin(0, tokens)
    a, size = 6364136223846793005, spec.config.pool_size
    for i in range(len(tokens) - 3):
        t0, t1, t2 = tokens[i:i + 3]
        slot = ((t0 * a * a + t1 * a + t2) % (1 << 64)) % size
        assert spec._pool[slot] == tokens[i + 3]


def test_ngram_mod_pool_is_shared_across_sequences():
    """Sequence 1 drafts from n-grams only sequence 0's prompt contained."""
    spec = make("ngram_mod")
    spec.begin(0, [10, 11, 12, 13, 14, 15])
    spec.begin(1, [20, 21])
    d = draft(spec, [20, 21, 10, 11, 12], seq_id=1)
    assert d.token_ids == [13, 14, 15]


def test_ngram_mod_occupancy_reset_at_begin():
    """A pool above 25% occupancy is cleared at the next begin, which keeps its own prompt."""
    spec = make("ngram_mod", pool_size=16)
    spec.begin(0, list(range(30, 50)))  # ~17 distinct n-grams into 16 slots
    assert spec.occupancy > 0.25
    resets = spec.num_resets
    spec.begin(1, [1, 2, 3, 4, 5])
    assert spec.num_resets == resets + 1
    assert draft(spec, [1, 2, 3, 4, 5, 9, 1, 2, 3], seq_id=1).token_ids[:2] == [4, 5]


def test_ngram_mod_low_acceptance_resets_pool():
    """Three rejected drafts in a row with under half their tokens accepted clear the pool."""
    spec = make("ngram_mod")
    history = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    spec.begin(0, history[:-1])
    resets = spec.num_resets
    for k in range(3):
        assert draft(spec, history) is not None
        spec.accept(0, 0, False)
        assert spec.num_resets == resets
        history = history + [50 + k, 1, 2, 3]  # the target rejected the draft; the key returns
    draft(spec, history)  # the third verdict is known once the history shows the rejection
    assert spec.num_resets == resets + 1


def test_ngram_mod_rollback_rehashes_replaced_tokens():
    """After a rollback, the tokens that replace the dropped ones feed the pool."""
    spec = make("ngram_mod")
    spec.begin(0, [1, 2, 3, 4])
    spec.process([CommittedTokens(0, 0, [1, 2, 3, 4, 5, 6])])
    spec.process([CommittedTokens(0, 4, [7, 8])])  # rollback: positions 4.. are now 7, 8
    assert draft(spec, [1, 2, 3, 4, 7, 8, 0, 2, 3, 4]).token_ids[0] == 7


# ---- ngram_cache ---------------------------------------------------------------------------------

@pytest.mark.parametrize("history, params, expected", [
    # a phrase seen once before is copied from the context cache, cycling up to n_draft=8
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], {}, [4, 5, 6, 1, 2, 3, 4, 5]),
    # a single earlier occurrence of a 1-gram is too little evidence (lax threshold: 2)
    ([7, 1, 8, 1], {}, None),
    # the request's n_max caps n_draft
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], {"n_max": 3}, [4, 5, 6]),
])
def test_ngram_cache_context(history, params, expected):
    assert draft_ids("ngram_cache", history, **params) == expected


def test_ngram_cache_probs_and_p_min():
    """token_probs are the empirical next-token shares; p_min cuts where they fall below."""
    history = [5, 1, 2, 5, 1, 2, 5, 1, 3, 5, 1]  # after (5,1): 2 twice, 3 once
    spec = make("ngram_cache")
    spec.begin(0, history[:-1])
    d = draft(spec, history, n_max=1)
    assert d.token_ids == [2] and d.token_probs == pytest.approx([2 / 3])
    assert d.expected_accepted == pytest.approx(2 / 3)
    assert draft(spec, history, n_max=1, p_min=0.7) is None


def test_ngram_cache_dynamic_spans_requests():
    """What a finished request generated drafts for the next one (strict thresholds)."""
    spec = make("ngram_cache")
    phrase = [40, 41, 42, 43, 44]
    spec.begin(0, [1] + phrase + [2] + phrase)
    spec.end(0)
    spec.begin(1, [9, 9, 40, 41])
    assert draft(spec, [9, 9, 40, 41, 42], seq_id=1).token_ids[:2] == [43, 44]


def test_ngram_cache_dynamic_is_bounded():
    """Past max_dynamic_ngrams, the least observed n-grams go first."""
    table = {(1,): {2: 5}, (2,): {3: 1}, (3,): {4: 1, 5: 1}, (4,): {1: 1}}
    prune_table(table, 2)
    assert table == {(1,): {2: 5}, (3,): {4: 1, 5: 1}}
    spec = make("ngram_cache", max_dynamic_ngrams=100)
    spec.begin(0, list(range(10)) * 5 + list(range(100, 140)))  # repeated part, then singletons
    spec.end(0)
    assert 0 < len(spec.dynamic) <= 75
    assert (3, 4) in spec.dynamic and (120, 121) not in spec.dynamic


def test_ngram_cache_static_cache(tmp_path):
    """A static cache built from a corpus drafts with no context evidence at all."""
    path = str(tmp_path / "static.bin")
    save_table(build_table([[60, 61, 62] * 3]), path)
    spec = make("ngram_cache", lookup_cache_static=path)
    spec.begin(0, [5, 60])
    assert draft(spec, [5, 60, 61], n_max=2).token_ids == [62, 60]


def test_ngram_cache_save_load_round_trip(tmp_path):
    """save() writes the dynamic cache; a new instance loads it and drafts the same."""
    path = str(tmp_path / "dynamic.bin")
    spec = make("ngram_cache", lookup_cache_dynamic=path)  # missing file: starts empty
    phrase = [40, 41, 42, 43, 44]
    spec.begin(0, [1] + phrase + [2] + phrase)
    spec.end(0)
    spec.save()
    assert load_table(path) == spec.dynamic
    again = make("ngram_cache", lookup_cache_dynamic=path)
    assert again.dynamic == spec.dynamic
    again.begin(1, [9, 40, 41])
    assert draft(again, [9, 40, 41, 42], seq_id=1).token_ids[:2] == [43, 44]


@pytest.mark.parametrize("content, field", [
    (b"not a cache", "lookup_cache_static"),  # wrong magic
    # 5 n-grams announced, none there
    (b"SPNGRAM1" + (5).to_bytes(4, "little"), "lookup_cache_dynamic"),
    (b"SPNGRAM1\x01\x00", "lookup_cache_static"),  # size not a multiple of 4
])
def test_ngram_cache_corrupt_file_names_path(tmp_path, content, field):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.bin"):
        make("ngram_cache", **{field: str(path)})


def test_ngram_cache_missing_static_names_path(tmp_path):
    path = str(tmp_path / "absent.bin")
    with pytest.raises(FileNotFoundError, match="absent.bin"):
        make("ngram_cache", lookup_cache_static=path)


# ---- lifecycle and rollback, every model-free drafter --------------------------------------

@pytest.mark.parametrize("name", MODEL_FREE)
def test_begin_twice_names_the_sequence(name):
    spec = make(name)
    spec.begin(7, [1, 2, 3])
    with pytest.raises(ValueError, match="sequence 7"):
        spec.begin(7, [1, 2, 3])


@pytest.mark.parametrize("name", MODEL_FREE)
def test_unknown_sequence_raises_and_end_releases(name):
    spec = make(name)
    with pytest.raises(ValueError, match="sequence 3"):
        draft(spec, [1, 2, 3], seq_id=3)
    with pytest.raises(ValueError, match="sequence 3"):
        spec.accept(3, 0, False)
    with pytest.raises(ValueError, match="sequence 3"):
        spec.process([CommittedTokens(3, 0, [1])])
    spec.end(3)  # unknown: no-op
    spec.begin(3, [1, 2])
    spec.end(3)
    spec.begin(3, [1, 2])  # released, so it can begin again


@pytest.mark.parametrize("name", [n for n in MODEL_FREE if n != "ngram_mod"])
def test_rollback_equals_fresh_history(name):
    """After process() rolls back and replaces tokens, drafts equal a fresh speculator's."""
    rng = random.Random(1)
    base = [rng.randrange(6) for _ in range(60)]
    spec = make(name)
    spec.begin(0, base[:30])
    spec.process([CommittedTokens(0, 0, base)])  # commits past the prompt
    replaced = base[:40] + base[10:25]
    spec.process([CommittedTokens(0, 40, replaced[40:])])  # rollback to 40, new tail
    history = replaced + [base[25]]
    d = draft(spec, history)
    fresh = make(name)
    fresh.begin(0, history[:-1])
    expected = draft(fresh, history)
    assert (d and d.token_ids) == (expected and expected.token_ids)


@pytest.mark.parametrize("name", MODEL_FREE)
def test_incremental_equals_begin(name):
    """Drafting step by step (sync + process) gives the drafts of a speculator begun fresh."""
    rng = random.Random(2)
    text = [rng.randrange(5) for _ in range(80)]
    spec = make(name)
    spec.begin(0, text[:20])
    for end in range(21, len(text), 3):
        got = draft(spec, text[:end])
        spec.process([CommittedTokens(0, end - 1, text[end - 1:end + 2])])
        fresh = make(name)
        fresh.begin(0, text[:end - 1])
        want = draft(fresh, text[:end])
        assert (got and got.token_ids) == (want and want.token_ids), end


@pytest.mark.parametrize("name", MODEL_FREE)
def test_drafts_on_cold_prompt_that_is_copied(name):
    """A fresh request whose answer repeats a span of its prompt gets that span drafted."""
    rng = random.Random(3)
    prompt = [rng.randrange(100) for _ in range(60)]
    answer = prompt[20:50]
    spec = make(name)
    spec.begin(0, prompt)
    d = draft(spec, prompt + answer[:6], n_max=4)
    assert d is not None and d.token_ids == answer[6:6 + len(d)] and len(d) >= 1


@pytest.mark.parametrize("name", MODEL_FREE)
def test_default_config_drafts_copied_span(name):
    """With llama.cpp's / vLLM's defaults, a long copied span of a cold prompt is drafted."""
    rng = random.Random(4)
    prompt = [rng.randrange(100) for _ in range(200)]
    answer = prompt[20:120]
    spec = speculator_class(name)(CTX, None)
    spec.begin(0, prompt)
    d = draft(spec, prompt + answer[:30], n_max=16)
    assert d is not None and len(d) >= 1 and d.token_ids == answer[30:30 + len(d)]


@pytest.mark.parametrize("name", MODEL_FREE)
def test_draft_stops_at_eos(name):
    """Nothing after an end-of-sequence token is drafted."""
    cls = speculator_class(name)
    spec = cls(SpeculatorContext(vocab_size=100, eos_token_ids=(2,)),
               cls.config_class(**SMALL[name]))
    prompt = [5, 6, 7, 8, 9, 2, 11, 12, 13, 14, 15, 16] * 2
    spec.begin(0, prompt)
    d = draft(spec, prompt + [5, 6, 7, 8], n_max=8)
    assert d is not None and d.token_ids[-1] == 2 and 2 not in d.token_ids[:-1]


def test_ngram_map_on_a_history_shorter_than_its_window_terminates():
    """Regression: a lookup limit below -1 once made NgramIndex.occurrences loop forever."""
    from speculant.speculators.base import DraftParams, DraftRequest, SpeculatorContext
    from speculant.speculators.ngram_map import NgramMapKSpeculator

    spec = NgramMapKSpeculator(SpeculatorContext(vocab_size=100))
    spec.begin(0, [1, 2, 3, 1, 2])
    out = spec.draft([DraftRequest(0, [1, 2, 3, 1, 2, 3], DraftParams(n_max=8))])
    assert isinstance(out, dict)  # returned at all: the default 12-token key is never matched
