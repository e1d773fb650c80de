"""The speculator contract: one interface every drafter implements.

After llama.cpp's `common_speculative` (see the seeds): a speculator is told when a sequence
starts (`begin`), sees every token the target commits (`process`), proposes drafts for all
drafting sequences at once (`draft`), learns how many of its tokens the target accepted
(`accept`) and when the sequence ends (`end`).

One instance serves every sequence of an engine (state keyed by `seq_id`), so state that is
meant to be shared across sequences and requests (ngram_mod's hash pool, the suffix drafter's
global tree of past responses) is naturally shared.

Vocabulary used throughout:
- *draft*: the tokens a speculator proposes after a sequence's last token.
- *accepted*: draft tokens the target verified; the target then adds one token of its own
  (the bonus token when all were accepted, the correction otherwise).
- *expected accepted tokens* (`Draft.expected_accepted`): the speculator's own estimate of how
  many of the draft's tokens the target will accept; the chain uses it to pick a winner.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from speculant.speculators.calibration import CalibrationPrior
from speculant.speculators.counters import AcceptanceCounters


@dataclass(slots=True)
class DraftParams:
    """Per-sequence limits for one draft (llama.cpp's n_max / n_min / p_min)."""

    n_max: int = 16  # longest draft to propose (already capped by context and max_tokens)
    n_min: int = 0  # drafts shorter than this are dropped
    p_min: float = 0.0  # stop drafting where the drafter's confidence falls below this
    # stop drafting where the product of the draft's probabilities so far would fall below
    # this (the first token is always kept): the chain's break-even for drafting one more
    # position of a model drafter, whose later tokens are then drafted only while they can pay
    p_min_run: float = 0.0
    # a model drafter that must catch up on more history than this restarts its context on the
    # last `context_tokens` tokens (0: its own setting): the chain's shadow probes and first
    # asks of a draft model, which would otherwise re-read up to its whole window each time
    context_tokens: int = 0
    # what one more forward of a model drafter costs for this sequence, in tokens' worth (the
    # chain's measure per row of its further forwards): a further forward runs where such
    # forwards have yielded at least that (`continuation.py`)
    further_cost: float = 0.0
    # the chance a token the drafter gave probability p is accepted at draft position i (its
    # earlier tokens right): the chain's calibration of this drafter for this sequence
    # (calibration.Survival: rate(p, i), least_prob(chance, i)); None: p itself
    survival: object | None = None

    def __post_init__(self) -> None:
        if self.n_max < 0:
            raise ValueError(f"n_max must be >= 0, got {self.n_max}")
        if self.n_min < 0:
            raise ValueError(f"n_min must be >= 0, got {self.n_min}")
        if self.n_min > self.n_max and self.n_max > 0:
            raise ValueError(f"n_min ({self.n_min}) must not exceed n_max ({self.n_max})")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")
        if not 0.0 <= self.p_min_run <= 1.0:
            raise ValueError(f"p_min_run must be in [0, 1], got {self.p_min_run}")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {self.context_tokens}")
        if not 0.0 <= self.further_cost < float("inf"):
            raise ValueError(f"further_cost must be >= 0 and finite, got {self.further_cost}")


class TargetDraws:
    """How the target will draw the tokens at a draft's positions when it verifies by
    sample-and-match (a request at temperature > 0): the request's filters and the uniform its
    sampler will use at draft position i (peeked, not consumed).

    A drafter with a distribution draws its token at position i with that uniform and those
    filters (a *coupled* draft): where its distribution is close to the target's, the two
    inverse-CDF draws coincide at any entropy, where a greedy draft matches only with the
    target's probability of that token (eagle3 at T 0.8 on mt_bench: acceptance 0.42 against
    0.59 greedy). Lossless either way: the target's own draws decide what is emitted. The
    target's repetition penalty is not applied by drafters."""

    __slots__ = ("params", "_sampler", "_uniforms")

    def __init__(self, params, sampler) -> None:
        self.params = params  # the request's SamplingParams (temperature > 0)
        self._sampler = sampler  # its Sampler: peek_uniforms(n) -> fp64 [n]
        self._uniforms: torch.Tensor | None = None

    def uniforms(self, n: int) -> torch.Tensor:
        """The target's uniforms at draft positions 0..n-1 (fp64 [n], CPU)."""
        if self._uniforms is None or self._uniforms.shape[0] < n:
            self._uniforms = self._sampler.peek_uniforms(max(n, 8))
        return self._uniforms[:n]


@dataclass(slots=True)
class DraftRequest:
    """What a speculator gets to draft for one sequence.

    `token_ids` is the sequence's whole history: prompt, generated tokens, and as its last
    element the token the target sampled most recently (not yet in the target's KV cache).
    The draft continues after `token_ids[-1]`. Read-only: speculators must not mutate it.
    `draws`: how the target will sample the draft's positions (None when it verifies greedily
    or by rejection sampling). `num_prompt_tokens`: how many of `token_ids` are the prompt (a
    draft model runs its prompt positions the way the target does: kernels/attention.py).
    """

    seq_id: int
    token_ids: list[int]
    params: DraftParams
    draws: TargetDraws | None = None
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class Draft:
    """A proposal for one sequence."""

    token_ids: list[int]
    # Expected number of draft tokens the target accepts (0..len(token_ids)); None lets the
    # chain estimate it from this speculator's measured acceptance per position.
    expected_accepted: float | None = None
    # Draft distribution q at each draft position, for rejection sampling; None means the
    # draft is deterministic (treated as one-hot by the verifier).
    probs: torch.Tensor | None = None  # [len(token_ids), vocab_size]
    # Drafter's probability of each drafted token (confidence), where it has one.
    token_probs: list[float] | None = None
    source: str = ""  # name of the speculator that made it (set by the chain)
    # Benchmarking only (the synthetic speculator): the engine accepts exactly this many
    # tokens instead of verifying, and flags the request's output as invalid.
    forced_num_accepted: int | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def prefix(self, length: int) -> "Draft":
        """The first `length` tokens of this draft, with their per-token fields."""
        if length >= len(self.token_ids):
            return self
        cut = (lambda xs: None if xs is None else xs[:length])
        expected = self.expected_accepted
        if expected is not None:
            expected = (expected_accepted(self.token_probs[:length])
                        if self.token_probs is not None else min(expected, length))
        forced = None if self.forced_num_accepted is None else min(self.forced_num_accepted, length)
        return Draft(self.token_ids[:length], expected, cut(self.probs), cut(self.token_probs),
                     self.source, forced)


class DraftBuilder:
    """A model drafter's draft, grown one token at a time: ids, the drafter's probability of
    each, and (when sampling) its distribution q over the target's vocabulary."""

    __slots__ = ("ids", "probs", "qs", "run_prob")

    def __init__(self):
        self.ids: list[int] = []
        self.probs: list[float] = []
        self.qs: list[torch.Tensor] = []  # each [vocab]
        self.run_prob = 1.0  # the chance the run survives: product of its tokens' chances

    def chance(self, prob: float, params: DraftParams) -> float:
        """The chance a next token of probability `prob` is accepted, the run's earlier tokens
        right (`params.survival`, else prob itself)."""
        return prob if params.survival is None else params.survival.rate(prob, len(self.ids))

    def takes(self, prob: float, params: DraftParams) -> bool:
        """Whether a next token of probability `prob` joins the draft under `params`' p_min
        and p_min_run: the chance the run survives through it must still pay for verifying
        it (the first token only needs p_min)."""
        return prob >= params.p_min and (
            not self.ids or self.run_prob * self.chance(prob, params) >= params.p_min_run)

    def need(self, params: DraftParams) -> float:
        """The probability a next token must reach to join the draft (`takes`); > 1 when
        none can (the run's chance already fell below p_min_run)."""
        if not self.ids or params.p_min_run <= 0.0:
            return params.p_min
        if self.run_prob <= 0.0:
            return float("inf")
        chance = params.p_min_run / self.run_prob
        least = chance if params.survival is None else \
            params.survival.least_prob(chance, len(self.ids))
        return max(params.p_min, least)

    def gain(self, prob: float, params: DraftParams, joins: bool | None = None) -> float:
        """What a next token of probability `prob` adds to the draft: the chance the run
        survives through it, past the verification break-even p_min_run; 0 when it does not
        join (`takes`, unless `joins` says)."""
        joins = self.takes(prob, params) if joins is None else joins
        return self.run_prob * self.chance(prob, params) - params.p_min_run if joins else 0.0

    def offer(self, tok: int, prob: float, q: torch.Tensor | None, params: DraftParams,
              continuation) -> bool:
        """The drafter's next pick: a further token (after the first) tells `continuation`
        (a `ContinuationRecord`) what its forward gained at the probability it needed; the
        token is added when it joins (`takes`). Returns whether it joined."""
        joins = self.takes(prob, params)
        if self.ids:
            continuation.record(self.need(params), self.gain(prob, params, joins))
        if joins:
            self.add(tok, prob, q, self.chance(prob, params))
        return joins

    def add(self, tok: int, prob: float, q: torch.Tensor | None,
            chance: float | None = None) -> None:
        """Append a token (`chance`: of it being accepted, its earlier tokens right; default
        its probability)."""
        self.ids.append(tok)
        self.probs.append(prob)
        self.run_prob *= prob if chance is None else chance
        if q is not None:
            self.qs.append(q)

    def to_draft(self) -> Draft:
        q = torch.stack(self.qs) if self.qs else None  # [k, vocab]
        return Draft(self.ids, expected_accepted=None, probs=q, token_probs=list(self.probs))


def expected_accepted(token_probs: list[float]) -> float:
    """Expected accepted tokens of a draft whose token i is right with probability token_probs[i]
    given tokens before it: sum over i of P(tokens 0..i all right)."""
    total, survive = 0.0, 1.0
    for p in token_probs:
        survive *= p
        total += survive
    return total


@dataclass(slots=True)
class CommittedTokens:
    """Tokens the target just committed to its KV cache for one sequence.

    `start_pos` is the position of `token_ids[0]`; everything before it was committed earlier.
    A sequence can appear with `start_pos` smaller than what the speculator saw before: that
    happens only after a rollback, and the speculator must forget positions >= start_pos.
    """

    seq_id: int
    start_pos: int
    token_ids: list[int]
    # The token the target sampled after these (not committed yet: the next step's first
    # input); None for a prompt chunk that is not the prompt's last.
    next_token_id: int | None = None
    # Target features for model drafters (EAGLE-3, MTP, DFlash): the step's captured layers
    # (`StepFeatures`, the layers some speculator asked for: `Speculator.hidden_layers`; None
    # when none did) and the row in them of token_ids[feature_skip], the first token that has
    # features: a prompt chunk's older tokens have none when no speculator reads that far back
    # (`Speculator.feature_rows`). Read them with `hidden_states` or `features(layers)`. A
    # dict layer -> [len(token_ids) - feature_skip, hidden_size] is taken as the features of
    # these tokens alone.
    step_features: StepFeatures | dict[int, torch.Tensor] | None = None
    feature_row: int = 0
    feature_skip: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.step_features, dict):
            self.step_features, self.feature_row = StepFeatures(self.step_features), 0

    @property
    def num_feature_rows(self) -> int:
        """How many of these tokens (the newest) have features."""
        return len(self.token_ids) - self.feature_skip

    @property
    def hidden_states(self) -> dict[int, torch.Tensor] | None:
        """layer -> the residual stream after that target layer at each of these tokens that
        has features, [num_feature_rows, hidden_size] (row i was computed reading
        token_ids[feature_skip + i]; it predicts the token after it); None without features.
        Views into the step's tensors."""
        if self.step_features is None:
            return None
        rows = slice(self.feature_row, self.feature_row + self.num_feature_rows)
        return {i: h[rows] for i, h in self.step_features.by_layer.items()}

    def features(self, layers: tuple[int, ...]) -> torch.Tensor:
        """[num_feature_rows, len(layers) * hidden_size] the features at `layers` of these
        tokens that have them, side by side in that order (a view of the step's fused tensor:
        one concatenation per step for the whole batch, not one per sequence)."""
        fused = self.step_features.fused(layers)
        return fused[self.feature_row:self.feature_row + self.num_feature_rows]


