"""suffix: SuffixDecoding over the request's own history and a global tree of past responses."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from speculant.speculators.base import Draft, DraftParams, SpeculatorContext
from speculant.speculators.ngram_match import MirroredSpeculator, SeqHistory, limit_draft
from speculant.speculators.suffix_tree import Match, SuffixTree


@dataclass(slots=True)
class SuffixConfig:
    """Field names after Arctic Inference's `SuffixDecodingCache`/`speculate()`; defaults from
    vLLM's `SpeculativeConfig` for method "suffix" (`suffix_decoding_*`, which runs Arctic's
    implementation), except max_cached_requests.

    - max_tree_depth = 24 (vLLM; Arctic's plugin: 64): longest suffix stored; bounds match
      length + draft length. Deeper costs more per token in Python.
    - max_cached_requests = 1000 (vLLM: 10000, Arctic's plugin: 100000): responses kept in the
      global tree, evicted oldest first; -1 keeps all, 0 disables the global tree. Lower than
      upstream because this tree costs ~350 bytes per cached token (1000 responses of 500
      tokens: ~175 MB) where Arctic's is C++.
    - max_spec_factor = 1.0, max_spec_offset = 0.0 (vLLM, Arctic): a match of length m drafts
      at most m * max_spec_factor + max_spec_offset tokens (longer matches are trusted further).
    - min_token_prob = 0.1 (vLLM, Arctic): drafting stops where the estimated probability of
      the path so far drops below this.
    """

    max_tree_depth: int = 24
    max_cached_requests: int = 1000
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2, got {self.max_tree_depth}")
        if self.max_cached_requests < -1:
            raise ValueError(f"max_cached_requests must be >= -1, got {self.max_cached_requests}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


class _SuffixState(SeqHistory):
    __slots__ = ("local", "global_matches", "global_version", "global_len")

    # local: SuffixTree of this sequence's history (prompt + output)
    # global_matches: (length, match) of the history's suffixes in the global tree, kept up to
    #   date token by token; valid while the tree's version is global_version and the history
    #   length is global_len


class SuffixSpeculator(MirroredSpeculator):
    """SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975; Arctic Inference
    `suffix_decoding/`).

    Two suffix trees: a *local* one per sequence over its prompt and output, and a *global* one
    over the responses of finished requests (at most `max_cached_requests`, FIFO eviction),
    shared by all sequences. For each suffix of the history that occurs in a tree (match length
    m = 1, 2, ...), the candidate draft follows the most frequent child from the match for at
    most `m * max_spec_factor + max_spec_offset` tokens. Each token carries the estimated
    probability that the path up to it is right (product of child count / parent count along
    the path); a candidate's *score* is their sum, its expected accepted tokens. The best
    score wins (the longer match on ties; the global tree only if strictly better), and
    becomes `Draft.expected_accepted`.

    Differences from Arctic Inference: responses enter the global tree when their request ends,
    not token by token (so concurrent requests do not see each other's partial output), and the
    whole history may be matched (Arctic stops one token short of its max-depth window).
    """

    name = "suffix"
    config_class = SuffixConfig
    state_class = _SuffixState

    def __init__(self, ctx: SpeculatorContext, config: SuffixConfig | None = None):
        super().__init__(ctx, config)
        self.global_tree = SuffixTree(self.config.max_tree_depth)
        self._cached: deque[int] = deque()  # keys of the responses in the global tree, oldest first
        self._next_key = 0

    # ---- history -----------------------------------------------------------------------------

    def _init_state(self, state: _SuffixState) -> None:
        state.local = SuffixTree(self.config.max_tree_depth)
        state.global_matches, state.global_version, state.global_len = [], -1, 0

    def _on_extend(self, state: _SuffixState, old_len: int) -> None:
        state.local.extend(0, state.tokens[old_len:])
        tree = self.global_tree
        if state.global_version == tree.version and state.global_len == old_len:
            max_len = self.config.max_tree_depth - 1
            matches = state.global_matches
            for tok in state.tokens[old_len:]:
                first = tree.match([tok])
                grown = [] if first is None else [(1, first)]
                for length, m in matches:
                    if length < max_len:
                        m = tree.advance(m, tok)
                        if m is not None:
                            grown.append((length + 1, m))
                matches = grown
            state.global_matches, state.global_len = matches, len(state.tokens)

    def _global_matches(self, state: _SuffixState) -> list:
        tree = self.global_tree
        if state.global_version != tree.version or state.global_len != len(state.tokens):
            context = state.tokens[-(self.config.max_tree_depth - 1):]
            state.global_matches = tree.suffix_matches(context)
            state.global_version, state.global_len = tree.version, len(state.tokens)
        return state.global_matches

    def _on_truncate(self, state: _SuffixState, new_len: int) -> None:
        # a rollback is rare: rebuilding beats undoing the tree
        state.local = SuffixTree(self.config.max_tree_depth)
        state.local.extend(0, state.tokens[:new_len])
        state.global_version = -1

    def _on_end(self, state: _SuffixState) -> None:
        response = state.tokens[state.prompt_len:]
        if self.config.max_cached_requests == 0 or not response:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self.global_tree.extend(key, response)
        self.global_tree.finish(key)
        self._cached.append(key)
        limit = self.config.max_cached_requests
        while limit > 0 and len(self._cached) > limit:
            self.global_tree.remove(self._cached.popleft())

    @property
    def num_cached_responses(self) -> int:
        return len(self._cached)

    # ---- drafting ----------------------------------------------------------------------------

    def _draft_one(self, state: _SuffixState, params: DraftParams) -> Draft | None:
        best = self._best(state.local, state.local.active_matches(0), params.n_max)
        if len(self.global_tree):
            other = self._best(self.global_tree, self._global_matches(state), params.n_max)
            if other[2] > best[2]:
                best = other
        token_ids, path_probs, _ = best
        if not token_ids:
            return None
        token_probs = [path_probs[0]] + [b / a for a, b in zip(path_probs, path_probs[1:])]
        limited = limit_draft(token_ids, token_probs, params)
        if limited is None:
            return None
        token_ids, token_probs = limited
        return Draft(token_ids, expected_accepted=sum(path_probs[:len(token_ids)]),
                     token_probs=token_probs)

    def _best(self, tree: SuffixTree, matches: list[tuple[int, Match]],
              n_max: int) -> tuple[list[int], list[float], float]:
        """The highest-scoring candidate over all match lengths (longest first, so a tie keeps
        the longer match); a candidate that cannot beat the best even at probability 1 is
        skipped."""
        cfg = self.config
        best: tuple[list[int], list[float], float] = ([], [], 0.0)
        for length, match in sorted(matches, key=lambda lm: -lm[0]):
            max_tokens = min(n_max, int(length * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6),
                             cfg.max_tree_depth - match.depth)
            if max_tokens <= best[2]:
                continue
            token_ids, path_probs = tree.best_path(match, max_tokens, cfg.min_token_prob)
            score = sum(path_probs)
            if score > best[2]:
                best = (token_ids, path_probs, score)
        return best
