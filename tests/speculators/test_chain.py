"""The speculator chain: winner by expected gain, accept/is_other routing, backoff, statistics."""
import pytest

from speculant.speculators.acceptance import (conditional_rates, net_gain, survival, survival_above,
                                              worth_drafting)
from speculant.speculators.counters import AcceptanceCounters
from speculant.speculators.base import Draft, DraftParams, DraftRequest, Speculator
from speculant.speculators.chain import PROBE_CONTEXT_TOKENS, SpeculatorChain


class Fixed(Speculator):
    """Always proposes the same draft; records what the chain tells it."""

    def __init__(self, name, tokens, expected=None):
        self.name = name
        self.tokens = tokens
        self.expected = expected
        self.accepts = []
        self.begun = set()

    def begin(self, seq_id, prompt_ids):
        self.begun.add(seq_id)

    def draft(self, requests):
        return {r.seq_id: Draft(list(self.tokens), expected_accepted=self.expected) for r in requests}

    def accept(self, seq_id, num_accepted, is_other):
        self.accepts.append((seq_id, num_accepted, is_other))

    def end(self, seq_id):
        self.begun.discard(seq_id)


def request(seq_id=0, n_max=8, n_min=0):
    return DraftRequest(seq_id, [1, 2, 3], DraftParams(n_max=n_max, n_min=n_min))


@pytest.mark.parametrize("rates, cost, expected_len", [
    ([0.9, 0.9, 0.9], 0.1, 3),  # every position pays for itself
    ([0.9, 0.1, 0.9], 0.1, 1),  # survival after position 2 is 0.09 < cost
    ([0.05], 0.1, 0),  # not even the first token is worth verifying
])
def test_worth_drafting_stops_where_survival_falls_below_cost(rates, cost, expected_len):
    assert worth_drafting(survival(rates), cost) == expected_len


def test_net_gain_is_expected_accepted_minus_cost():
    surv = survival([0.5, 0.5])
    assert net_gain(surv, 2, 0.1) == pytest.approx(0.5 + 0.25 - 0.2)


@pytest.mark.parametrize("floor", [0.0, 0.05, 0.2, 0.45, 0.9])
def test_survival_above_is_the_full_survival_cut_where_no_longer_draft_pays(floor):
    glob, seq = AcceptanceCounters(), AcceptanceCounters()
    for length, accepted in [(8, 3), (8, 8), (4, 0), (6, 2)]:
        glob.record_draft(length, accepted)
    seq.record_draft(5, 1)
    probs = [0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05, 0.01]
    full = survival(conditional_rates([glob], seq, 8, probs))
    cut = survival_above([glob], seq, 8, floor, probs)
    assert cut == full[:len(cut)]  # the same values, in the same order
    assert all(s > floor for s in cut[:-1])
    assert len(cut) == len(full) or cut[-1] <= floor
    # what the chain reads from it does not change
    assert worth_drafting(cut, floor) == worth_drafting(full, floor)
    n = max(1, worth_drafting(full, floor))
    assert net_gain(cut, n, floor) == net_gain(full, n, floor)


def test_counts_track_reached_and_accepted_positions():
    counts = AcceptanceCounters()
    counts.record_draft(draft_len=4, num_accepted=2)  # positions 0,1 accepted; 2 reached and rejected
    assert counts.reached_per_pos == [1, 1, 1, 0]
    assert counts.accepted_per_pos == [1, 1, 0, 0]
    assert counts.drafted_per_pos == [1, 1, 1, 1]


def test_winner_is_the_draft_with_highest_expected_gain_and_others_are_told_is_other():
    short = Fixed("short", [5], expected=1.0)
    long_ = Fixed("long", [5, 6, 7, 8], expected=4.0)
    chain = SpeculatorChain([short, long_])
    chain.begin(0, [1, 2], ("short", "long"))
    winner = chain.draft([request()], cost_per_token=0.01)[0]
    assert winner.source == "long"
    chain.accept(0, 3)
    assert long_.accepts == [(0, 3, False)]
    assert short.accepts == [(0, 3, True)]
    assert chain.stats["long"].num_accepted_tokens == 3
    assert chain.stats["long"].accepted_per_pos == [1, 1, 1, 0]
    assert chain.stats["short"].num_proposals == 1 and chain.stats["short"].num_drafts == 0


def test_sequence_only_uses_its_allowed_speculators():
    a, b = Fixed("a", [1]), Fixed("b", [2, 3])
    chain = SpeculatorChain([a, b])
    chain.begin(0, [1], ("a",))
    assert chain.draft([request()], 0.01)[0].source == "a"
    assert 0 not in b.begun


