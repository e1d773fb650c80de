"""Online step-cost model used to price draft tokens: time = fixed + per_seq S + per_row D."""
import pytest

from speculant.engine.step_cost import StepCostModel

FIXED, PER_SEQ, PER_ROW = 0.006, 0.0012, 0.0007  # the shape measured at c=8 (step_cost.py)


def step_time(num_seqs: int, num_rows: int) -> float:
    return FIXED + PER_SEQ * num_seqs + PER_ROW * num_rows


def test_fit_recovers_fixed_per_sequence_and_per_row_cost():
    model = StepCostModel()
    for i in range(80):
        s, d = 1 + i % 8, (3 * i) % 11  # sequences and draft rows varied independently
        model.observe(s, s + d, step_time(s, d))
    assert model.fixed_s == pytest.approx(FIXED, abs=1e-9)
    assert model.per_seq_s == pytest.approx(PER_SEQ, abs=1e-10)
    assert model.per_row_s == pytest.approx(PER_ROW, abs=1e-10)
    assert model.cost_per_token(8) == pytest.approx(PER_ROW * 8 / (FIXED + PER_SEQ * 8))
    assert model.seconds_per_token(8) == pytest.approx((FIXED + PER_SEQ * 8) / 8)


def test_a_batch_tail_is_not_read_as_the_price_of_a_row():
    """Sequences finishing (S falls) while drafts vary: a single slope over all tokens read the
    per-sequence cost as the draft row's; the plane prices the row at its own cost."""
    model = StepCostModel()
    for i in range(200):
        s = 8 - (i // 25)  # a batch draining: 8, 7, ... 1 sequences
        d = (i * 7) % 5 if i % 3 else 0
        model.observe(s, s + d, step_time(s, d))
    assert model.per_row_s == pytest.approx(PER_ROW, rel=1e-6)
    assert model.cost_per_token(8) == pytest.approx(0.0056 / 0.0156, rel=1e-6)  # 0.36 (one slope: 0.58)


def test_one_sequence_fits_the_row_and_folds_the_sequence_into_fixed():
    """At c=1 S never varies: per_seq keeps its prior, fixed takes the rest, and a row's price
    relative to a plain step is still right."""
    model = StepCostModel()
    for i in range(40):
        d = i % 6
        model.observe(1, 1 + d, step_time(1, d))
    assert model.per_seq_s == StepCostModel().per_seq_s
    assert model.per_row_s == pytest.approx(PER_ROW, rel=1e-9)
    assert model.fixed_s + model.per_seq_s == pytest.approx(FIXED + PER_SEQ, rel=1e-9)
    assert model.cost_per_token(1) == pytest.approx(PER_ROW / (FIXED + PER_SEQ), rel=1e-9)


def test_steps_without_drafts_keep_the_prior_row_cost():
    model = StepCostModel(per_row_s=0.0005)
    for i in range(40):
        s = 1 + i % 8
        model.observe(s, s, step_time(s, 0))
    assert model.per_row_s == 0.0005
    assert model.per_seq_s == pytest.approx(PER_SEQ, rel=1e-9)
    assert model.fixed_s == pytest.approx(FIXED, rel=1e-9)


def test_identical_steps_keep_the_prior():
    model = StepCostModel(fixed_s=0.01, per_seq_s=0.0005, per_row_s=0.0003)
    for _ in range(30):
        model.observe(4, 4, 0.02)
    assert (model.fixed_s, model.per_seq_s, model.per_row_s) == (0.01, 0.0005, 0.0003)


def test_a_fit_with_a_negative_slope_is_not_taken():
    """Noise can tilt a plane fitted on few distinct shapes; a slope <= 0 would price rows as
    free, so the previous coefficients stay."""
    model = StepCostModel()
    for i in range(20):
        d = i % 3
        model.observe(2, 2 + d, 0.010 - 0.001 * d)  # more rows, less time
    assert (model.fixed_s, model.per_seq_s, model.per_row_s) == (8e-3, 4e-4, 4e-4)


def test_cost_per_token_grows_with_the_number_of_sequences():
    model = StepCostModel(fixed_s=0.008, per_seq_s=0.0004, per_row_s=0.0004)
    assert model.cost_per_token(1) < model.cost_per_token(8) < 1.0
    assert abs(model.cost_per_token(1) - 0.0004 / 0.0084) < 1e-12


def test_a_row_price_fitted_too_high_fades_back_when_drafting_stops():
    """A few drafting steps that read a row at 1.5 plain steps (an early outlier, c=1): the
    chain then drafts nothing, so no step can correct that price. Kept as fitted (before), it
    priced drafting out for the rest of a bench run (0.97x plain where the chain paid 1.29x);
    it now fades back to the prior as those steps' weight decays."""
    model = StepCostModel()
    prior_row_s = model.per_row_s
    for i in range(20):
        d = 1 + i % 4
        model.observe(1, 1 + d, 0.008 + 0.012 * d)
    assert model.cost_per_token(1) == pytest.approx(1.5, rel=0.05)
    costs = []
    for _ in range(400):  # plain steps only
        model.observe(1, 1, 0.008)
        costs.append(model.cost_per_token(1))
    assert costs[30] > 1.0  # a short pause in drafting keeps the fit
    assert model.per_row_s == pytest.approx(prior_row_s, rel=0.1) and costs[-1] < 0.1


def test_drafting_now_and_then_keeps_its_fitted_row_price():
    """One drafting step in ten (the chain pricing most drafts out) is evidence enough: the
    fitted price stays, it does not fade to the prior."""
    model = StepCostModel()
    for i in range(600):
        d = 2 + i % 3 if i % 10 == 0 else 0
        model.observe(1, 1 + d, 0.008 + 0.002 * d)
    assert model.cost_per_token(1) == pytest.approx(0.25, rel=0.02)
