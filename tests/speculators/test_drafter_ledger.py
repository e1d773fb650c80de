"""The drafter ledger: a model drafter whose windows lose rests, longer each time, per
concurrency bucket; one that pays never rests; the chain stops asking a resting drafter and
tells its sequences to rest, then wakes them for the trial."""
from speculant.speculators.base import CommittedTokens, Draft, DraftParams, DraftRequest, Speculator
from speculant.speculators.chain import SpeculatorChain
import pytest

from speculant.speculators.drafter_ledger import (FIRST_REST, LOSS_SHARE, MAX_REST,
                                                  MIN_COST_TOKENS, REST_GROWTH, WIDE_BUCKET,
                                                  WIDE_LOSS_SHARE, WINDOW_ROUNDS, DrafterLedger,
                                                  loss_share_of)
from speculant.speculators.model_free_rest import (MODEL_FREE, MODEL_FREE_MIN_BUCKET,
                                                   MODEL_FREE_PROBE_EVERY)


def run_window(ledger, gain_per_round, cost_per_round, bucket=8, name="m"):
    """Rounds until a verdict (or WINDOW_ROUNDS + a few): the rounds asked, and whether the
    last one rests."""
    for i in range(1, 4 * WINDOW_ROUNDS):
        if ledger.resting(name, bucket):
            return i, True
        ledger.charge(name, bucket, cost_per_round)
        ledger.credit(name, bucket, gain_per_round)
        if ledger.account(name, bucket).rounds == 0:  # a verdict that did not rest
            return i, False
    return None, False


def rest_length(ledger, bucket=8, name="m"):
    n = 0
    while ledger.account(name, bucket).rest_left > 0:
        assert ledger.resting(name, bucket)
        n += 1
    return n + 1  # the verdict's round was the first of the rest


def test_a_drafter_that_pays_never_rests():
    ledger = DrafterLedger()
    for _ in range(20):
        rounds, rests = run_window(ledger, gain_per_round=0.5, cost_per_round=0.5)
        assert rounds is not None and not rests
    assert ledger.summary()["m"][8]["num_rests"] == 0


def test_a_losing_drafter_rests_longer_after_each_losing_window_and_is_tried_again():
    ledger = DrafterLedger()
    expected = FIRST_REST
    for _ in range(6):
        rounds, rests = run_window(ledger, gain_per_round=0.0, cost_per_round=1.0)
        assert rests and rounds <= WINDOW_ROUNDS  # a decisive loss ends its window early
        assert rest_length(ledger) == expected
        expected = min(expected * REST_GROWTH, MAX_REST)
    assert ledger.summary()["m"][8]["num_rests"] == 6
    # a trial that pays brings the next rest back to the first length
    run_window(ledger, gain_per_round=1.0, cost_per_round=1.0)
    run_window(ledger, gain_per_round=0.0, cost_per_round=1.0)
    assert rest_length(ledger) == FIRST_REST


def test_a_marginal_loss_is_judged_on_its_whole_window_a_decisive_one_early():
    """A window ends before WINDOW_ROUNDS only once it has lost twice MIN_COST_TOKENS net:
    3 tokens gained for 8 of cost (a head's unlucky stretch alone) waits for the whole window."""
    ledger = DrafterLedger()
    per_round_cost = 2 * MIN_COST_TOKENS / (0.75 * WINDOW_ROUNDS)  # 8 tokens at 24 rounds
    rounds, rests = run_window(ledger, gain_per_round=0.375 * per_round_cost,
                               cost_per_round=per_round_cost, bucket=1)
    assert rests and rounds == WINDOW_ROUNDS  # still a loss at LOSS_SHARE, judged at the end
    ledger = DrafterLedger()
    rounds, rests = run_window(ledger, gain_per_round=0.0, cost_per_round=1.0, bucket=1)
    assert rests and rounds == WINDOW_ROUNDS // 2  # 16 tokens lost: decisive


@pytest.mark.parametrize("bucket, share", [(1, LOSS_SHARE), (2, LOSS_SHARE),
                                           (WIDE_BUCKET, WIDE_LOSS_SHARE), (8, WIDE_LOSS_SHARE)])
def test_a_window_gaining_more_than_its_loss_share_does_not_rest(bucket, share):
    """Alone or nearly (noisy windows of a head that usually pays) a window may gain less
    than it cost; from WIDE_BUCKET sequences on it must gain what it cost."""
    assert loss_share_of(bucket) == share
    ledger = DrafterLedger()
    _, rests = run_window(ledger, gain_per_round=(share + 0.05), cost_per_round=1.0,
                          bucket=bucket)
    assert not rests
    _, rests = run_window(ledger, gain_per_round=(share - 0.05), cost_per_round=1.0,
                          bucket=bucket)
    assert rests


