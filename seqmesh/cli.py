"""The ``seqmesh`` command: demo, bench, plan (and, as they land, train and verify)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _add_attention_args(p: argparse.ArgumentParser, seq_len: int) -> None:
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


def _attention_bench_config(args: argparse.Namespace, world: int, meshes: list[tuple[int, int]]):
    from .bench import AttentionBench

    if args.seq_len < world:
        raise SystemExit(f"--seq-len {args.seq_len} is shorter than the {world} ranks; give at least {world} tokens.")
    return AttentionBench(
        seq_len=args.seq_len, batch=args.batch, q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        dtype=args.dtype, causal=not args.full, layout=args.layout, world=world, repeats=args.repeats,
        backend=args.backend, meshes=meshes,
    )


def _parse_mesh(text: str) -> tuple[int, int]:
    try:
        u, r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r} must look like ULYSSESxRING, e.g. 2x2") from None
    return u, r


def cmd_bench_attention(args: argparse.Namespace) -> int:
    from .bench import bench_attention, format_attention_rows

    cfg = _attention_bench_config(args, args.world, args.mesh or [])
    for u, r in cfg.factorisations():
        if u * r != args.world:
            raise SystemExit(f"mesh {u}x{r} has {u * r} ranks but --world is {args.world}.")
    rows = bench_attention(cfg)
    print(json.dumps(rows, indent=1) if args.json else format_attention_rows(cfg, rows))
    return 0


def cmd_bench_merge(args: argparse.Namespace) -> int:
    from .bench import MergeBench, bench_merge, format_merge_rows

    cfg = MergeBench(seq_len=args.seq_len, q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     dtype=args.dtype, causal=not args.full, rings=tuple(args.rings), repeats=args.repeats,
                     backend=args.backend, device=args.device)
    rows = bench_merge(cfg)
    print(json.dumps(rows, indent=1) if args.json else format_merge_rows(cfg, rows))
    return 0


def cmd_demo_attention(args: argparse.Namespace) -> int:
    from .bench import bench_attention, format_attention_rows

    cfg = _attention_bench_config(args, 4, [(4, 1), (1, 4), (2, 2)])
    print(f"seqmesh demo: exact sequence-parallel attention over {cfg.seq_len:,} tokens on 4 CPU processes "
          "(gloo): Ulysses 4x1, ring 1x4 and USP 2x2, each checked against one device.", flush=True)
    rows = bench_attention(cfg)
    print(format_attention_rows(cfg, rows))
    worst = max(r.get("max_error", 0.0) for r in rows)
    tol = 1e-4 if cfg.dtype in ("float32", "float64") else 5e-2
    print(f"largest difference from one device (output and all gradients): {worst:.2e} "
          f"({'OK' if worst <= tol else 'TOO LARGE'}, tolerance {tol:g})")
    return 0 if worst <= tol else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seqmesh", description="Exact sequence parallelism for long-sequence training.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the built-in demonstration")
    demo_sub = demo.add_subparsers(dest="what")
    demo_attention = demo_sub.add_parser("attention", help="USP/ring/Ulysses attention on 4 CPU processes")
    _add_attention_args(demo_attention, 16384)
    demo_attention.set_defaults(func=cmd_demo_attention, repeats=1)
    demo.set_defaults(func=lambda a: cmd_demo_attention(demo_attention.parse_args([])))

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    ba = bench_sub.add_parser("attention", help="Ulysses / ring / USP fwd+bwd across spawned CPU ranks")
    _add_attention_args(ba, 8192)
    ba.add_argument("--world", type=int, default=4, help="ranks to spawn (gloo, CPU)")
    ba.add_argument("--mesh", type=_parse_mesh, action="append", help="ULYSSESxRING to run (repeatable); default: all")
    ba.set_defaults(func=cmd_bench_attention)
    bm = bench_sub.add_parser("merge", help="ring split-and-merge on one device vs one attention call")
    _add_attention_args(bm, 8192)
    bm.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    bm.add_argument("--device", default="cpu")
    bm.set_defaults(func=cmd_bench_merge)

    from .planner.cli import register_plan

    register_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
