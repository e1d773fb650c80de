"""Who runs in the next step: admission by KV promise, prefill chunking, decode batching.

A request is admitted only when the KV cache can promise it every token it may ever need
(prompt + max_tokens + draft headroom, capped by the context length). Admitted sequences then
never run out of cache mid-decode, so nothing is ever preempted and no running request fails
because another one arrived; requests that do not fit yet simply wait.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from speculant.kv_cache import KVCache
from speculant.sequence import Sequence, SeqStatus


MIN_PREFILL_CHUNK = 32


class QueueFullError(RuntimeError):
    """Too many requests waiting; the caller should retry later (HTTP 429/503)."""


@dataclass(slots=True)
class ScheduledStep:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, num tokens)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 max_queue: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._promised_blocks = 0

    def add(self, seq: Sequence) -> None:
        if self.cache.blocks_needed(seq.kv_budget) > self.cache.num_blocks:
            raise ValueError(
                f"request needs {seq.kv_budget} KV tokens (prompt {seq.num_prompt} + max_tokens "
                f"{seq.params.max_tokens}); the cache holds {self.cache.capacity_tokens}")
        # Requests that free slots will take at the next step are not queued in earnest.
        free_slots = max(0, self.max_num_seqs - len(self.running))
        if len(self.waiting) - free_slots >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting; retry later")
        self.waiting.append(seq)

    def schedule(self, decode_tokens: int) -> ScheduledStep:
        """`decode_tokens`: budget each decoding sequence may use (1 + its draft limit)."""
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if not seq.is_prefilling:
                step.decode.append(seq)
                budget -= decode_tokens
        self._admit()
        # Decoding sequences must never starve a prompt: it always gets a minimum chunk.
        budget = max(budget, MIN_PREFILL_CHUNK)
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                n = min(seq.num_prompt - seq.num_computed, budget)
                step.prefill.append((seq, n))
                budget -= n
        return step

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self.cache.blocks_needed(seq.kv_budget)
            if self._promised_blocks + need > self.cache.num_blocks:
                return
            self.waiting.popleft()
            self._promised_blocks += need
            self.cache.allocate(seq.seq_id)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence (finished, aborted or failed) and everything it held."""
        if seq in self.running:
            self.running.remove(seq)
            self._promised_blocks -= self.cache.blocks_needed(seq.kv_budget)
            self.cache.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
