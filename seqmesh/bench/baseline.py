"""``seqmesh bench baseline``: the longest sequence and tokens/s of seqmesh against plain transformers.

At one per-process memory budget, on ``world`` spawned CPU processes, each method's training step is
measured by :class:`~seqmesh.memory.MemoryTracker` (the second step's peak, on the process holding most,
with the optimizer state in place) over a length sweep: doubling from ``start`` until a length no longer
fits, then bisection between the last fitting and the first failing length down to ``resolution``
tokens. The longest fitting length is reported, and the length ``resolution`` tokens above it was
measured and does not fit. Then each pair is timed side by side in the same processes (tracker off,
the fastest of ``repeats`` steps) at the longest length both fit and at each one's own longest.
Tokens/s counts the tokens a step trains: ``world`` whole sequences under data parallelism, one
sequence split over the processes under seqmesh.

The methods (the same model config and the same weights, from ``build_model``'s seed):

    transformers       the model with its own attention (``attn_implementation="sdpa"``: on the CPU,
                       ``aten._scaled_dot_product_flash_attention_for_cpu``, the op seqmesh's ``cpu_flash``
                       kernel calls) and its own full-logits loss (``model(input_ids, labels=labels).loss``);
                       on ``world`` > 1 plain data parallelism, FSDP2 over all processes, each holding
                       whole sequences
    transformers_ckpt  the same with transformers' gradient checkpointing
    seqmesh            the ``seqmesh train`` build: sequence parallelism over all processes, chunked loss,
                       FSDP2 on more than one process or in bf16 (as ``seqmesh train`` without ``--fsdp``)
    seqmesh_all        and every memory technique: checkpointing, offloaded checkpoints, tiled MLP,
                       the efficient RMSNorm, FSDP2 CPU offload (host-held bytes are reported apart, not
                       in the peak)
    seqmesh_all_bf16   (on request, CUDA) the same in bf16, as ``seqmesh selftest`` trains its longest sequence
    seqmesh_replicated (on request) ``--no-fsdp``: weights replicated, gradients summed after backward
    seqmesh_fsdp       (on request) ``--fsdp``: FSDP2 even on one process, what FSDP2's per-step copies cost

Each seqmesh method is compared with the transformers method of the same checkpointing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .memory import TECHNIQUES

ALL_TECHNIQUES = TECHNIQUES["all"][0]  # every memory technique, as `seqmesh bench memory --compare` runs them
# method -> (framework, TrainConfig memory options)
METHODS: dict[str, tuple[str, dict]] = {
    "transformers": ("transformers", {}),
    "transformers_ckpt": ("transformers", {"checkpointing": True}),
    "seqmesh": ("seqmesh", {}),
    "seqmesh_all": ("seqmesh", ALL_TECHNIQUES),
    "seqmesh_all_bf16": ("seqmesh", {**ALL_TECHNIQUES, "bf16": True}),  # on CUDA: what seqmesh selftest measures
    "seqmesh_replicated": ("seqmesh", {"fsdp": False}),
    "seqmesh_fsdp": ("seqmesh", {"fsdp": True}),
}
DEFAULT_METHODS = ("transformers", "transformers_ckpt", "seqmesh", "seqmesh_all")
PAIRS: tuple[tuple[str, str], ...] = (("seqmesh", "transformers"), ("seqmesh_all", "transformers_ckpt"),
                                      ("seqmesh_replicated", "transformers"), ("seqmesh_fsdp", "transformers"))


@dataclass
class BaselineBench:
    """One comparison: a model, a per-process budget, a world of CPU processes and a sweep."""

    model: str = "llama-tiny"
    budget: int = 8 << 20
    """Bytes one process may hold (MemoryTracker's peak, the process holding most)."""
    world: int = 4
    start: int = 256
    """First length of the doubling; a multiple of ``resolution``."""
    resolution: int = 256
    """Bisection stops when the first failing length is this many tokens above the last fitting one."""
    limit: int = 1 << 15
    """The sweep stops doubling here (the longest is then reported as at least this)."""
    repeats: int = 3
    """Timed steps per timing point, after one warm-up step; the fastest counts (on a shared machine the
    others measure its other load)."""
    loss_chunk: int = 4096
    """seqmesh's LM-head tile in tokens (TrainConfig.loss_chunk; its default here too)."""

    def __post_init__(self) -> None:
        for name in ("budget", "world", "start", "resolution", "limit", "repeats", "loss_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.start % self.resolution:
            raise ValueError(f"start={self.start} must be a multiple of resolution={self.resolution}; "
                             f"use e.g. start={max(1, self.start // self.resolution) * self.resolution}.")
        if self.start < 8:
            raise ValueError(f"start={self.start} is below the copy task's 8 tokens; start at 8 or more.")


# --- one process's steps ----------------------------------------------------------------------------------
def transformers_build(bench: BaselineBench, options: dict, seq_len: int, device: torch.device | None = None):
    """The plain model (FSDP2 over every process when there are several), its data and its loss; on ``device`` (the
    CPU by default; ``seqmesh bench families`` passes its GPU)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ..training.config import TrainConfig
    from ..model.fsdp import enable_checkpointing
    from ..model.lm import build_model, decoder_layers
    from ..training.run_data import make_dataset

    cfg = TrainConfig(model=bench.model, seq_len=seq_len, symbols=8, **options)
    data = make_dataset(cfg)
    from ..training.step import to_device

    device = device or torch.device("cpu")
    lm = build_model(cfg.model, seed=cfg.seed, device=device)  # transformers' own SDPA attention
    lm.train()
    if cfg.checkpointing:
        enable_checkpointing(lm)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:  # plain data parallelism: weights sharded, every process its own whole sequences
        for layer in decoder_layers(lm):
            fully_shard(layer)
        fully_shard(lm)

    def loss_of(step: int) -> torch.Tensor:
        batch = to_device(data.batch(step, rank, 1, world), device)
        return lm(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss

    return lm, None, loss_of, None, world * seq_len


def seqmesh_config(bench: BaselineBench, options: dict, seq_len: int):
    """The ``TrainConfig`` the seqmesh methods build from (``options``: its memory options)."""
    from ..training.config import TrainConfig

    return TrainConfig(model=bench.model, seq_len=seq_len, symbols=8, dp=1, loss_chunk=bench.loss_chunk, **options)


def _seqmesh_build(bench: BaselineBench, options: dict, seq_len: int):
    """The ``seqmesh train`` build, sequence-parallel over every process."""
    from ..memory.offload import enable_activation_offload
    from ..sequence.batch import shard_batch
    from ..model.fsdp import sync_gradients
    from ..training.step import to_device
    from ..training.train import build, uses_fsdp
    from ..training.run_data import make_dataset

    cfg = seqmesh_config(bench, options, seq_len)
    data = make_dataset(cfg)
    mesh, module, device = build(cfg)
    offload = enable_activation_offload(module.lm, device) if cfg.offload_checkpoints else None
    module.train()

    def loss_of(step: int) -> torch.Tensor:
        local = to_device(shard_batch(data.batch(step, mesh.dp_rank, 1, mesh.dp_size), mesh), device)
        return module(**local)

    after_backward = None if uses_fsdp(cfg) else (lambda: sync_gradients(module, mesh))  # as seqmesh train does
    return module, offload, loss_of, after_backward, mesh.dp_size * seq_len


BUILDERS: dict[str, Callable] = {"transformers": transformers_build, "seqmesh": _seqmesh_build}


def run_method(bench: BaselineBench, method: str, seq_len: int, *, track: bool, timed: int = 0) -> dict:
    """On every process: one step, then (``track``) one tracked step, then ``timed`` timed steps.
    Returns the tracked peak, the first step's loss, the step times and the tokens a step trains."""
    import torch.distributed as dist

    from ..memory import MemoryTracker
    from ..training.step import make_optimizer

    framework, options = METHODS[method]
    module, offload, loss_of, after_backward, tokens = BUILDERS[framework](bench, options, seq_len)
    optimizer = make_optimizer(module, lr=1e-4)

    def step(i: int) -> float:
        loss = loss_of(i)
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    result = {"loss": step(0), "tokens_per_step": tokens}
    if track:
        with MemoryTracker(module, optimizer, offload=offload) as tracker:
            step(1)
        result.update(tracker.report().as_dict())
    times = []
    for i in range(timed):
        dist.barrier()
        start = time.perf_counter()
        step(2 + i)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest process
        times.append(float(elapsed))
    result["seconds"] = times
    return result


# --- the search ---------------------------------------------------------------------------------------------
def longest_within(peak_of: Callable[[int], int], budget: int, start: int, resolution: int,
                   limit: int) -> tuple[int | None, dict[int, int]]:
    """The longest multiple of ``resolution`` whose ``peak_of`` fits ``budget`` (peaks grow with the
    length): doubling from ``start``, then bisection. Returns it (None if ``start`` does not fit) and
    every measured ``{length: peak}``; unless the doubling reached ``limit``, ``longest + resolution``
    is among them and does not fit."""
    peaks: dict[int, int] = {}
    fit, fail, length = None, None, start
    while length <= limit:
        peaks[length] = peak_of(length)
        if peaks[length] > budget:
            fail = length
            break
        fit, length = length, length * 2
    if fit is None or fail is None:
        return fit, peaks
    while fail - fit > resolution:
        mid = fit + (fail - fit) // resolution // 2 * resolution
        peaks[mid] = peak_of(mid)
        fit, fail = (mid, fail) if peaks[mid] <= budget else (fit, mid)
    return fit, peaks


def compare(bench: BaselineBench, methods: tuple[str, ...] = DEFAULT_METHODS, pool=None,
            progress: Callable[[str], None] | None = None) -> dict:
    """Sweep every method on one pool of ``bench.world`` processes (``pool``, or one started here), then
    time each pair side by side; ``progress`` is told each measurement. Returns ``{"methods": {method:
    {longest, peaks, reached_limit, host_bytes}}, "pairs": [{seqmesh, baseline, longest_ratio,
    speed_ratio_at_both, both_seqmesh, both_baseline, own_seqmesh, own_baseline}]}``."""
    from ..comm.launch import WorkerPool

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}.")
    out: dict = {"methods": {}}
    threads = max(1, (os.cpu_count() or 1) // bench.world)
    with contextlib.nullcontext(pool) if pool is not None else WorkerPool(bench.world, threads=threads) as pool:
        def measure(method: str, seq_len: int, **kw) -> dict:
            started = time.perf_counter()
            ranks = pool.run(run_method, bench, method, seq_len, timeout=3600, **kw)
            worst = max(ranks, key=lambda r: r.get("peak_bytes", 0))
            if progress is not None:
                what = (f"peak {worst['peak_bytes'] / 2**20:.2f} MiB" if "peak_bytes" in worst
                        else f"fastest step {min(worst['seconds']):.3f} s")
                progress(f"{method} at {seq_len:,} tokens: {what} ({time.perf_counter() - started:.1f} s)")
            return worst

        for method in methods:
            rows: dict[int, dict] = {}

            def peak_of(seq_len: int, method=method, rows=rows) -> int:
                rows[seq_len] = measure(method, seq_len, track=True)
                return rows[seq_len]["peak_bytes"]

            longest, peaks = longest_within(peak_of, bench.budget, bench.start, bench.resolution, bench.limit)
            out["methods"][method] = {"longest": longest, "peaks": peaks,
                                      "reached_limit": all(p <= bench.budget for p in peaks.values()),
                                      "host_bytes": rows[longest]["host_bytes"] if longest else 0}
        out["pairs"] = _time_pairs(bench, out["methods"], methods, measure)
    return out


def _time_pairs(bench: BaselineBench, swept: dict, methods: tuple[str, ...], measure: Callable) -> list[dict]:
    """Each pair's tokens/s at the longest length both fit and at each one's own longest (each
    ``(method, length)`` timed once, untracked), and the ratios seqmesh / baseline."""
    speeds: dict[tuple[str, int], float] = {}

    def tokens_per_s(method: str, seq_len: int) -> float:
        if (method, seq_len) not in speeds:
            timed = measure(method, seq_len, track=False, timed=bench.repeats)
            speeds[method, seq_len] = timed["tokens_per_step"] / min(timed["seconds"])
        return speeds[method, seq_len]

    pairs = []
    for ours, theirs in PAIRS:
        if ours not in methods or theirs not in methods:
            continue
        mine, base = swept[ours]["longest"], swept[theirs]["longest"]
        pair = {"seqmesh": ours, "baseline": theirs, "longest_ratio": mine / base if mine and base else None}
        both = min(mine, base) if mine and base else None
        for where, length, method in (("both_seqmesh", both, ours), ("both_baseline", both, theirs),
                                      ("own_seqmesh", mine, ours), ("own_baseline", base, theirs)):
            if length:
                pair[where] = {"seq_len": length, "tokens_per_s": tokens_per_s(method, length)}
        if both:
            pair["speed_ratio_at_both"] = pair["both_seqmesh"]["tokens_per_s"] / pair["both_baseline"]["tokens_per_s"]
        pairs.append(pair)
    return pairs


# --- the command ------------------------------------------------------------------------------------------
def format_comparison(bench: BaselineBench, result: dict) -> str:
    mib = bench.budget / 2**20
    lines = [f"seqmesh against plain transformers: {bench.model}, {bench.world} process(es), {mib:g} MiB per process "
             f"(MemoryTracker peak), lengths doubled from {bench.start} then bisected to {bench.resolution} tokens",
             f"{'method':<19}{'longest':>9}{'next fails':>12}{'peak MiB':>10}{'host MiB':>10}"]
    for method, row in result["methods"].items():
        longest, peaks = row["longest"], row["peaks"]
        above = "-" if longest is None or row["reached_limit"] else f"{longest + bench.resolution:,}"
        shown = f"{longest:,}" + ("+" if row["reached_limit"] else "") if longest else "none"
        peak = f"{peaks[longest] / 2**20:.2f}" if longest else "-"
        lines.append(f"{method:<19}{shown:>9}{above:>12}{peak:>10}{row['host_bytes'] / 2**20:>10.2f}")
    lines.append(f"{'seqmesh / baseline':<36}{'longest':>9}{'tokens/s at both':>22}{'tokens/s, each at own':>34}")
    for pair in result["pairs"]:
        ratio = "-"
        if pair["longest_ratio"]:  # a side that reached --limit was not bounded by the budget
            mine, base = (result["methods"][pair[side]]["reached_limit"] for side in ("seqmesh", "baseline"))
            ratio = f"{pair['longest_ratio']:.2f}x"
            ratio = f"<={ratio}" if base and not mine else f"{ratio}+" if mine and not base else ratio
        both = (f"{pair['speed_ratio_at_both']:.2f}x @ {pair['both_seqmesh']['seq_len']:,}"
                if "speed_ratio_at_both" in pair else "-")
        own = "-"
        if "own_seqmesh" in pair and "own_baseline" in pair:
            mine, base = pair["own_seqmesh"]["tokens_per_s"], pair["own_baseline"]["tokens_per_s"]
            own = f"{mine:,.0f} / {base:,.0f} = {mine / base:.2f}x"
        lines.append(f"{pair['seqmesh'] + ' / ' + pair['baseline']:<36}{ratio:>9}{both:>22}{own:>34}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench baseline``."""
    import json
    import sys

    from .memory import parse_bytes

    def run(args) -> int:
        try:
            bench = BaselineBench(model=args.model, budget=args.budget, world=args.world, start=args.start,
                                  resolution=args.resolution, limit=args.limit, repeats=args.repeats,
                                  loss_chunk=args.loss_chunk)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        result = compare(bench, tuple(args.methods), progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(result, indent=1) if args.json else format_comparison(bench, result))
        return 0

    defaults = BaselineBench()
    p = bench_sub.add_parser("baseline", help="longest sequence and tokens/s within a memory budget: seqmesh against "
                             "plain transformers (data parallel) on spawned CPU processes")
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--budget", type=parse_bytes, default=defaults.budget, help="bytes per process (8MiB, 1GiB)")
    p.add_argument("--world", type=int, default=defaults.world, help="processes to spawn (gloo, CPU)")
    p.add_argument("--start", type=int, default=defaults.start, help="first length of the doubling")
    p.add_argument("--resolution", type=int, default=defaults.resolution, help="bisection stops at this many tokens")
    p.add_argument("--limit", type=int, default=defaults.limit, help="longest length the doubling tries")
    p.add_argument("--repeats", type=int, default=defaults.repeats, help="timed steps per timing point (fastest kept)")
    p.add_argument("--loss-chunk", type=int, default=defaults.loss_chunk, help="seqmesh's LM-head tile in tokens")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                   help="default: %(default)s; seqmesh_replicated (--no-fsdp) and seqmesh_fsdp (--fsdp) on request")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of a table")
    p.set_defaults(func=run)
