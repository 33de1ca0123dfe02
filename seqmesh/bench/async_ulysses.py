"""``seqmesh bench async-ulysses``: a Llama-shaped model's training step with async Ulysses against the
synchronous path, side by side in one run on ``world`` spawned ranks (Ulysses over all of them).

Both models hold the same weights; the repeats alternate sync and async so that a shared machine's noise
falls on both alike. Each timing is the wall time of one forward and backward, the slowest rank's
(overlap hides communication in wall time; CPU time would count the communication thread too), and the
report gives the median of each and their ratio. On gloo the all-to-all is a memory copy between processes
run by a worker thread, which competes for the same cores as the projections it should hide behind: with
fewer cores than ranks plus their communication threads, expect no gain, and the ratio measures the
overhead of the pieces instead. ``--trace DIR`` writes each rank's torch.profiler trace of one async step
(Chrome trace format: the gloo thread's ``gloo:all_to_all`` spans beside the main thread's ``aten::mm``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

from ..rules.overlap import ASYNC_PIECES


@dataclass
class AsyncUlyssesBench:
    world: int = 2
    seq_len: int = 8192
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    layers: int = 2
    pieces: int = ASYNC_PIECES
    repeats: int = 5
    trace: str | None = None  # a folder for each rank's profiler trace of one async step


def _model(cfg: AsyncUlyssesBench):
    import torch
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=cfg.hidden, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                            num_hidden_layers=cfg.layers, intermediate_size=2 * cfg.hidden, vocab_size=256,
                            head_dim=cfg.hidden // cfg.heads, attention_dropout=0.0)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def run_rank(cfg: AsyncUlyssesBench) -> dict:
    """One rank: median wall seconds of a forward and backward, sync and async, the slowest rank's."""
    import torch
    import torch.distributed as dist

    import seqmesh
    from ..hf import parallelize

    mesh = seqmesh.init_mesh(cfg.world, 1)
    ids = torch.randint(0, 256, (1, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    batch = seqmesh.shard_batch({"input_ids": ids}, mesh)
    models = {mode: parallelize(_model(cfg), mesh, async_ulysses=mode == "async", async_pieces=cfg.pieces)
              for mode in ("sync", "async")}

    def step(mode: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        models[mode](**batch).logits.float().pow(2).mean().backward()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    for mode in models:  # warm-up: the input check's exchange, allocator, kernel selection
        step(mode)
    samples = {"sync": [], "async": []}
    for _ in range(cfg.repeats):
        for mode in samples:
            samples[mode].append(step(mode))
    result = {mode: statistics.median(s) for mode, s in samples.items()} | {"samples": samples}
    if cfg.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step("async")
        os.makedirs(cfg.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(cfg.trace, f"async_ulysses_rank{dist.get_rank()}.json"))
        result["trace"] = in_flight_beside_matmuls(prof.events())
    return result


def in_flight_beside_matmuls(events) -> dict:
    """From profiler events: seconds the gloo worker threads spent in all-to-alls, and how much of it the main
    thread (the one running ``aten::mm``) spent in a matmul at the same time."""
    main = next(e.thread for e in events if e.name == "aten::mm")
    comm = [(e.time_range.start, e.time_range.end) for e in events if e.name == "gloo:all_to_all" and e.thread != main]
    mms = [(e.time_range.start, e.time_range.end) for e in events if e.name == "aten::mm" and e.thread == main]
    beside = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in mms)
    return {"all_to_all_s": sum(b - a for a, b in comm) / 1e6, "beside_matmul_s": beside / 1e6}


def bench_rows(cfg: AsyncUlyssesBench) -> dict:
    from ..comm.launch import WorkerPool

    threads = max(1, (os.cpu_count() or 1) // cfg.world)
    with WorkerPool(cfg.world, threads=threads) as pool:
        result = pool.run(run_rank, cfg, timeout=3600)[0]
    return {"config": vars(cfg), "cores": os.cpu_count(), "threads_per_rank": threads, "sync_s": result["sync"],
            "async_s": result["async"], "async_over_sync": result["async"] / result["sync"],
            "min_async_over_sync": min(result["samples"]["async"]) / min(result["samples"]["sync"]),
            "samples": result["samples"], "trace": result.get("trace")}


def format_rows(row: dict) -> str:
    c = row["config"]
    return "\n".join([
        f"async vs sync Ulysses {c['world']}: Llama {c['layers']} layers, hidden {c['hidden']}, heads {c['heads']}/"
        f"{c['kv_heads']}, {c['seq_len']} tokens, float32, {c['pieces']} pieces; {row['cores']} cores, "
        f"{row['threads_per_rank']} thread(s) per rank; median wall s of forward+backward over {c['repeats']} "
        "alternating repeats (slowest rank)",
        f"  sync {row['sync_s']:.4f} s   async {row['async_s']:.4f} s   async/sync {row['async_over_sync']:.3f} "
        f"(fastest repeats: {row['min_async_over_sync']:.3f})",
    ] + ([f"  rank 0's traced async step: all-to-alls in flight {row['trace']['all_to_all_s'] * 1e3:.2f} ms, of which "
          f"{row['trace']['beside_matmul_s'] * 1e3:.2f} ms beside a matmul on the main thread"] if row["trace"] else []))


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench async-ulysses``."""

    def run(args: argparse.Namespace) -> int:
        cfg = AsyncUlyssesBench(world=args.world, seq_len=args.seq_len, hidden=args.hidden, heads=args.heads,
                                kv_heads=args.kv_heads, layers=args.layers, pieces=args.pieces, repeats=args.repeats,
                                trace=args.trace)
        row = bench_rows(cfg)
        print(json.dumps(row, indent=1) if args.json else format_rows(row))
        return 0

    p = bench_sub.add_parser("async-ulysses", help="async Ulysses (projections overlapped) vs sync: step time ratio")
    p.add_argument("--world", type=int, default=2, help="ranks, all on the Ulysses axis (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pieces", type=int, default=ASYNC_PIECES, help="pieces of tokens per layer (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trace", help="write each rank's profiler trace of one async step into this folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
