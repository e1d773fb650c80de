"""N-gram matching shared by the model-free drafters, and the history mirror they build on.

Terms used by every drafter in this package:
- *history*: one sequence's tokens as the drafter knows them: prompt, generated tokens and, after
  a draft request, the last sampled token (`DraftRequest.token_ids` in full).
- *key*: the last n tokens of the history; the drafters look for earlier occurrences of it.
- *committed*: tokens the target has in its KV cache (`process`). The history may run one token
  ahead of them (the sampled token), and `process` with a smaller `start_pos` rolls it back.

Every drafter here indexes the history incrementally: `begin` indexes the prompt once, each
draft or commit indexes only the new tokens, and a rollback un-indexes the dropped ones. Nothing
rescans the whole history per step.
"""
from __future__ import annotations

from abc import abstractmethod
from array import array
from typing import ClassVar

from speculant.speculators.base import (
    CommittedTokens,
    Draft,
    DraftParams,
    DraftRequest,
    Speculator,
    SpeculatorContext,
)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared at C speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def limit_draft(token_ids: list[int], token_probs: list[float] | None,
                params: DraftParams) -> tuple[list[int], list[float] | None] | None:
    """Apply a request's limits: cut at n_max and where confidence < p_min; None if < n_min.

    `token_probs[i]` is the drafter's probability of token i given the tokens before it; p_min
    only applies where the drafter has one.
    """
    keep = min(len(token_ids), params.n_max)
    if token_probs is not None and params.p_min > 0.0:
        for i in range(keep):
            if token_probs[i] < params.p_min:
                keep = i
                break
    if keep == 0 or keep < params.n_min:
        return None
    return token_ids[:keep], None if token_probs is None else token_probs[:keep]


def draft_was_rejected(tokens: list[int], draft_start: int, draft_ids: list[int],
                       num_accepted: int) -> bool | None:
    """Whether a draft placed at history position draft_start had num_accepted tokens accepted
    because the target rejected the next one (True) or because it was cut shorter before
    verification, by the chain or a length limit (False); None while the history does not
    reach the position that tells.

    A rejected draft token is never the token the target committed in its place (greedy or
    rejection sampling with a one-hot draft), so comparing the two tells the cases apart.
    """
    if num_accepted >= len(draft_ids):
        return False
    pos = draft_start + num_accepted
    if pos >= len(tokens):
        return None
    return tokens[pos] != draft_ids[num_accepted]


def _cut_after_eos(draft: Draft, eos: frozenset[int], n_min: int) -> Draft | None:
    """Nothing after an end-of-sequence token can be accepted: cut the draft there."""
    for i, tok in enumerate(draft.token_ids):
        if tok in eos:
            break
    else:
        return draft
    keep = i + 1
    if keep < n_min:
        return None
    return draft.prefix(keep)