def test_an_explicit_loss_share_overrides_the_buckets():
    ledger = DrafterLedger()
    for _ in range(WINDOW_ROUNDS):
        if ledger.resting("m", 8, loss_share=0.4):
            break
        ledger.charge("m", 8, 1.0)
        ledger.credit("m", 8, 0.6)
    assert ledger.account("m", 8).rest_left == 0  # 0.6 of its cost: not lost at 0.4


def test_a_window_without_enough_cost_is_no_evidence():
    """A drafter hardly asked (its window cost under MIN_COST_TOKENS) gets no verdict: its
    window runs on until it has cost enough."""
    ledger = DrafterLedger()
    per_round = MIN_COST_TOKENS / (3 * WINDOW_ROUNDS)
    for _ in range(2 * WINDOW_ROUNDS):
        assert not ledger.resting("m", 8)
        ledger.charge("m", 8, per_round)
    assert ledger.account("m", 8).rounds == 2 * WINDOW_ROUNDS


def test_buckets_and_drafters_keep_their_own_accounts():
    ledger = DrafterLedger()
    run_window(ledger, 0.0, 1.0, bucket=8, name="a")
    assert ledger.account("a", 8).rest_left > 0
    assert not ledger.resting("a", 1) and not ledger.resting("b", 8)
    assert ledger.bucket(5) == 8 and ledger.bucket(1) == 1


class CountingDrafter(Speculator):
    """A model drafter that always drafts `wrong` (or right) tokens and records the chain's
    rest and wake calls; each ask costs `seconds` of the chain's clock."""

    name = "model"
    is_model_based = True

    def __init__(self, clock, seconds, right):
        self.clock, self.seconds, self.right = clock, seconds, right
        self.asks, self.rested, self.woken = 0, [], []

    def begin(self, seq_id, prompt_ids):
        pass

    def draft(self, requests):
        self.clock.now += self.seconds
        self.asks += 1
        return {r.seq_id: Draft([r.token_ids[-1] + 1] if self.right else [-5], token_probs=[0.9])
                for r in requests}

    def accept(self, seq_id, num_accepted, is_other):
        pass

    def end(self, seq_id):
        pass

    def rest(self, seq_id):
        self.rested.append(seq_id)

    def wake(self, seq_id, history_len):
        self.woken.append((seq_id, history_len))


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def run_rounds(chain, hist, num_rounds, clock, price=0.5, row_s=0.0005):
    """Sequences `hist` (seq_id -> history) counting up one token a round (or as many as their
    drafts got accepted); a round's target step costs 1 ms a sequence and `row_s` a verified
    draft row, the chain pricing a row at `price` tokens; the step's time (drafting included)
    is reported to the chain."""
    for _ in range(num_rounds):
        start = clock.now
        clock.now += 0.001 * len(hist)
        reqs = [DraftRequest(s, list(h), DraftParams(n_max=1)) for s, h in hist.items()]
        winners = chain.draft(reqs, cost_per_token=price, seconds_per_token=0.001)
        clock.now += row_s * sum(len(d) for d in winners.values())
        chain.observe_step(clock.now - start, len(hist))
        for s, d in winners.items():
            accepted = 0
            while accepted < len(d) and d.token_ids[accepted] == hist[s][-1] + 1 + accepted:
                accepted += 1
            chain.accept(s, accepted)
            hist[s].extend(range(hist[s][-1] + 1, hist[s][-1] + 2 + accepted))
        for s, h in hist.items():
            if s not in winners:
                h.append(h[-1] + 1)
        chain.process([CommittedTokens(s, len(h) - 2, h[-2:-1], h[-1]) for s, h in hist.items()])


def run_chain(drafter, clock, num_rounds, num_seqs=8, rest_losers=True):
    """`num_seqs` sequences decoding for `num_rounds` rounds. No back-off of the chain's
    pricing (probe_interval 0): the ledger alone stops asking."""
    chain = SpeculatorChain([drafter], probe_interval=0, clock=clock, rest_losers=rest_losers)
    hist = {s: [1, 2, 3] for s in range(num_seqs)}
    for s in hist:
        chain.begin(s, hist[s], (drafter.name,))
    run_rounds(chain, hist, num_rounds, clock)
    chain.hist = hist  # for more rounds (`run_rounds`)
    return chain


