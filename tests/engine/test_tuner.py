"""The online tuner: a bandit over draft limits scored by measured goodput."""
import itertools

import pytest

from conftest import TEST_THREADS
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams, SpecParams
from speculant.engine.tuner import SpecTuner, TunerConfig, concurrency_bucket


def run_bandit(tuner, goodput_of, steps, num_decoding=1):
    """Drive the tuner with a deterministic goodput per draft limit (tokens per 1-second step);
    returns the choices."""
    choices = []
    for _ in range(steps):
        n = tuner.choose(num_decoding)
        choices.append(n)
        tuner.observe(num_decoding, int(goodput_of(n)), 1.0)
    return choices


def test_converges_to_plain_when_drafting_never_pays():
    """Goodput falls with the draft limit: after the measuring phase plain decoding wins, with
    only the periodic neighbour probe left."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = run_bandit(tuner, lambda n: 100 - 3 * n, steps=200)
    assert tuner.best(1) == 0
    tail = choices[-100:]
    assert tail.count(0) >= 95  # the rest: re-measuring the others, rarer and rarer


FINE = dict(grid=(0, 1, 2, 4, 8, 16))


def test_default_grid_is_whether_to_draft_at_all():
    assert SpecTuner(TunerConfig(), max_n=16).grid == (0, 16)
    assert SpecTuner(TunerConfig(), max_n=5).grid == (0, 5)


def test_converges_to_long_drafts_when_they_pay():
    tuner = SpecTuner(TunerConfig(**FINE), max_n=16)
    run_bandit(tuner, lambda n: 100 + 10 * n, steps=200)
    assert tuner.best(1) == 16


def test_follows_a_workload_that_changes():
    """Smoothed goodput and neighbour probes move the choice when the best limit changes."""
    tuner = SpecTuner(TunerConfig(**FINE), max_n=16)
    run_bandit(tuner, lambda n: 100 + 10 * n, steps=150)
    run_bandit(tuner, lambda n: 100 - 3 * n, steps=600)
    assert tuner.best(1) <= 1


def test_buckets_are_tuned_apart_and_grid_respects_the_engine_limit():
    tuner = SpecTuner(TunerConfig(grid=(0, 2, 8, 32)), max_n=8)
    assert tuner.grid == (0, 2, 8)
    run_bandit(tuner, lambda n: 100 + n, steps=60, num_decoding=1)
    run_bandit(tuner, lambda n: 100 - n, steps=1500, num_decoding=8)  # inherits 8, re-measures
    assert (tuner.best(1), tuner.best(8)) == (8, 0)
    assert concurrency_bucket(3) == 4 and concurrency_bucket(100) == 32
    assert set(tuner.summary()) == {"1", "8"}


def test_a_new_bucket_starts_from_its_neighbours_choice_without_measuring():
    """Once bucket 1 settled on plain decoding, bucket 2 starts there: no drafting steps until
    its first re-measurement."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    run_bandit(tuner, lambda n: 100 - 3 * n, steps=100, num_decoding=1)
    assert tuner.best(1) == 0
    choices = run_bandit(tuner, lambda n: 100 - 3 * n, steps=8, num_decoding=2)
    assert choices == [0] * 8 and tuner.best(2) == 0


def test_a_decisive_loss_switches_to_plain_after_two_probes():
    """Drafting at a fifth of plain's goodput (a draft model catching up on its prompts) is
    not measured four times: two probes of plain decide (one step is no evidence: an unpriced
    draft model's first long drafts), then only rare re-measurements."""
    tuner = SpecTuner(TunerConfig(warmup_steps=0), max_n=16)
    choices = run_bandit(tuner, lambda n: 20 if n else 100, steps=40)
    assert choices[:4] == [16, 0, 16, 0] and choices[4:].count(16) <= 2 and tuner.best(1) == 0


def test_the_first_steps_use_the_untuned_limit_while_the_chain_learns():
    """A fresh tuner's first bucket drafts at the engine's own limit for `warmup_steps` steps
    (however plain would measure: nothing is measured), then measures; a bucket created later
    inherits its neighbour's choice and does not warm up again."""
    tuner = SpecTuner(TunerConfig(warmup_steps=32), max_n=16)
    choices = run_bandit(tuner, lambda n: 20 if n else 100, steps=40)
    assert choices[:32] == [16] * 32 and choices[32:35] == [0, 16, 0]
    assert choices[35:] == [0] * 5 and tuner.best(1) == 0
    assert run_bandit(tuner, lambda n: 20 if n else 100, steps=4, num_decoding=2) == [0] * 4


def run_requests(tuner, requests, step):
    """Requests decoded one at a time (concurrency 1): (sequence id, steps) pairs; `step(n)`
    gives a step's (tokens, seconds) at draft limit n. Returns each request's choices."""
    out = []
    for seq_id, steps in requests:
        choices = []
        for _ in range(steps):
            n = tuner.choose(1, alone=seq_id)
            choices.append(n)
            tuner.observe(1, *step(n))
        out.append(choices)
    return out


def test_at_concurrency_1_each_request_starts_again_from_the_untuned_limit():
    """One request's text says little about the next one's: drafting switched off on request 7
    (it gains a token a step but takes 4x plain's time there) is back at the engine's limit for
    request 8's warm-up (a restart's own, shorter one: the chain has priced its drafters
    already), then measured again; the switches off are still counted."""
    tuner = SpecTuner(TunerConfig(warmup_steps=6, restart_warmup_steps=3), max_n=16)
    def step(n):
        return (2, 4.0) if n else (1, 1.0)

    first, second = run_requests(tuner, [(7, 60), (8, 6)], step)
    assert first[:6] == [16] * 6 and first[-20:].count(16) <= 2
    assert second[:3] == [16] * 3 and second[3] == 0  # warm-up, then measuring
    assert tuner.summary()["1"]["num_switches_off"] == 2  # request 8 measured and off again
    assert tuner.summary()["1"]["steps"] == 66
    # the same request on: no restart, plain again after its two probes
    assert run_requests(tuner, [(8, 40)], step)[0][-20:].count(16) <= 2 and tuner.best(1) == 0


