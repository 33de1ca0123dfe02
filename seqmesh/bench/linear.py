"""``seqmesh bench linear``: sequence-parallel Gated DeltaNet (conv + recurrence, forward+backward) against one device.

Every ``ulysses x ring`` factorisation of the world runs both designs in the same spawned group, one
after the other: the all-to-all (``sequence_parallel_gated_delta``, heads dealt to ranks) and state
passing (``state_passing_gated_delta``, every head on every rank, the recurrent state gathered), timed
side by side with one process running the same math on the whole sequence; each result is checked
against that process's, the bytes each rank sent are counted, and state passing's time is given as a
ratio to the all-to-all's on the same mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..linear_attention.gated_delta import segment_bounds
from ..linear_attention.sequence_parallel import GateParams, LinearHeads, gated_delta_heads, sequence_parallel_gated_delta
from ..linear_attention.state_passing import state_passing_gated_delta
from .common import check_meshes, factorisations, parse_mesh, side_by_side


@dataclass
class LinearBench:
    """One Gated DeltaNet workload. Every field has a CPU-friendly default."""

    seq_len: int = 8192
    batch: int = 1
    key_heads: int = 4
    value_heads: int = 8
    key_dim: int = 64
    value_dim: int = 64
    kernel: int = 4
    dtype: str = "float32"
    layout: str = "zigzag"
    world: int = 4
    repeats: int = 3
    warmup: int = 1
    meshes: list[tuple[int, int]] = field(default_factory=list)  # (ulysses, ring); empty: all factorisations
    designs: tuple[str, ...] = ("all_to_all", "state_passing")

    def factorisations(self) -> list[tuple[int, int]]:
        return factorisations(self.world, self.meshes)

    def heads(self, ranks: int) -> LinearHeads:
        return LinearHeads(self.key_heads, self.value_heads, self.key_dim, self.value_dim, ranks)


def _inputs(cfg: LinearBench):
    g = torch.Generator().manual_seed(1234)
    dt = getattr(torch, cfg.dtype)
    heads = cfg.heads(1)
    packed = torch.randn(cfg.batch, cfg.seq_len, heads.channels, generator=g).to(dt)
    params = GateParams((torch.randn(heads.conv_dim, cfg.kernel, generator=g) * 0.5).to(dt), None,
                        torch.empty(cfg.value_heads).uniform_(0.01, 0.3, generator=g).log().to(dt),
                        torch.randn(cfg.value_heads, generator=g).to(dt))
    dout = torch.randn(cfg.batch, cfg.seq_len, cfg.value_heads, cfg.value_dim, generator=g).to(dt)
    return packed, params, dout


def _time(step, repeats: int, warmup: int, barrier=None) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if barrier is not None:  # a step takes as long as its slowest rank
            import torch.distributed as dist

            t = torch.tensor([elapsed])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed = float(t)
        if i >= warmup:
            times.append(elapsed)
    return times


def _run_single(cfg: LinearBench, reference_path: str | None) -> dict:
    packed, params, dout = _inputs(cfg)
    bounds = segment_bounds(cfg.seq_len, None)
    result = {}

    def step():
        x = packed.clone().requires_grad_()
        out = gated_delta_heads(x, params, cfg.heads(1), 0, bounds)
        out.backward(dout)
        result.update(out=out.detach(), dx=x.grad)

    times = _time(step, cfg.repeats, cfg.warmup)
    if reference_path is not None:
        torch.save(result, reference_path)
    return {"times": times, "bytes_sent": 0}


def _run_rank(cfg: LinearBench, ulysses: int, ring: int, reference_path: str | None) -> dict:
    """Each of ``cfg.designs`` on this mesh, one after the other: ``{design: row}`` (an all-to-all the heads cannot
    split is left out)."""
    import torch.distributed as dist

    from .. import comm_stats, gather_sequence, init_mesh, shard_sequence

    mesh = init_mesh(ulysses, ring, dp_shard=dist.get_world_size() // (ulysses * ring), device_type="cpu")
    packed, params, dout = _inputs(cfg)
    local, dlocal = (shard_sequence(t, mesh, layout=cfg.layout).detach() for t in (packed, dout))
    ref = torch.load(reference_path, weights_only=True) if reference_path is not None else None
    rows = {}
    for design in cfg.designs:
        if design == "all_to_all" and mesh.sp_size > cfg.value_heads:
            continue
        run = sequence_parallel_gated_delta if design == "all_to_all" else state_passing_gated_delta
        heads = cfg.heads(mesh.sp_size if design == "all_to_all" else 1)
        result = {}

        def step():
            x = local.clone().requires_grad_()
            with comm_stats() as stats:
                out = run(x, params, heads, mesh, layout=cfg.layout, seq_len=cfg.seq_len)
                out.backward(dlocal)
            result.update(out=out.detach(), dx=x.grad, stats=stats)

        times = _time(step, cfg.repeats, cfg.warmup, barrier=dist.barrier)
        row = {"times": times, "bytes_sent": result["stats"].sent()}
        if ref is not None:
            row["max_error"] = max(
                float((gather_sequence(result[n], mesh, layout=cfg.layout, length=cfg.seq_len) - ref[n]).abs().max())
                for n in ("out", "dx"))
        rows[design] = row
    return rows


def bench_linear(cfg: LinearBench, *, check: bool = True) -> list[dict]:
    """Rows ``{method, mesh, seconds, vs_one_device, mib_sent_per_rank, max_error}``. A "device" is one process
    with ``cores // world`` threads, the one device as much as each rank (on a loaded machine, more threads
    than free cores make one process spin rather than compute)."""
    threads = max(1, (os.cpu_count() or 1) // cfg.world)
    single, meshes = side_by_side(cfg, _run_single, _run_rank, single_threads=threads, check=check)
    rows = [{"method": "one device", "mesh": "1x1", "seconds": statistics.median(single["times"]),
             "mib_sent_per_rank": 0.0}]
    for ulysses, ring, per_rank in meshes:
        for design in cfg.designs:
            if design not in per_rank[0]:
                continue
            ranks = [r[design] for r in per_rank]
            row = {"method": design.replace("_", " "), "mesh": f"{ulysses}x{ring}",
                   "seconds": statistics.median(ranks[0]["times"]),
                   "mib_sent_per_rank": max(r["bytes_sent"] for r in ranks) / 2**20}
            if check:
                row["max_error"] = max(r["max_error"] for r in ranks)
            if design == "state_passing" and "all_to_all" in per_rank[0]:  # the ratio on the same mesh and run
                row["vs_all_to_all"] = row["seconds"] / statistics.median(per_rank[0]["all_to_all"]["times"])
            rows.append(row)
    for r in rows:
        r["vs_one_device"] = r["seconds"] / rows[0]["seconds"]
    return rows


def format_linear_rows(cfg: LinearBench, rows: list[dict]) -> str:
    head = (f"Gated DeltaNet conv + recurrence fwd+bwd: {cfg.seq_len} tokens, batch {cfg.batch}, key/value heads "
            f"{cfg.key_heads}/{cfg.value_heads} x {cfg.key_dim}/{cfg.value_dim}, {cfg.dtype}, {cfg.layout}, {cfg.world} "
            f"CPU ranks (gloo); median of {cfg.repeats}")
    lines = [head, f"{'method':<19}{'mesh UxR':>9}{'seconds':>10}{'/ 1 dev':>9}{'/ a2a':>8}{'MiB sent/rank':>15}"
                   f"{'max |err|':>12}"]
    for r in rows:
        err = f"{r['max_error']:.2e}" if "max_error" in r else "-"
        ratio = f"{r['vs_all_to_all']:.2f}" if "vs_all_to_all" in r else "-"
        lines.append(f"{r['method']:<19}{r['mesh']:>9}{r['seconds']:>10.3f}{r['vs_one_device']:>9.2f}{ratio:>8}"
                     f"{r['mib_sent_per_rank']:>15.2f}{err:>12}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench linear``."""

    def run(args: argparse.Namespace) -> int:
        cfg = LinearBench(seq_len=args.seq_len, batch=args.batch, key_heads=args.key_heads,
                          value_heads=args.value_heads, key_dim=args.head_dim, value_dim=args.head_dim,
                          dtype=args.dtype, layout=args.layout, world=args.world, repeats=args.repeats,
                          meshes=args.mesh or [], designs=tuple(args.design or ("all_to_all", "state_passing")))
        check_meshes(cfg.factorisations(), args.world)
        rows = bench_linear(cfg)
        print(json.dumps(rows, indent=1) if args.json else format_linear_rows(cfg, rows))
        return 0

    p = bench_sub.add_parser("linear", help="sequence-parallel Gated DeltaNet fwd+bwd across spawned CPU ranks")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens in the sequence (default %(default)s)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--key-heads", type=int, default=4)
    p.add_argument("--value-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64, help="key and value head dim")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn (gloo, CPU)")
    p.add_argument("--mesh", type=parse_mesh, action="append", help="ULYSSESxRING to run (repeatable); default: all")
    p.add_argument("--design", action="append", choices=["all_to_all", "state_passing"],
                   help="Gated DeltaNet design to run (repeatable); default: both, side by side")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run)
