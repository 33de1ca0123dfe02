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


# Every mesh a case builds leaves its gloo groups' threads in the rank (torch's caches may still use the
# groups, so they are not destroyed); past this many threads per rank a pool is replaced by a fresh one
# (seconds to start) rather than slowing every later case.
THREAD_LIMIT = 400


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 300.0, **kwargs):
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


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