def test_the_chain_rests_a_losing_model_drafter_and_wakes_its_sequences_for_a_trial():
    """Always wrong, each ask costing 3 ms against 1 ms a token: the chain stops asking it
    after a window (its sequences told to rest), asks it again after the rest (the sequences
    woken at their current history), and rests it longer after the losing trial."""
    clock = Clock()
    drafter = CountingDrafter(clock, seconds=0.003, right=False)
    chain = run_chain(drafter, clock, num_rounds=WINDOW_ROUNDS + FIRST_REST + WINDOW_ROUNDS + 8)
    record = chain.ledger.summary()["model"][8]
    assert record["num_rests"] == 2 and record["resting"]
    assert sorted(drafter.rested) == sorted(list(range(8)) * 2)
    assert sorted(s for s, _ in drafter.woken) == list(range(8))
    assert drafter.asks <= 2 * WINDOW_ROUNDS  # not once a round: ~2 windows
    # without the ledger it is asked every round
    clock2 = Clock()
    always = CountingDrafter(clock2, seconds=0.003, right=False)
    run_chain(always, clock2, num_rounds=WINDOW_ROUNDS + FIRST_REST, rest_losers=False)
    assert always.asks == WINDOW_ROUNDS + FIRST_REST and not always.rested


def test_the_chain_never_rests_a_model_drafter_that_pays():
    clock = Clock()
    drafter = CountingDrafter(clock, seconds=0.001, right=True)
    chain = run_chain(drafter, clock, num_rounds=4 * WINDOW_ROUNDS)
    assert chain.ledger.summary()["model"][8]["num_rests"] == 0
    assert drafter.asks == 4 * WINDOW_ROUNDS and not drafter.rested
    assert chain.stats["model"].num_accepted_tokens > 0


def test_a_new_request_decoding_alone_starts_its_own_record():
    """At concurrency 1 a rest earned on one request's text does not carry into the next
    request: its first round asks the drafter again, with a fresh window."""
    clock = Clock()
    drafter = CountingDrafter(clock, seconds=0.003, right=False)
    chain = run_chain(drafter, clock, num_rounds=WINDOW_ROUNDS + 4, num_seqs=1)
    assert chain.ledger.account("model", 1).rest_left > 0
    asks = drafter.asks
    run_rounds(chain, {0: list(range(1, 60))}, 4, clock)  # the same request rests on
    assert drafter.asks == asks
    chain.end(0)
    chain.begin(1, [1, 2, 3], ("model",))
    run_rounds(chain, {1: [1, 2, 3]}, 1, clock)
    assert drafter.asks == asks + 1 and chain.ledger.account("model", 1).rest_left == 0
    assert chain.ledger.summary()["model"][1]["num_rests"] == 1


def test_a_round_whose_drafters_all_rest_is_counted_without_requests():
    """`resting_round`: while the only speculator rests, a round is counted (the rest runs
    down by one) and a sequence begun meanwhile is told to rest; with a model-free speculator
    in the chain, or once the rest is over, rounds draft as usual."""
    clock = Clock()
    drafter = CountingDrafter(clock, seconds=0.003, right=False)
    chain = run_chain(drafter, clock, num_rounds=WINDOW_ROUNDS + 2)
    acct = chain.ledger.account("model", 8)
    left, asks = acct.rest_left, drafter.asks
    assert left > 2
    chain.begin(99, [1, 2, 3], ("model",))
    seqs = [(s, ("model",)) for s in list(range(7)) + [99]]  # 8: the same bucket
    assert chain.resting_round(seqs)
    assert acct.rest_left == left - 1 and drafter.asks == asks and 99 in drafter.rested
    assert not chain.resting_round([(0, ("model", "ngram_simple"))])  # not all of them rest
    acct.rest_left = 0
    assert not chain.resting_round(seqs)


def test_a_draining_batch_starts_its_smaller_buckets_rested_but_not_bucket_one():
    ledger = DrafterLedger()
    run_window(ledger, 0.0, 1.0, bucket=8)  # resting at c=8
    assert ledger.resting("m", 4)  # the batch drains to 4 sequences: rested from the start
    assert ledger.account("m", 4).rest_left == FIRST_REST - 1
    assert ledger.summary()["m"][4]["num_rests"] == 1
    assert not ledger.resting("m", 16)  # a wider bucket does not inherit
    run_window(ledger, 0.0, 1.0, bucket=2)
    assert not ledger.resting("m", 1)  # one request alone always starts fresh


