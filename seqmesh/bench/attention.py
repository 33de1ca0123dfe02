"""``seqmesh bench attention``: sequence-parallel attention across spawned ranks against one device.

``bench_attention`` times forward+backward of every ``ulysses x ring`` factorisation of the world
(pure Ulysses, pure ring, USP) side by side with one device holding the whole sequence, checks each
result against that device's, and counts the bytes each rank sent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..kernels import kernel_chooser
from ..kernels.base import BlockMask
from .common import add_attention_args, check_meshes, factorisations, parse_mesh, side_by_side, sync


@dataclass
class AttentionBench:
    """One attention workload. Every field has a CPU-friendly default."""

    seq_len: int = 8192
    batch: int = 1
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    layout: str = "zigzag"
    world: int = 4
    repeats: int = 3
    warmup: int = 1
    backend: str = "auto"
    device: str = "cpu"
    meshes: list[tuple[int, int]] = field(default_factory=list)  # (ulysses, ring); empty: all factorisations

    def factorisations(self) -> list[tuple[int, int]]:
        return factorisations(self.world, self.meshes, self.q_heads)


def inputs(cfg: AttentionBench, device: torch.device):
    """``q, k, v`` and the output gradient of the whole sequence, the same on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    dt = getattr(torch, cfg.dtype)
    shape_q = (cfg.batch, cfg.seq_len, cfg.q_heads, cfg.head_dim)
    shape_kv = (cfg.batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim)
    q, dout = (torch.randn(shape_q, generator=g).to(device, dt) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=g).to(device, dt) for _ in range(2))
    return q, k, v, dout


def _run_rank(cfg: AttentionBench, ulysses: int, ring: int, reference_path: str | None) -> dict:
    """Runs on every rank: time forward+backward, count bytes, compare with the one-device result."""
    import torch.distributed as dist

    from .. import attention, comm_stats, gather_sequence, init_mesh, shard_sequence

    device = torch.device(cfg.device)
    mesh = init_mesh(ulysses, ring, dp_shard=dist.get_world_size() // (ulysses * ring), device_type=device.type)
    q, k, v, dout = inputs(cfg, device)
    shard = lambda t: shard_sequence(t, mesh, layout=cfg.layout)  # noqa: E731
    ql, kl, vl, dl = (shard(t).detach() for t in (q, k, v, dout))
    del q, k, v, dout
    times, stats = [], None
    for i in range(cfg.warmup + cfg.repeats):
        leaves = [t.clone().requires_grad_() for t in (ql, kl, vl)]
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        with comm_stats() as st:
            out = attention(*leaves, mesh, causal=cfg.causal, layout=cfg.layout, seq_len=cfg.seq_len,
                            backend=cfg.backend, validate=False)
            out.backward(dl)
        sync(device)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        if i >= cfg.warmup:
            times.append(float(elapsed))
            stats = st
    result = {"times": times, "bytes_sent": stats.sent(), "bytes_by_kind": stats.as_dict()}
    if reference_path is not None:
        ref = torch.load(reference_path, weights_only=True)
        got = {name: gather_sequence(t.detach(), mesh, layout=cfg.layout, length=cfg.seq_len).cpu()
               for name, t in (("out", out), *zip(("dq", "dk", "dv"), (x.grad for x in leaves)))}
        result["max_error"] = max(float((got[n].double() - ref[n].double()).abs().max()) for n in got)
    return result


def _run_single(cfg: AttentionBench, reference_path: str | None) -> dict:
    """One device, whole sequence: the same kernels, no communication."""
    device = torch.device(cfg.device)
    q, k, v, dout = inputs(cfg, device)
    choose = kernel_chooser(cfg.backend)
    mask = BlockMask(causal=cfg.causal)
    scale = cfg.head_dim**-0.5
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        sync(device)
        start = time.perf_counter()
        kernel = choose(q, k, mask)
        out, lse = kernel.forward(q, k, v, mask, scale)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, mask, scale)
        sync(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - start)
    if reference_path is not None:
        torch.save({"out": out.cpu(), "dq": dq.cpu(), "dk": dk.cpu(), "dv": dv.cpu()}, reference_path)
    return {"times": times, "bytes_sent": 0}