def test_failing_drafts_back_off_to_nothing_and_are_not_verified_as_probes():
    """Once failures price a drafter out, nothing of it is verified: its proposals are scored
    against the committed tokens instead (see the two tests at the end of this file)."""
    spec = Fixed("bad", [9, 9, 9, 9])
    chain = SpeculatorChain([spec], probe_interval=3)
    chain.begin(0, [1], ("bad",))
    lengths = []
    for _ in range(12):
        d = chain.draft([request()], cost_per_token=0.2).get(0)
        lengths.append(0 if d is None else len(d))
        if d is not None:
            chain.accept(0, 0)
    assert lengths[0] == 2  # prior a_i = 0.5: survival 0.5, 0.25 > cost 0.2 > 0.125
    assert max(lengths[4:]) == 0  # backed off completely, no verified probes


def test_n_min_drops_short_drafts():
    chain = SpeculatorChain([Fixed("a", [1, 2])])
    chain.begin(0, [1], ("a",))
    assert chain.draft([request(n_min=3)], 0.01) == {}


def test_lifecycle_misuse_is_loud():
    chain = SpeculatorChain([Fixed("a", [1])])
    with pytest.raises(ValueError, match="not loaded"):
        chain.begin(0, [1], ("zzz",))
    chain.begin(0, [1], ("a",))
    with pytest.raises(ValueError, match="already begun"):
        chain.begin(0, [1], ("a",))
    with pytest.raises(ValueError, match="no draft"):
        chain.accept(0, 1)
    chain.end(0)
    chain.end(0)  # ending twice is harmless


def test_confident_drafter_that_keeps_failing_backs_off():
    """A drafter's own confidence is a prior; the sequence's record overrides it."""
    class Confident(Fixed):
        def draft(self, requests):
            return {r.seq_id: Draft([7, 7, 7], token_probs=[1.0, 1.0, 1.0]) for r in requests}

    chain = SpeculatorChain([Confident("sure", [])], probe_interval=100)
    chain.begin(0, [1], ("sure",))
    assert len(chain.draft([request()], cost_per_token=0.2)[0]) == 3  # trusted at first
    for _ in range(30):
        d = chain.draft([request()], cost_per_token=0.2).get(0)
        if d is None:
            break
        chain.accept(0, 0)
    assert chain.draft([request()], cost_per_token=0.2) == {}


def test_expected_accepted_alone_maps_to_a_per_position_rate():
    from speculant.speculators.chain import _rate_for_expected

    a = _rate_for_expected(2.0, 4)
    assert abs(sum(a ** i for i in range(1, 5)) - 2.0) < 1e-6
    assert _rate_for_expected(4.0, 4) > 0.999 and _rate_for_expected(0.0, 4) < 1e-6


class SlowModelDrafter(Fixed):
    """A model-based drafter: drafting costs wall time per position, whether or not it wins."""

    is_model_based = True

    def __init__(self, name, tokens, seconds_per_position):
        super().__init__(name, tokens)
        self.seconds_per_position = seconds_per_position
        self.requested_n_max = []

    def draft(self, requests):
        import time

        out = {}
        for r in requests:
            self.requested_n_max.append(r.params.n_max)
            n = min(r.params.n_max, len(self.tokens))
            time.sleep(self.seconds_per_position * n)
            out[r.seq_id] = Draft(list(self.tokens[:n]), token_probs=[0.6] * n)
        return out


def test_work_a_model_drafter_does_anyway_is_not_priced_as_drafting():
    """A drafter whose draft call mostly mirrors committed tokens (work `process` does anyway)
    reports it as `sunk_draft_seconds`: the chain prices asking it by the rest only."""

    class MirroringDrafter(SlowModelDrafter):
        def draft(self, requests):
            import time

            time.sleep(0.05)  # mirroring committed tokens
            self.sunk_draft_seconds = 0.05
            return super().draft(requests)

    plain = SlowModelDrafter("plain", [5, 6], seconds_per_position=0.0)
    mirror = MirroringDrafter("mirror", [5, 6], seconds_per_position=0.0)
    for spec in (plain, mirror):
        chain = SpeculatorChain([spec])
        chain.begin(0, [1, 2], (spec.name,))
        chain.draft([request()], cost_per_token=0.1, seconds_per_token=0.01)
        assert chain._draft_seconds[spec.name] < 0.01  # per drafted position: not the 0.05 s


