"""SuffixDecoding: the suffix tree against brute-force counts, and the suffix drafter."""
import random

import pytest

from speculant.speculators.base import DraftParams, DraftRequest, SpeculatorContext
from speculant.speculators.suffix import SuffixConfig, SuffixSpeculator
from speculant.speculators.suffix_tree import SuffixTree

CTX = SpeculatorContext(vocab_size=200)


def occurrences(seqs, pattern):
    """Brute force: how many times `pattern` occurs in `seqs`."""
    n = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == pattern)


def check_counts(tree, seqs, depth):
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                pattern = s[i:i + n]
                assert tree.count(pattern) == occurrences(seqs, pattern), pattern


def random_seqs(rng, num, length, alphabet):
    return [[rng.randrange(alphabet) for _ in range(rng.randrange(1, length))] for _ in range(num)]


# ---- the tree ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed, depth, alphabet", [
    (0, 4, 2),  # tiny alphabet: deep shared paths, many leaf splits
    (1, 6, 3),
    (2, 24, 5),  # default depth
])
def test_tree_counts_match_brute_force(seed, depth, alphabet):
    """Every substring up to max_depth is found with its exact number of occurrences."""
    rng = random.Random(seed)
    seqs = random_seqs(rng, 4, 40, alphabet)
    tree = SuffixTree(depth)
    for key, s in enumerate(seqs):
        for i in range(0, len(s), 3):  # grown in chunks, as a live sequence
            tree.extend(key, s[i:i + 3])
        tree.finish(key)
    check_counts(tree, seqs, depth)
    assert tree.count([]) == sum(len(s) for s in seqs)  # the root: every suffix


def test_tree_remove_equals_never_added():
    """Removing a sequence leaves exactly the counts of the others."""
    rng = random.Random(3)
    seqs = random_seqs(rng, 5, 50, 3)
    tree = SuffixTree(5)
    for key, s in enumerate(seqs):
        tree.extend(key, s)
        tree.finish(key)
    for key in (1, 3):
        tree.remove(key)
    kept = [seqs[0], seqs[2], seqs[4]]
    check_counts(tree, kept, 5)
    for key in (1, 3):
        assert all(tree.count(seqs[key][i:i + 5]) == occurrences(kept, seqs[key][i:i + 5])
                   for i in range(len(seqs[key])))


def test_best_path_follows_most_frequent_child():
    """Each step of the path takes a most frequent continuation; its probability is
    count(match + path so far) / count(match)."""
    rng = random.Random(4)
    seqs = random_seqs(rng, 3, 80, 3)
    tree = SuffixTree(8)
    for key, s in enumerate(seqs):
        tree.extend(key, s)
        tree.finish(key)
    for _ in range(50):
        s = seqs[rng.randrange(3)]
        i = rng.randrange(len(s))
        pattern = s[i:i + rng.randrange(1, 4)]
        path, probs = tree.best_path(tree.match(pattern), 8, 0.0)
        base = occurrences(seqs, pattern)
        assert len(pattern) + len(path) <= 8
        for k, tok in enumerate(path):
            prefix = pattern + path[:k]
            best = max(occurrences(seqs, prefix + [x]) for x in range(3))
            assert occurrences(seqs, prefix + [tok]) == best
            assert probs[k] == pytest.approx(occurrences(seqs, prefix + [tok]) / base)
        if len(pattern) + len(path) < 8:  # stopped early: nothing follows
            assert all(occurrences(seqs, pattern + path + [x]) == 0 for x in range(3))


# ---- the drafter ---------------------------------------------------------------------------------

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def draft(spec, history, seq_id=0, n_max=16, p_min=0.0):
    request = DraftRequest(seq_id, list(history), DraftParams(n_max, 0, p_min))
    return spec.draft([request]).get(seq_id)