@dataclass(slots=True)
class StepFeatures:
    """What one target forward captured for every row of its batch: layer -> [T, hidden]
    (fresh tensors of that step, never written again), and their concatenations per layer set
    (`fused`), made once for all the step's sequences. (Concatenated per sequence and step,
    with a dict of per-layer views built per sequence, keeping the features of a head that was
    not asked cost ~15 us per sequence and step at c=8.)"""

    by_layer: dict[int, torch.Tensor]
    _fused: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def fused(self, layers: tuple[int, ...]) -> torch.Tensor:
        """[T, len(layers) * hidden] the layers side by side in `layers` order."""
        out = self._fused.get(layers)
        if out is None:
            out = self._fused[layers] = torch.cat([self.by_layer[i] for i in layers], dim=-1)
        return out


@dataclass(slots=True)
class TargetView:
    """What model drafters may use of the target: its configuration, where it was loaded
    from, its token embedding, final norm and LM head (never the engine itself)."""

    config: object  # speculant.models.config.ModelConfig
    model_path: str
    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [T] -> [T, hidden] float32
    final_norm: torch.Tensor  # [hidden]
    # [vocab, hidden] weight, callable on final-normed rows [R, hidden] -> [R, vocab]
    # (a PackedLinear: also select_rows(ids), dequantize())
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    # the packed token table whose rows `embed` dequantizes (a PackedLinear), when the target
    # keeps one: a drafter's native call may look its tokens up itself (models/eagle3_layer.py)
    embed_table: object | None = None


