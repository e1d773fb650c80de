"""/metrics shows the online tuner's choice per concurrency bucket (--spec-tune) and the
model drafters the chain rested (drafter_ledger.py)."""
from conftest import TEST_THREADS
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams
from speculant.server.metrics import ServerMetrics, engine_snapshot


def test_tuner_choice_and_switches_are_exported():
    engine = Engine(model="default", spec_type=["synthetic"], spec_tune=True,
                    spec_options={"synthetic": {"rates": [0.0]}}, num_threads=TEST_THREADS,
                    kv_cache_tokens=4096)
    engine.run_to_completion(["Hello."], SamplingParams(max_tokens=40, temperature=0.0,
                                                        ignore_eos=True))
    text = ServerMetrics().render(engine_snapshot(engine)).decode()
    chosen = engine.status().tuner["1"]["n_max"]
    assert f'speculant:spec_tuner_n_max{{bucket="1"}} {float(chosen)}' in text
    assert 'speculant:spec_tuner_switches_off_total{bucket="1"}' in text
    assert 'speculant:spec_tuner_steps_left_to_chain_total{bucket="1"} 0.0' in text
    skipped = engine.status().tuner["1"]["plain_probes_skipped"]
    assert f'speculant:spec_tuner_plain_probes_skipped_total{{bucket="1"}} {float(skipped)}' in text


def test_steps_left_to_the_chain_are_exported():
    """Four sequences drafting with model-free speculators only: their steps are the chain's
    (SpecTuner.leave_to_chain), counted in /metrics per bucket."""
    engine = Engine(model="default", spec_type=["synthetic"], spec_tune=True,
                    spec_options={"synthetic": {"rates": [0.5]}}, num_threads=TEST_THREADS,
                    kv_cache_tokens=4096)
    engine.run_to_completion(["Hello.", "Hi.", "Hey.", "Good day."],
                             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    left = engine.status().tuner["4"]["steps_left_to_chain"]
    assert left > 0
    text = ServerMetrics().render(engine_snapshot(engine)).decode()
    assert f'speculant:spec_tuner_steps_left_to_chain_total{{bucket="4"}} {float(left)}' in text


def test_model_drafter_rests_are_exported():
    """A drafter whose window lost (charged, never credited) is resting in its bucket; the
    engine's status and /metrics say so."""
    engine = Engine(model="default", spec_type=["synthetic"], num_threads=TEST_THREADS,
                    kv_cache_tokens=4096)
    ledger = engine.chain.ledger
    while not ledger.resting("eagle3", 8):
        ledger.charge("eagle3", 8, 1.0)
    assert ledger.account("eagle3", 8).rest_left > 0
    assert engine.status().rests["eagle3"][8]["num_rests"] == 1
    text = ServerMetrics().render(engine_snapshot(engine)).decode()
    assert 'speculant:spec_drafter_rests_total{bucket="8",speculator="eagle3"} 1.0' in text
    assert 'speculant:spec_drafter_resting{bucket="8",speculator="eagle3"} 1.0' in text
