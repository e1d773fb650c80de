"""Synthetic acceptance (benchmarking): drafts accepted by given per-position rates, output flagged."""
import pytest

from conftest import TEST_THREADS
from speculant.engine.engine import Engine
from speculant.engine.request_output import spec_summary
from speculant.engine.sampling_params import SamplingParams
from speculant.speculators.synthetic import synthetic_num_accepted


@pytest.mark.parametrize("rates, uniforms, expected", [
    ([1.0], [0.3, 0.9, 0.99], 3),  # rate 1 accepts every position (the last rate repeats)
    ([0.0], [0.0, 0.0], 0),  # rate 0 accepts nothing
    ([0.9, 0.5, 0.1], [0.2, 0.4, 0.2], 2),  # stops at the first uniform above its rate
])
def test_synthetic_num_accepted(rates, uniforms, expected):
    assert synthetic_num_accepted(rates, len(uniforms), uniforms) == expected


def test_engine_accepts_by_the_configured_rates_and_marks_output_invalid():
    engine = Engine(model="default", spec_type=["synthetic"], spec_options={"synthetic": {"rates": [1.0]}},
                    spec_n_max=4, num_threads=TEST_THREADS)
    seq = engine.add_request("Hello", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    summary = spec_summary(seq)
    assert summary["synthetic"] is True
    assert summary["num_accepted_tokens"] == summary["num_draft_tokens"] > 0
    assert summary["mean_accepted_length"] > 2.0
