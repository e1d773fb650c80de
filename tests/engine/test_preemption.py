"""Serving behaviour of the engine: preemption keeps outputs, one failure stays one request's,
and a short request is not stuck behind a long prompt."""
import random

import pytest

from conftest import TEST_THREADS
from speculant.engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name two primary colours.",
             "What is 2 + 2?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def small_engine():
    """4 slots and a KV cache (256 tokens) too small for 4 chat answers at once."""
    from speculant.engine.engine import Engine

    return Engine(model="default", spec_type=["ngram_mod", "suffix"], max_num_seqs=4,
                  kv_cache_tokens=256, num_threads=TEST_THREADS)


def chat_ids(engine, question):
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return engine.tokenizer.encode(text)


def no_max_tokens(engine, prompt_ids, **kw):
    """A chat request without max_tokens: whatever the context leaves (as the server does)."""
    return SamplingParams(max_tokens=engine.max_model_len - len(prompt_ids), **kw)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_preemption_keeps_every_output_equal_to_alone(small_engine, sampling):
    """Four chats without max_tokens run at once on a cache too small for all of them: the
    newest are preempted and recomputed, and every output equals its output alone."""
    engine = small_engine
    assert engine.max_model_len == 256  # the context is capped to the cache (with a warning)
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    alone = [engine.run_to_completion([p], no_max_tokens(engine, p, **sampling))[0].output_ids
             for p in prompts]
    preempted_before = engine.status().num_preemptions
    seqs = [engine.add_request(p, no_max_tokens(engine, p, **sampling)) for p in prompts]
    engine.step()
    assert len(engine.status().running) == 4  # admitted at once: nothing reserved up front
    while engine.has_unfinished():
        engine.step()
    for seq in seqs:
        engine.release(seq)
    assert engine.status().num_preemptions > preempted_before
    assert [s.output_ids for s in seqs] == alone
    assert all(s.finish_reason in ("stop", "length") for s in seqs)


class ExplodingSampler:
    """A sampler that fails at the first token it is asked for (the injected fault)."""

    def __getattr__(self, name):
        raise RuntimeError("injected sampler failure")


def test_a_failing_sampler_fails_only_its_request(default_engine):
    engine = default_engine
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3)
    alone = engine.run_to_completion(["Tell me a story."], params)[0].output_ids
    good = engine.add_request("Tell me a story.", params)
    bad = engine.add_request("Tell me a joke.", params)
    bad.sampler = ExplodingSampler()
    free_before = engine.status().num_free_blocks
    while engine.has_unfinished():
        engine.step()
    assert bad.finish_reason == "error" and bad.request_id in bad.error
    assert "injected" not in bad.error  # internals go to the log, not to the client
    assert good.finish_reason in ("stop", "length") and good.output_ids == alone
    assert engine.status().num_free_blocks >= free_before  # the failed request's KV is back
    engine.release(good)
    engine.release(bad)


def test_short_request_finishes_before_a_long_prompt_is_prefilled(default_engine):
    """A 16-token request arriving while a 3000-token prompt prefills finishes first (the
    latency ratio is measured by speculant/bench/head_of_line.py)."""
    engine = default_engine
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 40000) for _ in range(3000)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=1, **greedy))
    engine.step()  # the long prompt's first chunk
    short = engine.add_request("Count to ten:", SamplingParams(max_tokens=16, **greedy))
    finished = []
    while engine.has_unfinished():
        finished += [u.seq.request_id for u in engine.step() if u.finished]
    assert finished == [short.request_id, long.request_id]
    assert short.num_generated == 16
    engine.release(long)
    engine.release(short)