@dataclass(slots=True)
class SpeculatorContext:
    """What a speculator may know about the engine it serves (never the engine itself)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    max_seq_len: int = 8192
    device: str = "cpu"
    # The target's tokenizer: model drafters check their vocabulary against it.
    tokenizer: object | None = None
    target: TargetView | None = None  # for drafters that read the target's features
    kv_dtype: str = "float16"  # the target's KV cache element type (engine/kv_cache.py)


class Speculator(ABC):
    """Base class of every drafter. Subclasses set `name`; built-ins are listed in `registry.py`.

    Capabilities are class attributes, never name checks in the engine:
    - `hidden_layers`: target layers whose output (residual stream, before the final norm)
      `process` must receive for every committed token (empty: none; the engine then captures
      nothing for this speculator).
    - `provides_probs`: drafts carry `probs`, so rejection sampling can use them.
    - `is_model_based`: drafting runs a neural network (costs real time per token).

    `sunk_draft_seconds`: a model drafter may report how much of its last `draft` call went
    to work it does whether or not it drafts (a feature drafter computing the head entries of
    committed tokens, which `process` computes anyway once they pile up); the chain prices
    asking it by the rest. `catch_up_seconds`: how much of it went to reading history the
    drafter had not seen (a restarted window, tokens committed while it was not asked): paid
    once on resuming, not per drafted position, so the chain prices positions without it.
    `first_seconds`: how much of it went to the first draft token of every sequence (the
    first forward, catch-up included); the chain prices asking per call by it (`call_cost.py`).
    None: the whole call. `catch_up_rows`: how many revived rows (`revival_rows`) the last
    call's `catch_up_seconds` computed. `further_rows`: how many (sequence, position) rows the
    forwards after the first one ran; with `first_seconds` the chain prices one more forward
    (`DraftParams.further_cost`).
    """

    name: ClassVar[str] = ""
    hidden_layers: tuple[int, ...] = ()
    provides_probs: ClassVar[bool] = False
    is_model_based: ClassVar[bool] = False
    sunk_draft_seconds: float = 0.0
    catch_up_seconds: float = 0.0
    catch_up_rows: int = 0
    first_seconds: float | None = None
    further_rows: int = 0
    # a model drafter's first-token calibration measured where it was made (calibration.py;
    # a trained head's held-out figures), None when it ships none
    calibration_prior: CalibrationPrior | None = None

    def revival_rows(self, seq_id: int) -> int:
        """Rows a draft for `seq_id` would compute now only because the drafter stopped
        following it (priced per sequence by the chain, `call_cost.py`); 0 by default."""
        return 0

    def feature_rows(self, seq_id: int, num_tokens: int, tokens_after: int = 0) -> int:
        """Of a chunk of `num_tokens` tokens of sequence `seq_id`, how many (the newest) this
        speculator reads the target's features of (`hidden_layers`); the target captures no
        more when no other reader wants them, and no layer at all in a step where nobody
        wants rows. `tokens_after`: prompt tokens still to come after the chunk (0 for the
        prompt's last chunk and for decode chunks); a chunk none of whose rows are read is
        handed to `process` without features. Default: all."""
        return num_tokens

    def follows(self, seq_id: int) -> bool:
        """Whether `process` reads anything of `seq_id`'s committed tokens now (a model drafter
        resting or dormant for it reads nothing: the chain then does not call it). Default:
        yes."""
        return True

    def rest(self, seq_id: int) -> None:
        """The chain will not ask this drafter for `seq_id` for a while (it lost there:
        `drafter_ledger.py`): drop what following the sequence costs. Default: nothing."""

    def wake(self, seq_id: int, history_len: int) -> None:
        """The chain may ask for `seq_id` again (its history now `history_len` tokens, the
        last of them not in the target's KV yet): follow it again from here. Default: nothing."""

    @abstractmethod
    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        """A sequence starts with this prompt. Raises ValueError if seq_id is already active."""

    def process(self, batch: list[CommittedTokens]) -> None:
        """Mirror what the target committed (prompt chunks and accepted tokens)."""

    @abstractmethod
    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        """Propose drafts for these sequences; a sequence with nothing to propose is omitted."""

    @abstractmethod
    def accept(self, seq_id: int, num_accepted: int, is_other: bool) -> None:
        """The target accepted `num_accepted` tokens of the last draft made for `seq_id`.

        `is_other` is True when the draft that was verified came from another speculator of
        the chain (this one's proposal, if any, lost), so `num_accepted` refers to that draft.
        """

    @abstractmethod
    def end(self, seq_id: int) -> None:
        """The sequence finished or was aborted; release its state (no-op if unknown)."""

    def save(self) -> None:
        """Persist state that outlives the process (ngram_cache files); default: nothing."""


SpeculatorFactory = Callable[[SpeculatorContext, dict], Speculator]


def drafter_cache_kind(config, target_kv_dtype: str, head_dim: int) -> tuple[str, int]:
    """(kv_dtype, block_size) of a model drafter's own cache. Its `kv_dtype` auto takes the
    target's element type, so a drafter that shares the target's layers or reads its features
    computes what the target does: a bfloat16 cache in the AMX tiles' layout (32-position
    blocks) where the drafter's heads suit the tiles, else float16 (also under a float32
    target: a drafter's cache never needed reference numerics)."""
    from speculant.kernels.kv_layout import TILE_BLOCK, check_tile_shape

    if config.kv_dtype != "auto":
        return config.kv_dtype, config.block_size
    if target_kv_dtype == "bfloat16":
        try:
            check_tile_shape(TILE_BLOCK, head_dim)
            return "bfloat16", TILE_BLOCK
        except ValueError:
            pass
    return "float16", config.block_size


def check_model_drafter_config(who: str, config) -> None:
    """ValueError naming the field, for the options every model drafter has: its own paged KV
    cache (`kv_dtype`, `kv_cache_tokens`, `block_size`) and its draft `temperature`."""
    from speculant.engine.kv_cache import KV_DTYPES

    if config.kv_dtype not in ("auto", *KV_DTYPES):
        raise ValueError(f"{who}: kv_dtype must be auto or one of {tuple(KV_DTYPES)}, "
                         f"got {config.kv_dtype!r}")
    for name in ("kv_cache_tokens", "block_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"{who}: {name} must be >= 1, got {getattr(config, name)}")
    if not 0.0 <= config.temperature <= 10.0:
        raise ValueError(f"{who}: temperature must be in [0, 10], got {config.temperature}")

@dataclass(slots=True)
class SpeculatorStats(AcceptanceCounters):
    """Counters kept per speculator, as llama.cpp's `common_speculative_state` keeps them.

    The inherited `AcceptanceCounters` count this speculator's verified drafts (its
    `num_steps` = its verified drafts); the fields below add proposals, calls and time.
    """

    num_proposals: int = 0  # drafts proposed, verified or not (n_gen_drafts)
    num_drafts_accepted: int = 0  # verified drafts with at least one accepted token (n_acc_drafts)
    # proposals not verified (outbid, or not worth verifying) that the chain scored against the
    # tokens the target committed, and those whose first token matched
    num_scored: int = 0
    num_scored_first_matched: int = 0
    num_calls_begin: int = 0
    num_calls_draft: int = 0
    num_calls_accept: int = 0
    time_begin_s: float = 0.0
    time_draft_s: float = 0.0
    time_accept_s: float = 0.0
    time_process_s: float = 0.0

    def record_verified(self, draft_len: int, num_accepted: int) -> None:
        self.record_step()
        self.record_draft(draft_len, num_accepted)
        self.num_drafts_accepted += int(num_accepted > 0)
