"""``seqmesh bench window``: a windowed ring against the full causal ring: work and bytes saved, and balance per layout.

Work and bytes come from the ring schedule every rank runs (the same plan ``seqmesh.attention``
executes): pairs each ring rank computes, ring steps that run, and the K/V bytes each rank sends
(forward ``hops`` K/V blocks; backward ``hops`` K/V blocks and the float32 dK/dV partials:
``hops + 1`` when the blocks relay, ``hops`` when they go direct, see ``RingSchedule.dkv_shifts``).
Time is measured by running every ring rank's kernel calls and merges on one device
(``emulate_ring``, forward and backward), the compute a windowed ring does against a full one, as
the process's CPU time (not wall time, which a shared machine inflates at random).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from ..kernels import kernel_chooser
from ..sequence.layout import SequenceLayout
from ..sharded_attention.blocks import document_bounds
from ..sharded_attention.schedule import RingSchedule
from .emulate import emulate_ring
from .common import add_attention_args


@dataclass
class WindowBench:
    seq_len: int = 8192
    ring: int = 8
    windows: tuple[int | None, ...] = (None, 4096, 1024, 256)
    layouts: tuple[str, ...] = ("zigzag", "contiguous")
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 1  # emulated fwd+bwd timings per row (0: no timing)


def window_rows(cfg: WindowBench) -> list[dict]:
    """One row per (layout, window): work per rank, balance, steps, bytes per rank, emulated time."""
    element = torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size()
    block = 2 * (cfg.seq_len // cfg.ring) * cfg.kv_heads * cfg.head_dim  # K/V block elements (batch 1)
    full_work = None
    rows = []
    for kind in cfg.layouts:
        layout = SequenceLayout.for_length(kind, cfg.ring, 1, cfg.seq_len)
        for window in cfg.windows:
            schedule = RingSchedule(layout, document_bounds(layout.padded_len, cfg.seq_len, None), True, window)
            works = [schedule.work(r) for r in range(cfg.ring)]
            hops = len(schedule.steps) - 1
            if window is None and full_work is None:
                full_work = sum(works)
            rows.append({
                "layout": kind, "window": window, "steps": len(schedule.steps),
                "work_total": sum(works), "work_max": max(works), "balance": max(works) * cfg.ring / sum(works),
                # fwd K/V, bwd K/V, bwd fp32 dK/dV partials (one more than the hops when they relay)
                "bytes_per_rank": block * (2 * hops * element + 4 * sum(s is not None for s in schedule.dkv_shifts)),
                "seconds": _time(cfg, schedule) if cfg.repeats else None,
            })
    for row in rows:
        row["work_saved"] = 1 - row["work_total"] / full_work
    return rows


def _time(cfg: WindowBench, schedule: RingSchedule) -> float:
    g = torch.Generator().manual_seed(0)
    dt, n = getattr(torch, cfg.dtype), schedule.layout.padded_len
    q = torch.randn(1, n, cfg.q_heads, cfg.head_dim, generator=g).to(dt)
    k, v = (torch.randn(1, n, cfg.kv_heads, cfg.head_dim, generator=g).to(dt) for _ in range(2))
    dout = torch.randn_like(q)
    choose = kernel_chooser("auto")
    samples = []
    for _ in range(cfg.repeats):
        start = time.process_time()
        emulate_ring(q, k, v, dout, schedule, choose, cfg.head_dim**-0.5)
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def format_window_rows(cfg: WindowBench, rows: list[dict]) -> str:
    lines = [f"windowed vs full causal ring: {cfg.seq_len} tokens, ring {cfg.ring}, heads {cfg.q_heads}/{cfg.kv_heads} x "
             f"{cfg.head_dim}, {cfg.dtype}; work = (query, key) pairs; bytes = ring P2P one rank sends, fwd+bwd",
             f"{'layout':>11}{'window':>8}{'steps':>6}{'work saved':>11}{'max/mean':>9}{'MiB/rank':>10}{'CPU s':>9}"]
    for r in rows:
        seconds = f"{r['seconds']:.3f}" if r["seconds"] is not None else "-"
        lines.append(f"{r['layout']:>11}{str(r['window'] or 'full'):>8}{r['steps']:>6}{r['work_saved']:>11.1%}"
                     f"{r['balance']:>9.3f}{r['bytes_per_rank'] / 2**20:>10.2f}{seconds:>9}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench window``."""

    def run(args: argparse.Namespace) -> int:
        cfg = WindowBench(seq_len=args.seq_len, ring=args.ring,
                          windows=tuple(None if w == 0 else w for w in args.windows), q_heads=args.heads,
                          kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, repeats=args.repeats)
        rows = window_rows(cfg)
        print(json.dumps(rows, indent=1) if args.json else format_window_rows(cfg, rows))
        return 0

    p = bench_sub.add_parser("window", help="windowed vs full causal ring: work, bytes, balance per layout")
    add_attention_args(p, 8192)
    p.add_argument("--ring", type=int, default=8)
    p.add_argument("--windows", type=int, nargs="+", default=[0, 4096, 1024, 256], help="0: full causal")
    p.set_defaults(func=run)
