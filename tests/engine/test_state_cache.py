"""The state cache and its checkpoints: lifecycle, accounting, misuse (no model needed)."""
import pytest
import torch

from speculant.engine.state_cache import (SeqState, StateCache, StateCacheFullError, StateLayout,
                                          StepStates)
from speculant.engine.state_checkpoint import (StateCheckpoints, checkpoint_bytes_per_seq,
                                               resolve_mode)

# layer 0: a short conv (8 channels, window 2); layer 2: DeltaNet (conv 12 x 3, state 2 x 4 x 4)
LAYOUT = StateLayout(conv={0: (8, 2), 2: (12, 3)}, recurrent={2: (2, 4, 4)})
STATE_NUMEL = 8 * 2 + 12 * 3 + 2 * 4 * 4


def filled(seq_state: SeqState, value: float) -> SeqState:
    return SeqState({l: torch.full_like(t, value) for l, t in seq_state.conv.items()},
                    {l: torch.full_like(t, value) for l, t in seq_state.recurrent.items()})


def test_allocate_zeroes_a_slot_whatever_it_held():
    cache = StateCache(LAYOUT, num_slots=1)
    for t in (*cache.conv.values(), *cache.recurrent.values()):
        t.fill_(float("nan"))
    cache.allocate(7)
    state = cache.read(7)
    assert all(t.abs().sum() == 0 for t in (*state.conv.values(), *state.recurrent.values()))


def test_slots_are_reused_after_free_and_full_is_an_error_naming_the_sequence():
    cache = StateCache(LAYOUT, num_slots=2)
    cache.allocate(1)
    cache.allocate(2)
    with pytest.raises(StateCacheFullError, match="sequence 3"):
        cache.allocate(3)
    cache.free(1)
    cache.allocate(3)
    assert cache.num_free_slots == 0 and not cache.has(1)
    with pytest.raises(ValueError, match="sequence 3 is already allocated"):
        cache.allocate(3)
    with pytest.raises(KeyError, match="sequence 1"):
        cache.read(1)


def test_read_is_a_copy_and_write_restores_it():
    cache = StateCache(LAYOUT, num_slots=2)
    cache.allocate(0)
    saved = cache.read(0)
    cache.write(0, filled(saved, 3.0))
    assert cache.conv[2][cache.slot(0)].eq(3.0).all() and saved.conv[2].eq(0).all()
    cache.write(0, saved)
    assert cache.recurrent[2][cache.slot(0)].eq(0).all()


def test_a_sequence_twice_in_one_forward_is_refused():
    cache = StateCache(LAYOUT, num_slots=2)
    cache.allocate(0)
    with pytest.raises(ValueError, match="sequence 0 has two chunks"):
        cache.batch([0, 0])


def test_bytes_per_seq_and_per_checkpoint_mode():
    """Live state = its tensors' bytes; per_step holds one state per verified row, reeval one."""
    cache = StateCache(LAYOUT, num_slots=3)
    assert cache.bytes_per_seq == STATE_NUMEL * 4
    assert sum(t.nbytes for t in (*cache.conv.values(), *cache.recurrent.values())) == \
        3 * cache.bytes_per_seq
    assert checkpoint_bytes_per_seq("per_step", 100, max_rows=17) == 1700
    assert checkpoint_bytes_per_seq("reeval", 100, max_rows=17) == 100
    assert StateCheckpoints(cache, "per_step").bytes_per_seq(5) == 5 * cache.bytes_per_seq


@pytest.mark.parametrize("budget, expected", [(10**6, "per_step"), (1000, "reeval")])
def test_auto_mode_picks_per_step_when_its_memory_fits(budget, expected):
    # 8 sequences x 17 rows x 100 bytes = 13,600 bytes of step states
    assert resolve_mode("auto", 100, max_rows=17, max_seqs=8, budget_bytes=budget) == expected
    assert resolve_mode("reeval", 100, 17, 8, 10**9) == "reeval"
    with pytest.raises(ValueError, match="'sometimes'"):
        resolve_mode("sometimes", 100, 17, 8, 10**9)


def test_reeval_restores_the_saved_state_and_asks_for_the_kept_rows():
    cache = StateCache(LAYOUT, num_slots=1)
    cache.allocate(0)
    ckpt = StateCheckpoints(cache, "reeval")
    ckpt.begin(0)
    assert ckpt.stepping() == set()
    cache.write(0, filled(cache.read(0), 5.0))  # what the round's forward left
    assert ckpt.end(0, num_kept=2, num_rows=4, steps=None) == 2
    assert cache.conv[0][0].eq(0).all()


def test_per_step_selects_the_kept_rows_state_without_recompute():
    cache = StateCache(LAYOUT, num_slots=1)
    cache.allocate(0)
    ckpt = StateCheckpoints(cache, "per_step")
    ckpt.begin(0)
    assert ckpt.stepping() == {0}
    base = cache.read(0)
    steps = StepStates({l: torch.stack([torch.full_like(t, j) for j in range(4)])
                        for l, t in base.conv.items()},
                       {l: torch.stack([torch.full_like(t, j) for j in range(4)])
                        for l, t in base.recurrent.items()})
    assert ckpt.end(0, num_kept=3, num_rows=4, steps=steps) == 0
    assert cache.recurrent[2][0].eq(2.0).all() and cache.conv[0][0].eq(2.0).all()


def test_all_rows_kept_leaves_the_live_state():
    cache = StateCache(LAYOUT, num_slots=1)
    cache.allocate(0)
    for mode in ("per_step", "reeval"):
        ckpt = StateCheckpoints(cache, mode)
        ckpt.begin(0)
        cache.write(0, filled(cache.read(0), 9.0))
        assert ckpt.end(0, num_kept=4, num_rows=4, steps=None) == 0
        assert cache.conv[2][0].eq(9.0).all()


def test_checkpoint_misuse_fails_loudly():
    cache = StateCache(LAYOUT, num_slots=1)
    cache.allocate(0)
    ckpt = StateCheckpoints(cache, "per_step")
    with pytest.raises(ValueError, match="sequence 0 has no open round"):
        ckpt.end(0, 1, 2, None)
    ckpt.begin(0)
    with pytest.raises(ValueError, match="already has an open round"):
        ckpt.begin(0)
    with pytest.raises(ValueError, match="needs the states of its 3 rows"):
        ckpt.end(0, 1, 3, None)
    ckpt.discard(0)
    assert not ckpt.is_open(0)
    with pytest.raises(ValueError, match="unknown checkpoint mode 'fast'"):
        StateCheckpoints(cache, "fast")


def test_layout_with_an_empty_or_orphan_state_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match="layer 4 has an empty state"):
        StateLayout(conv={4: (8, 0)})
    with pytest.raises(ValueError, match=r"recurrent layers \[5\] have no conv"):
        StateLayout(conv={}, recurrent={5: (1, 2, 2)})
