"""The engine on the default model: batching invariance, stopping, seeds, abort, bad input."""
import pytest
import torch

from conftest import decode_all
from speculant.engine.sampling_params import SamplingParams, SpecParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain recursion in one sentence.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Say hello in Spanish.",
    "Why do cats purr?",
]
PLAIN = SpecParams(enabled=False)


def chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(engine, prompts, params, max_num_seqs=8):
    return decode_all(engine, [chat(engine, p) for p in prompts], params, max_num_seqs)


def test_eight_prompts_batched_equal_each_alone(default_engine):
    """Batch invariance: a sequence's greedy tokens do not depend on its neighbours."""
    params = SamplingParams(max_tokens=24, temperature=0.0, spec=PLAIN)
    batched = [s.output_ids for s in run(default_engine, PROMPTS, params)]
    alone = [run(default_engine, [p], params)[0].output_ids for p in PROMPTS]
    assert batched == alone


def test_request_joining_mid_run_gets_the_same_tokens(default_engine):
    """Continuous batching: a request admitted while another decodes is unaffected by it."""
    params = SamplingParams(max_tokens=20, temperature=0.0, spec=PLAIN)
    alone = run(default_engine, [PROMPTS[1]], params)[0].output_ids
    first = default_engine.add_request(chat(default_engine, PROMPTS[0]), params)
    for _ in range(5):
        default_engine.step()
    late = default_engine.add_request(chat(default_engine, PROMPTS[1]), params)
    while default_engine.has_unfinished():
        default_engine.step()
    assert late.output_ids == alone
    default_engine.release(first)
    default_engine.release(late)


