"""Shared fixtures: one pool of spawned gloo ranks per world size, reused by every test.

Test folders mirror seqmesh's packages (tests/attention, tests/sequence, tests/model, ...; tests/project
for what spans the project). The functions spawned ranks run live in the ``*_cases.py`` modules here at
the top, which every rank imports by module name.

Starting a rank costs seconds (importing torch); a pool starts once per session and runs many
cases. A case that fails or hangs on any rank ends its pool (so no rank waits forever) and the next
test that needs that world size starts a fresh one.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.forkserver
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import the case modules

import suite_gc  # noqa: E402,F401  (the thresholds of this process's collector; the ranks' come from PRELOAD)
from seqmesh.comm.launch import START_METHOD, WorkerPool  # noqa: E402
from trainer_cases import TORCHRUN_VARIABLES  # noqa: E402

# One intra-op thread in each pytest-xdist worker and the processes it starts: the two workers already keep both
# cores busy, and torch's default of one thread per core would have each worker's operators compete with the other's
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

# seqmesh's Triton kernels run on this CPU under Triton's interpreter, which Triton reads when it is first imported:
# set here, before any test imports it, and inherited by every rank. A machine with a GPU runs them compiled.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# What nearly every rank imports (torch, seqmesh, transformers' model machinery and the families most cases build,
# the case modules): the fork server imports them once, in the background while pytest collects, and every rank
# of every pool starts with them (seqmesh.comm.launch); a spawned rank would take seconds to import them itself.
PRELOAD = [
    "suite_gc",  # first: the collector's thresholds (tests/suite_gc.py), inherited by every rank the server forks
    "torch", "torch.distributed", "seqmesh", "seqmesh.hf", "seqmesh.model.lm", "seqmesh.training.train",
    "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "dist_cases", "family_cases",
    # what the ranks of many tests import besides, each new rank again (a pool is replaced when its ranks hold many
    # groups): the Trainer with datasets (1.6 s), the loss curve's matplotlib at the end of every `seqmesh train` run
    # (0.6 s), torch.compile's aot_eager backend and inductor's (2.1 s)
    "seqmesh.trainer", "matplotlib.pyplot", "torch._dynamo.backends.debugging", "torch._inductor.compile_fx",
]


# The files that take longest, longest first, in seconds on two workers (a fresh clone's `make test` at 40f070a,
# 2026-12-01, docs/testing.md's ledger; every file of 20 s or more; memory and the measured planner after 2026-12-02's
# kept-attention cases, estimated): pytest-xdist runs them first, so the run does not
# end with one worker on a long file while the other idles (xdist's own order, most tests first, left the one-test
# census and example files to the end). The rest follow, most tests first. A stale figure only costs time, never a
# result.
SLOWEST_FILES = {
    "rehearsal/test_rehearse.py": 525, "planner/test_planner_measured.py": 340, "experts/test_expert_parallel.py": 242,
    "hf/test_compile.py": 177, "hf/test_family_census.py": 140, "training/test_watchdog.py": 118,
    "memory/test_memory.py": 85,
    "hf/test_indexed_attention.py": 105, "hf/test_own_attention.py": 101, "attention/test_flash_triton.py": 98,
    "training/test_train_job.py": 91, "inference/test_generate_cli.py": 91, "training/test_train_compile.py": 91,
    "linear_attention/test_chunk_loops_triton.py": 83, "inference/test_generate.py": 78, "hf/test_hf_trainer.py": 74,
    "tensor_parallel/test_tensor_parallel.py": 73, "hf/test_mamba.py": 70, "inference/test_extend.py": 61,
    "hf/test_compressed_attention.py": 57, "vision/test_vision_families.py": 55, "tools/test_selftest.py": 54,
    "model/test_head_census.py": 53, "model/test_materialize.py": 49, "hf/test_inkling2.py": 46,
    "hf/test_short_conv.py": 45, "planner/test_planner_traffic.py": 45, "bench/test_bench_families.py": 44,
    "attention/test_attention_variants.py": 42, "training/test_run_folder.py": 42, "hf/test_qsa_attention.py": 41,
    "experts/test_expert_checkpoints.py": 36, "hf/test_kda.py": 35, "hf/test_mamba2.py": 34,
    "linear_attention/test_linear_attention.py": 34, "hf/test_hf_async_ulysses.py": 33,
    "attention/test_compiled_attention.py": 32, "sequence/test_document_layout.py": 30,
    "attention/test_attention_dist.py": 29, "linear_attention/test_state_passing.py": 28, "hf/test_hf_families.py": 27,
    "project/test_example_checkpoint_roundtrip.py": 26, "training/test_run_safety.py": 26, "hf/test_inkling.py": 26,
    "model/test_export.py": 24, "hf/test_rwkv.py": 21,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's controller: keep the order the workers collect
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker, the files in SLOWEST_FILES first, longest first, then the others, most tests first
    (xdist's ``--dist loadfile`` hands files out in this order; every worker collects the same)."""
    if not hasattr(config, "workerinput"):
        return  # one process: the files in their own order
    here = os.path.dirname(__file__)
    files = [os.path.relpath(str(item.path), here) for item in items]
    count = collections.Counter(files)
    order = {f: (-SLOWEST_FILES.get(f, 0), -count[f], f) for f in count}
    items[:] = [item for _, _, item in sorted(zip(files, range(len(items)), items), key=lambda e: (order[e[0]], e[1]))]


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """Starts the fork server inside the first test's capture, as a spawned rank inherits the output of the test that
    starts it: what ranks print is captured (shown with ``-s``), not written over pytest's report."""
    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
        # Python 3.11's fork server does not apply the sys.path it is handed (CPython gh-117378, fixed in later 3.12
        # and 3.13 releases, not in 3.11's): the modules of PRELOAD that live here were not found there, and the
        # server passes over an ImportError in silence. It is started with this folder on PYTHONPATH, which its
        # ranks inherit (they import the case modules from here anyway)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PYTHONPATH", os.path.dirname(__file__), prepend=os.pathsep)
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


@pytest.fixture(scope="session")
def rehearsal_server():
    from rehearsal_server import RehearsalServer

    server = RehearsalServer()
    yield server
    server.close()


@pytest.fixture
def rehearse(rehearsal_server):
    """``seqmesh.tools.rehearse.run_rehearsal`` with each rehearsal forked from a process that imported torch once
    (tests/rehearsal_server.py), instead of a fresh interpreter."""
    import functools

    from seqmesh.tools.rehearse import run_rehearsal

    return functools.partial(run_rehearsal, launch=rehearsal_server)
