"""The model-free speculators' rest: where their drafts do not pay for their rows and calls, the
chain stops asking them, but for probes and for copies under way.

All model-free speculators of the chain (n-gram family, suffix) share one ledger account,
`model-free` (drafter_ledger.py): its gain is the tokens their verified drafts got accepted,
its cost their draft rounds (the round's time outside the model drafters' calls, and the
verified rows at the step-cost model's row price, or the step's measured time beyond a plain
step of the same batch size once such steps are known). Where a verified row costs about what a
plain token does (c=8 on a 2-core CPU: ~0.6) their drafts barely pay for their rows and the
calls cost the rest: `ngram_mod,suffix` on 40 math_reasoning prompts at c=8 read 0.91-0.95x
plain (Intel Xeon with AMX, 2 threads, interleaved in one process), the forwards' time the same
as plain's and the draft phase, verification and bookkeeping +0.4 s of 7.6 s.

A round of the model-free speculators is one of four kinds (`mode`):
- MF_DRAFT: they draft, and the round joins their account's window;
- MF_REST: the account rests; only the sequences `following` a copy are drafted for;
- MF_PROBE: the account rests, and every PROBE_EVERY-th round of the rest drafts for every
  sequence, to see whether a copy starts;
- MF_UNBOOKED: they draft outside the ledger (resting off, a bucket below MIN_BUCKET, or none
  of them asked).

A sequence whose draft of a rest (probe or following round) was accepted in full is followed:
drafted for every round until one of those drafts is not accepted in full.
"""
from __future__ import annotations

from speculant.speculators.drafter_ledger import DrafterLedger

MODEL_FREE = "model-free"  # the ledger account's name
# The account rests when a window gained less than this share of its cost (a model drafter's
# windows are judged more leniently, drafter_ledger.LOSS_SHARE: its gain is net of the
# model-free rival's).
MODEL_FREE_LOSS_SHARE = 1.0
# Resting, the speculators still draft for every sequence every this many rounds, and every
# round for the sequences whose last draft of the rest was accepted in full (a copy under way),
# so a copy is missed by at most this many rounds. (Waking the whole bucket when one sequence's
# probe draft was worth a copy instead started windows of 32 rounds drafting at a loss for all
# 8: on math_reasoning at c=8 6 rests in ~800 rounds, 169 rounds drafting.)
MODEL_FREE_PROBE_EVERY = 8
# ... in concurrency buckets from this one on. Alone or in pairs a row costs ~0.2 of a token
# and a failed draft little, while a copy missed costs a token a row: resting at c=1 (11-12
# rests, ~650 of ~3,400 rounds, mt_bench and summarization, 16 prompts each, same Xeon) read
# 1.457x plain against 1.469x without.
MODEL_FREE_MIN_BUCKET = 4
# Where steps of the same batch size in which nothing was drafted have been seen (their time an
# EMA of this weight), a drafting round is booked at its step's measured time beyond such a
# step's, not at the step-cost model's row price: on math_reasoning at c=8 that plane priced a
# row at 0.40 of a token where one extra row on 8 sequences costs ~0.6 in isolated forwards
# (its one slope is the average over 1-20 extra rows; the chain verifies 1-2 a step there), and
# windows that lost in time booked a gain.
PLAIN_STEP_WEIGHT = 0.1
# what the model-free speculators do in a round (`ModelFreeRest.mode`)
MF_DRAFT, MF_PROBE, MF_REST, MF_UNBOOKED = 0, 1, 2, 3


