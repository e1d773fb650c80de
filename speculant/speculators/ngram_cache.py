"""ngram_cache: llama.cpp's lookup decoding over context, dynamic and static n-gram caches.

An n-gram cache ("table") maps an n-gram (a tuple of 1..4 tokens) to the counts of the tokens
that followed it: `{(t0, .., tn-1): {next token: count}}`.

Lookup cache file format (ours; llama.cpp's is a raw dump of its C++ structs):
    8 bytes   magic b"SPNGRAM1"
    int32 little-endian words:
        num_ngrams
        per n-gram: ngram_len (1..4), ngram_len tokens, num_next (>= 1),
                    num_next pairs (token, count >= 1)
    nothing after the last n-gram.
"""
from __future__ import annotations

import os
import sys
from array import array
from dataclasses import dataclass

from speculant.speculators.base import Draft, DraftParams, SpeculatorContext, expected_accepted
from speculant.speculators.ngram_match import MirroredSpeculator, SeqHistory, limit_draft

NgramTable = dict[tuple[int, ...], dict[int, int]]

# llama.cpp common/ngram-cache.h
NGRAM_MIN = 1  # LLAMA_NGRAM_MIN: shortest context/dynamic n-gram
NGRAM_MAX = 4  # LLAMA_NGRAM_MAX: longest context/dynamic n-gram
NGRAM_STATIC = 2  # LLAMA_NGRAM_STATIC: n-gram length of the static cache
# llama.cpp common/ngram-cache.cpp: a draft token needs at least this many observations of the
# n-gram and this share (percent) for the most frequent next token, by n-gram length 1..4.
# Context cache (this sequence) and static cache use the lax thresholds, dynamic the strict.
MIN_SAMPLES_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLES_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)

_MAGIC = b"SPNGRAM1"


@dataclass(slots=True)
class NgramCacheConfig:
    """Defaults from llama.cpp: flags `-lcs/--lookup-cache-static`, `-lcd/--lookup-cache-dynamic`
    (common/arg.cpp, `common_params_speculative_ngram_cache`), n_draft from
    common/speculative.cpp (`create_state_ngram_cache`: `n_draft = 8`).

    - lookup_cache_static = "": file of the static cache (n-grams of a large corpus), read-only
      while serving; a missing or corrupt file is an error.
    - lookup_cache_dynamic = "": file of the dynamic cache, which accumulates every finished
      sequence's n-grams; loaded if it exists, written by `save()`.
    - n_draft = 8: longest draft (a request's n_max caps it further).
    - max_dynamic_ngrams = 1000000 (ours; llama.cpp's lookup tool runs one prompt per process
      and never bounds it): when the dynamic cache grows past this many n-grams, the least
      observed ones are dropped down to 3/4 of it. An n-gram costs ~300 bytes, so the default
      is ~300 MB; -1 = no limit, 0 = the dynamic cache only holds what its file held.
    """

    lookup_cache_static: str = ""
    lookup_cache_dynamic: str = ""
    n_draft: int = 8
    max_dynamic_ngrams: int = 1_000_000

    def __post_init__(self) -> None:
        if self.n_draft < 1:
            raise ValueError(f"n_draft must be >= 1, got {self.n_draft}")
        if self.max_dynamic_ngrams < -1:
            raise ValueError(f"max_dynamic_ngrams must be >= -1, got {self.max_dynamic_ngrams}")


# ---- tables -----------------------------------------------------------------------------------

def count_ngrams(table: NgramTable, tokens: list[int], start: int,
                 ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX, sign: int = 1) -> None:
    """Add (sign=1) or remove (sign=-1) the n-grams ending before tokens[i] -> tokens[i],
    for i >= start (llama.cpp common_ngram_cache_update)."""
    for i in range(max(start, ngram_min), len(tokens)):
        nxt = tokens[i]
        for size in range(ngram_min, min(ngram_max, i) + 1):
            key = tuple(tokens[i - size:i])
            part = table.get(key)
            if part is None:
                if sign > 0:
                    table[key] = {nxt: 1}
                continue
            count = part.get(nxt, 0) + sign
            if count > 0:
                part[nxt] = count
            elif nxt in part:
                del part[nxt]
                if not part:
                    del table[key]


