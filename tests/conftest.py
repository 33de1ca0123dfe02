"""Shared fixtures: one pool of spawned gloo ranks per world size, reused by every test.

Test folders mirror seqmesh's packages (tests/attention, tests/sequence, tests/model, ...; tests/project
for what spans the project). The functions spawned ranks run live in the ``*_cases.py`` modules here at
the top, which every rank imports by module name.

Starting a rank costs seconds (importing torch); a pool starts once per session and runs many
cases. A case that fails or hangs on any rank ends its pool (so no rank waits forever) and the next
test that needs that world size starts a fresh one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import the case modules

from seqmesh.comm.launch import START_METHOD, WorkerPool  # noqa: E402
from trainer_cases import TORCHRUN_VARIABLES  # noqa: E402

# What nearly every rank imports (torch, seqmesh, transformers' model machinery and the families most cases build,
# the case modules): the fork server imports them once, in the background while pytest collects, and every rank
# of every pool starts with them (seqmesh.comm.launch); a spawned rank would take seconds to import them itself.
PRELOAD = [
    "torch", "torch.distributed", "seqmesh", "seqmesh.hf", "seqmesh.model.lm", "seqmesh.training.train",
    "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "dist_cases", "family_cases",
]


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """Starts the fork server inside the first test's capture, as a spawned rank inherits the output of the test that
    starts it: what ranks print is captured (shown with ``-s``), not written over pytest's report."""
    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()
    yield


# Every mesh a case builds leaves its gloo process groups in the rank: torch's caches of sharding plans compare meshes
# by layout and would hand a new mesh of the same shape the old groups, so they are not destroyed. A gloo group keeps
# a loop thread that wakes every 10 ms while it lives, idle or not: ranks that held up to 400 threads each (the old
# limit), idle pools included, kept the kernel busy a fifth of the suite's time (vmstat: 21% system time, 48,000
# context switches a second). A pool is replaced by a fresh one (under a second from the fork server) once a rank
# holds more than THREAD_LIMIT threads after a job (a fresh rank holds 6, a gloo group 3 more), and an idle pool
# once it holds more than IDLE_LIMIT when another world size runs.
THREAD_LIMIT = 100
IDLE_LIMIT = 40


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 300.0, **kwargs):
        for world, idle in self._pools.items():
            if world != world_size and idle.alive and idle.threads_held() > IDLE_LIMIT:
                idle.close()
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = WorkerPool(world_size, threads=1, collective_timeout=60.0)
        results = pool.run(fn, *args, timeout=timeout, **kwargs)
        if pool.threads_held() > THREAD_LIMIT:
            pool.close()
        return results

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(autouse=True)
def nothing_distributed_left():
    """A test that leaves a process group, or torchrun's variables, in pytest's own process fails here, by name: the
    tests after it in the process (which differ with the order pytest-xdist's workers take files in) would inherit
    them. Both are undone first."""
    before = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    yield
    import torch.distributed as dist

    left = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        left.append("a process group")
    changed = sorted(name for name, value in before.items() if os.environ.get(name) != value)
    for name in changed:
        if before[name] is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before[name]
    if changed:
        left.append(f"torchrun's variables {', '.join(changed)}")
    if left:
        pytest.fail(f"this test left {' and '.join(left)} in pytest's process (undone now); later tests would see it")


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