class ModelFreeRest:
    """The `model-free` account's rounds, bookings and followed sequences (module docstring).
    The chain tells it each round's mode, winners and verdicts, and each step's time."""

    def __init__(self, ledger: DrafterLedger):
        self.ledger = ledger
        # per number of decoding sequences: the time of a step in which nothing was drafted (EMA)
        self.plain_step_s: dict[int, float] = {}
        # the last drafting round's booking, made once its step's time is known
        # (`observe_step`): (bucket, sequences, cost in tokens at the row price, whether only
        # model-free drafts ran) or None
        self._pending: tuple[int, int, float, bool] | None = None
        # sequences drafted for every round of a rest (their last draft of it accepted in full)
        self.following: set[int] = set()
        self._rest_winners: set[int] = set()  # ... and those whose winner is a draft of a rest

    # ---- a round ---------------------------------------------------------------------------

    def mode(self, bucket: int, enabled: bool, asked: bool) -> int:
        """This round's kind in `bucket` (module docstring); `enabled`: the chain rests losers
        at all; `asked`: some sequence of the round uses a model-free speculator."""
        if not enabled or not asked or bucket < MODEL_FREE_MIN_BUCKET:
            return MF_UNBOOKED
        if not self.ledger.resting(MODEL_FREE, bucket, MODEL_FREE_LOSS_SHARE):
            return MF_DRAFT
        left = self.ledger.account(MODEL_FREE, bucket).rest_left
        return MF_PROBE if left % MODEL_FREE_PROBE_EVERY == 0 else MF_REST

    def rests_through(self, bucket: int) -> bool:
        """Whether the next round of `bucket` rests and does not probe (`mode` would count down
        to MF_REST)."""
        if bucket < MODEL_FREE_MIN_BUCKET:
            return False
        left = self.ledger.account(MODEL_FREE, bucket).rest_left
        return left > 0 and (left - 1) % MODEL_FREE_PROBE_EVERY != 0

    def count_rest_round(self, bucket: int) -> None:
        """A round that drafts nothing at all (the chain's `resting_round`) still counts down
        the rest."""
        self.ledger.resting(MODEL_FREE, bucket, MODEL_FREE_LOSS_SHARE)

    def winner(self, seq_id: int, mode: int, model_free: bool | None) -> bool:
        """Sequence `seq_id`'s round of kind `mode` ended with a winner drafted by a model-free
        speculator (`model_free` True), by a model drafter (False) or none (None). True: the
        winner joins the account's window (its verdict is booked by the chain)."""
        resting = mode in (MF_PROBE, MF_REST)
        if model_free and mode == MF_DRAFT:
            return True
        if model_free and resting:
            self._rest_winners.add(seq_id)  # judged in `verdict`
        elif resting:
            self.following.discard(seq_id)  # no copy of theirs under way
        return False

    def book_round(self, mode: int, bucket: int, num_seqs: int, rows_tokens: float,
                   other_tokens: float, alone: bool) -> None:
        """A round of kind `mode`: when it drafted for the account (MF_DRAFT) its cost is
        booked once its step is timed (`observe_step`): `rows_tokens`, its verified rows at the
        row price, plus `other_tokens`, its time outside the model drafters' calls (tokens'
        worth); `alone`: no model drafter ran in it (then the step's time can price it)."""
        if mode == MF_DRAFT:
            self._pending = (bucket, num_seqs, rows_tokens + other_tokens, alone)

    def verdict(self, seq_id: int, accepted_in_full: bool) -> None:
        """The winner of `seq_id` was verified: a draft of a rest accepted in full starts (or
        keeps) following the sequence, one that was not ends it."""
        if seq_id in self._rest_winners:
            self._rest_winners.discard(seq_id)
            if accepted_in_full:
                self.following.add(seq_id)
            else:
                self.following.discard(seq_id)

    def end(self, seq_id: int) -> None:
        self.following.discard(seq_id)
        self._rest_winners.discard(seq_id)

    # ---- a step ----------------------------------------------------------------------------

    def observe_step(self, seconds: float, num_decoding: int, drafted: bool,
                     seconds_per_token: float) -> None:
        """The engine's step took `seconds`; `num_decoding`: its decoding sequences when it was
        a pure decode step, else 0; `drafted`: a speculator was asked for it. A step with
        nothing drafted times plain steps of its size; the last drafting round is booked, at
        the step's time beyond a plain step of the same size when that is known and only
        model-free drafts ran (PLAIN_STEP_WEIGHT), else at its row price."""
        pending, self._pending = self._pending, None
        if num_decoding <= 0:
            if pending is not None:
                self.ledger.charge(MODEL_FREE, pending[0], pending[2])
            return
        plain = self.plain_step_s.get(num_decoding)
        if not drafted:
            self.plain_step_s[num_decoding] = seconds if plain is None else \
                plain + PLAIN_STEP_WEIGHT * (seconds - plain)
        if pending is None:
            return
        bucket, num_seqs, priced, alone = pending
        if alone and plain is not None and num_seqs == num_decoding and seconds_per_token > 0:
            priced = max(0.0, seconds - plain) / seconds_per_token
        self.ledger.charge(MODEL_FREE, bucket, priced)
