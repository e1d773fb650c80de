"""A step's captured target features: fused once per step, handed to each sequence as views,
and joined into the sequence's own tensors before they keep many steps' tensors alive."""
import torch

from speculant.speculators.base import CommittedTokens, StepFeatures
from speculant.speculators.feature_drafter import MAX_FEATURE_PARTS, _SeqState

HIDDEN = 6


def step_of(num_rows: int, layers=(1, 4, 7), seed: int = 0) -> StepFeatures:
    g = torch.Generator().manual_seed(seed)
    return StepFeatures({i: torch.randn(num_rows, HIDDEN, generator=g) for i in layers})


def test_each_sequence_reads_its_rows_of_one_fused_tensor_per_step():
    step = step_of(5)
    a = CommittedTokens(0, 10, [3, 4], 5, step, feature_row=0)  # rows 0-1 of the step
    b = CommittedTokens(1, 20, [6, 7, 8], 9, step, feature_row=2)  # rows 2-4
    layers = (7, 1)  # the drafter's order, not the capture order
    fa, fb = a.features(layers), b.features(layers)
    assert fa.shape == (2, 2 * HIDDEN) and fb.shape == (3, 2 * HIDDEN)
    assert torch.equal(fb, torch.cat([step.by_layer[7][2:5], step.by_layer[1][2:5]], dim=-1))
    assert torch.equal(fa[:, HIDDEN:], a.hidden_states[1])
    # one concatenation for the step, shared by both sequences (views of it)
    assert list(step._fused) == [layers]
    fused = step.fused(layers)
    assert fa.data_ptr() == fused.data_ptr() and fb.data_ptr() == fused[2].data_ptr()


def test_a_dict_of_layers_is_the_features_of_these_tokens_alone():
    feats = {3: torch.arange(12.0).reshape(2, HIDDEN)}
    c = CommittedTokens(0, 0, [1, 2], 3, feats)
    assert isinstance(c.step_features, StepFeatures) and c.feature_row == 0
    assert torch.equal(c.hidden_states[3], feats[3])
    assert CommittedTokens(0, 0, [1], 2).hidden_states is None


def test_waiting_views_are_joined_into_the_sequences_own_tensor():
    state = _SeqState()
    steps = [step_of(4, seed=s) for s in range(MAX_FEATURE_PARTS + 3)]
    rows = [st.fused((1, 4))[1:2] for st in steps]  # the sequence is row 1 of every step
    for r in rows[:MAX_FEATURE_PARTS]:
        state.add_features(r)
    assert state.num_views == MAX_FEATURE_PARTS  # still views of their steps
    state.add_features(rows[MAX_FEATURE_PARTS])
    assert state.num_views == 0 and len(state.feature_parts) == 1
    block = state.feature_parts[0]
    steps_storage = {st.fused((1, 4)).untyped_storage().data_ptr() for st in steps}
    assert block.untyped_storage().data_ptr() not in steps_storage  # releases the steps
    for r in rows[MAX_FEATURE_PARTS + 1:]:
        state.add_features(r)
    assert state.num_views == 2
    assert torch.equal(state.features(), torch.cat(rows))
    state.drop_features(5)
    assert torch.equal(state.features(), torch.cat(rows)[5:]) and state.num_views == 0
    state.clear_features()
    assert state.feature_parts == [] and state.num_views == 0