@pytest.mark.parametrize("history, cfg, n_max, expected_ids, expected_probs", [
    # match [1,2,3] (one earlier occurrence + this one): 3 tokens at path probability 1/2
    (PROMPT + [1, 2, 3], {}, 16, [4, 5, 6], [0.5, 0.5, 0.5]),
    # max_spec_factor=2 lets a match of 3 draft 6 tokens
    (PROMPT + [1, 2, 3], {"max_spec_factor": 2.0}, 16, [4, 5, 6, 7, 8, 9], [0.5] * 6),
    # min_token_prob above 1/2 stops before the first token
    (PROMPT + [1, 2, 3], {"min_token_prob": 0.6}, 16, None, None),
    # the request's n_max caps the draft
    (PROMPT + [1, 2, 3], {}, 2, [4, 5], [0.5, 0.5]),
    # frequency beats recency: 5 -> 6 three times, 5 -> 7 once (5 occurs 5 times with this one)
    ([5, 6, 0, 5, 6, 1, 5, 7, 2, 5, 6, 3, 5], {}, 16, [6], [0.6]),
    # nothing earlier matches the last token: no draft
    (PROMPT + [10], {}, 16, None, None),
])
def test_suffix_draft(history, cfg, n_max, expected_ids, expected_probs):
    spec = SuffixSpeculator(CTX, SuffixConfig(**cfg))
    spec.begin(0, history[:-1])
    d = draft(spec, history, n_max=n_max)
    if expected_ids is None:
        assert d is None
        return
    assert d.token_ids == expected_ids
    assert d.expected_accepted == pytest.approx(sum(expected_probs))
    conditional = [expected_probs[0]] + [b / a for a, b in zip(expected_probs, expected_probs[1:])]
    assert d.token_probs == pytest.approx(conditional)


def test_suffix_p_min_cuts_low_confidence_token():
    spec = SuffixSpeculator(CTX)
    spec.begin(0, PROMPT + [1, 2])
    assert draft(spec, PROMPT + [1, 2, 3], p_min=0.4).token_ids == [4, 5, 6]
    assert draft(spec, PROMPT + [1, 2, 3], p_min=0.6) is None


def finish_request(spec, seq_id, prompt, response):
    spec.begin(seq_id, prompt)
    draft(spec, prompt + response, seq_id=seq_id)  # draft requests carry the response
    spec.end(seq_id)


def test_global_tree_serves_other_requests():
    """A finished response drafts for a later request with an unrelated prompt."""
    spec = SuffixSpeculator(CTX)
    finish_request(spec, 0, [100, 101, 102], [40, 41, 42, 43, 44, 45])
    spec.begin(1, [9, 9])
    d = draft(spec, [9, 9, 40, 41, 42], seq_id=1)
    assert d.token_ids == [43, 44, 45] and d.expected_accepted == pytest.approx(3.0)


def test_global_tree_fifo_eviction():
    """With max_cached_requests=2, the oldest response is evicted when a third one ends."""
    spec = SuffixSpeculator(CTX, SuffixConfig(max_cached_requests=2))
    responses = [[40 + 10 * k + i for i in range(6)] for k in range(3)]
    for k, response in enumerate(responses):
        finish_request(spec, k, [150 + k], response)
    assert spec.num_cached_responses == 2
    spec.begin(9, [9])
    assert draft(spec, [9] + responses[0][:3], seq_id=9) is None  # evicted
    assert draft(spec, [9] + responses[1][:3], seq_id=9).token_ids == responses[1][3:6]


def test_global_tree_disabled():
    spec = SuffixSpeculator(CTX, SuffixConfig(max_cached_requests=0))
    finish_request(spec, 0, [100], [40, 41, 42, 43])
    spec.begin(1, [9])
    assert draft(spec, [9, 40, 41], seq_id=1) is None
    assert spec.num_cached_responses == 0


@pytest.mark.parametrize("response, expected_ids", [
    # global: [50..53] at probability 1 (score 4) beats local [60, 0, 40, 41] at 1/2 (score 2)
    ([40, 41, 42, 43, 50, 51, 52, 53], [50, 51, 52, 53]),
    # global: [50] then the response ends (score 1): the local candidate (score 2) wins
    ([40, 41, 42, 43, 50], [60, 0, 40, 41]),
])
def test_best_score_wins_across_trees(response, expected_ids):
    spec = SuffixSpeculator(CTX)
    finish_request(spec, 0, [100], response)
    spec.begin(1, [40, 41, 42, 43, 60, 0, 40])
    assert draft(spec, [40, 41, 42, 43, 60, 0, 40, 41, 42, 43], seq_id=1).token_ids == expected_ids