def test_a_restarts_prompt_read_is_not_charged_to_drafting():
    """At a restarted request's first step the drafters read its prompt once (catch-up: here
    30x a step's time); drafting then pays 1.5x plain. A restart's warm-up is short, and that
    read would still weigh in the incumbent's recent goodput its first probes of plain are
    compared with: it is left out, so drafting is kept."""
    tuner = SpecTuner(TunerConfig(warmup_steps=4, restart_warmup_steps=3), max_n=16)
    run_requests(tuner, [(1, 60)], lambda n: (2, 4.0) if n else (1, 1.0))
    assert tuner.best(1) == 0
    choices = []
    for i in range(40):
        n = tuner.choose(1, alone=2)
        choices.append(n)
        catch_up = 30.0 if i == 0 else 0.0
        tuner.observe(1, *((3, 2.0 + catch_up) if n else (1, 1.0)), catch_up_seconds=catch_up)
    assert choices[:3] == [16] * 3 and choices[-20:] == [16] * 20, choices
    assert tuner.summary()["1"]["num_switches_off"] == 1


def test_a_drafter_that_gains_nothing_stays_off_for_the_next_request():
    """Drafting that never gets a token accepted (the chain prices its drafter out; it only
    costs 10% more time): plain decoding, once chosen, carries to the next request: no
    per-request warm-up where no request can gain."""
    tuner = SpecTuner(TunerConfig(warmup_steps=4), max_n=16)
    run_requests(tuner, [(1, 300)], lambda n: (1, 1.1) if n else (1, 1.0))
    assert tuner.best(1) == 0
    nxt = run_requests(tuner, [(2, 8)], lambda n: (1, 1.1) if n else (1, 1.0))[0]
    assert nxt.count(16) <= 1 and tuner.best(1) == 0  # at most a re-measurement, no warm-up


def paying_step(n):
    """Drafting commits a token more a step at 1.2x plain's time."""
    return (2, 1.2) if n else (1, 1.0)


def losing_steps(seconds):
    """A step function where drafting gains 0.05 tokens a step (one more token every 20th
    drafting step) at `seconds` per step, against plain's 1 token in 1 s."""
    count = itertools.count()
    return lambda n: ((2 if next(count) % 20 == 0 else 1), seconds) if n else (1, 1.0)


def test_requests_after_a_workload_where_drafting_paid_stop_restarting():
    """20 requests where drafting pays (a token more a step, 1.2x plain's time), then 20 where
    it gains 0.05 tokens a step at 1.12x the time: once drafting is switched off there, a new
    request no longer restarts the bucket (the last requests' drafting gained nothing), so its
    warm-up is not drafted at a loss again and again: two restarted warm-ups that gained
    little, then one only after 2 and after 4 requests that did not restart (before: 52-68
    drafted steps in each of the last 14 requests, against the long average of the paying
    requests)."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    paying, losing = paying_step, losing_steps(1.12)

    first = run_requests(tuner, [(i, 130) for i in range(20)], paying)
    assert sum(c.count(16) for c in first) >= 0.9 * 20 * 130
    second = run_requests(tuner, [(100 + i, 130) for i in range(20)], losing)
    drafted = [c.count(16) for c in second]
    assert all(d >= 32 for d in drafted[:2])  # drafting, the incumbent, carries over at first
    switched = next(i for i, d in enumerate(drafted) if d < 100)  # the request it went off in
    warm = TunerConfig().restart_warmup_steps
    restarted = [i for i in range(switched + 1, len(second)) if second[i][:warm] == [16] * warm
                 and second[i - 1][-10:].count(16) <= 2]  # drafting warm-ups after plain
    assert len(restarted) == 4, drafted
    assert [b - a for a, b in zip(restarted[1:], restarted[2:])] == [3, 5], drafted  # backoff
    between = [d for i, d in enumerate(drafted) if i > restarted[1] and i not in restarted]
    assert all(d <= 8 for d in between), drafted  # probes only
    assert tuner.best(1) == 0


def test_a_drafter_switched_off_on_the_first_requests_comes_back_when_it_pays():
    """Three requests where drafting gains 0.05 tokens a step at twice plain's time (switched
    off in the first; its gain stays under LOW_GAIN), then requests where it pays: a request
    still restarts the bucket after two that did not, so drafting comes back and stays (before:
    no restart after a gain under LOW_GAIN, and plain for every later request; the 4-layer
    draft on summarization at c=1 read 0.978x plain tuned against 1.086x untuned)."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    losing = run_requests(tuner, [(i, 130) for i in range(3)], losing_steps(2.0))
    assert losing[0][-20:].count(16) <= 2 and tuner.best(1) == 0
    assert all(c.count(16) <= 8 for c in losing[1:])  # no restart yet: probes at most
    paying = run_requests(tuner, [(10 + i, 130) for i in range(6)], paying_step)
    warm = TunerConfig().restart_warmup_steps
    assert paying[0][:warm] == [16] * warm  # the third request without a restart restarts
    assert all(c.count(16) >= 120 for c in paying) and tuner.best(1) == 16


