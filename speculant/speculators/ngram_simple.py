"""ngram_simple: copy what followed the last earlier occurrence of the current n-gram."""
from __future__ import annotations

from dataclasses import dataclass

from speculant.speculators.base import Draft, DraftParams
from speculant.speculators.ngram_match import MirroredSpeculator, NgramIndex, SeqHistory, limit_draft


@dataclass(slots=True)
class NgramSimpleConfig:
    """Defaults from llama.cpp `common_params_speculative_ngram_map` (common/common.h), flags
    `--spec-ngram-size-n` / `--spec-ngram-size-m` (common/arg.cpp, docs/speculative.md).

    - size_n = 12: length of the key n-gram looked up in the history.
    - size_m = 48: at most this many tokens following the match are drafted.
    """

    size_n: int = 12
    size_m: int = 48

    def __post_init__(self) -> None:
        if self.size_n < 1:
            raise ValueError(f"size_n must be >= 1, got {self.size_n}")
        if self.size_m < 1:
            raise ValueError(f"size_m must be >= 1, got {self.size_m}")


class _SimpleState(SeqHistory):
    __slots__ = ("index",)


class NgramSimpleSpeculator(MirroredSpeculator):
    """Self-speculation without a draft model (llama.cpp `common_ngram_simple_draft`, PR #18471;
    the idea is prompt-lookup decoding).

    The key is the last `size_n` tokens of the history (ending with the sampled token); the
    draft is the up to `size_m` tokens that followed its most recent earlier occurrence. An
    `NgramIndex` of the sequence's history replaces llama.cpp's backward scan.
    """

    name = "ngram_simple"
    config_class = NgramSimpleConfig
    state_class = _SimpleState

    def _init_state(self, state: _SimpleState) -> None:
        state.index = NgramIndex(self.config.size_n)

    def _on_extend(self, state: _SimpleState, old_len: int) -> None:
        state.index.extend(state.tokens)

    def _on_truncate(self, state: _SimpleState, new_len: int) -> None:
        state.index.truncate(state.tokens, new_len)

    def _draft_one(self, state: _SimpleState, params: DraftParams) -> Draft | None:
        n, tokens = self.config.size_n, state.tokens
        if len(tokens) <= n:
            return None
        # the newest occurrence of the key is the key itself (it ends the history)
        match = state.index.prev[len(tokens) - n]
        if match < 0:
            return None
        start = match + n
        draft_ids = tokens[start:start + min(self.config.size_m, params.n_max)]
        limited = limit_draft(draft_ids, None, params)
        return None if limited is None else Draft(limited[0])
