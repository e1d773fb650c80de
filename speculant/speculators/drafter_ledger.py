"""What a model drafter has actually gained and cost, per concurrency: the chain rests it where
it loses.

The chain asks a model drafter (`eagle3`, `mtp`, a draft model) by a price made ahead of time:
its first tokens' calibrated acceptance against what a call, the verified rows and a rival
draft cost. The ledger checks that price against what happened, per concurrency bucket
(`engine/tuner.py`'s buckets): over windows of WINDOW_ROUNDS draft rounds it books, in tokens'
worth of plain decoding time,

- *gain*: the tokens its verified drafts got accepted, less what the best model-free draft of
  the same round was expected to gain (the chain would have verified that one instead);
- *cost*: every second of its calls (shadow drafts, catch-up, first reads included) and of its
  `process` calls, and the rows of its verified drafts at the step-cost model's row price.

A window that cost at least MIN_COST_TOKENS and gained less than LOSS_SHARE of it (all of it
from WIDE_BUCKET sequences on) sends the drafter to *rest* in that bucket for FIRST_REST rounds, REST_GROWTH times longer after each
further losing window (up to MAX_REST), back to FIRST_REST after a window that did not lose. A
resting drafter is not asked at all (no pricing, no shadow drafts), and its sequences are told
to `rest` (a feature drafter then keeps no target features for them and the target captures
none); when the rest ends they are woken and the next window is a trial. A bucket first used
while the next wider one rests (a batch draining: 8 sequences, then 4, 2) starts with a rest of
FIRST_REST rounds; bucket 1 always starts fresh (one request decoding alone is where a head
pays most). Started fresh, `eagle3` on math_reasoning at c=8 drafted at a loss through the
draining tail (buckets 4 and 2) after resting 643 rounds in bucket 8: 0.94x plain in a bench
run; in-process A/B (40 prompts, c=8, 2 repeats) 0.974x fresh against 0.985x inherited. A sequence decoding alone that is not the
one before (a new request at concurrency 1) starts its bucket's account over: resting on one
request's text and carrying the rest (4x longer each time) into the next ones took `eagle3` on
translation at c=1 from 1.23x to 1.10x plain in one bench run.

The chain keeps one more account, `model-free` (model_free_rest.py): the model-free
speculators together, their gain the tokens their verified drafts got accepted, their cost
their draft rounds (calls and judging) and verified rows. It is judged at "gain < cost", in
buckets of 4 and more sequences only, and while it rests the chain still drafts with them every
few rounds, and every round for a sequence whose last such draft was accepted in full.

Why (measured 2026-12-06, Intel Xeon with AMX, 2 threads, `eagle3` alone on 24 mt_bench prompts
at c=8, engines interleaved in one process against plain): 0.908x plain. A verified row costs
~0.5 of a plain token there and a head call ~1.5 ms, so even its 77%-accepted first tokens
did not pay: never asked but still followed it read 0.962x, never asked and not followed 0.987x,
and its shadow drafts (each re-reading a window) cost 5%. The chain's up-front price cannot see
all of that (a shadow's catch-up, the rows a rarely asked head computes); the ledger sees the
sum.
"""
from __future__ import annotations

from dataclasses import dataclass

from speculant.engine.tuner import concurrency_bucket

# draft rounds of one bucket per verdict (the window grows until it has evidence); a window
# that loses by twice MIN_COST_TOKENS ends after half as many
WINDOW_ROUNDS = 32
MIN_COST_TOKENS = 4.0  # a window that cost less is no evidence either way (hardly asked)
# A window loses when it gained less than this share of its cost. Windows of 32 rounds are
# noisy where the head pays only on some text: `eagle3` at c=1 on mt_bench (1.20x plain) had
# windows gaining 9 / 9 / 16 tokens for 13.3 / 11.9 / 16.3 of cost among others gaining 2x their
# cost, and resting at "gain < cost" cost it nearly all its speedup (1.02x); over 16 mt_bench
# and 16 qa prompts its least gaining windows there gained 0.62-0.93 of their cost; at c=8,
# where it loses, windows gained 0 to 3 tokens for 13 to 22 (0-0.2 of their cost).
LOSS_SHARE = 0.4
# From this many decoding sequences on, a window loses when it gained less than it cost
# (WIDE_LOSS_SHARE): there a head rarely pays (`eagle3` alone at c=8 read 0.96-0.98x plain on
# every chat category on an AMX Xeon) and the books miss part of what drafting costs (the
# chain's pricing around the calls, the features kept for eight sequences), so windows the
# books call nearly even are losses. Measured (2026-12-06, the Xeon, math_reasoning at c=8): a
# first window in bucket 8 booked 48 tokens gained for 50.6 of cost and was not rested at 0.4;
# in one bench run the head went on drafting (2,315 drafts, 73% accepted, 27% fewer steps than
# plain) at 0.89x plain.
WIDE_BUCKET = 4
WIDE_LOSS_SHARE = 1.0
FIRST_REST = 64  # rounds a drafter rests after a losing window ...
# ... this many times longer after each further losing window, up to MAX_REST rounds (each
# trial of a losing drafter costs a window of its losses: `eagle3` at c=8 on mt_bench read
# 0.968x plain with growth 4, 0.950x with growth 2)
REST_GROWTH = 4
MAX_REST = 1024


