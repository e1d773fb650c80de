"""Who runs in the next step: admission, fair prefill chunks within a token budget, and
preemption when the KV cache runs out.

Token budget (chunked prefill, as vLLM's): decoding sequences come first (1 + draft tokens
each), prompt chunks share what is left of `max_num_batched_tokens`, shortest remaining prompt
first, so a short request is never queued behind a long prompt. While any other sequence runs,
one prompt's chunk is at most `max_prefill_chunk_decoding` tokens (vLLM's long-prefill
threshold): a long prompt then slows every other sequence's next token by a bounded amount. A prompt
always gets at least `MIN_PREFILL_CHUNK` tokens, so decoders never starve it either.

KV cache (optimistic admission, as vLLM's): a request is admitted when its prompt fits the
free blocks, not the whole window its `max_tokens` might need. Every step reserves what each
running sequence writes (decode: its next position, plus draft room while blocks allow;
prefill: its chunk). When a decoding sequence cannot get its block, the newest running
sequence is *preempted*: its KV freed, it goes back to the front of the queue and is recomputed
(prompt + generated tokens prefilled again) once blocks free up. Its sampler and text state
are untouched, so its output is the one it gets alone; no running request ever fails because
another arrived.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from speculant.engine.kv_cache import KVCache
from speculant.engine.sequence import Sequence, SeqStatus


MIN_PREFILL_CHUNK = 32


class QueueFullError(RuntimeError):
    """Too many requests waiting; the caller should retry later (HTTP 429/503)."""


@dataclass(slots=True)
class ScheduledStep:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, num tokens)
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 max_queue: int, max_prefill_chunk_decoding: int | None = None):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk_decoding = max_prefill_chunk_decoding or max_num_batched_tokens
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if self.cache.admission_blocks(seq.num_prompt + 1) > self.cache.num_blocks:
            overhead = self.cache.seq_overhead_blocks * self.cache.block_size
            raise ValueError(
                f"prompt of {seq.num_prompt} tokens needs {seq.num_prompt + 1} KV tokens"
                + (f" plus {overhead} tokens' worth for its state" if overhead else "")
                + f"; the cache holds {self.cache.capacity_tokens}")
        # Requests that free slots will take at the next step are not queued in earnest.
        free_slots = max(0, self.max_num_seqs - len(self.running))
        if len(self.waiting) - free_slots >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting; retry later")
        self.waiting.append(seq)

    def schedule(self, decode_tokens: int, preempted: list[Sequence] | None = None) -> ScheduledStep:
        """`decode_tokens`: budget each decoding sequence may use (1 + its draft limit)."""
        step = ScheduledStep(preempted=preempted or [])
        # 1) every decoding sequence gets its next position, preempting the newest if needed
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq in self.running and self._reserve(seq, len(seq.token_ids), step):
                step.decode.append(seq)
        # 2) admit waiting requests whose prompt fits the free blocks now
        self._admit(step)
        # 3) prompt chunks, shortest remaining first, within the step's token budget
        budget = max(self.max_num_batched_tokens - decode_tokens * len(step.decode),
                     MIN_PREFILL_CHUNK)
        shared = len(self.running) > 1  # a lone prompt takes the whole budget
        chunk = self.max_prefill_chunk_decoding if shared else budget
        for seq in sorted((s for s in self.running if s.is_prefilling),
                          key=lambda s: s.num_prefill - s.num_computed):
            n = min(seq.num_prefill - seq.num_computed, budget, chunk, self._room(seq))
            if n > 0:
                self.cache.reserve(seq.seq_id, seq.num_computed + n)
                step.prefill.append((seq, n))
                budget -= n
        # 4) draft room for decoders, from the blocks nobody needs this step
        for seq in step.decode:
            seq.kv_budget = len(seq.token_ids) + min(decode_tokens - 1, self._room(seq))
            self.cache.reserve(seq.seq_id, seq.kv_budget)
        if step.empty and self.running:  # every running prompt is stuck on a full cache
            self._preempt(self.running[-1], step)
            return self.schedule(decode_tokens, step.preempted)
        return step

    def _reserve(self, seq: Sequence, length: int, step: ScheduledStep) -> bool:
        """Reserve KV for positions [0, length) of `seq`, preempting the newest running
        sequences until it fits; False if `seq` itself had to go."""
        while not self.cache.can_grow(seq.seq_id, length):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        self.cache.reserve(seq.seq_id, length)
        seq.kv_budget = length
        return True

    def _room(self, seq: Sequence) -> int:
        """Positions `seq` can grow by (beyond what it computed) with its own and free blocks."""
        have = len(self.cache.block_table(seq.seq_id)) + self.cache.num_free_blocks
        return have * self.cache.block_size - max(seq.num_computed, seq.kv_budget)

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        if seq in step.decode:
            step.decode.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.kv_budget = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)  # resumed before any new request
        self.num_preemptions += 1
        step.preempted.append(seq)

    def _admit(self, step: ScheduledStep) -> None:
        # Free blocks that running prompts will take before they finish are not free.
        free = self.cache.num_free_blocks - sum(
            self._blocks_to_finish_prompt(s) for s in self.running if s.is_prefilling)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in step.preempted:  # not back in the step that took its blocks away
                return
            need = self.cache.admission_blocks(seq.num_prefill + 1)
            if need > free:
                return
            free -= need
            self.waiting.popleft()
            self.cache.allocate(seq.seq_id)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _blocks_to_finish_prompt(self, seq: Sequence) -> int:
        have = len(self.cache.block_table(seq.seq_id))
        return max(0, self.cache.blocks_needed(seq.num_prefill + 1) - have)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence (finished, aborted or failed) and everything it held."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
