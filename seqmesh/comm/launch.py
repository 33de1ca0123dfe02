"""Local process groups: run a function on N spawned ranks (gloo on CPU, or NCCL) with time limits.

``WorkerPool`` keeps N initialised ranks alive and runs many jobs on them, which is how the tests
amortise process start-up; ``spawn`` is a pool used once. A job that raises on any rank, or runs past
its time limit, ends the whole pool (a rank stuck in a collective would otherwise wait forever) and
raises a ``RuntimeError`` carrying every rank's traceback.

With ``backend="nccl"`` each rank takes GPU ``rank`` (``torch.cuda.set_device``) before joining, so
a machine with several GPUs can run distributed jobs over NCCL (the jobs put their tensors on
``torch.cuda.current_device()``).

Ranks start from multiprocessing's fork server where the platform has one (Linux, macOS), else by spawn. A
fresh interpreter imports torch and whatever a job needs (seconds each); a rank forked from the server starts
with every module the server preloaded (``multiprocessing.set_forkserver_preload``, called before the first
pool of the process), which is how the tests start dozens of pools in a session at little cost. The server never
runs a tensor operation or touches CUDA, so what it hands each rank is freshly imported modules only.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BACKENDS = ("gloo", "nccl")
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
# What a rank of seqmesh's own jobs imports (train, bench, selftest: torch, transformers, seqmesh): the fork server
# imports it once, where the process has not chosen its own preload, instead of every rank importing it again
RANK_MODULES = ("torch", "torch.distributed", "seqmesh.training.train")


def init_distributed(timeout: float = 600.0) -> None:
    """From torchrun's environment (NCCL when GPUs are present, gloo otherwise), or a group of one.
    A collective that waits ``timeout`` seconds for a rank ends the job (NCCL's watchdog aborts it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def _preload_rank_modules() -> None:
    """``multiprocessing.set_forkserver_preload`` with :data:`RANK_MODULES`, if the fork server has not started and
    its preload is still multiprocessing's default (a program, or the test suite, that set its own keeps it)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", 0) is None and getattr(server, "_preload_modules", None) == ["__main__"]:
        mp.set_forkserver_preload(["__main__", *RANK_MODULES])


def _worker(
    rank: int, world: int, port: int, jobs: Any, results: Any, threads: int, pg_timeout: float, backend: str
) -> None:
    import gc

    import torch.distributed as dist

    # what the rank was forked with (the fork server's imports, some 370,000 objects) is never garbage: frozen, a full
    # collection (seqmesh bench memory's before each point) walks only what the jobs made, not 0.4 s of modules
    gc.freeze()
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: seqmesh train picks its GPU by it
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
    except BaseException:  # report start-up failures instead of dying silently
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned ranks that run jobs until closed.

    Args:
        world_size: number of ranks.
        threads: torch intra-op threads per rank (keep ranks x threads <= cores).
        collective_timeout: the process group's own limit for one collective, a second safety net.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
    """

    def __init__(
        self, world_size: int, *, threads: int = 1, collective_timeout: float = 120.0, start_timeout: float = 180.0,
        backend: str = "gloo",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}.")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"backend='nccl' with {world_size} ranks needs {world_size} GPUs; "
                             f"this machine has {torch.cuda.device_count()}. Use backend='gloo' or fewer ranks.")
        self.world_size = world_size
        self.backend = backend
        # NCCL ranks are spawned: a fork server whose preloaded modules initialized CUDA forks ranks that cannot use
        # the GPU ("Cannot re-initialize CUDA in forked subprocess": the test suite's preload on an H200 with
        # flash-linear-attention installed, whose import reads the device's name)
        method = "spawn" if backend == "nccl" else START_METHOD
        if method == "forkserver":
            _preload_rank_modules()
        ctx = mp.get_context(method)
        port = free_port()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self._jobs[r], self._results, threads, collective_timeout, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start-up", start_timeout)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def threads_held(self) -> int:
        """The most OS threads any rank holds now (0 where /proc cannot tell). A gloo process group keeps its
        threads until destroyed, and torch's own caches may hold a mesh's groups, so a long-lived pool that
        builds many meshes grows; its owner can read this and start a fresh pool."""
        counts = [0]
        for p in self._procs:
            try:
                counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
            except OSError:
                pass
        return max(counts)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self.alive:
            raise RuntimeError("the worker pool is closed (an earlier job failed or it was shut down).")
        for q in self._jobs:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "job"), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        failed_at: float | None = None
        while len(results) + len(failures) < self.world_size:
            # once a rank has failed, the others get a few seconds to report, not a whole timeout
            limit = deadline if failed_at is None else min(deadline, failed_at + 5.0)
            now = time.monotonic()
            if now >= limit:
                break
            try:
                rank, ok, payload = self._results.get(timeout=min(limit - now, 1.0))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if not p.is_alive() and r not in results and r not in failures:
                        failures[r] = f"rank {r} exited with code {p.exitcode}"
                        failed_at = failed_at or time.monotonic()
                continue
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
                failed_at = failed_at or time.monotonic()
        if failures or len(results) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in results and r not in failures]
            self.close()
            if failures:
                head = f"{what} failed on rank(s) {sorted(failures)}" + (f"; no answer from {missing}" if missing else "")
            else:
                head = f"{what} ran past its {timeout:.0f} s limit; no answer from rank(s) {missing}"
            raise RuntimeError("\n".join([head] + [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._jobs:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
        self._procs = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh gloo ranks; return results by rank."""
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    with WorkerPool(world_size, threads=threads) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