def test_one_losing_warm_up_does_not_stop_the_restarts():
    """A paying request, then two where drafting gains 0.05 tokens a step at twice plain's
    time (switched off in the first; the second restarts and its warm-up loses), then paying
    ones again: one failed warm-up is not enough to stop the restarts, so they warm up
    drafting and keep it."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    paying, losing = paying_step, losing_steps(2.0)

    run_requests(tuner, [(0, 130)], paying)
    first_loss, second_loss = run_requests(tuner, [(1, 130), (2, 130)], losing)
    assert first_loss[-20:].count(16) <= 2
    warm = TunerConfig().restart_warmup_steps
    assert second_loss[:warm] == [16] * warm and second_loss[-20:].count(16) <= 2
    later = run_requests(tuner, [(i, 130) for i in range(3, 6)], paying)
    assert all(c[:warm] == [16] * warm and c.count(16) >= 120 for c in later)


def test_an_arm_far_behind_is_re_measured_rarer():
    """Drafting at half plain's goodput: after the switch to plain, the gaps between drafting
    probes grow 4x (a losing draft model's probes are its costliest steps); an arm within the
    margin is re-measured every 8 steps while it might still beat the incumbent by the margin
    (too few steps to tell), then at gaps that only double."""
    tuner = SpecTuner(TunerConfig(warmup_steps=0), max_n=16)
    probes = [i for i, n in enumerate(run_bandit(tuner, lambda n: 50 if n else 100, 3000)) if n]
    assert probes[:2] == [0, 2]  # the measuring phase: two plain probes decide
    gaps = [b - a for a, b in zip(probes, probes[1:])][2:]  # from the first re-measurement
    assert gaps[0] == 8 and all(b == min(4 * a, 1024) for a, b in zip(gaps, gaps[1:]))
    assert gaps[-1] == 1024
    tuner = SpecTuner(TunerConfig(warmup_steps=0), max_n=16)
    # plain and drafting equal: within plain's own (smaller) margin, so drafting stays
    plain = [i for i, n in enumerate(run_bandit(tuner, lambda n: 100, 3000)) if not n]
    gaps = [b - a for a, b in zip(plain, plain[1:])][4:]  # after the measuring phase
    num_short = gaps.index(16)
    assert num_short >= 2 and set(gaps[:num_short]) == {8}
    assert gaps[num_short:num_short + 4] == [16, 32, 64, 128] and gaps[-1] == 1024


@pytest.mark.parametrize("bad", [dict(grid=(-1, 2)), dict(min_pulls=0), dict(smoothing=0.0),
                                 dict(explore_every=2048), dict(margin=1.5), dict(plain_margin=-0.1),
                                 dict(confidence=-1.0), dict(prior_rel_sd=-0.1),
                                 dict(sure_lead=0.9), dict(sure_lead=1.0)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError, match="tuner"):
        TunerConfig(**bad)


def drive(tuner, steps, tokens_s, plain_step_s, num_decoding=2):
    """`steps` steps of `num_decoding` sequences; `tokens_s(n)`: (tokens, seconds) of a step
    at draft limit n; the step-cost model's plain step is `plain_step_s` (0: none given)."""
    choices = []
    for _ in range(steps):
        n = tuner.choose(num_decoding)
        choices.append(n)
        tuner.observe(num_decoding, *tokens_s(n), plain_step_s=plain_step_s)
    return choices


def copying(n):  # drafting commits 4 tokens a sequence in 1.5 plain steps: 2.67x plain
    return (8, 1.5) if n else (2, 1.0)


def test_plain_is_not_probed_while_the_cost_model_puts_drafting_far_ahead():
    """A drafting incumbent the step-cost model reads at 2.67x plain: no plain step at all,
    where without the model's estimate plain is measured and re-measured; with a lead under
    `sure_lead` (1.2x) plain is probed as before."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = drive(tuner, 400, copying, plain_step_s=1.0)
    assert choices.count(0) == 0 and tuner.best(2) == 16
    assert tuner.summary()["2"]["plain_probes_skipped"] > 0
    # the batch's tail: bucket 1 starts from bucket 2's lead, and probes no plain step either
    assert drive(tuner, 100, lambda n: (4, 1.5) if n else (1, 1.0), 1.0, num_decoding=1).count(0) == 0
    blind = drive(SpecTuner(TunerConfig(), max_n=16), 400, copying, plain_step_s=0.0)
    assert blind.count(0) >= 4
    off = drive(SpecTuner(TunerConfig(sure_lead=0.0), max_n=16), 400, copying, plain_step_s=1.0)
    assert off.count(0) >= 4
    modest = drive(SpecTuner(TunerConfig(), max_n=16), 400,
                   lambda n: (3, 1.25) if n else (2, 1.0), plain_step_s=1.0)  # 1.2x
    assert modest.count(0) >= 4
    assert SpecTuner(TunerConfig(), max_n=16).summary() == {}


def test_plain_is_probed_again_once_the_lead_falls_short():
    """The text turns: drafting now commits what plain commits, slower. Within a few dozen
    steps of the lead falling under `sure_lead` plain is probed, and it takes over."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    drive(tuner, 300, copying, plain_step_s=1.0)
    after = drive(tuner, 200, lambda n: (2, 1.3) if n else (2, 1.0), plain_step_s=1.0)
    assert 0 in after[:40] and tuner.best(2) == 0


ROW_COST = 0.2  # a verified row's price as a fraction of a step (this CPU measures 0.2-0.3)


def synthetic_engine(rate):
    """An engine whose drafts are accepted at `rate`, and whose steps the tuner scores by a
    cost model (1 + ROW_COST per extra row) instead of the clock: convergence is then a
    property of the tuner and the drafts, not of this machine's load."""
    engine = Engine(model="default", spec_type=["synthetic"], spec_tune=True, spec_n_max=16,
                    spec_options={"synthetic": {"rates": [rate]}}, num_threads=TEST_THREADS,
                    kv_cache_tokens=8192)
    engine._tuner_seconds = lambda num_tokens, measured_s: 1.0 + ROW_COST * (num_tokens - 1)
    engine._plain_step_seconds = lambda num_decoding: 1.0  # the same model's plain step
    return engine


def test_engine_stops_drafting_on_synthetic_acceptance_zero():
    """Acceptance 0: drafts only cost time. The chain's own pricing keeps that cost near 1% in
    the first request (within the tuner's margin); once it grows past the margin by more than
    the noise the tuner switches drafting off, and the next request is decoded with (almost) no
    draft tokens: at most the periodic re-measurement probes."""
    engine = synthetic_engine(0.0)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for prompt in ("Tell me a story.", "Tell me another story."):
        engine.run_to_completion([prompt], params)
    assert engine.tuner.best(1) == 0
    seq = engine.run_to_completion(["Tell me a third story."], params)[0]
    assert seq.spec.num_drafts <= seq.spec.num_steps // 16  # only re-measurement probes
    assert engine.status().tuner["1"]["steps"] > 300 and engine.tuner.best(1) == 0


def test_engine_tuner_picks_long_drafts_on_synthetic_acceptance_high():
    """Acceptance 0.95: long drafts commit many tokens per step; the tuner settles on one."""
    engine = synthetic_engine(0.95)
    engine.run_to_completion(["Tell me a story."], SamplingParams(max_tokens=256, temperature=0.0,
                                                                  ignore_eos=True))
    assert engine.tuner.best(1) >= 4


def test_engine_names_the_sequence_that_decodes_alone():
    """The engine gives the tuner the id of a sequence decoding alone (bucket 1 restarts per
    request on it) and none when several decode."""
    engine = synthetic_engine(0.5)
    seen = []
    choose = engine.tuner.choose

    def recording(num_decoding, alone=None):
        seen.append((num_decoding, alone))
        return choose(num_decoding, alone=alone)

    engine.tuner.choose = recording
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt in ("Tell me a story.", "Tell me another story."):
        engine.run_to_completion([prompt], params)
    assert {n for n, _ in seen} == {1} and len({a for _, a in seen}) == 2 and (1, None) not in seen
    seen.clear()
    engine.run_to_completion(["Tell me a story.", "Tell me another story."], params)
    assert (2, None) in seen and all(a is None for n, a in seen if n == 2)


def test_plain_steps_chosen_by_the_tuner_are_shadow_rounds(default_engine):
    """Where the tuner decodes plain and asks for a shadow round, the chain's model-free
    speculators still propose for every decoding sequence (scored, never verified), at the
    engine's draft limit; a request that asked for no drafts (n_max 0) is left alone, and the
    output is plain's."""
    engine = Engine(model="default", spec_type=["ngram_mod", "suffix"], spec_tune=True,
                    num_threads=TEST_THREADS, kv_cache_tokens=8192, spec_n_max=6)
    engine.tuner.choose = lambda num_decoding, alone=None: 0
    engine.tuner.shadow_due = lambda num_decoding: True  # its cadence: tested on the tuner
    shadowed, drafted = [], []
    shadow, draft = engine.chain.shadow, engine.chain.draft
    engine.chain.shadow = lambda requests: shadowed.append(requests) or shadow(requests)
    engine.chain.draft = lambda requests, *a: drafted.append(requests) or draft(requests, *a)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content":
        "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log."}])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tuned = engine.run_to_completion([prompt, prompt], params)
    assert not drafted and len(shadowed) >= 20
    assert {len(r) for r in shadowed[:8]} == {2} and all(q.params.n_max == 6 for q in shadowed[0])
    assert sum(engine.chain.stats[n].num_proposals for n in ("ngram_mod", "suffix")) > 0
    assert all(s.spec.num_drafts == 0 for s in tuned)
    plain = engine.run_to_completion([prompt], SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True, spec=SpecParams(enabled=False)))
    assert tuned[0].output_ids == tuned[1].output_ids == plain[0].output_ids
    shadowed.clear()
    engine.run_to_completion([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                      spec=SpecParams(n_max=0)))
    assert not shadowed


