"""``seqmesh bench merge``: the ring's split-and-merge cost on one device.

``bench_merge`` runs every ring rank's kernel calls and merges on one device and compares with one
kernel call over the same work; ``seqmesh plan --ring-efficiency`` reads its ``--json`` rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from ..kernels import kernel_chooser
from ..kernels.base import BlockMask
from ..sequence.layout import SequenceLayout
from ..sharded_attention.blocks import document_bounds
from ..sharded_attention.schedule import RingSchedule
from .emulate import emulate_ring
from .attention import AttentionBench, inputs
from .common import add_attention_args, sync


@dataclass
class MergeBench:
    """The ring's split-and-merge on one device against one attention call over the same work."""

    seq_len: int = 8192
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    rings: tuple[int, ...] = (2, 4, 8)
    repeats: int = 3
    backend: str = "auto"
    device: str = "cpu"


def bench_merge(cfg: MergeBench) -> list[dict]:
    """Rows ``{ring, seq_len, block_tokens, one_call_s, split_merge_s, efficiency}``; efficiency = one call /
    split+merge; ``block_tokens`` = one ring rank's query tokens (what ``seqmesh plan --ring-efficiency`` reads)."""
    device = torch.device(cfg.device)
    choose = kernel_chooser(cfg.backend)
    scale = cfg.head_dim**-0.5
    bench = AttentionBench(cfg.seq_len, 1, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.dtype, cfg.causal, device=cfg.device)
    q, k, v, dout = inputs(bench, device)
    mask = BlockMask(causal=cfg.causal)

    def one_call() -> None:
        kernel = choose(q, k, mask)
        out, lse = kernel.forward(q, k, v, mask, scale)
        kernel.backward(dout, q, k, v, out, lse, mask, scale)

    def timed(fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(cfg.repeats):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    rows = []
    for ring in cfg.rings:
        layout = SequenceLayout("zigzag", ring, 1, cfg.seq_len)
        schedule = RingSchedule(layout, document_bounds(cfg.seq_len, cfg.seq_len, None), cfg.causal)
        one = timed(one_call)  # measured next to each split, so drift hits both alike
        split = timed(lambda: emulate_ring(q, k, v, dout, schedule, choose, scale))
        rows.append({"ring": ring, "seq_len": cfg.seq_len, "block_tokens": layout.ring_len, "one_call_s": one,
                     "split_merge_s": split, "efficiency": one / split})
    return rows


def format_merge_rows(cfg: MergeBench, rows: list[dict]) -> str:
    lines = [f"ring split-and-merge vs one call (fwd+bwd, {cfg.seq_len} tokens, heads {cfg.q_heads}/{cfg.kv_heads}, "
             f"head dim {cfg.head_dim}, {cfg.dtype}, {'causal' if cfg.causal else 'full'}, {cfg.device})",
             f"{'ring':>5}{'one call s':>12}{'split+merge s':>15}{'efficiency':>12}"]
    for r in rows:
        lines.append(f"{r['ring']:>5}{r['one_call_s']:>12.3f}{r['split_merge_s']:>15.3f}{r['efficiency']:>12.3f}")
    return "\n".join(lines)



def add_subcommand(bench_sub) -> None:
    """``seqmesh bench merge``."""

    def run(args: argparse.Namespace) -> int:
        cfg = MergeBench(seq_len=args.seq_len, q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                         dtype=args.dtype, causal=not args.full, rings=tuple(args.rings), repeats=args.repeats,
                         backend=args.backend, device=args.device)
        rows = bench_merge(cfg)
        print(json.dumps(rows, indent=1) if args.json else format_merge_rows(cfg, rows))
        return 0

    p = bench_sub.add_parser("merge", help="ring split-and-merge on one device vs one attention call")
    add_attention_args(p, 8192)
    p.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)