@dataclass(slots=True)
class LedgerAccount:
    """One drafter's record in one concurrency bucket."""

    gain: float = 0.0  # tokens gained beyond the rival drafts, this window
    cost: float = 0.0  # tokens' worth of time spent, this window
    rounds: int = 0  # draft rounds of this window so far
    rest_left: int = 0  # rounds of rest still to go (0: asked as the chain prices it)
    next_rest: int = FIRST_REST  # the rest a losing window brings next
    num_rests: int = 0  # rests so far
    num_rounds_rested: int = 0


def loss_share_of(bucket: int) -> float:
    """The share of its cost a model drafter's window must gain in `bucket` not to lose."""
    return LOSS_SHARE if bucket < WIDE_BUCKET else WIDE_LOSS_SHARE


class DrafterLedger:
    """Gain and cost of every model drafter per concurrency bucket, and whether it rests."""

    def __init__(self):
        self._accounts: dict[tuple[str, int], LedgerAccount] = {}

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return concurrency_bucket(num_decoding)

    def account(self, name: str, bucket: int) -> LedgerAccount:
        key = (name, bucket)
        acct = self._accounts.get(key)
        if acct is None:
            acct = self._accounts[key] = LedgerAccount()
            wider = self._accounts.get((name, 2 * bucket))
            if bucket > 1 and wider is not None and wider.rest_left > 0:
                # a batch draining from a bucket where the drafter rests: start rested too
                acct.rest_left, acct.next_rest = FIRST_REST, wider.next_rest
                acct.num_rests = 1
        return acct

    def resting(self, name: str, bucket: int, loss_share: float | None = None) -> bool:
        """A draft round of `bucket` starts: whether `name` rests through it (counted down) or
        is asked (the round joins its window, which may end here in a verdict: one that gained
        less than `loss_share` of its cost, by default `loss_share_of(bucket)`, starts a rest
        at this round)."""
        if loss_share is None:
            loss_share = loss_share_of(bucket)
        acct = self.account(name, bucket)
        if acct.rest_left > 0:
            acct.rest_left -= 1
            acct.num_rounds_rested += 1
            return True
        acct.rounds += 1
        lost = acct.gain < loss_share * acct.cost
        # early: the window has already lost twice MIN_COST_TOKENS net (cost beyond gain), not
        # merely cost that much. Judged by its cost alone, `eagle3` at c=1 rested on half
        # windows that had gained 3 tokens for 8 (a window of a head paying 1.3x on mt_bench,
        # whose windows gained a median 1.7x their cost: ad hoc /tmp/s27/ledgerlog.py) once
        # per 40 mt_bench or translation prompts, 64 rounds without drafts each time.
        early = (lost and acct.rounds >= WINDOW_ROUNDS // 2
                 and acct.cost - acct.gain >= 2 * MIN_COST_TOKENS)
        if not early and (acct.rounds < WINDOW_ROUNDS or acct.cost < MIN_COST_TOKENS):
            return False
        acct.gain = acct.cost = 0.0
        acct.rounds = 0
        if not lost:
            acct.next_rest = FIRST_REST
            return False
        acct.rest_left = acct.next_rest - 1  # this round is the first of the rest
        acct.next_rest = min(acct.next_rest * REST_GROWTH, MAX_REST)
        acct.num_rests += 1
        acct.num_rounds_rested += 1
        return True

    def restart(self, name: str, bucket: int) -> None:
        """Forget `name`'s rest and window in `bucket` (its counts of rests stay): a new
        request decoding alone, whose text says little about the last one's."""
        acct = self.account(name, bucket)
        acct.gain = acct.cost = 0.0
        acct.rounds = acct.rest_left = 0
        acct.next_rest = FIRST_REST

    def charge(self, name: str, bucket: int, tokens: float) -> None:
        """`name` spent `tokens`' worth of plain decoding time in `bucket`."""
        if tokens > 0:
            self.account(name, bucket).cost += tokens

    def credit(self, name: str, bucket: int, tokens: float) -> None:
        """`name`'s verified draft gained `tokens` in `bucket` (negative: less than its rival's
        expected gain)."""
        self.account(name, bucket).gain += tokens

    def summary(self) -> dict[str, dict[int, dict]]:
        """Per drafter, per bucket: rests so far, rounds rested, and whether it rests now."""
        out: dict[str, dict[int, dict]] = {}
        for (name, bucket), a in sorted(self._accounts.items()):
            out.setdefault(name, {})[bucket] = {
                "num_rests": a.num_rests, "num_rounds_rested": a.num_rounds_rested,
                "resting": a.rest_left > 0}
        return out