def test_tuned_outputs_equal_plain(default_engine):
    """The tuner changes how much is drafted, never what is emitted."""
    engine = Engine(model="default", spec_type=["ngram_mod", "suffix"], spec_tune=True,
                    num_threads=TEST_THREADS, kv_cache_tokens=8192)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content":
        "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log."}])
    plain = engine.run_to_completion([prompt], SamplingParams(max_tokens=64, temperature=0.0,
                                                              spec=SpecParams(enabled=False)))
    tuned = engine.run_to_completion([prompt], SamplingParams(max_tokens=64, temperature=0.0))
    assert tuned[0].output_ids == plain[0].output_ids


def test_steps_of_four_or_more_model_free_drafting_sequences_are_left_to_the_chain(default_engine):
    """With only model-free speculators and 4+ decoding sequences the chain's own ledger
    account decides whether drafting pays (speculators/model_free_rest.py): the tuner neither
    chooses nor scores those steps, counts them, and the output is plain's."""
    engine = Engine(model="default", spec_type=["ngram_mod", "suffix"], spec_tune=True,
                    num_threads=TEST_THREADS, kv_cache_tokens=8192)
    chosen = []
    choose = engine.tuner.choose
    engine.tuner.choose = lambda num_decoding, alone=None: chosen.append(num_decoding) or \
        choose(num_decoding, alone=alone)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
               for text in ("Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
                            "Count from one to twenty in words.", "Name three colours.",
                            "Repeat exactly: one two three, one two three, one two three.")]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tuned = engine.run_to_completion(prompts, params)
    summary = engine.status().tuner
    assert summary["4"]["steps_left_to_chain"] >= 10 and summary["4"]["steps"] == 0
    assert all(n < 4 for n in chosen)
    assert sum(s.spec.num_drafts for s in tuned) > 0  # the chain drafted in those steps
    plain = engine.run_to_completion(prompts, SamplingParams(
        max_tokens=32, temperature=0.0, ignore_eos=True, spec=SpecParams(enabled=False)))
    assert [s.output_ids for s in tuned] == [s.output_ids for s in plain]
    chosen.clear()
    engine.run_to_completion(prompts[:2], params)  # two sequences: the tuner's
    assert chosen and set(chosen) <= {1, 2}


