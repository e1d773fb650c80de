"""ngram_mod: one hash pool of "n-gram -> next token", shared by every sequence and request."""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from speculant.speculators.base import Draft, DraftParams, SpeculatorContext
from speculant.speculators.ngram_match import MirroredSpeculator, SeqHistory, draft_was_rejected

# llama.cpp common_ngram_mod::idx: res = res * LCG + token over the n-gram, modulo 2**64.
_LCG = 6364136223846793005
_MASK = (1 << 64) - 1
_EMPTY = -1
# llama.cpp constants of common_speculative_state_ngram_mod (not command-line options there)
MAX_OCCUPANCY = 0.25  # at begin, a pool fuller than this is reset
LOW_ACCEPTANCE = 0.5  # a draft with a smaller accepted fraction is a low-acceptance round ...
MAX_LOW_ROUNDS = 3  # ... and this many in a row reset the pool


@dataclass(slots=True)
class NgramModConfig:
    """Defaults from llama.cpp `common_params_speculative_ngram_mod` (common/common.h), flags
    `--spec-ngram-mod-n-match`, `--spec-ngram-mod-n-min`, `--spec-ngram-mod-n-max`.

    - n_match = 24: length of the hashed n-gram (llama.cpp warns below 16).
    - n_max = 64: longest draft (a request's n_max caps it further).
    - n_min = 48: shorter drafts are dropped (capped at the effective n_max, so a request that
      allows fewer tokens still gets drafts).
    - pool_size = 4 Mi: entries in the hash pool (llama.cpp hard-codes 4*1024*1024, 16 MB).
    """

    n_match: int = 24
    n_max: int = 64
    n_min: int = 48
    pool_size: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.n_match < 1:
            raise ValueError(f"n_match must be >= 1, got {self.n_match}")
        if self.n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {self.n_max}")
        if not 0 <= self.n_min <= self.n_max:
            raise ValueError(f"n_min must be in [0, n_max={self.n_max}], got {self.n_min}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")


class _ModState(SeqHistory):
    __slots__ = ("num_added", "hash", "pending", "num_low")

    # num_added: n-grams starting before this position are in the pool (llama.cpp i_last)
    # hash: hash of tokens[num_added:num_added + n] (None: not computed yet)
    # pending: (start, draft ids) of the draft out for verification, then + accepted count
    # num_low: consecutive low-acceptance rounds (llama.cpp n_low)