class CopyDrafter(Speculator):
    """A model-free drafter proposing `length` tokens, the sequence's next ones (`right`) or
    wrong ones; each call costs `seconds` of the chain's clock."""

    name = "copy"
    is_model_based = False

    def __init__(self, clock, seconds, right, length=1):
        self.clock, self.seconds, self.right, self.length = clock, seconds, right, length
        self.asks = 0

    def begin(self, seq_id, prompt_ids):
        pass

    def draft(self, requests):
        self.clock.now += self.seconds
        self.asks += 1
        return {r.seq_id: Draft([r.token_ids[-1] + 1 + i if self.right else -5 - i
                                 for i in range(self.length)]) for r in requests}

    def accept(self, seq_id, num_accepted, is_other):
        pass

    def end(self, seq_id):
        pass


def test_losing_model_free_drafts_rest_at_high_concurrency_and_are_probed_every_few_rounds():
    """Model-free drafts that are never right, verified at half a token a row: after a window
    the chain stops asking for them but every MODEL_FREE_PROBE_EVERY rounds; without the
    ledger, or at concurrency 1, they are asked every round."""
    clock = Clock()
    copy = CopyDrafter(clock, seconds=0.0002, right=False)
    chain = run_chain(copy, clock, num_rounds=WINDOW_ROUNDS + 2)
    acct = chain.ledger.account(MODEL_FREE, 8)
    assert chain.ledger.summary()[MODEL_FREE][8]["num_rests"] == 1 and acct.rest_left > 16
    asks = copy.asks
    run_rounds(chain, chain.hist, 2 * MODEL_FREE_PROBE_EVERY, clock)
    assert copy.asks == asks + 2  # two probe rounds in 16
    for num_seqs, rest_losers in ((8, False), (1, True)):
        clock2 = Clock()
        always = CopyDrafter(clock2, seconds=0.0002, right=False)
        chain2 = run_chain(always, clock2, 3 * WINDOW_ROUNDS, num_seqs, rest_losers)
        assert always.asks == 3 * WINDOW_ROUNDS
        assert MODEL_FREE not in chain2.ledger.summary()  # nothing booked
    assert MODEL_FREE_MIN_BUCKET > 1


def test_model_free_drafts_that_pay_never_rest():
    clock = Clock()
    copy = CopyDrafter(clock, seconds=0.0002, right=True, length=4)
    chain = run_chain(copy, clock, num_rounds=4 * WINDOW_ROUNDS)
    assert chain.ledger.summary()[MODEL_FREE][8]["num_rests"] == 0
    assert copy.asks == 4 * WINDOW_ROUNDS and chain.stats["copy"].num_accepted_tokens > 0


def test_a_copy_starting_during_a_rest_is_followed_every_round_and_dropped_when_it_ends():
    """Resting after a losing window, the drafts turn right (a copy starts): once a probe
    round's draft is accepted in full its sequence is drafted for every round, the rest going
    on for the others; when the drafts turn wrong again it is dropped back to probe rounds."""
    clock = Clock()
    copy = CopyDrafter(clock, seconds=0.0002, right=False)
    chain = run_chain(copy, clock, num_rounds=WINDOW_ROUNDS + 2)
    acct = chain.ledger.account(MODEL_FREE, 8)
    assert acct.rest_left > 3 * MODEL_FREE_PROBE_EVERY
    copy.right = True
    run_rounds(chain, chain.hist, MODEL_FREE_PROBE_EVERY, clock)  # a probe round in there
    assert chain.model_free.following == set(range(8))
    asks, left = copy.asks, acct.rest_left
    run_rounds(chain, chain.hist, MODEL_FREE_PROBE_EVERY, clock)
    assert copy.asks == asks + MODEL_FREE_PROBE_EVERY  # every round, the rest running on
    assert acct.rest_left == left - MODEL_FREE_PROBE_EVERY
    seqs = [(s, ("copy",)) for s in range(8)]
    assert not chain.resting_round(seqs)  # a round with a copy under way is not skipped
    copy.right = False
    run_rounds(chain, chain.hist, 1, clock)
    assert not chain.model_free.following
    asks = copy.asks
    run_rounds(chain, chain.hist, 2 * MODEL_FREE_PROBE_EVERY, clock)
    assert copy.asks == asks + 2  # probe rounds only


