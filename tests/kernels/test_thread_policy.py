"""The `speculant` command puts the kernels on their own thread pool, unless the user chose."""
import os
import subprocess
import sys

import pytest

from speculant.kernels.native import native_available
from speculant.kernels.thread_policy import prefer_kernel_pool


def test_sets_passive_wait_policy_before_torch_loads():
    env = {"PATH": "/bin"}
    assert prefer_kernel_pool(env, {"json": object()}) is True
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "passive"}


@pytest.mark.parametrize("env, modules", [
    ({"OMP_WAIT_POLICY": "active"}, {}),     # the user's choice stands
    ({"SPECULANT_POOL": "0"}, {}),           # torch's OpenMP threads asked for
    ({}, {"torch": object()}),               # libgomp has read the environment already
])
def test_leaves_the_environment_alone_when_the_user_chose_or_torch_is_loaded(env, modules):
    before = dict(env)
    assert prefer_kernel_pool(env, modules) is False
    assert env == before


def _cli_threads(env_update: dict) -> list[str]:
    """OMP_WAIT_POLICY and the kernels' thread team in a fresh process that imports the CLI."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "SPECULANT_POOL")}
    env.update(env_update)
    code = ("import os, speculant.cli.main\n"
            "from speculant.kernels.native import thread_team\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), thread_team())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not native_available(), reason="native kernels unavailable")
def test_the_cli_runs_the_kernels_on_their_pool_unless_told_otherwise():
    assert _cli_threads({}) == ["passive", "pool"]
    assert _cli_threads({"OMP_WAIT_POLICY": "active"}) == ["active", "openmp"]
    assert _cli_threads({"SPECULANT_POOL": "0"}) == ["None", "openmp"]


_WARM_SCRIPT = r"""
import torch
torch.set_num_threads(2)
from speculant.kernels import PackedLinear, native_available
from speculant.kernels.native import warm_in_background
assert native_available()
gen = torch.Generator().manual_seed(0)
lin = PackedLinear.from_float(torch.randn(640, 1024, generator=gen), "Q4_1")
xs = [torch.randn(n, 1024, generator=gen) for n in (1, 3, 17)]
refs = [lin(x) for x in xs]  # before any warm
weights = [torch.randn(1 << 18, generator=gen) for _ in range(6)]  # 6 MB to read
started = []
for i in range(300):
    started.append(warm_in_background(weights))
    if i % 5 == 0:
        started.append(warm_in_background(weights[::-1]))  # a warm ends the one under way
    x, ref = xs[i % 3], refs[i % 3]
    assert torch.equal(lin(x), ref), i  # a kernel call ends what is left of the warm
print(all(started), warm_in_background([]))
try:
    warm_in_background([torch.randn(8, 8).t()])
except RuntimeError as e:
    print("refused:", "contiguous" in str(e))
torch.set_num_threads(1)
print(warm_in_background(weights))
"""


@pytest.mark.skipif(not native_available(), reason="native kernels unavailable")
def test_the_pool_warms_memory_in_the_background_without_changing_a_result():
    """`warm_in_background` starts the pool's worker reading memory and returns: kernel calls
    made while it runs end it and give bit for bit what they gave before; a second warm ends
    the first; nothing is started with one thread, and a tensor it cannot read as one block of
    memory is refused by name."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",)}
    env["SPECULANT_POOL"] = "1"
    out = subprocess.run([sys.executable, "-c", _WARM_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["True False", "refused: True", "False"]