class NgramModSpeculator(MirroredSpeculator):
    """llama.cpp's ngram_mod (PR #19164): a fixed-size pool maps the hash of an n-gram to the
    token that last followed it; drafting rolls the hash over the last n tokens and reads the
    pool until it hits an empty slot.

    Memory layout: `array('i')` of `pool_size` int32 tokens, -1 = empty, one per instance and
    shared by every sequence (so requests benefit from each other). Collisions overwrite.
    Reset rules (llama.cpp): at `begin`, a pool whose occupancy exceeds 25% is cleared; three
    consecutive verified drafts with less than half their tokens accepted clear it too.

    Rejected tokens never reach the pool: only history tokens are hashed, and a rollback
    (`process` with a smaller start_pos) moves the sequence's insertion point back, so the
    replaced tokens' successors are hashed again. Differences from llama.cpp, and why:
    - n-grams are added as tokens arrive, not in chunks of 32 (the chunks only saved time);
    - the sampled token is hashed as the successor of the n-gram before it (it is final);
    - occupancy counts slots that were empty, checked *before* adding the new prompt, so a
      reset never discards the prompt of the request that triggered it;
    - a draft the chain cut shorter (everything verified accepted) is not a low-acceptance
      round; the fraction is taken over the drafted length, as in llama.cpp, otherwise.
    """

    name = "ngram_mod"
    config_class = NgramModConfig
    state_class = _ModState

    def __init__(self, ctx: SpeculatorContext, config: NgramModConfig | None = None):
        super().__init__(ctx, config)
        self._apow = pow(_LCG, self.config.n_match - 1, 1 << 64)  # LCG**(n-1) for rolling
        self._pool = array("i", [_EMPTY]) * self.config.pool_size
        self.num_used = 0  # occupied slots
        self.num_resets = 0

    def reset_pool(self) -> None:
        """Empty the pool (every sequence loses its n-grams)."""
        self._pool = array("i", [_EMPTY]) * self.config.pool_size
        self.num_used = 0
        self.num_resets += 1

    @property
    def occupancy(self) -> float:
        return self.num_used / self.config.pool_size

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id not in self._seqs and self.occupancy > MAX_OCCUPANCY:
            self.reset_pool()
        super().begin(seq_id, prompt_ids)

    # ---- pool --------------------------------------------------------------------------------

    def _hash(self, tokens: list[int], start: int) -> int:
        h = 0
        for t in tokens[start:start + self.config.n_match]:
            h = (h * _LCG + t) & _MASK
        return h

    def _init_state(self, state: _ModState) -> None:
        state.num_added = 0
        state.hash = None
        state.pending = None
        state.num_low = 0

    def _on_extend(self, state: _ModState, old_len: int) -> None:
        """Add every n-gram whose successor is now in the history."""
        n, tokens = self.config.n_match, state.tokens
        i = state.num_added
        if i + n >= len(tokens):
            return
        h = self._hash(tokens, i) if state.hash is None else state.hash
        pool, size, apow = self._pool, self.config.pool_size, self._apow
        used = 0
        for i in range(i, len(tokens) - n):
            nxt = tokens[i + n]
            slot = h % size
            if pool[slot] == _EMPTY:
                used += 1
            pool[slot] = nxt
            h = ((h - tokens[i] * apow) * _LCG + nxt) & _MASK
        self.num_used += used
        state.num_added = len(tokens) - n
        state.hash = h

    def _on_truncate(self, state: _ModState, new_len: int) -> None:
        # entries already written stay (the pool is a cache of hints), but the tokens that
        # replace the dropped ones get their n-grams hashed again
        num_added = max(0, min(state.num_added, new_len - self.config.n_match))
        if num_added != state.num_added:
            state.num_added, state.hash = num_added, None
        state.pending = None

    # ---- drafting ----------------------------------------------------------------------------

    def _draft_one(self, state: _ModState, params: DraftParams) -> Draft | None:
        self._record_verdict(state)
        n, tokens = self.config.n_match, state.tokens
        if len(tokens) < n:
            return None
        h = state.hash if state.num_added + n == len(tokens) else None
        if h is None:
            h = self._hash(tokens, len(tokens) - n)
        n_max = min(self.config.n_max, params.n_max)
        n_min = max(params.n_min, min(self.config.n_min, n_max))
        pool, size, apow = self._pool, self.config.pool_size, self._apow
        draft_ids: list[int] = []
        first = len(tokens) - n  # position of the token leaving the window at step 0
        for i in range(n_max):
            tok = pool[h % size]
            if tok == _EMPTY:
                break
            draft_ids.append(tok)
            out = tokens[first + i] if i < n else draft_ids[i - n]
            h = ((h - out * apow) * _LCG + tok) & _MASK
        if not draft_ids or len(draft_ids) < n_min:
            return None
        state.pending = (len(tokens), draft_ids)
        return Draft(draft_ids)

    def _on_accept(self, state: _ModState, num_accepted: int, is_other: bool) -> None:
        if state.pending is not None and len(state.pending) == 2 and not is_other:
            state.pending = (*state.pending, num_accepted)
        else:
            state.pending = None

    def _record_verdict(self, state: _ModState) -> None:
        """Count a low-acceptance round once the history shows the draft was rejected."""
        if state.pending is None:
            return
        if len(state.pending) == 2:  # drafted but never verified
            state.pending = None
            return
        start, draft_ids, num_accepted = state.pending
        rejected = draft_was_rejected(state.tokens, start, draft_ids, num_accepted)
        if rejected is None:
            return
        state.pending = None
        if rejected and num_accepted < LOW_ACCEPTANCE * len(draft_ids):
            state.num_low += 1
            if state.num_low >= MAX_LOW_ROUNDS:
                self.reset_pool()
                state.num_low = 0
                state.num_added, state.hash = 0, None  # re-add this sequence's history
                self._on_extend(state, 0)
        else:
            state.num_low = 0
