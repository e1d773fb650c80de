"""Methods run side by side in time: one engine per method, stepped in turns of a fraction of a
second, so that a machine whose speed drifts (turbo, other tenants: ±10% between two 8-second
runs of identical work on our 2-core VMs) slows every method alike.

Each engine decodes its own copy of the workload exactly as it would alone (same prompts, same
concurrency, its own speculators and tuner state); only the wall clock is shared. A method's time
is the sum of its own turns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

DEFAULT_TURN_SECONDS = 0.1  # a few decode steps; any turn of at least one step is exact


@dataclass(slots=True)
class InterleavedRun:
    wall_s: float  # the engine's own turns, summed
    seqs: list  # [Sequence], in prompt order
    num_turns: int


def run_interleaved(engines: list, prompts: list, params: list, turn_s: float = DEFAULT_TURN_SECONDS,
                    clock=time.perf_counter) -> list[InterleavedRun]:
    """Engine i decodes every prompt with `params[i]`; each turn steps one engine until `turn_s`
    has passed (at least one step), round robin, the order reversed every round so that no
    engine always follows the same one. The engines must be distinct objects."""
    if len({id(e) for e in engines}) != len(engines):
        raise ValueError("run_interleaved needs one engine per method")
    if len(params) != len(engines):
        raise ValueError(f"{len(engines)} engines but {len(params)} parameter sets")
    seqs = [[e.add_request(p, prm) for p in prompts] for e, prm in zip(engines, params)]
    wall, turns = [0.0] * len(engines), [0] * len(engines)
    order = list(range(len(engines)))
    while any(e.has_unfinished() for e in engines):
        for i in order:
            if engines[i].has_unfinished():
                wall[i] += _turn(engines[i], turn_s, clock)
                turns[i] += 1
        order.reverse()
    for e, own in zip(engines, seqs):
        for seq in own:
            e.release(seq)
    return [InterleavedRun(w, s, n) for w, s, n in zip(wall, seqs, turns)]


def _turn(engine, turn_s: float, clock) -> float:
    """Step `engine` for `turn_s` seconds (one step at least); the time it took."""
    t0 = clock()
    while True:
        engine.step()
        elapsed = clock() - t0
        if elapsed >= turn_s or not engine.has_unfinished():
            return elapsed
