"""Optimistic admission, preemption of the newest sequence, fair prefill chunks, the queue."""
import pytest

from speculant.engine.kv_cache import KVCache
from speculant.engine.sampling_params import SamplingParams
from speculant.engine.scheduler import QueueFullError, Scheduler
from speculant.engine.sequence import Sequence, SeqStatus


def seq(i, prompt_len, max_tokens=4):
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_ids=list(range(1, prompt_len + 1)),
                    params=SamplingParams(max_tokens=max_tokens), sampler=None)


def make(num_blocks=8, block_size=4, max_seqs=4, max_tokens=64, max_queue=4, chunk=None):
    cache = KVCache(1, 1, 2, num_blocks, block_size)
    return Scheduler(cache, max_seqs, max_tokens, max_queue, chunk), cache


def run(sched, step):
    """What the engine does after a forward: prompt chunks committed, decoders gain a token."""
    for s, n in step.prefill:
        s.num_computed += n
        if not s.is_prefilling and s.num_generated == 0:
            s.token_ids.append(7)
    for s in step.decode:
        s.num_computed = len(s.token_ids)
        s.token_ids.append(7)
    for s in sched.running:
        sched.cache.set_length(s.seq_id, s.num_computed)
        sched.cache.trim_reservation(s.seq_id)


def test_admission_needs_only_the_prompt_not_max_tokens():
    sched, _ = make(num_blocks=4)
    a, b = seq(0, 6, max_tokens=100), seq(1, 6, max_tokens=100)  # 7 tokens -> 2 blocks each
    sched.add(a)
    sched.add(b)
    step = sched.schedule(decode_tokens=1)
    assert [s.seq_id for s, _ in step.prefill] == [0, 1]


def test_request_waits_while_its_prompt_does_not_fit():
    sched, _ = make(num_blocks=4)
    a, b = seq(0, 10), seq(1, 10)  # 11 tokens -> 3 blocks each
    sched.add(a)
    sched.add(b)
    step = sched.schedule(decode_tokens=1)
    assert [s.seq_id for s, _ in step.prefill] == [0]
    assert b.status is SeqStatus.WAITING
    sched.finish(a)
    step = sched.schedule(decode_tokens=1)
    assert [s.seq_id for s, _ in step.prefill] == [1]


def test_prompt_larger_than_the_whole_cache_is_refused_with_a_reason():
    sched, _ = make(num_blocks=2)
    with pytest.raises(ValueError, match="KV tokens"):
        sched.add(seq(0, 20))


def test_newest_sequence_is_preempted_when_blocks_run_out_and_resumes_first():
    sched, cache = make(num_blocks=4)  # 16 tokens
    old, new = seq(0, 7), seq(1, 7)
    sched.add(old)
    sched.add(new)
    run(sched, sched.schedule(decode_tokens=1))  # both prefilled: 8 tokens each
    run(sched, sched.schedule(decode_tokens=1))  # 9 tokens each: positions 0-7 in 2 blocks
    step = sched.schedule(decode_tokens=1)  # the old one needs a 3rd block: the new one goes
    assert step.decode == [old] and step.preempted == [new]
    assert new.status is SeqStatus.WAITING and new.num_computed == 0 and sched.waiting[0] is new
    assert new.num_prefill == len(new.token_ids) - 1  # prompt + generated, the last token aside
    sched.finish(old)
    step = sched.schedule(decode_tokens=1)
    assert step.prefill == [(new, 8)] and step.decode == []


def test_many_requests_on_a_small_cache_all_finish():
    """Preemption and recompute never leave a step empty while requests are unfinished."""
    sched, _ = make(num_blocks=8, max_tokens=16)  # 32 tokens of KV
    seqs = [seq(i, 3 + 2 * i, max_tokens=12) for i in range(6)]
    for s in seqs:
        sched.add(s)
    for _ in range(300):
        if not sched.num_unfinished:
            break
        step = sched.schedule(decode_tokens=3)
        assert not step.empty
        run(sched, step)
        for s in list(sched.running):
            if s.num_generated >= s.params.max_tokens:
                sched.finish(s)
    assert sched.num_unfinished == 0 and sched.num_preemptions > 0
    assert all(s.num_generated == 12 for s in seqs)