def test_a_sequence_is_timed_over_the_steps_that_decoded_it(default_engine):
    """`decode_step_time_s` sums the steps that committed a token after a sequence's first,
    those that also ran another request's prompt chunk included (what the bench's per-request
    decode rate divides by); `prefill_time_s` the steps that ran its own prompt."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, spec=PLAIN)
    default_engine.reset_stats()
    seqs = [default_engine.add_request(chat(default_engine, PROMPTS[0]), params)]
    expected_decode, expected_prefill = [0.0, 0.0], [0.0, 0.0]
    mixed = 0
    while default_engine.has_unfinished():
        if len(seqs) == 1 and seqs[0].num_generated == 4:  # joins while the first decodes
            seqs.append(default_engine.add_request(chat(default_engine, PROMPTS[5]), params))
        before = [s.num_generated for s in seqs]
        st = default_engine.stats
        t_before = st.decode_time_s + st.prefill_time_s
        default_engine.step()
        took = st.decode_time_s + st.prefill_time_s - t_before
        grew = [s.num_generated > b for s, b in zip(seqs, before)]
        for i, (g, b) in enumerate(zip(grew, before)):
            if g and b >= 1:
                expected_decode[i] += took
            elif b == 0:
                expected_prefill[i] += took
        mixed += len(seqs) == 2 and grew[0] and before[1] == 0
    assert mixed >= 1  # the first sequence decoded beside the second's prompt
    for seq, dec, pre in zip(seqs, expected_decode, expected_prefill):
        assert seq.decode_step_time_s == pytest.approx(dec, rel=1e-9)
        assert seq.prefill_time_s == pytest.approx(pre, rel=1e-9)
        assert seq.decode_step_time_s > 0
        default_engine.release(seq)
    # each sequence's share of the decode-only steps adds up to the run's decode rate: their
    # tokens, and their time split evenly between the sequences in them
    st = default_engine.stats
    assert sum(s.decode_only_tokens for s in seqs) == st.decode_tokens > 0
    assert sum(s.decode_only_s for s in seqs) == pytest.approx(st.decode_time_s, rel=1e-9)
    assert all(s.decode_only_s < s.decode_step_time_s for s in seqs)  # shared and mixed steps


def test_max_tokens_and_length_finish(default_engine):
    s = run(default_engine, [PROMPTS[3]], SamplingParams(max_tokens=5, temperature=0.0,
                                                         ignore_eos=True, spec=PLAIN))[0]
    assert s.num_generated == 5 and s.finish_reason == "length"


def test_eos_stops_generation(default_engine):
    # a prompt the model answers in ~25 tokens with either KV cache type
    s = run(default_engine, [PROMPTS[3]], SamplingParams(max_tokens=200, temperature=0.0, spec=PLAIN))[0]
    assert s.finish_reason == "stop" and s.output_ids[-1] == default_engine.tokenizer.eos_token_id


def test_stop_string_truncates_text(default_engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, spec=PLAIN)
    full = default_engine.output_text(run(default_engine, [PROMPTS[0]], params)[0])
    stop = full.split()[2]  # a word from the middle of the answer
    s = run(default_engine, [PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0.0,
                                                        stop=[stop], spec=PLAIN))[0]
    text = default_engine.output_text(s)
    assert s.finish_reason == "stop" and stop not in text and full.startswith(text)


def test_stop_token_ids(default_engine):
    params = SamplingParams(max_tokens=30, temperature=0.0, spec=PLAIN)
    full = run(default_engine, [PROMPTS[0]], params)[0].output_ids
    s = run(default_engine, [PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.0,
                                                        stop_token_ids=[full[3]], spec=PLAIN))[0]
    assert s.output_ids == full[:full.index(full[3]) + 1]


def test_same_seed_same_output_and_different_seed_differs(default_engine):
    def sample(seed):
        p = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True, spec=PLAIN)
        return run(default_engine, [PROMPTS[1]], p)[0].output_ids
    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_abort_frees_the_kv_cache(default_engine):
    cache = default_engine.cache
    free_before = cache.num_free_blocks
    s = default_engine.add_request(chat(default_engine, PROMPTS[0]),
                                   SamplingParams(max_tokens=50, temperature=0.0, spec=PLAIN))
    default_engine.step()
    assert cache.num_free_blocks < free_before
    assert default_engine.abort(s.request_id)
    assert s.finish_reason == "abort" and cache.num_free_blocks == free_before
    assert not default_engine.has_unfinished()
    default_engine.release(s)


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),  # nothing to condition on
    ("x " * 9000, SamplingParams(), "context"),  # longer than the model's context
    ("hi", SamplingParams(spec=SpecParams(types=["nope"])), "not loaded"),  # unknown speculator
    ("hi", SamplingParams(temperature=0.7, spec=SpecParams(verify="greedy")), "temperature 0"),
])
def test_bad_requests_are_refused_with_a_reason(default_engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        default_engine.add_request(prompt, params)
    assert not default_engine.has_unfinished()


def test_spec_none_takes_the_engine_defaults_and_a_wrong_type_is_named():
    assert SamplingParams(spec=None).spec == SpecParams()
    assert SamplingParams(spec={"n_max": 3}).spec.n_max == 3
    with pytest.raises(ValueError, match="spec must be SpecParams"):
        SamplingParams(spec=3)


def test_out_of_vocabulary_token_ids_are_refused(default_engine):
    with pytest.raises(ValueError, match="vocabulary"):
        default_engine.add_request([1, 2, 10**7], SamplingParams())


def test_stop_string_token_count_does_not_depend_on_speculation(default_engine):
    """Tokens accepted past the one completing a stop string are dropped, as plain decoding
    would never have generated them."""
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    prompt = f"Repeat exactly: {text}"
    outs = {}
    for label, spec in (("plain", PLAIN), ("spec", SpecParams())):
        params = SamplingParams(max_tokens=60, temperature=0.0, stop=["iota"], spec=spec)
        s = run(default_engine, [prompt], params)[0]
        outs[label] = (s.output_ids, default_engine.output_text(s), s.finish_reason)
    assert outs["plain"] == outs["spec"]
    assert outs["spec"][2] == "stop"  # the model does repeat the text: the stop string is hit


def quantized_auto_kv_dtype() -> str:
    """What auto gives quantized weights here: the AMX tiles' bfloat16 layout where the CPU
    attends it, else fp16 (llama.cpp's default)."""
    from speculant.kernels.native import tile_kv_cache

    return "bfloat16" if tile_kv_cache() else "float16"


@pytest.mark.parametrize("overrides, kv_dtype", [
    ({}, None),  # quantized weights: quantized_auto_kv_dtype()
    ({"dtype": "float32"}, "float32"),  # reference numerics keep a float32 cache
    ({"dtype": "float32", "kv_dtype": "float16"}, "float16"),
    ({"kv_dtype": "auto", "block_size": 16}, "float16"),  # a block size the tiles cannot take
])
def test_kv_dtype_auto_follows_the_weights(overrides, kv_dtype):
    from speculant.engine.config import EngineConfig

    assert EngineConfig(**overrides).kv_dtype == (kv_dtype or quantized_auto_kv_dtype())


def test_bad_kv_dtype_is_named():
    from speculant.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_dtype must be auto or one of.*'bfloat8'"):
        EngineConfig(kv_dtype="bfloat8")


def test_default_engine_keeps_the_auto_cache(default_engine):
    want = getattr(torch, quantized_auto_kv_dtype())
    assert all(k.dtype == want for k in default_engine.cache.k + default_engine.cache.v)


def test_reset_stats_forgets_the_fitted_step_cost(default_engine):
    """The chain prices draft tokens with the engine's fitted step cost: a benchmark run after
    reset_stats starts from the same prior whatever ran before it."""
    from speculant.engine.step_cost import StepCostModel

    run(default_engine, PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0.0))
    assert default_engine.cost.num_observations > 0
    default_engine.reset_stats()
    assert default_engine.cost == StepCostModel()


def test_greedy_steps_take_the_lm_heads_own_picks(default_engine):
    """A step with greedy rows gets each logits row's argmax from the model's LM head (found as
    it writes them: none off the native path), equal to torch.argmax of the logits; a step
    whose rows all sample asks for none."""
    from speculant.engine.forward_batch import SeqChunk, build_forward_batch
    from speculant.kernels import native_available

    engine, seq_id = default_engine, 10_000
    engine.cache.allocate(seq_id)
    try:
        prompt = engine.tokenizer.encode("The capital of France is")
        batch = build_forward_batch(engine.cache, [SeqChunk(seq_id, 0, prompt, 3)])
        batch.greedy_picks = True
        out = engine.model.forward(batch, engine.cache)
        if native_available():
            assert torch.equal(out.argmax, out.logits.argmax(dim=-1))
        else:
            assert out.argmax is None
        assert engine._batched_argmax(batch, out) == out.logits.argmax(dim=-1).tolist()
        batch.greedy_picks = False
        assert engine._batched_argmax(batch, out) is None
    finally:
        engine.cache.free(seq_id)