def bench_attention(cfg: AttentionBench, *, check: bool = True) -> list[dict]:
    """Rows ``{method, mesh, seconds, vs_one_device, vs_fastest, mib_sent_per_rank, max_error}``."""
    cores = os.cpu_count() or 1
    single, meshes = side_by_side(cfg, _run_single, _run_rank, single_threads=cores if cfg.device == "cpu" else 1,
                                  check=check)
    rows = [{"method": "one device", "mesh": "1x1", **_summary(single)}]
    for ulysses, ring, per_rank in meshes:
        method = "ulysses" if ring == 1 else "ring" if ulysses == 1 else "usp"
        row = {"method": method, "mesh": f"{ulysses}x{ring}", **_summary(per_rank[0])}
        row["mib_sent_per_rank"] = max(r["bytes_sent"] for r in per_rank) / 2**20
        rows.append(row)
    one = rows[0]["seconds"]
    fastest = min(r["seconds"] for r in rows[1:]) if len(rows) > 1 else one
    for r in rows:
        r["vs_one_device"] = r["seconds"] / one
        r["vs_fastest"] = r["seconds"] / fastest
    return rows


def _summary(result: dict) -> dict:
    out = {"seconds": statistics.median(result["times"]), "mib_sent_per_rank": result["bytes_sent"] / 2**20}
    if "max_error" in result:
        out["max_error"] = result["max_error"]
    return out


def format_attention_rows(cfg: AttentionBench, rows: list[dict]) -> str:
    head = (f"attention fwd+bwd: {cfg.seq_len} tokens, batch {cfg.batch}, heads {cfg.q_heads}/{cfg.kv_heads}, "
            f"head dim {cfg.head_dim}, {cfg.dtype}, {'causal' if cfg.causal else 'full'}, {cfg.layout}, "
            f"{cfg.world} ranks on {cfg.device}; median of {cfg.repeats}")
    lines = [head, f"{'method':<12}{'mesh UxR':>9}{'seconds':>10}{'/ 1 dev':>9}{'/ best':>8}{'MiB sent/rank':>15}{'max |err|':>12}"]
    for r in rows:
        err = f"{r['max_error']:.2e}" if "max_error" in r else "-"
        lines.append(f"{r['method']:<12}{r['mesh']:>9}{r['seconds']:>10.3f}{r['vs_one_device']:>9.2f}"
                     f"{r['vs_fastest']:>8.2f}{r['mib_sent_per_rank']:>15.2f}{err:>12}")
    return "\n".join(lines)


def attention_bench_config(args: argparse.Namespace, world: int, meshes: list[tuple[int, int]]) -> AttentionBench:
    """The workload the attention flags describe (``seqmesh bench attention``, ``seqmesh demo attention``)."""
    if args.seq_len < world:
        raise SystemExit(f"--seq-len {args.seq_len} is shorter than the {world} ranks; give at least {world} tokens.")
    return AttentionBench(
        seq_len=args.seq_len, batch=args.batch, q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        dtype=args.dtype, causal=not args.full, layout=args.layout, world=world, repeats=args.repeats,
        backend=args.backend, meshes=meshes,
    )


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench attention``."""

    def run(args: argparse.Namespace) -> int:
        cfg = attention_bench_config(args, args.world, args.mesh or [])
        check_meshes(cfg.factorisations(), args.world)
        rows = bench_attention(cfg)
        print(json.dumps(rows, indent=1) if args.json else format_attention_rows(cfg, rows))
        return 0

    p = bench_sub.add_parser("attention", help="Ulysses / ring / USP fwd+bwd across spawned CPU ranks")
    add_attention_args(p, 8192)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn (gloo, CPU)")
    p.add_argument("--mesh", type=parse_mesh, action="append", help="ULYSSESxRING to run (repeatable); default: all")
    p.set_defaults(func=run)
