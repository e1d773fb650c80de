"""Rolling a hybrid model back after a speculative round, in the style of llama.cpp's
test-recurrent-state-rollback: caches pre-filled with garbage, a round of n draft rows, keep
1..n+1 of them with each checkpoint mode, then compare with a reference that never saw the
rejected tokens."""
import sys
import os

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from hybrid_models import VOCAB, Runner, load_ours, save_hf_model  # noqa: E402

from speculant.engine.forward_batch import SeqChunk  # noqa: E402
from speculant.engine.state_checkpoint import CKPT_MODES, StateCheckpoints  # noqa: E402

NUM_DRAFT = 5  # rows per round: [last, d1..d5]


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_hf_model(folder, request.param, hidden=128, seed=3)
    return load_ours(folder)


def garbage_runner(model, num_slots: int) -> Runner:
    """Caches whose every entry starts as NaN: nothing may read a slot or row it did not write."""
    runner = Runner(model, num_blocks=64, num_slots=num_slots)
    for t in (*runner.kv.k, *runner.kv.v, *runner.states.conv.values(),
              *runner.states.recurrent.values()):
        t.fill_(float("nan"))
    return runner


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def speculative_round(runner: Runner, ckpt: StateCheckpoints, prompts, rounds, num_kept):
    """Every sequence i: prompt, then one round of rows `rounds[i]` keeping `num_kept[i]` rows
    (all sequences in one forward), then the rollback; returns nothing, leaves the caches."""
    seqs = range(len(prompts))
    for i in seqs:
        runner.add(i)
    runner.run([SeqChunk(i, 0, prompts[i], 1) for i in seqs])
    for i in seqs:
        ckpt.begin(i)
    out = runner.run([SeqChunk(i, len(prompts[i]), rounds[i], len(rounds[i])) for i in seqs],
                     keep_steps=ckpt.stepping())
    rerun = []
    for i in seqs:
        start = len(prompts[i])
        runner.kv.truncate(i, start + num_kept[i])
        n = ckpt.end(i, num_kept[i], len(rounds[i]), out.step_states.get(i))
        if n:
            rerun.append(SeqChunk(i, start, rounds[i][:n], 0))
    if rerun:
        runner.run(rerun)


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_rollback_by_1_to_n_tokens_equals_never_seeing_them(model, mode):
    """Sequence i keeps i + 1 of its 6 rows (rollback by 5..0 tokens); its state and the next
    token's logits equal a clean run over prompt + kept rows."""
    num_seqs = NUM_DRAFT + 1
    prompts = [tokens(9 + 7 * i, seed=i) for i in range(num_seqs)]
    rounds = [tokens(NUM_DRAFT + 1, seed=100 + i) for i in range(num_seqs)]
    num_kept = [i + 1 for i in range(num_seqs)]
    runner = garbage_runner(model, num_seqs)
    speculative_round(runner, StateCheckpoints(runner.states, mode), prompts, rounds, num_kept)
    nxt = tokens(num_seqs, seed=7)
    spec = runner.run([SeqChunk(i, len(prompts[i]) + num_kept[i], [nxt[i]], 1)
                       for i in range(num_seqs)]).logits
    for i in range(num_seqs):
        ref = garbage_runner(model, 1)
        ref.add(0)
        kept = prompts[i] + rounds[i][:num_kept[i]]
        ref_logits = ref.run([SeqChunk(0, 0, kept + [nxt[i]], 1)]).logits
        assert (spec[i] - ref_logits[0]).abs().max().item() < 1e-4, f"seq {i}"


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_rolled_back_state_equals_reference_state(model, mode):
    """After keeping 2 of 6 rows, every layer's conv window and recurrent state equal those of
    a clean run over prompt + 2 rows."""
    prompt, rows = tokens(20, seed=1), tokens(NUM_DRAFT + 1, seed=2)
    runner = garbage_runner(model, 1)
    speculative_round(runner, StateCheckpoints(runner.states, mode), [prompt], [rows], [2])
    ref = garbage_runner(model, 1)
    ref.add(0)
    ref.run([SeqChunk(0, 0, prompt + rows[:2], 1)])
    got, want = runner.states.read(0), ref.states.read(0)
    for layer in want.conv:
        assert torch.allclose(got.conv[layer], want.conv[layer], atol=1e-5), f"conv {layer}"
    for layer in want.recurrent:
        assert torch.allclose(got.recurrent[layer], want.recurrent[layer], atol=1e-5), layer


def test_per_step_snapshots_are_the_states_of_shorter_runs(model):
    """The state kept after row j of a round is the state a run ending at row j leaves."""
    prompt, rows = tokens(12, seed=4), tokens(4, seed=5)
    runner = garbage_runner(model, 1)
    runner.add(0)
    runner.run([SeqChunk(0, 0, prompt, 1)])
    steps = runner.run([SeqChunk(0, 12, rows, 4)], keep_steps={0}).step_states[0]
    for j in range(4):
        ref = garbage_runner(model, 1)
        ref.add(0)
        ref.run([SeqChunk(0, 0, prompt + rows[:j + 1], 1)])
        want = ref.states.read(0)
        for layer, t in want.conv.items():
            assert torch.allclose(steps.step(j).conv[layer], t, atol=1e-5)
        for layer, t in want.recurrent.items():
            assert torch.allclose(steps.step(j).recurrent[layer], t, atol=1e-5)