def test_model_drafter_is_budgeted_by_its_draft_time():
    """The model drafter's n_max shrinks when its draft time is as dear as a plain token."""
    model = SlowModelDrafter("model", [5, 6, 0, 0], seconds_per_position=0.004)
    chain = SpeculatorChain([model])
    chain.begin(0, [1, 2], ("model",))
    for _ in range(6):
        # One plain token costs ~4 ms, like one draft position: drafting is far from free.
        w = chain.draft([request()], cost_per_token=0.1, seconds_per_token=0.004).get(0)
        if w is not None:
            chain.accept(0, min(len(w), 2))
    # Before its time is known, the prior acceptance (0.5) caps it at 3 positions (the 4th's
    # survival 0.0625 is below the verify cost 0.1); once a position is known to cost a plain token,
    # no position pays for itself and the model drafter is not asked again (until a probe).
    assert model.requested_n_max == [3]


def test_model_drafter_is_not_run_where_a_model_free_draft_promises_more():
    """Once the n-gram drafter's record makes its draft worth more than anything the model
    drafter could add, the model is not run for that sequence (its time is saved)."""
    ngram = Fixed("ngram", [5, 6, 7, 8])
    model = SlowModelDrafter("model", [5, 6, 7, 8], seconds_per_position=0.0)
    chain = SpeculatorChain([model, ngram])  # listed first, still drafts after the n-gram one
    chain.begin(0, [1, 2], ("model", "ngram"))
    for _ in range(8):
        w = chain.draft([request()], cost_per_token=0.1, seconds_per_token=0.004).get(0)
        chain.accept(0, len(w) if w.source == "ngram" else 0)
    calls = len(model.requested_n_max)
    for _ in range(4):
        w = chain.draft([request()], cost_per_token=0.1, seconds_per_token=0.004).get(0)
        assert w.source == "ngram"
        chain.accept(0, len(w))
    assert len(model.requested_n_max) == calls  # never asked again


class Copier(Fixed):
    """Proposes the next `length` tokens of `text` after the history, or junk while `wrong`."""

    def __init__(self, name, text, length=4):
        super().__init__(name, [])
        self.text, self.length, self.wrong = text, length, True

    def draft(self, requests):
        out = {}
        for r in requests:
            pos = len(r.token_ids)
            tokens = [9999] * self.length if self.wrong else self.text[pos:pos + self.length]
            out[r.seq_id] = Draft(list(tokens))
        return out


def run_like_the_engine(chain, text, start, num_rounds, cost=0.3, seq_id=0):
    """Greedy steps over a known `text` as the engine drives the chain: draft, verify against the
    text, accept, then commit the kept inputs and the sampled token. Returns each round's draft
    length (0: nothing verified)."""
    from speculant.speculators.base import CommittedTokens

    pos, lengths = start, []
    for _ in range(num_rounds):
        history = text[:pos]
        w = chain.draft([DraftRequest(seq_id, history, DraftParams(n_max=8))], cost).get(seq_id)
        num_acc = 0
        if w is not None:
            while num_acc < len(w) and w.token_ids[num_acc] == text[pos + num_acc]:
                num_acc += 1
            chain.accept(seq_id, num_acc)
        lengths.append(0 if w is None else len(w))
        chain.process([CommittedTokens(seq_id, pos - 1, text[pos - 1:pos + num_acc],
                                       text[pos + num_acc])])
        pos += num_acc + 1
    return lengths


def test_a_silent_drafter_learns_from_unverified_proposals_that_would_have_matched():
    """After a drafter's failures priced it out, its proposals are still scored against what
    the target wrote: once they match, it drafts again long before a probe is due."""
    text = list(range(100, 400))
    copier = Copier("copy", text)
    chain = SpeculatorChain([copier], probe_interval=1000)
    chain.begin(0, text[:10], ("copy",))
    failing = run_like_the_engine(chain, text, 10, 12)
    assert failing[0] > 0 and failing[-1] == 0  # backed off to nothing
    copier.wrong = False
    matching = run_like_the_engine(chain, text, 30, 8)
    assert matching[:1] == [0] and max(matching[:4]) > 0  # verified again within 4 rounds
    assert matching[-1] >= 4  # and long drafts once the copy keeps matching
    assert chain.stats["copy"].num_accepted_tokens >= 8
    stats = chain.stats["copy"]  # the silent rounds' proposals were scored, not verified
    assert stats.num_scored > 0 and 0 < stats.num_scored_first_matched < stats.num_scored