def merge_tables(dst: NgramTable, src: NgramTable) -> None:
    """Add src's counts into dst (llama.cpp common_ngram_cache_merge)."""
    for key, part in src.items():
        dst_part = dst.get(key)
        if dst_part is None:
            dst[key] = dict(part)
            continue
        for tok, count in part.items():
            dst_part[tok] = dst_part.get(tok, 0) + count


def prune_table(table: NgramTable, max_ngrams: int) -> None:
    """Drop the n-grams observed least often until at most max_ngrams remain."""
    if len(table) <= max_ngrams:
        return
    totals = {key: sum(part.values()) for key, part in table.items()}
    by_total: dict[int, int] = {}
    for total in totals.values():
        by_total[total] = by_total.get(total, 0) + 1
    excess, cutoff = len(table) - max_ngrams, 0
    for total in sorted(by_total):  # drop whole count classes, rarest first
        if excess <= 0:
            break
        excess -= by_total[total]
        cutoff = total
    for key, total in totals.items():
        if total <= cutoff:
            del table[key]


def build_table(corpus: list[list[int]], ngram_size: int = NGRAM_STATIC) -> NgramTable:
    """A static cache from tokenized documents (llama.cpp llama-lookup-create)."""
    table: NgramTable = {}
    for tokens in corpus:
        count_ngrams(table, tokens, 0, ngram_size, ngram_size)
    return table


def save_table(table: NgramTable, path: str) -> None:
    words = array("i", [len(table)])
    for key, part in table.items():
        words.append(len(key))
        words.extend(key)
        words.append(len(part))
        for tok, count in part.items():
            words.append(tok)
            words.append(count)
    if sys.byteorder != "little":
        words.byteswap()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(_MAGIC)
        words.tofile(f)
    os.replace(tmp, path)


