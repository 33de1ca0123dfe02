"""What several benchmarks share: the attention workload's flags, ``ULYSSESxRING`` meshes, the device
sync around a timed region, and running one process beside ``world`` spawned ranks."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def add_attention_args(p: argparse.ArgumentParser, seq_len: int) -> None:
    """The attention workload's flags (``seqmesh bench attention / merge / window``, ``seqmesh demo attention``)."""
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens in the sequence (default %(default)s)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA when fewer than --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--full", action="store_true", help="non-causal attention")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(ulysses, ring) = (2, 4)``; an argparse type."""
    try:
        u, r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r} must look like ULYSSESxRING, e.g. 2x2") from None
    return u, r


def factorisations(world: int, meshes: list[tuple[int, int]], max_ulysses: int | None = None) -> list[tuple[int, int]]:
    """``meshes`` when given, else every ``(ulysses, ring)`` with ``ulysses x ring = world``, the most
    Ulysses first (at most ``max_ulysses``: the heads it deals)."""
    if meshes:
        return list(meshes)
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0 and u <= (max_ulysses or world)]


def check_meshes(meshes: list[tuple[int, int]], world: int) -> None:
    for u, r in meshes:
        if u * r != world:
            raise SystemExit(f"mesh {u}x{r} has {u * r} ranks but --world is {world}.")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def side_by_side(cfg, run_single, run_rank, *, single_threads: int, check: bool = True) -> tuple[dict, list]:
    """Run ``run_single(cfg, path)`` on one process, then ``run_rank(cfg, ulysses, ring, path)`` on
    ``cfg.world`` spawned ranks for each of ``cfg.factorisations()``; ``path`` is where the one process
    leaves its results for the ranks to check against (None without ``check``). Returns the one
    process's result and ``[(ulysses, ring, per-rank results)]``."""
    from ..comm.launch import WorkerPool

    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one_device.pt") if check else None
        with WorkerPool(1, threads=single_threads) as pool:
            single = pool.run(run_single, cfg, path, timeout=3600)[0]
        with WorkerPool(cfg.world, threads=max(1, cores // cfg.world)) as pool:
            meshes = [(u, r, pool.run(run_rank, cfg, u, r, path, timeout=3600)) for u, r in cfg.factorisations()]
    return single, meshes
