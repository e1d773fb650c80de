"""bench/interleave.py: methods stepped side by side, each on its own engine."""
import pytest

from speculant.bench.interleave import run_interleaved
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams, SpecParams

from conftest import TEST_THREADS


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class StepCounter:
    """An engine stand-in for the driver: `steps_left` steps of `step_s` seconds each, on a
    shared clock; it logs who stepped when."""

    def __init__(self, name, steps_left, step_s, clock, log):
        self.name, self.steps_left, self.step_s, self.clock, self.log = name, steps_left, step_s, clock, log
        self.added, self.released = [], []

    def add_request(self, prompt, params):
        self.added.append((prompt, params))
        return f"{self.name}:{prompt}"

    def has_unfinished(self):
        return self.steps_left > 0

    def step(self):
        assert self.steps_left > 0
        self.steps_left -= 1
        self.clock.now += self.step_s
        self.log.append(self.name)

    def release(self, seq):
        self.released.append(seq)


def test_turns_alternate_in_reversed_order_and_time_is_each_engines_own():
    clock, log = Clock(), []
    a = StepCounter("a", 6, 0.04, clock, log)  # a turn of 0.1 s: 3 steps of 0.04
    b = StepCounter("b", 2, 0.25, clock, log)  # longer than a turn: one step per turn
    done = run_interleaved([a, b], ["p1", "p2"], ["pa", "pb"], turn_s=0.1, clock=clock)
    assert log == ["a"] * 3 + ["b", "b"] + ["a"] * 3
    assert [d.num_turns for d in done] == [2, 2]
    assert done[0].wall_s == pytest.approx(6 * 0.04) and done[1].wall_s == pytest.approx(0.5)
    assert a.added == [("p1", "pa"), ("p2", "pa")] and b.added == [("p1", "pb"), ("p2", "pb")]
    assert done[1].seqs == ["b:p1", "b:p2"] and b.released == done[1].seqs


def test_one_engine_for_two_methods_is_refused():
    clock, log = Clock(), []
    a = StepCounter("a", 1, 0.01, clock, log)
    with pytest.raises(ValueError, match="one engine per method"):
        run_interleaved([a, a], ["p"], [None, None], clock=clock)
    with pytest.raises(ValueError, match="parameter sets"):
        run_interleaved([a], ["p"], [None, None], clock=clock)


@pytest.fixture(scope="module")
def base_engine():
    return Engine(model="default", spec_type=["suffix"], max_num_seqs=2, num_threads=TEST_THREADS,
                  kv_cache_tokens=4096)


def test_sibling_engines_share_the_weights_and_decode_exactly_side_by_side(base_engine):
    """Plain on one engine, the suffix chain on its sibling, stepped in alternation: each equals
    what the base engine decodes alone; the weights are one copy, the KV caches two."""
    sibling = base_engine.sibling()
    assert sibling.model is base_engine.model and sibling.tokenizer is base_engine.tokenizer
    assert sibling.cache is not base_engine.cache and sibling.chain is not base_engine.chain
    tok = base_engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}])
               for p in ("Repeat exactly: one two three four five six.", "Count from 1 to 12.")]
    plain = SamplingParams(max_tokens=24, temperature=0.0, spec=SpecParams(enabled=False))
    spec = SamplingParams(max_tokens=24, temperature=0.0, spec=SpecParams())
    alone = [s.output_ids for s in base_engine.run_to_completion(prompts, plain)]
    done = run_interleaved([base_engine, sibling], prompts, [plain, spec], turn_s=0.0)
    assert [s.output_ids for s in done[0].seqs] == alone
    assert [s.output_ids for s in done[1].seqs] == alone
    assert done[0].num_turns > 1 and done[1].num_turns > 1  # they did alternate
    assert not base_engine.has_unfinished() and not sibling.has_unfinished()


def test_a_sibling_cannot_change_the_model(base_engine):
    with pytest.raises(ValueError, match="dtype"):
        base_engine.sibling(dtype="float32")
