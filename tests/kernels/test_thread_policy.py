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
