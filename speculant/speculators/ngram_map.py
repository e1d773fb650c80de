"""ngram_map_k and ngram_map_k4v: llama.cpp's n-gram map (key n-gram -> value m-grams)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from speculant.speculators.base import Draft, DraftParams, expected_accepted
from speculant.speculators.ngram_match import (
    MirroredSpeculator,
    NgramIndex,
    SeqHistory,
    draft_was_rejected,
    limit_draft,
)

# llama.cpp COMMON_NGRAM_MAX_VALUES: value m-grams tracked per key (later ones are not counted).
MAX_VALUES = 4


@dataclass(slots=True)
class NgramMapConfig:
    """Defaults from llama.cpp `common_params_speculative_ngram_map` (common/common.h), flags
    `--spec-ngram-size-n`, `--spec-ngram-size-m`, `--spec-ngram-min-hits` (common/arg.cpp,
    docs/speculative.md).

    - size_n = 12: length of the key n-gram.
    - size_m = 48: length of a value m-gram (the longest draft).
    - min_hits = 1: earlier occurrences of the key (each followed by a full m-gram) needed
      before it drafts.
    """

    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1

    def __post_init__(self) -> None:
        if self.size_n < 1:
            raise ValueError(f"size_n must be >= 1, got {self.size_n}")
        if self.size_m < 1:
            raise ValueError(f"size_m must be >= 1, got {self.size_m}")
        if self.min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {self.min_hits}")


class _MapState(SeqHistory):
    __slots__ = ("index", "value_stats", "last_accepted", "last_draft", "verdict")

    # value_stats: key -> [newest occurrence counted, [[value m-gram, count], ...]]   (k4v only)
    # last_accepted: (key, value) -> tokens accepted the last time this value was drafted
    # last_draft: ((key, value), start position, draft ids) of the draft out for verification
    # verdict: last_draft plus its accepted count, until the history shows whether it was
    #          rejected or only cut shorter


class _NgramMapSpeculator(MirroredSpeculator):
    """Shared part of the two map drafters: find the key's earlier occurrences, remember how
    many tokens of a drafted value the target accepted last time.

    As in llama.cpp, a value is drafted only up to the number of its tokens accepted the last
    time it was drafted (all `size_m` the first time), so a key whose continuation changed stops
    drafting. Unlike llama.cpp, a draft the chain cut shorter before verification (all of what
    was verified accepted) does not shrink the value. Occurrences come from an `NgramIndex`,
    not from llama.cpp's backward scan.
    """

    config_class = NgramMapConfig
    state_class = _MapState

    def _init_state(self, state: _MapState) -> None:
        state.index = NgramIndex(self.config.size_n)
        state.value_stats = {}
        state.last_accepted = {}
        state.last_draft = None
        state.verdict = None

    def _on_extend(self, state: _MapState, old_len: int) -> None:
        state.index.extend(state.tokens)

    def _on_truncate(self, state: _MapState, new_len: int) -> None:
        state.index.truncate(state.tokens, new_len)
        state.value_stats.clear()  # recounted lazily from the index
        state.last_draft = state.verdict = None

    def _on_accept(self, state: _MapState, num_accepted: int, is_other: bool) -> None:
        if state.last_draft is not None and not is_other:
            state.verdict = (*state.last_draft, num_accepted)
        state.last_draft = None

    def _record_verdict(self, state: _MapState) -> None:
        """Remember the accepted count of the last verified draft once it is known to be a
        rejection (the next draft request shows the token the target put in its place)."""
        if state.verdict is None:
            return
        stat_key, start, draft_ids, num_accepted = state.verdict
        rejected = draft_was_rejected(state.tokens, start, draft_ids, num_accepted)
        if rejected is None:
            return
        if rejected:
            state.last_accepted[stat_key] = num_accepted
        state.verdict = None

    def _propose(self, state: _MapState, stat_key, start: int, draft_ids: list[int]) -> None:
        state.last_draft = (stat_key, start, draft_ids)

    def _occurrences(self, state: _MapState) -> tuple[tuple[int, ...], int] | None:
        """The key and the newest occurrence followed by a full value, if the key has at least
        min_hits such occurrences."""
        n, m = self.config.size_n, self.config.size_m
        tokens = state.tokens
        if len(tokens) <= n:
            return None
        key = tuple(tokens[-n:])
        # a full value ends before the last token (the sampled one, which the key ends with)
        occurrences = state.index.occurrences(key, len(tokens) - 1 - n - m)
        found = list(islice(occurrences, self.config.min_hits))
        if len(found) < self.config.min_hits:
            return None
        return key, found[0]

    def _value_len(self, state: _MapState, key, value, params: DraftParams) -> int:
        m = self.config.size_m
        return min(m, params.n_max, state.last_accepted.get((key, value), m))


class NgramMapKSpeculator(_NgramMapSpeculator):
    """ngram_map_k (llama.cpp `common_ngram_map_draft` with key_only): draft the m-gram that
    followed the most recent earlier occurrence of the key."""

    name = "ngram_map_k"

    def _draft_one(self, state: _MapState, params: DraftParams) -> Draft | None:
        self._record_verdict(state)
        state.last_draft = None
        found = self._occurrences(state)
        if found is None:
            return None
        key, newest = found
        start = newest + self.config.size_n
        # key_only mode keeps one value slot per key, so the accepted count is per key
        num = self._value_len(state, key, None, params)
        limited = limit_draft(state.tokens[start:start + num], None, params)
        if limited is None:
            return None
        self._propose(state, (key, None), len(state.tokens), limited[0])
        return Draft(limited[0])


class NgramMapK4vSpeculator(_NgramMapSpeculator):
    """ngram_map_k4v (llama.cpp `common_ngram_map_draft`, complex mode): count up to four
    distinct value m-grams after the key and draft the most frequent one, but only if it is at
    least twice as frequent as all the others together.

    Confidence: token i of the chosen value is right with the empirical probability that the
    continuation agrees with it up to i, over the counted occurrences; `token_probs` holds the
    conditional probabilities and `expected_accepted` their survival sum.
    """

    name = "ngram_map_k4v"

    def _draft_one(self, state: _MapState, params: DraftParams) -> Draft | None:
        self._record_verdict(state)
        state.last_draft = None
        found = self._occurrences(state)
        if found is None:
            return None
        key, newest = found
        values = self._count_values(state, key, newest)
        best = max(range(len(values)), key=lambda i: (values[i][1], -i))
        value, best_count = values[best]
        others = sum(c for _, c in values) - best_count
        if others > 0 and best_count < 2 * others:
            return None  # no value clearly dominates
        draft_ids = list(value[:self._value_len(state, key, value, params)])
        token_probs = _agreement_probs(values, value, len(draft_ids))
        limited = limit_draft(draft_ids, token_probs, params)
        if limited is None:
            return None
        draft_ids, token_probs = limited
        self._propose(state, (key, value), len(state.tokens), draft_ids)
        return Draft(draft_ids, expected_accepted=expected_accepted(token_probs),
                     token_probs=token_probs)

    def _count_values(self, state: _MapState, key, newest: int) -> list:
        """Count the values after the key's occurrences up to `newest`, continuing the count."""
        stats = state.value_stats.get(key)
        if stats is None:
            stats = state.value_stats[key] = [-1, []]
        n, m, tokens = self.config.size_n, self.config.size_m, state.tokens
        fresh = []
        for start in state.index.occurrences(key, newest):
            if start <= stats[0]:
                break
            fresh.append(start)
        values = stats[1]
        for start in reversed(fresh):  # oldest first: value slots fill in history order
            value = tuple(tokens[start + n:start + n + m])
            for slot in values:
                if slot[0] == value:
                    slot[1] += 1
                    break
            else:
                if len(values) < MAX_VALUES:
                    values.append([value, 1])
        stats[0] = newest
        return values


def _agreement_probs(values: list, chosen: tuple[int, ...], length: int) -> list[float]:
    """P(token i right | tokens before right) for the chosen value, from the value counts."""
    alive = [(v, c) for v, c in values]
    total = sum(c for _, c in alive)
    probs = []
    for i in range(length):
        if len(alive) == 1:
            probs.extend([1.0] * (length - i))
            break
        kept = [(v, c) for v, c in alive if v[i] == chosen[i]]
        kept_total = sum(c for _, c in kept)
        probs.append(kept_total / total)
        alive, total = kept, kept_total
    return probs
