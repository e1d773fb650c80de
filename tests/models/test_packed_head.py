"""Drafter heads with packed weights: every format runs the head's maths within its rounding,
the CPU default is the 4-bit one, and an unknown format is refused by name."""
import copy

import pytest
import torch

from speculant.kernels import native_available
from speculant.models.eagle3_head import Eagle3Head
from speculant.models.loader import load_model
from speculant.models.packed_head import (DEFAULT_CPU_HEAD_WEIGHTS, HEAD_WEIGHTS,
                                          PackedLinearModule, pack_linears,
                                          resolve_head_weights)

PACKED = [w for w in HEAD_WEIGHTS if w != "float32"]


@pytest.fixture(scope="module")
def float_head():
    target = load_model("default", "auto").config
    head = Eagle3Head.random(target, torch.arange(0, target.vocab_size, 7), seed=3).eval()
    with torch.no_grad():  # trained-head-like scales: logits spread over a few units
        head.lm_head.weight.mul_(8.0)
    return head


def logits_error(head, packed_head, hidden):
    """Relative error of the packed head's draft logits: ||packed - float|| / ||float||."""
    with torch.inference_mode():
        ref, got = head.draft_logits(hidden), packed_head.draft_logits(hidden)
    return float((got - ref).norm() / ref.norm())


@pytest.mark.skipif(not native_available(), reason="packed weights run on the native kernels")
def test_every_packed_format_runs_the_heads_maths_within_its_rounding(float_head):
    hidden = torch.randn(6, float_head.config.hidden_size, generator=torch.Generator().manual_seed(0))
    errors = {}
    for qtype in PACKED:
        packed = copy.deepcopy(float_head)
        count = pack_linears(packed, qtype)
        # fc, q/k/v/o, gate/up/down and the draft LM head
        assert count == 9, count
        assert isinstance(packed.lm_head, PackedLinearModule)
        errors[qtype] = logits_error(float_head, packed, hidden)
        with torch.inference_mode():
            top_ref = float_head.draft_logits(hidden).argmax(-1)
            top_got = packed.draft_logits(hidden).argmax(-1)
        assert (top_ref == top_got).float().mean() >= 0.5, (qtype, top_ref, top_got)
    assert errors["q8_0"] < 0.01, errors
    assert errors["q4_1"] < 0.15 and errors["q4_0"] < 0.15, errors
    assert errors["q8_0"] < errors["q4_1"], errors  # 8 bits round less than 4


def test_the_cpu_default_is_the_4_bit_format_and_other_devices_keep_floats():
    expected = DEFAULT_CPU_HEAD_WEIGHTS if native_available() else "float32"
    assert DEFAULT_CPU_HEAD_WEIGHTS == "q4_1"
    assert resolve_head_weights("auto", "cpu") == expected
    assert resolve_head_weights("auto", "cuda:0") == "float32"
    assert resolve_head_weights("q8_0", "cpu") == "q8_0"


def test_an_unknown_weight_format_is_refused_by_name():
    with pytest.raises(ValueError, match="'q5_k'"):
        resolve_head_weights("q5_k", "cpu")