def test_short_prompt_is_not_queued_behind_a_long_one():
    sched, _ = make(num_blocks=64, max_tokens=40)
    long, short = seq(0, 200), seq(1, 8)
    sched.add(long)
    run(sched, sched.schedule(decode_tokens=1))
    sched.add(short)
    step = sched.schedule(decode_tokens=1)
    assert step.prefill == [(short, 8), (long, 32)]


def test_while_decoding_a_long_prompt_advances_by_bounded_chunks():
    """A decoder's next token waits for at most one bounded chunk of a long prompt; short
    prompts are still taken whole."""
    sched, _ = make(num_blocks=256, max_tokens=512, chunk=64, max_seqs=8)
    d, long, short = seq(0, 4), seq(1, 500), seq(2, 40)
    sched.add(d)
    run(sched, sched.schedule(decode_tokens=1))  # d decodes from now on
    sched.add(long)
    sched.add(short)
    step = sched.schedule(decode_tokens=1)
    assert step.decode == [d] and step.prefill == [(short, 40), (long, 64)]


def test_decoding_sequences_do_not_starve_a_prompt():
    sched, _ = make(num_blocks=64, max_tokens=40, max_seqs=8)
    decoders = [seq(i, 2) for i in range(3)]
    for d in decoders:
        sched.add(d)
    run(sched, sched.schedule(decode_tokens=17))
    sched.add(seq(9, 50))
    step = sched.schedule(decode_tokens=17)  # 3 * 17 > 40 tokens of budget
    assert len(step.decode) == 3
    assert step.prefill and step.prefill[0][1] > 0


def test_draft_room_is_reserved_only_from_free_blocks():
    sched, cache = make(num_blocks=3)  # 12 tokens
    d = seq(0, 7)
    sched.add(d)
    run(sched, sched.schedule(decode_tokens=17))
    step = sched.schedule(decode_tokens=17)
    assert step.decode == [d] and d.kv_budget == 12  # 9 needed + 3 of draft room, not 16


def test_queue_is_bounded_beyond_the_free_slots():
    sched, _ = make(max_queue=2, max_seqs=1)
    sched.add(seq(0, 2))  # takes the free slot at the next step: not queued in earnest
    sched.add(seq(1, 2))
    sched.add(seq(2, 2))
    with pytest.raises(QueueFullError):
        sched.add(seq(3, 2))
    sched.schedule(decode_tokens=1)
    assert len(sched.running) == 1 and len(sched.waiting) == 2


def test_finish_frees_the_cache():
    sched, cache = make(num_blocks=4)
    a = seq(0, 10)
    sched.add(a)
    sched.schedule(decode_tokens=1)
    sched.finish(a)
    assert cache.num_free_blocks == 4
    assert a.status is SeqStatus.FINISHED
    assert sched.num_unfinished == 0


def test_per_sequence_overhead_blocks_are_budgeted_in_admission():
    """Memory a sequence holds beyond its K/V (a hybrid model's state and checkpoints) is
    taken from the same pool at admission and given back when it finishes."""
    sched, cache = make(num_blocks=8, block_size=4)
    cache.seq_overhead_blocks = 3
    a, b, c = seq(0, 3), seq(1, 3), seq(2, 3)  # 4 tokens: 1 block each + 3 overhead
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule(decode_tokens=1)
    assert [s.seq_id for s, _ in step.prefill] == [0, 1]  # 2 x (1 + 3) blocks = all 8
    assert c.status is SeqStatus.WAITING and cache.num_free_blocks == 8 - 2 * 4
    sched.finish(a)
    assert cache.num_free_blocks == 4  # its token block and its overhead came back


def test_request_whose_overhead_cannot_fit_is_refused_naming_it():
    sched, cache = make(num_blocks=4, block_size=4)
    cache.seq_overhead_blocks = 4
    with pytest.raises(ValueError, match="for its state"):
        sched.add(seq(0, 3))
