"""``seqmesh bench memory``: a rank's peak tensor bytes, by category, against the sequence length.

Each point is one training step of a real model (``TrainConfig`` with the chosen memory options: the
same build as ``seqmesh train``) on spawned CPU ranks, measured by :class:`~seqmesh.memory.MemoryTracker`
on the step after the first (the optimizer state then exists). The sweep reports the longest length
whose peak, on the rank that holds most, fits a budget. ``--compare`` runs every technique at each
length and reports what each saves per local token: the slope of its peak against the length next to
the slope of the configuration it changes. Each measured peak is printed next to the planner's
prediction for the same ``TrainConfig`` (``seqmesh.planner.workload.plan_inputs``) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, replace

import torch

# each technique, and the configuration it is compared with
TECHNIQUES: dict[str, tuple[dict, str]] = {
    "baseline": ({}, ""),
    "tiled_mlp": ({"tiled_mlp": True}, "baseline"),
    "efficient_norm": ({"efficient_norm": True}, "baseline"),
    "checkpointing": ({"checkpointing": True}, "baseline"),
    "offload_checkpoints": ({"checkpointing": True, "offload_checkpoints": True}, "checkpointing"),
    "keep_attention": ({"checkpointing": True, "keep_attention": True}, "checkpointing"),
    "fsdp_cpu_offload": ({"fsdp_cpu_offload": True}, "baseline"),
    "all": ({"checkpointing": True, "offload_checkpoints": True, "tiled_mlp": True, "fsdp_cpu_offload": True,
             "efficient_norm": True}, "baseline"),
}


@dataclass
class MemoryBench:
    """A sweep of the sequence length for one model, world and set of memory options."""

    model: str = "llama-tiny"
    seq_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    world: int = 1
    ulysses: int | str = "auto"
    ring: int | str = "auto"
    tp: int = 1
    """Tensor-parallel degree, innermost (``TrainConfig.tp``)."""
    budget: int | None = None
    """Bytes a rank may hold; None: report the peaks only."""
    options: dict = field(default_factory=dict)
    """TrainConfig memory options: checkpointing, tiled_mlp, mlp_tiles, efficient_norm, offload_checkpoints,
    keep_attention, fsdp_cpu_offload."""
    device: str = "cpu"
    """``cuda``: one GPU per rank (NCCL); each point also reports ``torch.cuda.max_memory_allocated``."""


def bench_config(bench: MemoryBench, seq_len: int, options: dict):
    """The ``TrainConfig`` of one point: ``bench``'s model and degrees at ``seq_len`` with ``options``, with
    FSDP2 on any number of processes (the planner's prediction printed beside each peak models FSDP2 runs;
    ``seqmesh train`` on one process shards only with ``--fsdp``)."""
    from ..training.config import TrainConfig

    return TrainConfig(model=bench.model, seq_len=seq_len, ulysses=bench.ulysses, ring=bench.ring, tp=bench.tp,
                       steps=2, symbols=8, **{"fsdp": True, **options})


def predicted_peak(bench: MemoryBench, seq_len: int, options: dict) -> tuple[int | None, str]:
    """The planner's peak for the same run on these CPU ranks (no CUDA reserve: the tracker counts
    tensors only), and the moment it falls at; ``(None, why)`` for a run seqmesh does but the planner does not
    model (fewer kv heads than tensor-parallel ranks, Gated DeltaNet under TP)."""
    from ..planner.memory import memory_per_gpu
    from ..planner.tensor_parallel import tensor_parallel_refusal
    from ..planner.workload import plan_inputs

    work, layout = plan_inputs(bench_config(bench, seq_len, options), bench.world, device=bench.device)
    refused = tensor_parallel_refusal(work, None, layout) if layout.tp > 1 else None
    if refused is not None:
        return None, f"not modelled: {refused}"
    peak = memory_per_gpu(work, layout)
    return peak.total, peak.moment


def measure_rank(bench: MemoryBench, seq_len: int, options: dict) -> dict:
    """On every rank: the tracked peak of a training step at ``seq_len`` that every step of a run repeats: AdamW's
    state made first (:func:`seqmesh.memory.prime_optimizer`, in place of a first step that would only create it)."""
    from ..memory import MemoryTracker, prime_optimizer
    from ..memory.offload import enable_activation_offload
    from ..sequence.batch import shard_batch
    from ..training.step import make_optimizer, to_device
    from ..training.train import build
    from ..training.run_data import make_dataset

    import gc

    gc.collect()  # the previous point's model and optimizer, before this one is built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cfg = bench_config(bench, seq_len, options)
    data = make_dataset(cfg)
    mesh, module, device = build(cfg)
    offload = enable_activation_offload(module.lm, device) if cfg.offload_checkpoints else None
    optimizer = make_optimizer(module, lr=1e-4)
    module.train()
    cuda = device.type == "cuda"
    prime_optimizer(module, optimizer)
    local = to_device(shard_batch(data.batch(1, mesh.dp_rank, 1, mesh.dp_size), mesh), device)
    tracker = MemoryTracker(module, optimizer, device=device, offload=offload)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        module(**local).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    allocator = {"allocator_peak_bytes": torch.cuda.max_memory_allocated(device)} if cuda else {}
    return {**tracker.report().as_dict(), **allocator, "local_tokens": seq_len // (mesh.sp_size * mesh.tp)}


def sweep(bench: MemoryBench, pool=None) -> list[dict]:
    """One row per length: the peak of the rank that holds most, its categories, and whether it fits."""
    from ..comm.launch import WorkerPool

    owned = pool is None
    backend = "nccl" if bench.device == "cuda" else "gloo"
    pool = pool or WorkerPool(bench.world, threads=max(1, (os.cpu_count() or 1) // bench.world), backend=backend)
    rows = []
    try:
        for seq_len in sorted(bench.seq_lens):
            ranks = pool.run(measure_rank, bench, seq_len, bench.options, timeout=3600)
            row = {"seq_len": seq_len, **max(ranks, key=lambda r: r["peak_bytes"])}
            row["predicted_bytes"], row["predicted_moment"] = predicted_peak(bench, seq_len, bench.options)
            row["predicted_ratio"] = row["predicted_bytes"] / row["peak_bytes"] if row["predicted_bytes"] else None
            row["fits"] = bench.budget is None or row["peak_bytes"] <= bench.budget
            rows.append(row)
    finally:
        if owned:
            pool.close()
    return rows


def longest_fitting(rows: list[dict]) -> int | None:
    """The longest swept length that fits (every shorter one fits too, as peaks grow with the length)."""
    fitting = [r["seq_len"] for r in rows if r["fits"]]
    return max(fitting) if fitting else None


def bytes_per_token(rows: list[dict]) -> float:
    """Least-squares slope of the peak against the local tokens."""
    xs, ys = [r["local_tokens"] for r in rows], [r["peak_bytes"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)


def compare(bench: MemoryBench) -> list[dict]:
    """Every technique swept; rows ``{technique, bytes_per_token, saved_per_token, vs, model_state_bytes}``."""
    from ..comm.launch import WorkerPool

    if len(bench.seq_lens) < 2:
        raise ValueError("--compare fits a slope: give at least two --seq-lens.")
    results = {}
    with WorkerPool(bench.world, threads=max(1, (os.cpu_count() or 1) // bench.world)) as pool:
        for name, (options, _) in TECHNIQUES.items():
            results[name] = sweep(replace(bench, options={**bench.options, **options}), pool)
    rows = []
    for name, (_, reference) in TECHNIQUES.items():
        slope = bytes_per_token(results[name])
        last = results[name][-1]
        row = {"technique": name, "bytes_per_token": slope, "vs": reference, "peak_bytes": last["peak_bytes"],
               "model_state_bytes": last["parameters_bytes"] + last["gradients_bytes"] + last["optimizer_bytes"],
               "host_bytes": last["host_bytes"]}
        row["saved_per_token"] = bytes_per_token(results[reference]) - slope if reference else 0.0
        rows.append(row)
    return rows


def format_sweep(bench: MemoryBench, rows: list[dict]) -> str:
    options = ", ".join(f"{k}={v}" for k, v in bench.options.items()) or "no memory options"
    lines = [f"peak tensor memory per rank: {bench.model}, {bench.world} rank(s), {options} (MiB)",
             f"{'seq_len':>9}{'peak':>9}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'transient':>11}"
             f"{'host':>9}{'fits':>6}{'planner':>9}{'ratio':>7}  planner's moment"]
    mib = lambda b: f"{b / 2**20:9.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"{r['seq_len']:>9}{mib(r['peak_bytes'])}{mib(r['parameters_bytes'])}{mib(r['gradients_bytes'])}"
                     f"{mib(r['optimizer_bytes'])}{mib(r['activations_bytes'])}  {mib(r['transient_bytes'])}"
                     f"{mib(r['host_bytes'])}{'yes' if r['fits'] else 'no':>6}"
                     + (f"{mib(r['predicted_bytes'])}{r['predicted_ratio']:>7.3f}" if r["predicted_bytes"] else f"{'-':>9}{'-':>7}")
                     + f"  {r['predicted_moment']}")
    if bench.budget is not None:
        longest = longest_fitting(rows)
        lines.append(f"longest that fits {bench.budget / 2**20:.1f} MiB: "
                     + (f"{longest:,} tokens" if longest else "none of the lengths swept"))
    return "\n".join(lines)


def format_compare(bench: MemoryBench, rows: list[dict]) -> str:
    lines = [f"bytes per local token of each technique: {bench.model}, {bench.world} rank(s), lengths "
             f"{', '.join(map(str, sorted(bench.seq_lens)))} (slope of the peak)",
             f"{'technique':<21}{'bytes/token':>12}{'saved/token':>13}{'vs':>15}{'model state MiB':>17}{'host MiB':>10}"]
    for r in rows:
        lines.append(f"{r['technique']:<21}{r['bytes_per_token']:>12.0f}{r['saved_per_token']:>13.0f}{r['vs']:>15}"
                     f"{r['model_state_bytes'] / 2**20:>17.2f}{r['host_bytes'] / 2**20:>10.2f}")
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """``512MiB``, ``2GiB``, ``64M`` or a number of bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    number = text.lower().removesuffix("ib").removesuffix("b")
    scale = units.get(number[-1:], 1)
    try:
        return int(float(number[:-1] if scale > 1 else number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} must look like 512MiB, 2GiB or a number of bytes") from None


OPTIONS = ("checkpointing", "tiled_mlp", "efficient_norm", "offload_checkpoints", "keep_attention", "fsdp_cpu_offload")


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench memory``."""

    def run(args) -> int:
        if args.offload_checkpoints and not args.checkpointing:
            raise SystemExit("--offload-checkpoints moves the inputs checkpointed layers keep; add --checkpointing.")
        if args.keep_attention and not args.checkpointing:
            raise SystemExit("--keep-attention keeps what checkpointed layers would recompute; add --checkpointing.")
        bench = MemoryBench(model=args.model, seq_lens=args.seq_lens, world=args.world, ulysses=args.ulysses,
                            ring=args.ring, tp=args.tp, budget=args.budget,
                            options={name: True for name in OPTIONS if getattr(args, name)})
        rows = compare(bench) if args.compare else sweep(bench)
        text = format_compare(bench, rows) if args.compare else format_sweep(bench, rows)
        print(json.dumps(rows, indent=1) if args.json else text)
        return 0

    degree = lambda text: text if text == "auto" else int(text)  # noqa: E731
    p = bench_sub.add_parser("memory", help="peak tensor bytes per rank by category against the sequence length")
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--world", type=int, default=1, help="ranks to spawn (gloo, CPU)")
    p.add_argument("--ulysses", type=degree, default="auto")
    p.add_argument("--ring", type=degree, default="auto")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree, innermost (default 1: none)")
    p.add_argument("--budget", type=parse_bytes, help="bytes a rank may hold (512MiB, 2GiB): report the longest "
                   "length that fits")
    for name in OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", action="store_true")
    p.add_argument("--compare", action="store_true", help="every technique, and the bytes per token each saves")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run)
