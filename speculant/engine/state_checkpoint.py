"""Rolling back recurrent state after a speculative round (the seeds' speculative checkpoints).

A *round* is one verification forward of a sequence's rows `[last, d1..dk]`; verification
keeps the first `num_kept` = 1 + accepted rows and rejects the rest. K/V rows roll back by
length (`KVCache.truncate`), but a recurrent layer (conv window, DeltaNet state) holds only the
state after its last row, which has seen the rejected drafts. Two ways back, as in llama.cpp /
ik_llama.cpp (`--spec-ckpt-mode`) and vLLM (one state slot per speculative token):

- **per_step**: the round's forward keeps the state after every row (`StateBatch.keep_steps`,
  returned as `StepStates`); keeping `num_kept` rows selects step `num_kept - 1`, no
  recompute. Memory: one state per verified row while the round is open.
- **reeval** (checkpoint + re-evaluation): the state is saved before the round; on partial
  acceptance it is restored and the caller re-runs the kept rows (a shorter forward, KV rows
  rewritten with the same values). Memory: one saved state.

Short-conv layers are restored with their conv window too (a bug llama.cpp users hit when only
the recurrent state was snapshotted): `SeqState` holds both. The sampler's own state (penalty
history, RNG) is the engine's to save beside this.
"""
from __future__ import annotations

from speculant.engine.state_cache import SeqState, StateCache, StepStates

CKPT_MODES = ("per_step", "reeval")


def checkpoint_bytes_per_seq(mode: str, state_bytes: int, max_rows: int) -> int:
    """Bytes a sequence's open round holds beyond its live state: `max_rows` (= 1 + the longest
    draft) step states for per_step, one saved state for reeval. Admission adds this to the
    live state (`StateCache.bytes_per_seq`) for every sequence that may speculate."""
    if mode == "per_step":
        return max_rows * state_bytes
    if mode == "reeval":
        return state_bytes
    raise ValueError(f"unknown checkpoint mode {mode!r}; expected one of {CKPT_MODES}")


def resolve_mode(mode: str, state_bytes: int, max_rows: int, max_seqs: int,
                 budget_bytes: int) -> str:
    """`auto`: per_step (no recompute) when every sequence's step states fit the budget,
    else reeval (one state each, paying a re-run of the kept rows on partial acceptance)."""
    if mode in CKPT_MODES:
        return mode
    if mode != "auto":
        raise ValueError(f"unknown checkpoint mode {mode!r}; expected auto or one of {CKPT_MODES}")
    per_step = max_seqs * checkpoint_bytes_per_seq("per_step", state_bytes, max_rows)
    return "per_step" if per_step <= budget_bytes else "reeval"


class StateCheckpoints:
    """Open rounds of a state cache's sequences, in one mode. Lifecycle per round:
    `begin(seq)` before the forward, the forward (with `keep_steps` = `stepping()`), then
    `end(seq, num_kept, num_rows, steps)`; `discard(seq)` when a sequence stops mid-round."""

    def __init__(self, states: StateCache, mode: str):
        if mode not in CKPT_MODES:
            raise ValueError(f"unknown checkpoint mode {mode!r}; expected one of {CKPT_MODES}")
        self.states = states
        self.mode = mode
        self._saved: dict[int, SeqState | None] = {}  # open rounds (reeval: the saved state)

    def bytes_per_seq(self, max_rows: int) -> int:
        return checkpoint_bytes_per_seq(self.mode, self.states.bytes_per_seq, max_rows)

    def begin(self, seq_id: int) -> None:
        if seq_id in self._saved:
            raise ValueError(f"state checkpoint: sequence {seq_id} already has an open round")
        self._saved[seq_id] = self.states.read(seq_id) if self.mode == "reeval" else None

    def stepping(self) -> set[int]:
        """Sequences whose next forward must keep the state after every row."""
        return set(self._saved) if self.mode == "per_step" else set()

    def end(self, seq_id: int, num_kept: int, num_rows: int, steps: StepStates | None) -> int:
        """Leave the sequence's state as after the first `num_kept` of the round's `num_rows`
        rows. Returns how many of those rows the caller must re-run from the restored state
        (their tokens, at their positions, without logits): 0 unless reeval rolled back."""
        if seq_id not in self._saved:
            raise ValueError(f"state checkpoint: sequence {seq_id} has no open round")
        if not 0 <= num_kept <= num_rows:
            raise ValueError(f"state checkpoint: sequence {seq_id} keeps {num_kept} of "
                             f"{num_rows} rows")
        saved = self._saved.pop(seq_id)
        if num_kept == num_rows:  # all accepted: the live state is already right
            return 0
        if self.mode == "reeval":
            self.states.write(seq_id, saved)
            return num_kept
        if num_kept == 0 or steps is None or steps.num_steps != num_rows:
            raise ValueError(f"state checkpoint: sequence {seq_id} needs the states of its "
                             f"{num_rows} rows and at least one kept row (per_step)")
        self.states.write(seq_id, steps.step(num_kept - 1))
        return 0

    def discard(self, seq_id: int) -> None:
        self._saved.pop(seq_id, None)

    def is_open(self, seq_id: int) -> bool:
        return seq_id in self._saved