def drifting_run(ratio, plain_rate, steps=2000):
    """Drive a tuner where drafting commits `ratio` x plain's tokens at every step, and plain
    decoding runs at `plain_rate(step)` tokens/s (contexts grow, the machine's speed drifts)."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = []
    for i in range(steps):
        n = tuner.choose(1)
        choices.append(n)
        tuner.observe(1, plain_rate(i) * (ratio if n else 1.0), 1.0)
    return tuner, choices


def test_arms_are_compared_at_the_same_moments():
    """Steps slow down as the context grows (here plain decoding from 100 to 30 tokens/s over
    the run) whichever arm takes them; drafting always commits 1.1x plain's tokens. Compared by
    raw goodput, plain probed early beat drafting measured later and switched drafting off;
    compared with the incumbent's steps just before each probe, drafting keeps its 1.1x."""
    tuner, choices = drifting_run(1.1, lambda i: 100 - 70 * i / 2000)
    assert tuner.best(1) == 16 and tuner.summary()["1"]["num_switches_off"] == 0
    # a few re-measurements: a goodput 25% down since plain's last probe makes it due again
    assert choices[-500:].count(16) >= 490
    assert tuner.summary()["1"]["speedup"]["16"] == pytest.approx(1.1, rel=0.01)


@pytest.mark.parametrize("ratio", [0.9, 1.15])
def test_a_machine_that_slows_down_for_a_while_does_not_mislead_it(ratio):
    """Another tenant slows every step by 40% from step 300 to 500 (this machine drifts by
    5-10% within minutes): each probe meets the incumbent at the same speed, so drafting at 0.9x
    is switched off and stays off, and drafting at 1.15x is never switched off."""
    tuner, choices = drifting_run(ratio, lambda i: 60 if 300 <= i < 500 else 100, steps=1500)
    summary = tuner.summary()["1"]
    # the reference lags a sudden change by a few steps: a probe just after it reads a few %
    assert summary["speedup"]["16"] == pytest.approx(ratio, rel=0.05)
    if ratio < 1:
        assert tuner.best(1) == 0 and summary["num_switches_off"] == 1
        assert choices[-1000:].count(16) <= 10
    else:
        assert tuner.best(1) == 16 and summary["num_switches_off"] == 0