def test_losing_proposals_are_scored_so_the_better_drafter_takes_over():
    """Only the winner is verified. A confident drafter whose first token is always right wins
    every round at first; the other drafter's proposals, once they match the text, are scored
    against the committed tokens while they lose, and it takes over with long drafts."""
    text = list(range(500, 900))
    good = Copier("good", text)

    class FirstTokenOnly(Copier):
        def draft(self, requests):
            return {r.seq_id: Draft([self.text[len(r.token_ids)], 7, 7, 7], token_probs=[0.99] * 4)
                    for r in requests}

    chain = SpeculatorChain([FirstTokenOnly("first", text), good], probe_interval=1000)
    chain.begin(0, text[:10], ("first", "good"))
    run_like_the_engine(chain, text, 10, 6)
    assert chain.stats["good"].num_drafts == 0 and chain.stats["first"].num_drafts == 6
    good.wrong = False
    lengths = run_like_the_engine(chain, text, 60, 12)
    assert chain.stats["good"].num_drafts >= 6  # it won most of the later rounds
    assert lengths[-1] >= 4


class ModelCopier(Copier):
    """A model drafter (priced by its drafting time) that copies; records each ask's n_max and
    history window."""
    is_model_based = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked, self.windows = [], []

    def draft(self, requests):
        self.asked.extend(r.params.n_max for r in requests)
        self.windows.extend(r.params.context_tokens for r in requests)
        return {r.seq_id: Draft(d.token_ids[:r.params.n_max])
                for r, d in zip(requests, super().draft(requests).values())}


def test_a_priced_out_model_drafter_is_shadow_probed_then_wins_again():
    """A model drafter the chain stopped asking gets a one-token draft after `probe_interval`
    silent rounds, then twice as late each time; it is scored, not verified, and once such
    drafts match it drafts again (after at most the interval it had reached: 64 rounds here)."""
    text = list(range(1000, 3000))
    model = ModelCopier("model", text)
    chain = SpeculatorChain([model], probe_interval=4)
    chain.begin(0, text[:10], ("model",))
    lengths = run_like_the_engine(chain, text, 10, 16)
    assert lengths[0] > 0 and lengths[-1] == 0 and max(lengths[-8:]) == 0
    assert model.asked[-1] == 1  # shadow probes of one token, never verified...
    # ...re-reading a short window of the history, as the first, not yet priced asks did
    assert model.windows[0] == model.windows[-1] == PROBE_CONTEXT_TOKENS
    assert len(model.asked) <= 7  # ...one per `probe_interval` silent rounds, not every round
    asked = len(model.asked)
    run_like_the_engine(chain, text, 40, 60)  # still wrong: probes come twice as late each time
    assert len(model.asked) - asked <= 4  # a fixed interval of 4 would have asked 15 times
    verified = chain.stats["model"].num_drafts
    model.wrong = False
    lengths = run_like_the_engine(chain, text, 200, 120)
    assert chain.stats["model"].num_drafts > verified and lengths[-1] >= 2


