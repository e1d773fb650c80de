"""Per-sequence state of a hybrid model's recurrent layers, beside the paged KV cache.

A recurrent layer keeps only the state after its last token: unlike K/V rows, rejected draft
tokens cannot be dropped by lowering a length. This cache holds that state, one slot per
sequence, allocated and freed with the sequence; rollback goes through `state_checkpoint.py`.

Memory layout, per stateful layer l (`StateLayout`):
    conv[l]       [num_slots, channels, window]   the last `window` inputs of the layer's causal
                                                  conv, oldest first (LFM2 conv, DeltaNet q|k|v)
    recurrent[l]  [num_slots, heads, k_dim, v_dim] the gated DeltaNet state (DeltaNet layers only)
A slot is zeroed when allocated: a new sequence starts from the empty state whatever the slot
held before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculant.engine.kv_cache import KVCache


class StateCacheFullError(RuntimeError):
    """No free state slot; the caller should wait or refuse the request."""


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What each stateful layer keeps: the model says it, the cache allocates it."""

    conv: dict[int, tuple[int, int]]  # layer -> (channels, window)
    recurrent: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # -> (H, dk, dv)

    def __post_init__(self) -> None:
        for layer, shape in {**self.conv, **self.recurrent}.items():
            if any(d < 1 for d in shape):
                raise ValueError(f"state layout: layer {layer} has an empty state {shape}")
        orphans = set(self.recurrent) - set(self.conv)
        if orphans:
            raise ValueError(f"state layout: recurrent layers {sorted(orphans)} have no conv "
                             "window (every supported recurrent layer has one)")

    def numel_per_seq(self) -> int:
        conv = sum(c * w for c, w in self.conv.values())
        return conv + sum(h * k * v for h, k, v in self.recurrent.values())


@dataclass(slots=True)
class SeqState:
    """One sequence's state, all layers (a snapshot, or a view of one step of `StepStates`)."""

    conv: dict[int, torch.Tensor]  # layer -> [channels, window]
    recurrent: dict[int, torch.Tensor]  # layer -> [H, dk, dv]

    def clone(self) -> "SeqState":
        return SeqState({i: t.clone() for i, t in self.conv.items()},
                        {i: t.clone() for i, t in self.recurrent.items()})


@dataclass(slots=True)
class StepStates:
    """A chunk's state after each of its n rows, as the forward computed it."""

    conv: dict[int, torch.Tensor]  # layer -> [n, channels, window]
    recurrent: dict[int, torch.Tensor]  # layer -> [n, H, dk, dv]

    @property
    def num_steps(self) -> int:
        return next(iter(self.conv.values())).shape[0] if self.conv else 0

    def step(self, i: int) -> SeqState:
        """The state after row i (views, no copy)."""
        return SeqState({l: t[i] for l, t in self.conv.items()},
                        {l: t[i] for l, t in self.recurrent.items()})


@dataclass(slots=True)
class StateBatch:
    """Which state slot each chunk of a ForwardBatch reads and writes, and which chunks keep the
    state after every row (per-step snapshots of a speculative round)."""

    cache: "StateCache"
    seq_ids: list[int]  # [S]
    slots: list[int]  # [S]
    keep_steps: list[bool]  # [S]


class StateCache:
    def __init__(self, layout: StateLayout, num_slots: int, dtype: torch.dtype = torch.float32,
                 device="cpu", grow: bool = False):
        if num_slots < 1:
            raise ValueError(f"state cache needs num_slots >= 1, got {num_slots}")
        self.grow = grow  # when full, double the slots instead of refusing
        self.layout = layout
        self.num_slots = num_slots
        self.dtype = dtype
        self.conv = {l: torch.empty((num_slots, c, w), dtype=dtype, device=device)
                     for l, (c, w) in layout.conv.items()}
        self.recurrent = {l: torch.empty((num_slots, *shape), dtype=dtype, device=device)
                          for l, shape in layout.recurrent.items()}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._slots: dict[int, int] = {}

    # ---- accounting --------------------------------------------------------------------------

    @property
    def bytes_per_seq(self) -> int:
        """Bytes of one sequence's live state (a checkpoint of it costs the same)."""
        return self.layout.numel_per_seq() * self.dtype.itemsize

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._slots

    def slot(self, seq_id: int) -> int:
        if seq_id not in self._slots:
            raise KeyError(f"state cache: sequence {seq_id} is not allocated")
        return self._slots[seq_id]

    # ---- lifecycle ---------------------------------------------------------------------------

    def allocate(self, seq_id: int) -> int:
        if seq_id in self._slots:
            raise ValueError(f"state cache: sequence {seq_id} is already allocated")
        if not self._free_slots and self.grow:
            self._double()
        if not self._free_slots:
            raise StateCacheFullError(f"state cache full: {self.num_slots} slots in use, "
                                      f"sequence {seq_id} has none")
        slot = self._slots[seq_id] = self._free_slots.pop()
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[slot].zero_()
        return slot

    def free(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _double(self) -> None:
        # the engine may raise max_num_seqs at run time (`Engine.set_limits`)
        n = self.num_slots
        for tensors in (self.conv, self.recurrent):
            for l, t in tensors.items():
                tensors[l] = torch.cat([t, torch.empty_like(t)])
        self._free_slots = list(range(2 * n - 1, n - 1, -1)) + self._free_slots
        self.num_slots = 2 * n

    # ---- reading and writing a sequence's state ----------------------------------------------

    def read(self, seq_id: int) -> SeqState:
        """A copy of the sequence's state (a checkpoint)."""
        slot = self.slot(seq_id)
        return SeqState({l: t[slot].clone() for l, t in self.conv.items()},
                        {l: t[slot].clone() for l, t in self.recurrent.items()})

    def write(self, seq_id: int, state: SeqState) -> None:
        slot = self.slot(seq_id)
        for l, t in self.conv.items():
            t[slot].copy_(state.conv[l])
        for l, t in self.recurrent.items():
            t[slot].copy_(state.recurrent[l])

    def batch(self, seq_ids: list[int], keep_steps: set[int] | frozenset = frozenset()) -> StateBatch:
        """The state rows of a forward whose chunks belong to `seq_ids`, in chunk order. A
        sequence has at most one chunk per forward: two would both start from the same state."""
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(s for s in seq_ids if list(seq_ids).count(s) > 1)
            raise ValueError(f"state cache: sequence {dup} has two chunks in one forward")
        return StateBatch(self, list(seq_ids), [self.slot(s) for s in seq_ids],
                          [s in keep_steps for s in seq_ids])


class HybridCache(KVCache):
    """The paged KV cache of a hybrid model's attention layers, carrying its state cache
    (`states`): a sequence's state slot is allocated and freed with its KV, so admission,
    preemption and finishing (all in terms of the KV cache) keep both in step."""

    def __init__(self, *args, states: StateCache, **kwargs):
        super().__init__(*args, **kwargs)
        self.states = states

    def allocate(self, seq_id: int) -> None:
        super().allocate(seq_id)
        self.states.allocate(seq_id)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self.states.free(seq_id)