@pytest.mark.parametrize("charged", [False, True])
def test_a_probe_is_not_charged_for_catching_up(charged):
    """Plain decoding settled first (drafting at half its goodput); then the text turns and
    drafting commits 1.3x plain's tokens per second, but a step that drafts after plain steps
    first re-reads what they committed (a draft model catching up), which triples that step's
    time. Charged to the probes, that catch-up keeps drafting off for good; not charged (the
    arm, once chosen, pays it once), drafting is switched back on."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    run_bandit(tuner, lambda n: 50 if n else 100, steps=100)
    assert tuner.best(1) == 0
    previous = 0
    for _ in range(3000):
        n = tuner.choose(1)
        catch_up = 2.0 if n and not previous else 0.0
        tuner.observe(1, 130 if n else 100, 1.0 + catch_up,
                      catch_up_seconds=0.0 if charged else catch_up)
        previous = n
    assert tuner.best(1) == (0 if charged else 16)


@pytest.mark.parametrize("catch_up_steps", [0.0, 6.5])
def test_probes_that_make_drafters_catch_up_wait_until_it_is_paid_for(catch_up_steps):
    """Plain settled first (drafting at 0.75x: the 4-layer draft at c=8); each later probe of
    drafting makes the draft model catch up for `catch_up_steps` plain steps' time (8 windows
    of 64 rows: 6.5 steps on qa at c=8, AMD EPYC Zen 1). The next probe waits until that is
    CATCH_UP_SHARE of the plain steps since; without catch-up the usual schedule holds (7
    probes in the first 400 steps, where a c=8 run's bucket takes ~400 steps in all)."""
    from speculant.engine.tuner import CATCH_UP_SHARE

    tuner = SpecTuner(TunerConfig(), max_n=16)
    run_bandit(tuner, lambda n: 600 if n else 800, steps=100, num_decoding=8)
    assert tuner.best(8) == 0
    probes, previous = [], 0
    for step in range(4000):
        n = tuner.choose(8)
        catch_up = 0.04 * catch_up_steps if n and not previous else 0.0
        tuner.observe(8, 6 if n else 8, (0.04 + catch_up) if n else 0.04,
                      catch_up_seconds=catch_up)
        if n and not previous:
            probes.append(step)
        previous = n
    assert tuner.best(8) == 0
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    first = [p for p in probes if p < 400]
    if catch_up_steps:
        assert probes and min(gaps) >= catch_up_steps / CATCH_UP_SHARE and len(first) <= 2
    else:
        assert len(first) >= 5


def test_noise_around_equal_goodput_keeps_the_untuned_limit():
    """Arms whose goodput differs only by noise (+-2%, under the 3% margin) never displace the
    incumbent: the engine's own limit, i.e. the untuned behaviour."""
    import random

    rng = random.Random(0)
    tuner = SpecTuner(TunerConfig(**FINE), max_n=16)
    run_bandit(tuner, lambda n: 1000 * (1 + rng.uniform(-0.02, 0.02)), steps=500)
    assert tuner.best(1) == 16 and tuner.summary()["1"]["num_switches_off"] == 0


def bursty_runs(mean_speedup, step_sd, seeds=40, steps=600, num_decoding=8, gains=True):
    """Drive fresh tuners with noisy steps, as measured on the chain at c=8 (a drafting step's
    speedup over plain 0.79-1.25 from the 10th to the 90th percentile; plain steps +-5%):
    per seed, whether drafting was ever switched off and the share of drafting steps.
    `gains` False: drafting commits one token per sequence (its drafts are never accepted, it
    only costs time), so plain's smaller margin applies."""
    import random

    out = []
    for seed in range(seeds):
        rng = random.Random(seed)
        tuner = SpecTuner(TunerConfig(), max_n=16)
        num_drafting = 0
        for _ in range(steps):
            n = tuner.choose(num_decoding)
            num_drafting += n > 0
            mean, sd = (mean_speedup, step_sd) if n else (1.0, 0.05)
            rate = 100 * max(0.3, rng.gauss(mean, sd))
            if gains:
                tuner.observe(num_decoding, rate, 1.0)
            else:
                tuner.observe(num_decoding, num_decoding, num_decoding / rate)
        out.append((tuner.summary()[str(num_decoding)]["num_switches_off"] > 0,
                    num_drafting / steps))
    return out


def test_bursty_drafting_that_pays_is_never_switched_off():
    """Drafting at 1.15x plain with bursty steps: four steps each differ by +-10%, more than
    the margin, and the comparison without the noise term switched drafting off in 4 of these
    40 runs; with it, none is."""
    runs = bursty_runs(1.15, 0.2)
    assert not any(off for off, _ in runs)
    # (plain measured ahead by early noise is probed 4x as often until that is undone: AHEAD_SPEEDUP)
    assert min(share for _, share in runs) > 0.94


def test_a_draft_that_gains_nothing_and_costs_5_percent_is_switched_off():
    """Drafting at 0.95x plain, noisy, its drafts never accepted: plain's 2% margin and its 4x
    more frequent probes once it measures ahead switch drafting off in every run, drafting
    under 20% of the steps (with the 5% margin and probes every 8 steps: 36 of 40 runs, 33%)."""
    runs = bursty_runs(0.95, 0.2, gains=False)
    assert all(off for off, _ in runs)
    assert sum(share for _, share in runs) / len(runs) < 0.2


def test_drafting_that_wins_in_bursts_keeps_the_full_margin():
    """The same 0.95x where drafting commits many tokens a step (it wins in bursts, and a few
    probes can miss them): plain needs the full 5% margin, and is taken in fewer runs."""
    with_gains = sum(off for off, _ in bursty_runs(0.95, 0.2))
    without = sum(off for off, _ in bursty_runs(0.95, 0.2, gains=False))
    assert with_gains < without


def test_bursty_drafting_that_loses_is_still_switched_off():
    """Drafting at 0.9x plain, as bursty: every run switches it off, and re-measuring while
    the difference is within the noise keeps drafting under 15% of the steps on average."""
    runs = bursty_runs(0.9, 0.2)
    assert all(off for off, _ in runs)
    assert sum(share for _, share in runs) / len(runs) < 0.15


@pytest.mark.parametrize("drafting, switched_off", [(96, True), (99, False)])
def test_plain_needs_a_smaller_lead_than_a_draft_to_take_over(drafting, switched_off):
    """Plain decoding is the safe choice: 3-4% ahead of a drafting incumbent whose drafts gain
    little (one accepted token in 20 steps) it takes over (below the 5% a draft limit needs),
    1% ahead it does not."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = []
    for step in range(600):  # goodput `drafting` tok/s drafting, 100 plain
        n = tuner.choose(1)
        choices.append(n)
        tokens = 2 if n and step % 20 == 0 else 1
        tuner.observe(1, tokens, tokens / (drafting if n else 100))
    assert (tuner.summary()["1"]["n_max"] == 0) == switched_off
    assert (choices[-100:].count(0) > 90) == switched_off


@pytest.mark.parametrize("num_decoding", [1, 8])
def test_drafting_that_gains_nothing_gives_way_to_plain_even_when_as_fast(num_decoding):
    """Drafts never accepted: drafting commits what plain commits, at a cost too small for
    the clock to tell (here none at all, measured as fast as plain). Plain takes over right
    after the warm-up and its first measurement, and drafting is then only re-measured."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = []
    for _ in range(300):  # one token per sequence a step, drafting or not, in the same time
        choices.append(tuner.choose(num_decoding))
        tuner.observe(num_decoding, num_decoding, 0.01)
    assert choices[:33] == [16] * 32 + [0]  # the warm-up, then plain's first measurement...
    assert tuner.best(num_decoding) == 0 and choices[33:41] == [0] * 8  # ...takes over
    assert choices[41:].count(16) <= 8  # re-measured at doubling intervals (not open)


def test_a_chain_switched_off_while_learning_comes_back_when_its_probes_gain():
    """c=8: drafting first gains little (0.06 tokens per sequence per step) at 0.92x plain and
    is switched off; then the text turns and its probes commit 18 tokens where plain commits 8,
    at 1.27x plain's goodput. Its record of ~14 probes at 0.92x counts a quarter after such a
    probe (`TURN_LEAD`), so it is back within 100 steps (231 with the record kept whole)."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = []
    for step in range(450):
        n = tuner.choose(8)
        choices.append(n)
        if n == 0:
            tuner.observe(8, 8, 0.010)
        elif step < 150:
            tuner.observe(8, 9 if step % 2 else 8, 0.0115)
        else:
            tuner.observe(8, 18, 0.0177)
    assert choices[100:150].count(0) > 40  # switched off while it gained little
    back = next(i for i in range(150, 450) if choices[i:i + 20] == [16] * 20)
    assert back < 250


def test_a_bucket_that_never_decoded_passes_nothing_on():
    """Steps with prompt chunks only ask for a bucket's best limit: that bucket is not made,
    so the first bucket that decodes still warms up and measures as a fresh tuner's does."""
    tuner = SpecTuner(TunerConfig(warmup_steps=12), max_n=16)
    assert tuner.best(2) == 16 and tuner.best(6) == 16  # prompt chunks in these steps
    choices = run_bandit(tuner, lambda n: 100 if n else 101, steps=16, num_decoding=8)
    assert choices[:12] == [16] * 12 and 0 in choices[12:]  # warm-up, then plain is measured
    assert tuner.summary().keys() == {"8"}


def test_a_new_bucket_inherits_its_neighbours_comparison_and_probes_a_losing_plain_later():
    """Bucket 8 measured plain at 0.7x the chain: bucket 4 (the batch draining) starts from
    that comparison, discounted, so its first plain probe comes after 32 steps, not 8."""
    tuner = SpecTuner(TunerConfig(warmup_steps=4), max_n=16)
    run_bandit(tuner, lambda n: 140 if n else 100, steps=60, num_decoding=8)
    assert tuner.best(8) == 16
    choices = run_bandit(tuner, lambda n: 140 if n else 100, steps=40, num_decoding=4)
    assert choices.index(0) == 32 and choices.count(0) == 1
    inherited = tuner.summary()["4"]["speedup"]
    assert inherited["16"] == pytest.approx(1.4, rel=0.02)


def test_an_open_arm_measured_behind_is_probed_rarer():
    """A bucket inheriting from one still warming up (nothing compared yet) probes plain at its
    8th step; plain measures behind a bursty 1.4x chain but one probe cannot close it: the next
    probe comes 32 steps later, not 8 (code_edit at c=8: 5 plain steps in 82 decode-only
    steps of buckets 2 and 1)."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    burst = itertools.cycle([2, 3, 1, 9, 4, 2, 6, 1])  # tokens per sequence per drafting step
    for _ in range(14):  # bucket 4: its warm-up only
        tuner.choose(4)
        tuner.observe(4, 4 * next(burst), 0.040)
    plain_steps = []
    for step in range(60):
        if tuner.choose(2) == 0:
            plain_steps.append(step)
            tuner.observe(2, 2, 0.012)
        else:
            tuner.observe(2, 2 * next(burst), 0.030)
    assert plain_steps[0] == 8 and plain_steps[1] - plain_steps[0] >= 32
    assert tuner.best(2) == 16


def test_shadow_rounds_come_every_few_plain_steps_and_before_each_probe():
    """Under a plain incumbent, one step in SHADOW_EVERY and the step before each probe of
    drafting are shadow rounds; while drafting is the incumbent, none."""
    from speculant.engine.tuner import SHADOW_EVERY

    tuner = SpecTuner(TunerConfig(warmup_steps=0), max_n=16)
    assert not tuner.shadow_due(1)  # no bucket yet
    due, probes = [], []
    for step in range(300):
        n = tuner.choose(1)
        if n == 0 and tuner.best(1) == 0:
            due.append(tuner.shadow_due(1))
        elif n > 0 and tuner.best(1) == 0 and due:
            probes.append(due[-1])  # the step before this probe
        tuner.observe(1, 4 if n else 1, 1.0 if n else 0.1)  # plain is far ahead
    assert tuner.best(1) == 0 and probes and all(probes)
    assert SHADOW_EVERY * (sum(due) - len(probes)) <= len(due) + SHADOW_EVERY
    assert sum(due) < len(due) / 2
    tuner = SpecTuner(TunerConfig(warmup_steps=0), max_n=16)
    run_bandit(tuner, lambda n: 200 if n else 100, steps=100)
    assert tuner.best(1) == 16 and not tuner.shadow_due(1)



def test_drafting_switched_off_early_comes_back_when_the_text_turns():
    """Drafting loses (0.85x) for the first 150 steps, then wins (1.4x): under plain, its old
    comparison fades with the steps since each probe, so it is back on within 250 steps."""
    tuner = SpecTuner(TunerConfig(warmup_steps=0), max_n=16)
    run_bandit(tuner, lambda n: 85 if n else 100, steps=150)
    assert tuner.best(1) == 0
    choices = run_bandit(tuner, lambda n: 140 if n else 100, steps=250)
    assert tuner.best(1) == 16 and choices[-20:].count(16) >= 18


def test_bursty_steps_do_not_make_a_settled_comparison_stale():
    """c=1, drafting 1.4x plain in i.i.d. bursty steps (70% commit one token, 15% a copy hit
    of 5-10, as the chain on summarization): a stretch of one-token steps is no change of text.
    Staleness judged on the incumbent's 8-step goodput discounted plain's record every ~100
    steps and probed it every 32 (~110 plain steps in 2,000, 2,236 logged steps: 76); judged
    on its long-run goodput, a settled plain is probed at doubling intervals."""
    import random

    num_plain = []
    for seed in range(8):
        rng = random.Random(seed)
        tuner = SpecTuner(TunerConfig(), max_n=16)
        for _ in range(2000):
            if tuner.choose(1) == 0:
                num_plain.append(seed)
                tuner.observe(1, 1, 0.008 * rng.gauss(1, 0.03))
                continue
            u = rng.random()
            tokens = 1 if u < 0.7 else rng.randint(2, 3) if u < 0.85 else rng.randint(5, 10)
            tuner.observe(1, tokens, 0.011 * rng.gauss(1, 0.05))
        assert tuner.summary()["1"]["num_switches_off"] == 0
    assert len(num_plain) / 8 < 40


def test_drafting_that_stops_gaining_is_switched_off_once_and_comes_back():
    """c=8: drafting pays 1.2x, then for 250 steps its drafts are never accepted (it commits
    what plain commits, 2% slower), then it pays again. Plain takes over once (`NO_GAIN`); the
    drafting arm's old record (1.2x) does not bring it straight back while it still gains
    nothing: it did, and the two rules alternated every other step (75 switches off here; 32
    in 374 steps of mt_bench at c=8). Once its probes gain again it is back."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    choices = []
    for step in range(900):
        n = tuner.choose(8)
        choices.append(n)
        if n == 0:
            tuner.observe(8, 8, 0.010)
        elif 150 <= step < 400:
            tuner.observe(8, 8, 0.0102)
        else:
            tuner.observe(8, 12, 0.0125)
    assert tuner.summary()["8"]["num_switches_off"] == 1
    assert choices[300:400].count(0) > 90
    back = next(i for i in range(400, 900) if choices[i:i + 20].count(16) >= 18)
    assert back < 700


def test_probes_are_scored_against_the_incumbents_steps_before_and_after_them():
    """Drafting alternates 30 steps committing 3 tokens with 30 committing 1 (plain's rate, a
    dry spell), 2.0x plain over time. A dry spell makes drafting's goodput fall and plain due
    for a probe (`STALE_DROP`), so a probe scored against the steps before it alone met the dry
    spell: drafting read 1.61x and plain, kept open, was probed 19 times in 4,000 steps. Scored
    against the steps before and after it (`SETTLE_STEPS`), drafting reads within 10% of its
    2.0x and plain is probed at most 12 times."""
    tuner = SpecTuner(TunerConfig(), max_n=16)
    num_plain = 0
    for step in range(4000):
        if tuner.choose(1) == 0:
            num_plain += 1
            tuner.observe(1, 1, 1.0)
        else:
            tuner.observe(1, 3 if step % 60 < 30 else 1, 1.0)
    summary = tuner.summary()["1"]
    assert summary["n_max"] == 16 and summary["num_switches_off"] == 0
    assert summary["speedup"]["16"] == pytest.approx(2.0, rel=0.1)
    assert num_plain <= 12


def test_steps_where_the_ledger_rests_the_model_drafter_are_left_to_the_chain(default_engine):
    """While the chain's ledger rests the only (model) drafter asked, the chain decodes those
    steps plain and the tuner neither chooses nor scores them: scored, they read as drafting
    that gains nothing and switched a paying draft off for the run. Output stays plain's."""
    engine = Engine(model="default", spec_type=["eagle3"], spec_tune=True,
                    num_threads=TEST_THREADS, kv_cache_tokens=8192)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
               for text in ("Name three colours.", "Count from one to ten in words.",
                            "Say hello in French.", "What is two plus two?")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.chain.ledger.account("eagle3", 4).rest_left = 10_000  # resting all run long
    chosen = []
    choose = engine.tuner.choose
    engine.tuner.choose = lambda num_decoding, alone=None: chosen.append(num_decoding) or \
        choose(num_decoding, alone=alone)
    tuned = engine.run_to_completion(prompts, params)
    summary = engine.status().tuner
    assert summary["4"]["steps_left_to_chain"] >= 10 and summary["4"]["steps"] == 0
    assert 4 not in chosen and 3 not in chosen  # 3 and 4 decoding sequences: bucket 4
    assert summary["4"]["num_switches_off"] == 0
    plain = engine.run_to_completion(prompts, SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, spec=SpecParams(enabled=False)))
    assert [s.output_ids for s in tuned] == [s.output_ids for s in plain]