class NgramIndex:
    """Occurrences of every n-gram of one history, newest first, for most-recent-match lookups.

    Memory layout (a chained hash index, no per-key lists, so the garbage collector has
    nothing to traverse): `last` maps an n-gram (tuple of n tokens) to the start position of
    its newest occurrence; `prev[p]` is the start of the previous occurrence of the n-gram
    starting at p, or -1. `extend` and `truncate` cost O(new or dropped tokens).
    """

    __slots__ = ("n", "last", "prev")

    def __init__(self, n: int):
        self.n = n
        self.last: dict[tuple[int, ...], int] = {}
        self.prev = array("q")  # [num n-grams indexed]

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams of `tokens` not indexed yet (it grew since the last call)."""
        n = self.n
        first = len(self.prev)  # next n-gram start to index
        if len(tokens) - first < n:
            return
        if len(tokens) - first > 64:
            # zip of shifted slices builds all keys at C speed (begin on a long prompt)
            window = tokens[first:]
            keys = zip(*[window[i:] for i in range(n)])
        else:
            keys = (tuple(tokens[i:i + n]) for i in range(first, len(tokens) - n + 1))
        last, prev = self.last, self.prev
        get = last.get
        for start, key in enumerate(keys, first):
            prev.append(get(key, -1))
            last[key] = start

    def truncate(self, tokens: list[int], new_len: int) -> None:
        """Forget the n-grams ending at or after new_len (call before cutting `tokens`)."""
        n, last, prev = self.n, self.last, self.prev
        keep = max(new_len - n + 1, 0)
        for start in range(len(prev) - 1, keep - 1, -1):
            key = tuple(tokens[start:start + n])
            if prev[start] < 0:
                del last[key]
            else:
                last[key] = prev[start]
        del prev[keep:]

    def newest(self, key: tuple[int, ...]) -> int:
        """Start of the newest occurrence of key, -1 if none."""
        return self.last.get(key, -1)

    def occurrences(self, key: tuple[int, ...], limit: int):
        """Starts of the occurrences of key at or before `limit`, newest first."""
        pos = self.last.get(key, -1)
        prev = self.prev
        while pos >= 0 and pos > limit:  # limit may be < -1 for short histories
            pos = prev[pos]
        while pos >= 0:
            yield pos
            pos = prev[pos]


class SeqHistory:
    """Per-sequence state of a mirroring drafter: the history and how much of it is committed."""

    __slots__ = ("seq_id", "tokens", "num_committed", "prompt_len")

    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.num_committed = 0  # high-water mark of positions the target reported via process
        self.prompt_len = 0


class MirroredSpeculator(Speculator):
    """Base of the model-free drafters: keeps each sequence's history and tells the subclass
    which tokens were added (`_on_extend`) or dropped (`_on_truncate`).

    History sources, in the order the engine produces them:
    1) `begin` — the prompt;
    2) `process` — committed tokens; a `start_pos` below what was committed before is a rollback
       (positions >= start_pos are forgotten), otherwise tokens already known are confirmed;
    3) `draft` — `DraftRequest.token_ids`, which runs ahead of the commits by the sampled token
       (or more if the engine skipped `process`). Only the last known token is checked there:
       the engine reports rollbacks through `process`.
    """

    config_class: ClassVar[type]
    state_class: ClassVar[type[SeqHistory]] = SeqHistory

    def __init__(self, ctx: SpeculatorContext, config=None):
        if config is None:
            config = self.config_class()
        elif isinstance(config, dict):
            config = self.config_class(**config)
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{self.name}: config must be {self.config_class.__name__}, "
                            f"got {type(config).__name__}")
        self.ctx = ctx
        self.config = config
        self._eos = frozenset(ctx.eos_token_ids)
        self._seqs: dict[int, SeqHistory] = {}

    # ---- lifecycle -----------------------------------------------------------------------

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id} is already active")
        state = self.state_class(seq_id)
        self._init_state(state)
        self._seqs[seq_id] = state
        self._extend(state, list(prompt_ids))
        state.prompt_len = len(prompt_ids)

    def process(self, batch: list[CommittedTokens]) -> None:
        for c in batch:
            self._commit(self._state(c.seq_id), c.start_pos, c.token_ids)

    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        out = {}
        for r in requests:
            state = self._state(r.seq_id)
            self._sync(state, r.token_ids)
            if r.params.n_max <= 0:
                continue
            d = self._draft_one(state, r.params)
            if d is not None and self._eos:
                d = _cut_after_eos(d, self._eos, r.params.n_min)
            if d is not None:
                out[r.seq_id] = d
        return out

    def accept(self, seq_id: int, num_accepted: int, is_other: bool) -> None:
        self._on_accept(self._state(seq_id), num_accepted, is_other)

    def end(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self._on_end(state)

    # ---- hooks for subclasses --------------------------------------------------------------

    def _init_state(self, state) -> None:
        """Create the subclass's per-sequence indexes on a fresh state."""

    def _on_extend(self, state, old_len: int) -> None:
        """state.tokens[old_len:] were just appended; index them."""

    def _on_truncate(self, state, new_len: int) -> None:
        """state.tokens[new_len:] are about to be dropped; un-index them."""

    @abstractmethod
    def _draft_one(self, state, params: DraftParams) -> Draft | None:
        """This sequence's draft under `params`, or None."""

    def _on_accept(self, state, num_accepted: int, is_other: bool) -> None:
        """The last draft for this sequence had num_accepted tokens accepted."""

    def _on_end(self, state) -> None:
        """The sequence ended; fold what outlives it into shared state."""

    # ---- history bookkeeping ---------------------------------------------------------------

    def _state(self, seq_id: int):
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"{self.name}: sequence {seq_id} is not active (call begin first)")
        return state

    def _extend(self, state, new_tokens: list[int]) -> None:
        if new_tokens:
            old_len = len(state.tokens)
            state.tokens.extend(new_tokens)
            self._on_extend(state, old_len)

    def _truncate(self, state, new_len: int) -> None:
        if new_len < len(state.tokens):
            self._on_truncate(state, new_len)
            del state.tokens[new_len:]

    def _commit(self, state, start_pos: int, token_ids: list[int]) -> None:
        tokens = state.tokens
        if start_pos > len(tokens):
            raise ValueError(f"{self.name}: sequence {state.seq_id} commits from position "
                             f"{start_pos} but only {len(tokens)} tokens are known")
        end = start_pos + len(token_ids)
        keep = start_pos + common_prefix_len(tokens[start_pos:end], token_ids)
        if keep < end:
            self._truncate(state, keep)
            self._extend(state, token_ids[keep - start_pos:])
        elif start_pos < state.num_committed:  # rollback: forget everything after this batch
            self._truncate(state, end)
        state.num_committed = end

    def _sync(self, state, token_ids: list[int]) -> None:
        tokens = state.tokens
        n = len(tokens)
        if n <= len(token_ids) and (n == 0 or tokens[-1] == token_ids[n - 1]):
            if n < len(token_ids):
                self._extend(state, token_ids[n:])
            return
        keep = common_prefix_len(tokens, token_ids)
        self._truncate(state, keep)
        self._extend(state, token_ids[keep:])
