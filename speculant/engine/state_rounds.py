"""What an engine step does for a hybrid model's recurrent state, around the one target forward.

  1) `forward`: open a checkpoint round for every sequence verifying a draft (reeval saves its
     state), run the forward with each chunk's state slot, keeping per-row states for the
     rounds that want them (per_step);
  2) the engine verifies and commits as for any model: the KV cache keeps `num_kept` rows;
  3) `settle`: every round ends with the state of its kept rows (`StateCheckpoints.end`);
     rounds that reeval rolled back re-run their kept rows in one extra forward, without logits.

The number of kept rows is read from the KV cache's committed length, so the engine's commit
code needs no hook; a sequence that finished or failed in between has freed its slot and its
round is dropped.
"""
from __future__ import annotations

from speculant.engine.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from speculant.engine.state_cache import HybridCache
from speculant.engine.state_checkpoint import StateCheckpoints, resolve_mode

# auto: per_step when every sequence's step states fit in this share of the KV cache's bytes
AUTO_BUDGET_SHARE = 0.25


class StateRounds:
    def __init__(self, model, cache: HybridCache, mode: str, max_rows: int, max_seqs: int):
        kv_bytes = sum(t.nbytes for t in (*cache.k, *cache.v))
        self.mode = resolve_mode(mode, cache.states.bytes_per_seq, max_rows, max_seqs,
                                 int(AUTO_BUDGET_SHARE * kv_bytes))
        self.model = model
        self.cache = cache
        self.checkpoints = StateCheckpoints(cache.states, self.mode)
        # admission budgets each sequence's live state and checkpoints like KV blocks
        state_bytes = cache.states.bytes_per_seq + self.checkpoints.bytes_per_seq(max_rows)
        cache.seq_overhead_blocks = -(-state_bytes // cache.block_bytes)
        self._rounds: list[SeqChunk] = []  # verification chunks with an open round
        self._steps: dict = {}  # seq_id -> StepStates of the last forward (per_step)
        self.num_reruns = 0  # rounds that re-ran their kept rows (reeval)
        self.num_rerun_tokens = 0

    def forward(self, batch: ForwardBatch, chunks: list[SeqChunk], drafted: set[int]):
        """The step's forward; `drafted`: sequences whose chunk is `[last, draft...]`."""
        self._rounds = [c for c in chunks if c.seq_id in drafted]
        for chunk in self._rounds:
            self.checkpoints.begin(chunk.seq_id)
        try:
            states = self.cache.states.batch([c.seq_id for c in chunks],
                                             self.checkpoints.stepping())
            out = self.model.forward(batch, self.cache, states)
        except Exception:
            self._drop_rounds()
            raise
        self._steps = out.step_states
        return out

    def settle(self) -> None:
        """After the commit: each round's state as after its kept rows; reeval re-runs."""
        rerun = []
        for chunk in self._rounds:
            seq_id = chunk.seq_id
            if not self.cache.has(seq_id):  # finished or failed during the commit
                self.checkpoints.discard(seq_id)
                continue
            num_kept = self.cache.length(seq_id) - chunk.start_pos
            n = self.checkpoints.end(seq_id, num_kept, len(chunk.token_ids),
                                     self._steps.get(seq_id))
            if n:
                rerun.append(SeqChunk(seq_id, chunk.start_pos, chunk.token_ids[:n], 0))
        self._rounds, self._steps = [], {}
        if rerun:
            self._rerun(rerun)

    def _rerun(self, chunks: list[SeqChunk]) -> None:
        # the kept rows' K/V are rewritten with the values they already hold; only the
        # recurrent state changes
        batch = build_forward_batch(self.cache, chunks, self.model.device)
        self.model.forward(batch, self.cache,
                           self.cache.states.batch([c.seq_id for c in chunks]))
        self.num_reruns += len(chunks)
        self.num_rerun_tokens += sum(len(c.token_ids) for c in chunks)

    def _drop_rounds(self) -> None:
        for chunk in self._rounds:
            self.checkpoints.discard(chunk.seq_id)
        self._rounds, self._steps = [], {}
