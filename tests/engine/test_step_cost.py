"""Online step-cost model used to price draft tokens."""
from speculant.engine.step_cost import StepCostModel


def test_fit_recovers_fixed_and_per_token_cost():
    model = StepCostModel()
    for i in range(60):
        n = 1 + (i % 9)
        model.observe(n, 0.010 + 0.001 * n)
    assert abs(model.fixed_s - 0.010) < 1e-6
    assert abs(model.per_token_s - 0.001) < 1e-7


def test_constant_batch_size_keeps_the_prior_slope():
    model = StepCostModel(fixed_s=0.01, per_token_s=0.0005)
    for _ in range(30):
        model.observe(4, 0.02)
    assert model.per_token_s == 0.0005


def test_cost_per_token_grows_with_the_number_of_sequences():
    model = StepCostModel(fixed_s=0.008, per_token_s=0.0004)
    assert model.cost_per_token(1) < model.cost_per_token(8) < 1.0
    assert abs(model.cost_per_token(1) - 0.0004 / 0.0084) < 1e-12