def test_a_round_of_resting_model_free_drafts_builds_no_request_but_probe_rounds_do():
    clock = Clock()
    copy = CopyDrafter(clock, seconds=0.0002, right=False)
    chain = run_chain(copy, clock, num_rounds=WINDOW_ROUNDS + 2)
    acct = chain.ledger.account(MODEL_FREE, 8)
    seqs = [(s, ("copy",)) for s in range(8)]
    results = []
    for _ in range(MODEL_FREE_PROBE_EVERY):
        left = acct.rest_left
        rested = chain.resting_round(seqs)
        results.append(rested)
        if rested:
            assert acct.rest_left == left - 1
        else:  # a probe round: the engine drafts (and the draft call counts the round)
            run_rounds(chain, chain.hist, 1, clock)
    assert results.count(False) == 1


def test_model_free_rounds_are_booked_at_their_measured_step_time_once_plain_steps_are_known():
    """Drafts always right, verified rows priced at 0.5 of a token but costing 1.2 in the
    steps' time: booked at the price they pay and never rest; once the chain has timed steps
    of the same batch size in which nothing was drafted, their rounds are booked at the
    measured time beyond those, and they rest."""
    for known_plain in (False, True):
        clock = Clock()
        copy = CopyDrafter(clock, seconds=0.0002, right=True)
        chain = SpeculatorChain([copy], probe_interval=0, clock=clock, rest_losers=True)
        hist = {s: [1, 2, 3] for s in range(8)}
        for s in hist:
            chain.begin(s, hist[s], ("copy",))
        if known_plain:
            for _ in range(3):
                chain.observe_step(0.008, 8)  # steps in which nothing was drafted
        run_rounds(chain, hist, 3 * WINDOW_ROUNDS, clock, price=0.5, row_s=0.0012)
        assert chain.stats["copy"].num_accepted_tokens > 0
        rests = chain.ledger.summary()[MODEL_FREE][8]["num_rests"]
        assert (rests > 0) == known_plain


def test_the_chain_decides_drafting_itself_only_where_its_model_free_account_books():
    """The engine's tuner leaves a step to the chain exactly where every speculator asked is
    model-free and their account books the concurrency (4+ sequences, rests on)."""
    clock = Clock()
    chain = SpeculatorChain([CopyDrafter(clock, 0.0, True),
                             CountingDrafter(clock, 0.0, True)], clock=clock)
    copy, model = ("copy",), ("model",)
    assert chain.decides_drafting([copy] * 4, 4) and chain.decides_drafting([copy] * 8, 8)
    assert chain.decides_drafting([copy, (), copy, copy], 4)  # a plain request among them
    assert not chain.decides_drafting([copy] * 2, 2)  # below MODEL_FREE_MIN_BUCKET
    assert MODEL_FREE_MIN_BUCKET == 4
    assert not chain.decides_drafting([copy, model, copy, copy], 4)  # a model drafter asked
    assert not chain.decides_drafting([("copy", "model")] * 8, 8)
    assert not chain.decides_drafting([()] * 8, 8)  # nothing asked
    off = SpeculatorChain([CopyDrafter(clock, 0.0, True)], clock=clock, rest_losers=False)
    assert not off.decides_drafting([copy] * 8, 8)


def test_the_chain_decides_drafting_while_the_ledger_rests_its_model_drafters():
    """While the ledger rests every model drafter asked, the chain decides the step (plain, or
    its model-free drafts where their account books), not the engine's tuner; at concurrency 1
    only for the sequence the rest was booked for (a new request starts bucket 1 over)."""
    clock = Clock()
    chain = SpeculatorChain([CopyDrafter(clock, 0.0, True),
                             CountingDrafter(clock, 0.0, True)], clock=clock)
    copy, model = ("copy",), ("model",)
    assert not chain.decides_drafting([model] * 8, 8)
    chain.ledger.account("model", 8).rest_left = 10
    assert chain.decides_drafting([model] * 8, 8)
    assert chain.decides_drafting([("copy", "model")] * 8, 8)  # model-free ones book at 8
    assert not chain.decides_drafting([model] * 2, 2)  # bucket 2 does not rest
    chain.ledger.account("model", 2).rest_left = 10
    assert chain.decides_drafting([model] * 2, 2)
    assert not chain.decides_drafting([("copy", "model")] * 2, 2)  # model-free below 4: tuner
    chain.resting_round([(7, model)])  # sequence 7 decodes alone: bucket 1 is its record
    chain.ledger.account("model", 1).rest_left = 10
    assert chain.decides_drafting([model], 1, solo=7)
    assert not chain.decides_drafting([model], 1, solo=8)  # a new request: its own record
    off = SpeculatorChain([CountingDrafter(clock, 0.0, True)], clock=clock, rest_losers=False)
    off.ledger.account("model", 8).rest_left = 10
    assert not off.decides_drafting([model] * 8, 8)
