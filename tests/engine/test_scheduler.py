"""Admission by KV promise, prefill chunking, and the bounded waiting queue."""
import pytest

from speculant.engine.kv_cache import KVCache
from speculant.engine.sampling_params import SamplingParams
from speculant.engine.scheduler import QueueFullError, Scheduler
from speculant.engine.sequence import Sequence, SeqStatus


def seq(i, prompt_len, max_tokens=4):
    s = Sequence(seq_id=i, request_id=f"r{i}", prompt_ids=list(range(1, prompt_len + 1)),
                 params=SamplingParams(max_tokens=max_tokens), sampler=None)
    s.kv_budget = prompt_len + max_tokens
    return s


def make(num_blocks=8, block_size=4, max_seqs=4, max_tokens=64, max_queue=4):
    cache = KVCache(1, 1, 2, num_blocks, block_size)
    return Scheduler(cache, max_seqs, max_tokens, max_queue), cache


def test_request_waits_until_the_cache_can_promise_its_tokens():
    sched, _ = make(num_blocks=4)
    a, b = seq(0, 10), seq(1, 10)  # 14 tokens each -> 4 blocks each
    sched.add(a)
    sched.add(b)
    step = sched.schedule(decode_tokens=1)
    assert [s.seq_id for s, _ in step.prefill] == [0]
    assert b.status is SeqStatus.WAITING
    sched.finish(a)
    step = sched.schedule(decode_tokens=1)
    assert [s.seq_id for s, _ in step.prefill] == [1]


def test_request_larger_than_the_whole_cache_is_refused_with_a_reason():
    sched, _ = make(num_blocks=2)
    with pytest.raises(ValueError, match="KV tokens"):
        sched.add(seq(0, 20))


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    sched, _ = make(num_blocks=64, max_tokens=40)
    s = seq(0, 100)
    sched.add(s)
    step = sched.schedule(decode_tokens=1)
    assert step.prefill == [(s, 40)]


def test_decoding_sequences_do_not_starve_a_prompt():
    sched, _ = make(num_blocks=64, max_tokens=40, max_seqs=8)
    decoders = [seq(i, 2) for i in range(3)]
    for d in decoders:
        sched.add(d)
    sched.schedule(decode_tokens=17)
    for d in decoders:
        d.num_computed = d.num_prompt  # prompts done: now decoding
    sched.add(seq(9, 50))
    step = sched.schedule(decode_tokens=17)  # 3 * 17 > 40 tokens of budget
    assert len(step.decode) == 3
    assert step.prefill and step.prefill[0][1] > 0


def test_queue_is_bounded_beyond_the_free_slots():
    sched, _ = make(max_queue=2, max_seqs=1)
    sched.add(seq(0, 2))  # takes the free slot at the next step: not queued in earnest
    sched.add(seq(1, 2))
    sched.add(seq(2, 2))
    with pytest.raises(QueueFullError):
        sched.add(seq(3, 2))
    sched.schedule(decode_tokens=1)
    assert len(sched.running) == 1 and len(sched.waiting) == 2


def test_finish_frees_cache_and_promise():
    sched, cache = make(num_blocks=4)
    a = seq(0, 10)
    sched.add(a)
    sched.schedule(decode_tokens=1)
    cache.reserve(0, 10)
    sched.finish(a)
    assert cache.num_free_blocks == 4
    assert a.status is SeqStatus.FINISHED
    assert sched.num_unfinished == 0