def load_table(path: str) -> NgramTable:
    """Read a lookup cache file; errors name the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"ngram_cache: lookup cache file {path!r} does not exist") from None
    except OSError as exc:
        raise OSError(f"ngram_cache: cannot read lookup cache file {path!r}: {exc}") from exc
    if not data.startswith(_MAGIC) or (len(data) - len(_MAGIC)) % 4:
        raise ValueError(f"ngram_cache: {path!r} is not a lookup cache file (bad magic or size)")
    words = array("i")
    words.frombytes(data[len(_MAGIC):])
    if sys.byteorder != "little":
        words.byteswap()
    try:
        return _parse_table(words)
    except (IndexError, ValueError) as exc:
        raise ValueError(f"ngram_cache: corrupt lookup cache file {path!r}: {exc}") from None


def _parse_table(words: array) -> NgramTable:
    table: NgramTable = {}
    num_ngrams, i = words[0], 1
    for _ in range(num_ngrams):
        size = words[i]
        if not NGRAM_MIN <= size <= NGRAM_MAX:
            raise ValueError(f"n-gram length {size} at word {i}")
        key = tuple(words[i + 1:i + 1 + size])
        num_next = words[i + 1 + size]
        if num_next < 1 or len(key) < size:
            raise ValueError(f"bad n-gram record at word {i}")
        i += 2 + size
        pairs = words[i:i + 2 * num_next]
        if len(pairs) < 2 * num_next or min(pairs[1::2]) < 1:
            raise ValueError(f"bad next-token counts at word {i}")
        table[key] = dict(zip(pairs[0::2], pairs[1::2]))
        i += 2 * num_next
    if i != len(words):
        raise ValueError(f"{len(words) - i} trailing words")
    return table


# ---- drafting -----------------------------------------------------------------------------------

def _try_primary(table: NgramTable, keys: list[tuple[int, ...]], part_static: dict[int, int],
                 min_samples: tuple, min_percent: tuple) -> tuple[int, float] | None:
    """Most likely next token from the longest n-gram that passes the thresholds; the static
    cache reweights candidates (llama.cpp try_draft with a primary cache). Returns the token
    and its empirical probability in the primary cache."""
    for key in reversed(keys):  # longest first
        part = table.get(key)
        if part is None:
            continue
        total = sum(part.values())
        size = len(key)
        if total < min_samples[size - 1]:
            continue
        if part_static:
            best = max(part, key=lambda t: part[t] * (100 * part_static.get(t, 0) or 1))
        else:
            best = max(part, key=part.__getitem__)
        count = part[best]
        if 100 * count < min_percent[size - 1] * total:
            continue
        return best, count / total
    return None


def _try_static(part_static: dict[int, int]) -> tuple[int, float] | None:
    if not part_static:
        return None
    total = sum(part_static.values())
    best = max(part_static, key=part_static.__getitem__)
    count = part_static[best]
    size = NGRAM_STATIC
    if total < MIN_SAMPLES_LAX[size - 1] or 100 * count < MIN_PERCENT_LAX[size - 1] * total:
        return None
    return best, count / total


def draft_from_caches(tokens: list[int], n_draft: int, context: NgramTable,
                      dynamic: NgramTable, static: NgramTable) -> tuple[list[int], list[float]]:
    """llama.cpp common_ngram_cache_draft: extend the history one token at a time from the
    context cache, else the dynamic cache, else the static one; stop when none is confident."""
    seq = tokens[-NGRAM_MAX:]
    draft_ids: list[int] = []
    probs: list[float] = []
    if len(tokens) < NGRAM_STATIC:
        return draft_ids, probs
    while len(draft_ids) < n_draft:
        part_static = static.get(tuple(seq[-NGRAM_STATIC:]), {}) if static else {}
        keys = [tuple(seq[-size:]) for size in range(NGRAM_MIN, min(NGRAM_MAX, len(seq)) + 1)]
        found = _try_primary(context, keys, part_static, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
        if found is None and dynamic:
            found = _try_primary(dynamic, keys, part_static, MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT)
        if found is None:
            found = _try_static(part_static)
        if found is None:
            break
        draft_ids.append(found[0])
        probs.append(found[1])
        seq.append(found[0])
    return draft_ids, probs


class _CacheState(SeqHistory):
    __slots__ = ("context",)


class NgramCacheSpeculator(MirroredSpeculator):
    """Lookup decoding (llama.cpp common/ngram-cache.cpp, PRs #5479, #6828, #6848).

    Three levels of n-gram statistics:
    - context: the n-grams (1..4 tokens) of this sequence's history, counted incrementally;
    - dynamic: the context caches of every sequence that ended in this process (and whatever
      the dynamic file held at start), shared by all sequences, bounded by
      max_dynamic_ngrams;
    - static: counts of 2-grams from a large corpus, loaded from a file, never changed.
    Each draft token comes from the longest context n-gram with enough evidence, else the
    dynamic cache under stricter thresholds, else the static cache; the static counts reweight
    the primary candidates. `token_probs` are the empirical probabilities of the chosen tokens.
    """

    name = "ngram_cache"
    config_class = NgramCacheConfig
    state_class = _CacheState

    def __init__(self, ctx: SpeculatorContext, config: NgramCacheConfig | None = None):
        super().__init__(ctx, config)
        self.static: NgramTable = {}
        self.dynamic: NgramTable = {}
        if self.config.lookup_cache_static:
            self.static = load_table(self.config.lookup_cache_static)
        path = self.config.lookup_cache_dynamic
        if path and os.path.exists(path):  # a missing dynamic file is created by save()
            self.dynamic = load_table(path)

    def save(self) -> None:
        """Write the dynamic cache (and the static one, unchanged) to their files."""
        if self.config.lookup_cache_dynamic:
            save_table(self.dynamic, self.config.lookup_cache_dynamic)
        if self.config.lookup_cache_static:
            save_table(self.static, self.config.lookup_cache_static)

    def _init_state(self, state: _CacheState) -> None:
        state.context = {}

    def _on_extend(self, state: _CacheState, old_len: int) -> None:
        count_ngrams(state.context, state.tokens, old_len)

    def _on_truncate(self, state: _CacheState, new_len: int) -> None:
        count_ngrams(state.context, state.tokens, new_len, sign=-1)

    def _on_end(self, state: _CacheState) -> None:
        limit = self.config.max_dynamic_ngrams
        if limit == 0:
            return
        merge_tables(self.dynamic, state.context)
        if limit > 0 and len(self.dynamic) > limit:
            prune_table(self.dynamic, limit * 3 // 4)

    def _draft_one(self, state: _CacheState, params: DraftParams) -> Draft | None:
        n_draft = min(self.config.n_draft, params.n_max)
        draft_ids, probs = draft_from_caches(state.tokens, n_draft, state.context,
                                             self.dynamic, self.static)
        limited = limit_draft(draft_ids, probs, params)
        if limited is None:
            return None
        draft_ids, probs = limited
        return Draft(draft_ids, expected_accepted=expected_accepted(probs), token_probs=probs)
