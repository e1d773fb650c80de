"""Weights and KV caches copied to (or allocated on) a huge-page arena: same values, same
shapes, every holder of a tensor sees the move, and SPECULANT_HUGE_PAGES=0 leaves them alone."""
from __future__ import annotations

import pytest
import torch

from speculant.kernels.huge_pages import (HUGE_PAGE_BYTES, empty_on_huge_pages, huge_page_arena,
                                          huge_pages_wanted, move_to_huge_pages)

needs_huge_pages = pytest.mark.skipif(not huge_pages_wanted(), reason="no MADV_HUGEPAGE here")


@needs_huge_pages
def test_arena_starts_on_a_huge_page():
    arena = huge_page_arena(3 * HUGE_PAGE_BYTES + 5)
    assert arena.data_ptr() % HUGE_PAGE_BYTES == 0
    assert arena.numel() == 3 * HUGE_PAGE_BYTES + 5
    arena.fill_(7)  # writable, every byte
    assert int(arena.sum()) == 7 * arena.numel()


@needs_huge_pages
def test_move_keeps_values_and_repoints_every_holder():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, 3, generator=g)
    b = torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g)
    c = torch.randn(8, 8, generator=g).half()
    strided = torch.randn(6, 4, generator=g).t()  # not contiguous: stays where it is
    before = [t.clone() for t in (a, b, c, strided)]
    holder = {"a": a}  # another reference to the same tensor object
    old = a.data_ptr(), strided.data_ptr()
    moved = move_to_huge_pages([a, b, c, None, a, strided])  # `a` twice (tied weights)
    assert moved == sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in (a, b, c))
    assert a.data_ptr() != old[0] and a.data_ptr() % HUGE_PAGE_BYTES == 0
    assert strided.data_ptr() == old[1]
    for t, ref in zip((a, b, c, strided), before):
        assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref)
    assert holder["a"].data_ptr() == a.data_ptr()
    for t in (b, c):
        assert t.data_ptr() % 64 == 0
    a.add_(1.0)  # the copies do not overlap
    assert torch.equal(b, before[1]) and torch.equal(c, before[2])


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECULANT_HUGE_PAGES", "0")
    assert not huge_pages_wanted()
    t = torch.arange(10.0)
    ptr = t.data_ptr()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr
    k, v = empty_on_huge_pages([(2, 3), (4,)], torch.float16)
    assert k.shape == (2, 3) and v.shape == (4,) and k.dtype == torch.float16


@needs_huge_pages
def test_empty_on_huge_pages_gives_separate_tensors_of_the_shapes_asked():
    shapes = [(5, 3, 64, 16), (5, 16, 3, 64), (1,), (7, 9)]
    ts = empty_on_huge_pages(shapes, torch.float16)
    assert [tuple(t.shape) for t in ts] == shapes
    assert all(t.dtype == torch.float16 and t.is_contiguous() for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for i, t in enumerate(ts):
        t.fill_(float(i))
    for i, t in enumerate(ts):
        assert bool((t == float(i)).all()), f"tensor {i} was overwritten by a neighbour"


def test_model_and_cache_still_decode_the_same_text(monkeypatch):
    """The default model's greedy text with its weights and KV cache on the arena equals the
    text with both left on torch's allocations."""
    from speculant.llm import LLM
    from speculant.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = "List three prime numbers and say why each is prime."
    texts = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("SPECULANT_HUGE_PAGES", setting)
        llm = LLM(num_threads=2)
        assert (llm.engine.model.huge_page_bytes > 0) == (setting == "1" and huge_pages_wanted())
        texts[setting] = llm.generate([llm.chat_prompt([prompt])], params)[0].token_ids
    assert texts["1"] == texts["0"]