def test_a_round_shadow_drafts_a_few_sequences_and_the_others_later():
    """Eight sequences all due for a shadow draft of a priced-out model drafter (the tuner
    decoded plain for 40 steps): a round asks it for at most SHADOW_DRAFTS_PER_ROUND of them
    (each re-reads a window: all eight at once cost two decode steps of the 4-layer draft), and
    the others go in the next rounds, so every sequence is still probed."""
    from speculant.speculators.base import CommittedTokens
    from speculant.speculators.chain import SHADOW_DRAFTS_PER_ROUND

    class Recording(ModelCopier):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.rounds = []

        def draft(self, requests):
            self.rounds.append(sorted(r.seq_id for r in requests))
            return super().draft(requests)

    text = list(range(1000, 3000))
    model = Recording("model", text)
    chain = SpeculatorChain([model], probe_interval=4)
    chain.begin(0, text[:10], ("model",))
    run_like_the_engine(chain, text, 10, 16)  # its junk drafts priced it out
    seqs = range(1, 9)
    for s in seqs:
        chain.begin(s, text[:30], ("model",))
    model.rounds.clear()
    pos = 30
    assert chain.draft([DraftRequest(s, text[:pos], DraftParams(n_max=8)) for s in seqs],
                       0.3) == {} and model.rounds == []  # priced out, none due yet
    for _ in range(40):  # plain steps: every sequence falls due
        chain.process([CommittedTokens(s, pos - 1, text[pos - 1:pos], text[pos]) for s in seqs])
        pos += 1
    probed = set()
    for _ in range(8 // SHADOW_DRAFTS_PER_ROUND):
        drafts = chain.draft([DraftRequest(s, text[:pos], DraftParams(n_max=8)) for s in seqs], 0.3)
        assert drafts == {}  # shadow drafts are scored, never verified
        assert 0 < len(model.rounds[-1]) <= SHADOW_DRAFTS_PER_ROUND
        probed.update(model.rounds[-1])
        chain.process([CommittedTokens(s, pos - 1, text[pos - 1:pos], text[pos]) for s in seqs])
        pos += 1
    assert probed == set(seqs)


def test_silence_counts_the_steps_between_rounds():
    """Rounds only every 10th step (the tuner decodes plain in between: nothing is drafted, the
    committed tokens are still processed): a priced-out model drafter's shadow draft is due
    after `probe_interval` silent *steps*, so it comes at the next round. Counted in rounds it
    needed 4 rounds, 40 steps here, and with the tuner's rarer probes at c=1 it never came."""
    from speculant.speculators.base import CommittedTokens

    text = list(range(1000, 3000))
    model = ModelCopier("model", text)
    chain = SpeculatorChain([model], probe_interval=4)
    chain.begin(0, text[:10], ("model",))
    run_like_the_engine(chain, text, 10, 16)  # its junk drafts priced it out
    chain.begin(1, text[:10], ("model",))
    asked = len(model.asked)
    pos = 10
    for round_ in range(3):
        assert run_like_the_engine(chain, text, pos, 1, seq_id=1) == [0]  # never verified
        pos += 1
        if round_ == 0:
            assert len(model.asked) == asked  # one silent step: not due yet
        else:
            assert len(model.asked) == asked + round_ and model.asked[-1] == 1  # a shadow draft
        for _ in range(9):  # plain steps
            chain.process([CommittedTokens(1, pos - 1, text[pos - 1:pos], text[pos])])
            pos += 1


def test_shadow_rounds_keep_a_model_free_drafter_current_through_plain_steps():
    """The tuner decodes plain for a while; the text turns copyable meanwhile. A chain whose
    model-free drafter proposed in those steps (shadow rounds, scored, nothing verified) has a
    draft verified at the first drafting step after them; a chain blind through them still prices the
    drafter by its failures from before and verifies nothing then."""
    from speculant.speculators.base import CommittedTokens

    text = list(range(100, 600))
    firsts = {}
    for shadowed in (True, False):
        copier = Copier("copy", text)
        chain = SpeculatorChain([copier], probe_interval=1000)
        chain.begin(0, text[:10], ("copy",))
        assert run_like_the_engine(chain, text, 10, 12)[-1] == 0  # priced out by its junk
        copier.wrong = False
        pos, verified = 22, chain.stats["copy"].num_drafts
        for _ in range(6):  # plain steps
            if shadowed:
                assert chain.shadow([DraftRequest(0, text[:pos], DraftParams(n_max=8))]) is None
            chain.process([CommittedTokens(0, pos - 1, text[pos - 1:pos], text[pos])])
            pos += 1
        assert chain.stats["copy"].num_drafts == verified  # shadow proposals: not verified
        firsts[shadowed] = run_like_the_engine(chain, text, pos, 1)[0]
        if shadowed:
            assert chain.stats["copy"].num_scored >= 6
    assert firsts[False] == 0 and firsts[True] >= 2


def test_a_shadow_round_asks_no_model_drafter():
    model = ModelCopier("model", list(range(100, 200)))
    chain = SpeculatorChain([model], probe_interval=1)
    chain.begin(0, list(range(100, 110)), ("model",))
    for n in range(110, 130):
        chain.shadow([DraftRequest(0, list(range(100, n)), DraftParams(n_max=8))])
    assert model.asked == []


def test_probe_interval_zero_verifies_every_proposal():
    """No back-off at all: even a drafter that always fails is verified every round."""
    chain = SpeculatorChain([Fixed("bad", [9, 9, 9, 9])], probe_interval=0)
    chain.begin(0, [1], ("bad",))
    for _ in range(10):
        d = chain.draft([request()], cost_per_token=0.5).get(0)
        assert d is not None and len(d) >= 1
        chain.accept(0, 0)


def test_catch_up_is_not_priced_as_drafting():
    """A drafter re-reading history it had not seen (a restarted window, a long silence)
    reports that time as `catch_up_seconds`: paid once on resuming, so positions are priced
    without it."""

    class CatchingUp(SlowModelDrafter):
        def draft(self, requests):
            import time

            time.sleep(0.05)  # reading a 64-token window
            self.catch_up_seconds = 0.05
            return super().draft(requests)

    spec = CatchingUp("model", [5, 6], seconds_per_position=0.0)
    chain = SpeculatorChain([spec])
    chain.begin(0, [1, 2], ("model",))
    chain.draft([request()], cost_per_token=0.1, seconds_per_token=0.01)
    assert chain._draft_seconds["model"] < 0.01  # per drafted position: not 0.05 s / 2


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Hopeless(Fixed):
    """A model drafter always wrong, each sequence it is asked for costing `seconds_per_ask`
    of the clock (re-reading its window dominates a one-token probe)."""

    is_model_based = True

    def __init__(self, name, clock, seconds_per_ask):
        super().__init__(name, [])
        self.clock, self.seconds_per_ask, self.asked = clock, seconds_per_ask, 0

    def draft(self, requests):
        self.clock.now += self.seconds_per_ask * len(requests)
        self.asked += len(requests)
        return {r.seq_id: Draft([7] * r.params.n_max, token_probs=[0.05] * r.params.n_max)
                for r in requests}


def run_sequences(chain, num_seqs, num_rounds, seconds_per_token, text, clock, others_s=0.0,
                  report_steps=False):
    """`num_seqs` sequences decoding `text` one token a round, each step taking
    `seconds_per_token` per sequence of the clock (nothing is verified, the drafter is never
    right); a sequence ends after 100-280 tokens and a new one begins. `others_s`: clock time
    of other engines between two steps (an interleaved bench); `report_steps`: the step's time
    is reported to the chain as an engine does (`observe_step`)."""
    from speculant.speculators.base import CommittedTokens

    pos, next_id = {}, 0
    for _ in range(num_rounds):
        clock.now += seconds_per_token * num_seqs + others_s  # the target's step, others' turns
        if report_steps:
            chain.observe_step(seconds_per_token * num_seqs)
        while len(pos) < num_seqs:
            chain.begin(next_id, text[:10], ("model",))
            pos[next_id], next_id = 10, next_id + 1
        reqs = [DraftRequest(s, text[:p], DraftParams(n_max=4)) for s, p in pos.items()]
        winners = chain.draft(reqs, cost_per_token=0.6, seconds_per_token=seconds_per_token)
        for s in winners:
            chain.accept(s, 0)
        chain.process([CommittedTokens(s, p - 1, text[p - 1:p], text[p]) for s, p in pos.items()])
        for s in list(pos):
            pos[s] += 1
            if pos[s] >= 110 + (37 * s) % 180:
                chain.end(s)
                del pos[s]
    return next_id


def test_shadow_probes_stay_within_their_share_of_decoding_time():
    """At c=8 a priced-out drafter's shadow drafts, each re-reading a window (6-17 ms of the
    4-layer draft against 2.6 ms of step time per token), take at most PROBE_TIME_SHARE
    of the time between rounds, though every new sequence starts probing at `probe_interval` again;
    they still come (the drafter would be seen to improve)."""
    from speculant.speculators.chain import PROBE_TIME_SHARE

    text = list(range(100, 400))
    spent = {}
    for seconds_per_token in (0.0, 0.0026):  # 0: a plain token's time unknown, no budget
        clock = FakeClock()
        model = Hopeless("model", clock, seconds_per_ask=0.012)
        chain = SpeculatorChain([model], clock=clock, rest_losers=False)  # the budget alone
        num_rounds = 1000
        num_seqs = run_sequences(chain, 8, num_rounds, seconds_per_token, text, clock)
        spent[seconds_per_token] = clock.now - num_rounds * 8 * seconds_per_token
        assert num_seqs > 30 and chain.stats["model"].num_drafts == 0
    decoding_s = 1000 * 8 * 0.0026 + spent[0.0026]  # steps and probes: the time between rounds
    assert 0 < spent[0.0026] <= PROBE_TIME_SHARE * decoding_s + 8 * 0.012  # + one round's
    assert spent[0.0] > 3 * spent[0.0026]  # per-sequence doubling alone: several times more


def test_the_shadow_budget_counts_the_engines_own_steps_not_other_engines_turns():
    """Interleaved with four other engines (4x its step time on the clock between its steps),
    a chain told its steps' time keeps shadow drafts within PROBE_TIME_SHARE of its *own*
    decoding time; counting the clock it spends several times that."""
    from speculant.speculators.chain import PROBE_TIME_SHARE

    text = list(range(100, 400))
    spent = {}
    for report in (True, False):
        clock = FakeClock()
        model = Hopeless("model", clock, seconds_per_ask=0.012)
        chain = SpeculatorChain([model], clock=clock, rest_losers=False)  # the budget alone
        step_s, num_rounds = 8 * 0.0026, 1000
        run_sequences(chain, 8, num_rounds, 0.0026, text, clock, others_s=4 * step_s,
                      report_steps=report)
        spent[report] = clock.now - num_rounds * 5 * step_s
    assert 0 < spent[True] <= PROBE_TIME_SHARE * (1000 * 8 * 0.0026 + spent[True]) + 8 * 0.012
    assert spent[False] > 2.5 * spent[True]


def test_an_unpriced_model_drafter_is_first_asked_for_a_few_new_sequences_a_round():
    """Before its first tokens price it (calibration.MIN_FIRST), a model drafter re-reads at
    most FIRST_READS_PER_ROUND new sequences' histories per round; sequences it already read
    may be asked again. Without back-off (probe_interval 0) every sequence is asked."""
    from speculant.speculators.chain import FIRST_READS_PER_ROUND

    class Recording(SlowModelDrafter):
        def __init__(self):
            super().__init__("model", [5, 6], seconds_per_position=0.0)
            self.asked = []

        def draft(self, requests):
            self.asked.append(sorted(r.seq_id for r in requests))
            return super().draft(requests)

    for probe_interval, first_round in ((16, FIRST_READS_PER_ROUND), (0, 8)):
        model = Recording()
        chain = SpeculatorChain([model], probe_interval=probe_interval)
        for s in range(8):
            chain.begin(s, [1, 2], ("model",))
        reqs = [request(s, n_max=2) for s in range(8)]
        chain.draft(reqs, cost_per_token=0.05, seconds_per_token=0.01)
        assert len(model.asked[0]) == first_round
        chain.draft(reqs, cost_per_token=0.05, seconds_per_token=0.01)
        if probe_interval:  # the two read before, and two more
            assert model.asked[1][:2] == model.asked[0] and len(model.asked[1]) == 4


class SureModel(Fixed):
    """A model drafter always right with probability 0.95 whose call costs `call_s` of the
    clock however many sequences it drafts for (its weights read once per call)."""

    is_model_based = True

    def __init__(self, clock, call_s):
        super().__init__("model", [])
        self.clock, self.call_s, self.calls = clock, call_s, []

    def draft(self, requests):
        self.clock.now += self.call_s
        self.calls.append(len(requests))
        return {r.seq_id: Draft([4], token_probs=[0.95]) for r in requests}


def test_a_model_drafter_is_asked_where_its_call_pays_for_all_sequences_together():
    """Once a call costs two plain tokens whatever it drafts for (its weights read once), and
    each sure first token gains ~0.7 of a token after its verification, eight sequences pay
    for the call and two do not: the chain stops asking for two (priced per drafted position,
    after calls for eight, two sequences each looked worth asking)."""
    clock = FakeClock()
    model = SureModel(clock, call_s=0.001)
    chain = SpeculatorChain([model], probe_interval=10 ** 6, clock=clock)
    for s in range(8):
        chain.begin(s, [1, 2, 3], ("model",))

    def round_(seqs):
        winners = chain.draft([request(s, n_max=1) for s in seqs], cost_per_token=0.3,
                              seconds_per_token=0.01)
        for s in winners:
            chain.accept(s, 1)
        return len(winners)

    for _ in range(10):  # cheap calls: the calibration learns the drafter is sure and right
        round_(range(8))
    model.call_s = 0.02
    for _ in range(30):  # dear calls, for eight and for two sequences
        round_(range(8))
        round_([0, 1])
    for _ in range(10):
        assert round_(range(8)) == 8
        before = len(model.calls)
        assert round_([0, 1]) == 0
        assert len(model.calls) == before  # not asked at all for two


class RevivingModel(SureModel):
    """A SureModel that stopped following the sequences `silent`: asking one of them also
    computes ROWS skipped rows at `row_s` each (a feature drafter's restart window)."""

    ROWS = 128

    def __init__(self, clock, call_s, row_s, silent):
        super().__init__(clock, call_s)
        self.row_s, self.silent = row_s, set(silent)

    def revival_rows(self, seq_id):
        return self.ROWS if seq_id in self.silent else 0

    def draft(self, requests):
        rows = sum(self.revival_rows(r.seq_id) for r in requests)
        self.clock.now += rows * self.row_s
        self.catch_up_rows, self.catch_up_seconds = rows, rows * self.row_s
        return super().draft(requests)


def test_a_sequence_the_drafter_must_revive_is_asked_only_where_its_rows_pay():
    """Sure first tokens gain ~0.65 of a token; reviving a silent sequence costs 128 rows of
    0.5 ms (6.4 plain tokens, 1.6 per ask once spread over REVIVAL_ASKS): once a revival has
    been timed, the followed sequences are still asked and the silent ones are not (priced
    as sunk, every sequence was asked, and at c=8 on mt_bench the head's catch-up was 0.3 s
    of its 0.54 s)."""
    from speculant.speculators.call_cost import REVIVAL_ASKS

    clock = FakeClock()
    model = RevivingModel(clock, call_s=0.001, row_s=0.0005, silent=range(4, 8))
    chain = SpeculatorChain([model], probe_interval=10 ** 6, clock=clock)
    for s in range(8):
        chain.begin(s, [1, 2, 3], ("model",))
    for _ in range(12):
        model.calls.clear()
        winners = chain.draft([request(s, n_max=1) for s in range(8)], cost_per_token=0.3,
                              seconds_per_token=0.01)
        for s in winners:
            chain.accept(s, 1)
    assert model.ROWS * 0.0005 / REVIVAL_ASKS / 0.01 > 1.0  # the premise: dearer than a token
    assert sorted(winners) == [0, 1, 2, 3]
    assert model.calls == [4]


def test_shadow_time_saved_while_not_probing_is_capped():
    """A drafter not probed for a long time (100 s of steps: asked, or on another workload)
    does not spend that time's share at once when it stops paying: its probes stay within
    PROBE_TIME_SHARE of the steps after, plus MAX_PROBE_CREDIT_S saved and one round's."""
    from speculant.speculators.chain import MAX_PROBE_CREDIT_S, PROBE_TIME_SHARE

    text = list(range(100, 400))
    clock = FakeClock()
    model = Hopeless("model", clock, seconds_per_ask=0.012)
    chain = SpeculatorChain([model], clock=clock)
    for _ in range(100):
        chain.observe_step(1.0)
    num_rounds, step_s = 200, 8 * 0.0026
    run_sequences(chain, 8, num_rounds, 0.0026, text, clock, report_steps=True)
    spent = clock.now - num_rounds * step_s
    assert 0 < spent <= PROBE_TIME_SHARE * (num_rounds * step_s + spent) + MAX_PROBE_CREDIT_S \
        + 8 * 0.012


def test_one_more_forward_is_priced_by_the_forwards_after_the_first():
    """A drafter whose first forward (catch-up, LM head) costs 10 ms and each later row 2 ms:
    the chain asks the next draft to run further forwards only where they gain 0.2 tokens'
    worth (2 ms against a 10 ms plain token), not the 4 ms average per drafted position, and
    no longer prices that average into the run's verification floor."""

    class TwoSpeed(SlowModelDrafter):
        def __init__(self, clock):
            super().__init__("model", [5, 6, 7], seconds_per_position=0.0)
            self.clock, self.asked = clock, []

        def draft(self, requests):
            self.asked.extend(r.params for r in requests)
            out = super().draft(requests)
            self.first_seconds = 0.010
            self.further_rows = sum(len(d) - 1 for d in out.values())
            self.clock.now += self.first_seconds + 0.002 * self.further_rows
            return out

    clock = FakeClock()
    spec = TwoSpeed(clock)
    chain = SpeculatorChain([spec], probe_interval=0, clock=clock)
    chain.begin(0, [1, 2], ("model",))
    winner = chain.draft([request()], cost_per_token=0.1, seconds_per_token=0.01)[0]
    assert chain._draft_seconds["model"] == pytest.approx(0.014 / 3)
    assert chain._further_seconds["model"] == pytest.approx(0.002)
    history = [1, 2]
    for _ in range(12):  # its first tokens (p 0.6) price asking it from the 8th on
        chain.accept(0, len(winner))
        history += [5, 6, 7, 8]
        winner = chain.draft([DraftRequest(0, list(history), DraftParams(n_max=8))],
                             cost_per_token=0.1, seconds_per_token=0.01)[0]
    assert chain._calibration["model"].first_rates() is not None
    assert spec.asked[-1].further_cost == pytest.approx(0.2)
    # the run's floor is the verification break-even alone (it held the 0.47 average before)
    assert spec.asked[-1].p_min_run == pytest.approx(0.1)