class AlwaysChallenging(SpecTuner):
    """The tuner with `_challenge`'s skip switched off: it re-checks the arms at every step."""

    def _challenge(self, state):
        state.challenged = None
        super()._challenge(state)


def drive_noisy(tuner, seed, steps=6000):
    """A bursty, changing workload over several buckets and requests: drafting's worth turns
    every few hundred steps (paying, losing, gaining nothing), goodput noisy per step, requests
    changing at c=1, the batch passing through buckets 1-8. Returns every choice, with the
    step's bucket."""
    import random
    rng = random.Random(seed)
    choices = []
    worth, request = 1.5, 0
    for step in range(steps):
        if step % 300 == 0:
            worth = rng.choice([0.6, 0.9, 1.0, 1.2, 1.8])
        if step % 97 == 0:
            request += 1
        num_decoding = rng.choice([1, 1, 1, 2, 4, 8]) if step % 1000 > 600 else 1
        alone = request if num_decoding == 1 else None
        n = tuner.choose(num_decoding, alone=alone)
        if n == 0:
            tokens, seconds = num_decoding, 0.01 * rng.uniform(0.9, 1.1)
        else:
            gain = 0 if worth <= 0.6 else rng.choice([0, 0, 1, 2, 5])
            tokens = num_decoding * (1 + gain) if worth > 0.6 else num_decoding
            seconds = 0.01 * tokens / (worth * num_decoding) * rng.uniform(0.7, 1.3) \
                if worth > 0.6 else 0.012 * rng.uniform(0.9, 1.1)
        tuner.observe(num_decoding, tokens, seconds)
        choices.append((num_decoding, n))
    return choices


@pytest.mark.parametrize("grid", [(0,), (0, 2, 8)])
def test_skipping_the_unchanged_check_never_changes_a_decision(grid):
    """`_challenge` skips its check while nothing it reads changed (`BucketState.version`,
    drafting's gain): the same decisions at every step as re-checking every time, over a
    workload that switches drafting off and on again."""
    for seed in range(3):
        fast = SpecTuner(TunerConfig(grid=grid), max_n=8)
        slow = AlwaysChallenging(TunerConfig(grid=grid), max_n=8)
        got = drive_noisy(fast, seed)
        assert got == drive_noisy(slow, seed)
        assert fast.summary() == slow.summary()
        assert sum(b["num_switches_off"] for b in fast.summary().values()) >= 1
        assert len({n for _, n in got}) == len(fast.grid)  # every arm was used
