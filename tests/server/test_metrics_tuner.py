"""/metrics shows the online tuner's choice per concurrency bucket (--spec-tune)."""
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
