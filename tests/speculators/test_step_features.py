"""A step's captured target features: fused once per step for the sequences that read them,
kept by the others as references to their rows, and joined into the sequence's own tensors
before they keep many steps' tensors alive."""
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


def test_waiting_rows_are_references_joined_into_the_sequences_own_tensor():
    layers = (1, 4)
    state = _SeqState(layers=layers)
    steps = [step_of(4, seed=s) for s in range(MAX_FEATURE_PARTS + 3)]
    want = torch.cat([torch.cat([st.by_layer[i][1:2] for i in layers], dim=-1) for st in steps])
    for st in steps[:MAX_FEATURE_PARTS]:
        state.add_features(st, 1, 1)  # the sequence is row 1 of every step
    assert state.num_views == MAX_FEATURE_PARTS  # still references to their steps
    assert all(st._fused == {} for st in steps)  # nothing fused for a sequence not read
    state.add_features(steps[MAX_FEATURE_PARTS], 1, 1)
    assert state.num_views == 0 and len(state.feature_parts) == 1
    block = state.feature_parts[0]
    steps_storage = {t.untyped_storage().data_ptr() for st in steps for t in st.by_layer.values()}
    assert block.untyped_storage().data_ptr() not in steps_storage  # releases the steps
    assert torch.equal(block, want[:MAX_FEATURE_PARTS + 1])
    for st in steps[MAX_FEATURE_PARTS + 1:]:
        state.add_features(st, 1, 1)
    assert state.num_views == 2
    assert torch.equal(state.features(), want)
    state.drop_features(5)
    assert torch.equal(state.features(), want[5:]) and state.num_views == 0
    state.clear_features()
    assert state.feature_parts == [] and state.num_views == 0


def test_dropping_rows_narrows_references_without_fusing():
    layers = (4, 1)
    state = _SeqState(layers=layers)
    big, small = step_of(10, seed=1), step_of(3, seed=2)
    state.add_features(big, 2, 6)  # a prompt chunk's rows 2-7
    state.add_features(small, 0, 2)
    state.drop_features(3, 7)  # rows 5-7 of big, row 0 of small
    assert state.num_views == 2 and big._fused == {} and small._fused == {}
    fuse = lambda st, a, b: torch.cat([st.by_layer[i][a:b] for i in layers], dim=-1)
    assert torch.equal(state.features(), torch.cat([fuse(big, 5, 8), fuse(small, 0, 1)]))
    state.own_features()  # a tensor of its own, not a view of a bigger block
    own = state.feature_parts[0]
    assert own._base is None and own.untyped_storage().nbytes() == own.numel() * own.element_size()
    assert torch.equal(state.features(), torch.cat([fuse(big, 5, 8), fuse(small, 0, 1)]))
