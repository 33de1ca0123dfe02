"""``seqmesh plan``: arguments, checks that name the bad number and the fix, and output."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..rules.positions import position_problem
from ..model.presets import MODELS, model_shape
from ..rules.settings import setting_names
from ..rules.flags import add_dataclass_flags, flag_values
from .experts import expert_degrees
from .network import parse_fabric
from .hardware import GB, GiB, PRESETS, HardwareSpec, load_ring_efficiency, make_cluster, parse_link
from .plan import longest_plan, plan
from .report import format_longest, format_plan
from .media import add_media_flags, media_from_flags
from .workload import Workload, global_batch_from


PLANNED = tuple(name for name in setting_names(planned=True) if name != "bf16")  # bf16 is --dtype's


class PlanInputError(ValueError):
    """A bad command line; reported with exit code 2 before any work."""


def register_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``seqmesh``'s subparsers."""
    p = sub.add_parser("plan", help="predict memory, traffic and step time per layout, and recommend one",
                       description="Predict per-GPU memory, per-rank traffic and step time of every ulysses x ring x "
                                   "tensor-parallel x data-parallel layout and recommend one.")
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(MODELS)}) or a config.json path")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch of a sequence group (default 1)")
    add_media_flags(p)
    p.add_argument("--gpus", type=int, help="GPUs in all (default: nodes x gpus-per-node)")
    p.add_argument("--nodes", type=int, help="nodes (default: from --gpus)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the hardware preset's)")
    p.add_argument("--hardware", default="h100-nvlink", help=f"preset: {', '.join(PRESETS)} (default %(default)s)")
    p.add_argument("--memory-gib", type=float, help="memory per GPU, GiB (overrides the preset)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 tensor-core peak per GPU, TFLOP/s (overrides the "
                   "preset; with --dtype fp32 give --peak-tflops-fp32 too)")
    p.add_argument("--peak-tflops-fp32", type=float, help="dense fp32 peak per GPU without tensor cores (TF32 off), "
                   "TFLOP/s: 1/16 to 1/2 of the bf16 peak depending on the part (H100 SXM 67 of 989, A100 19.5 of "
                   "312, L20 59.4 of 119.5)")
    p.add_argument("--memory-bandwidth-gbs", type=float, help="achievable GPU memory bandwidth, GB/s")
    p.add_argument("--link", action="append", metavar="NAME:GROUP:GBPS:US",
                   help="a link level, innermost first (repeat); GROUP 'all' for the outermost; replaces the "
                        "preset's links, e.g. --link pcie:4:24:10 --link host:8:12:15 --link ib:all:40:15")
    p.add_argument("--fabric", metavar="NICS:GBS[:OVERSUB[:NODES_PER_SWITCH]]", help="the network of a node: NICs "
                   "per node, achievable GB/s per NIC, the leaf switches' oversubscription (1 = non-blocking) and "
                   "nodes per leaf switch (default: the preset's, e.g. DGX H100 8:40:1:32; none with --link)")
    p.add_argument("--ring-efficiency", metavar="FILE",
                   help="ring split-and-merge efficiency by block size, from `seqmesh bench merge --json > FILE` "
                        "on the GPU being planned (default: 90.2%% at 8K-token blocks, ring-flash-attention on H800)")
    p.add_argument("--global-batch-seqs", type=int, metavar="N", help="sequences per optimizer step over the "
                   "cluster: only layouts whose dp_shard x --batch divides N, accumulating gradients over the rest")
    p.add_argument("--global-batch-tokens", type=int, metavar="N", help="the same in tokens (a multiple of --seq-len)")
    p.add_argument("--one-group", action="store_true", help="one sequence group over the whole cluster "
                   "(ulysses x ring = GPUs, no data parallelism)")
    p.add_argument("--efficiency", type=float, help="achieved/peak FLOP/s for matmuls and attention (default 0.5)")
    p.add_argument("--matmul-efficiency", type=float, help="achieved/peak FLOP/s for matmuls")
    p.add_argument("--attention-efficiency", type=float, help="achieved/peak FLOP/s for attention")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype (default bf16)")
    p.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=True,
                   help="cross-entropy in chunks, never the full logits (default on)")
    p.add_argument("--reserve-gib", type=float, default=2.0, help="per-GPU memory kept for the CUDA context, "
                   "communication buffers and allocator slack (default %(default)s)")
    add_dataclass_flags(p, Workload, only=PLANNED)  # the run's settings the planner models, one flag each
    p.add_argument("--inference", action="store_true", help="plan `seqmesh generate` instead of training: per "
                   "ulysses x ring layout of the GPUs, each GPU's weights, KV-cache share and prefill activations, the "
                   "prefill's seconds and each decode step's (--seq-len: the prompt's tokens)")
    p.add_argument("--new-tokens", type=int, default=1, help="with --inference: tokens generated after the prompt, "
                   "whose keys and values join the cache (default %(default)s)")
    p.add_argument("--shard-weights", action="store_true", help="with --inference: the weights sharded over the GPUs "
                   "(seqmesh generate --shard-weights), each layer gathered for its forward")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.add_argument("--max-seq-len", action="store_true", help="find the longest sequence that fits per layout")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's matmul/attention throughput and all-to-all/P2P bandwidth "
                        "(2 local processes, under a minute) and use them instead of the preset")
    p.add_argument("--top", type=int, default=12, help="rows of the table (default %(default)s)")
    p.set_defaults(func=cmd_plan)
    return p


def hardware_from_args(args: argparse.Namespace) -> HardwareSpec:
    if args.hardware not in PRESETS:
        raise PlanInputError(f"unknown hardware {args.hardware!r}; presets: {', '.join(PRESETS)} "
                             "(or describe yours with --memory-gib, --peak-tflops and --link).")
    hw = PRESETS[args.hardware]
    changes: dict = {}
    for flag, key, unit in (("memory_gib", "memory_bytes", GiB), ("peak_tflops", "peak_flops", 1e12),
                            ("peak_tflops_fp32", "peak_flops_fp32", 1e12),
                            ("memory_bandwidth_gbs", "memory_bandwidth", GB)):
        value = getattr(args, flag)
        if value is not None:
            if value <= 0:
                raise PlanInputError(f"--{flag.replace('_', '-')} {value} must be positive.")
            changes[key] = int(value * unit) if key == "memory_bytes" else value * unit
    if args.peak_tflops is not None:  # the preset's fp32 peak no longer describes this GPU; fp32 plans must give it
        changes.setdefault("peak_flops_fp32", None)
    for name in ("matmul", "attention"):
        value = getattr(args, f"{name}_efficiency")
        value = value if value is not None else args.efficiency
        if value is not None:
            if not 0 < value <= 1:
                raise PlanInputError(f"--{name}-efficiency / --efficiency {value} must be in (0, 1], e.g. 0.5.")
            changes[f"{name}_efficiency"] = value
    if args.link:
        links = tuple(parse_link(text) for text in args.link)
        inner = [lv.group for lv in links[:-1]]
        changes["links"] = links
        changes["gpus_per_node"] = args.gpus_per_node or (max(inner) if inner else hw.gpus_per_node)
        changes["name"] = f"{hw.name}+custom-links"
        changes["fabric"] = None  # the preset's NICs need not be the described machine's
    if args.fabric:
        changes["fabric"] = parse_fabric(args.fabric)
    if args.ring_efficiency:
        changes["ring_efficiency"] = load_ring_efficiency(args.ring_efficiency)
    return replace(hw, **changes) if changes else hw


def workload_from_args(args: argparse.Namespace, seq_len: int | None) -> Workload:
    model = model_shape(args.model)
    media = media_from_flags(model, args.images, args.image_size, args.video_frames)
    if media is not None and seq_len is None and model.vision is not None:  # --max-seq-len: from the placeholders
        seq_len = max(1, media.tokens(model.vision))
    return Workload(model=model, seq_len=seq_len or 1, batch=args.batch, bf16=args.dtype == "bf16",
                    chunked_loss=args.chunked_loss, reserve_bytes=int(args.reserve_gib * GiB), media=media,
                    **flag_values(Workload, args, only=PLANNED))


def check_args(args: argparse.Namespace):
    """Everything the plan needs (workload, cluster, global batch), checked; raises PlanInputError naming the
    problem and the fix."""
    if args.shard_weights or args.new_tokens != 1:
        raise PlanInputError("--shard-weights and --new-tokens plan generation: add --inference (training's plan "
                             "always shards the weights with FSDP2).")
    if args.seq_len is None and not args.max_seq_len:
        raise PlanInputError("give --seq-len N (tokens per sequence), or --max-seq-len to find the longest that fits.")
    if args.seq_len is not None and args.seq_len < 1:
        raise PlanInputError(f"--seq-len {args.seq_len}: a sequence needs at least 1 token.")
    if args.top < 1:
        raise PlanInputError(f"--top {args.top} must be at least 1.")
    if args.reserve_gib < 0:
        raise PlanInputError(f"--reserve-gib {args.reserve_gib} cannot be negative.")
    try:
        hw = hardware_from_args(args)
        cluster = make_cluster(hw, args.gpus, args.nodes, args.gpus_per_node if not args.link else None)
        work = workload_from_args(args, args.seq_len)
        target = global_batch_from(args.global_batch_seqs, args.global_batch_tokens, args.seq_len, args.batch,
                                   args.one_group)
    except ValueError as err:  # a PlanInputError too: the same message again
        raise PlanInputError(str(err)) from None
    if work.ep != "auto" and cluster.gpus % work.ep:
        fitting = ", ".join(map(str, expert_degrees(work.model, cluster.gpus, "auto")))
        raise PlanInputError(f"--ep {work.ep} does not divide the {cluster.gpus} GPUs: a MoE layer's experts are split "
                             "over ranks holding different tokens (dp x ring x ulysses). Degrees dividing the GPUs and "
                             f"the {work.model.experts} routed experts: {fitting}; or --ep auto.")
    if work.dtype == "fp32" and hw.peak_flops_fp32 is None and not args.calibrate:
        raise PlanInputError(f"--dtype fp32 needs the fp32 peak: --peak-tflops {args.peak_tflops} replaced the "
                             "preset's bf16 peak, and fp32 without tensor cores is not a fixed fraction of it (1/15 "
                             "on an H100, 1/2 on an L20); give --peak-tflops-fp32, or --calibrate to measure it.")
    m = work.model
    if (m.indexed_layers or m.compressed_layers or m.block_sparse_layers) and hw.peak_flops_fp32 is None \
            and not (args.calibrate and work.dtype == "fp32"):
        which = ("DeepSeek Sparse Attention indexer scores" if m.indexed_layers else
                 "MiniMax-M3 block-sparse indexer scores" if m.block_sparse_layers else
                 "DeepSeek-V4's hyper-connections mix (and its CSA indexer scores)")
        raise PlanInputError(f"{m.name}'s {which} in float32 (as transformers does), which needs the fp32 peak: "
                             f"--peak-tflops {args.peak_tflops} replaced the preset's bf16 peak; give "
                             "--peak-tflops-fp32 too.")
    return work, cluster, target


def check_inference_args(args: argparse.Namespace):
    """``--inference``'s workload and cluster, checked; raises PlanInputError naming the problem and the fix."""
    from ..rules.own_attention import DOGE_WINDOW, doge_window_problem
    from .inference import inference_refusal, inference_workload

    if args.seq_len is None:
        raise PlanInputError("--inference needs --seq-len N, the prompt's tokens.")
    if args.seq_len < 1 or args.new_tokens < 1 or args.batch < 1:
        raise PlanInputError(f"--seq-len {args.seq_len}, --new-tokens {args.new_tokens} and --batch {args.batch} must "
                             "each be at least 1.")
    training_only = [flag for flag, value in (("--max-seq-len", args.max_seq_len), ("--one-group", args.one_group),
                                              ("--global-batch-seqs", args.global_batch_seqs),
                                              ("--global-batch-tokens", args.global_batch_tokens),
                                              ("--images", args.images), ("--video-frames", args.video_frames))
                     if value]
    if training_only:
        raise PlanInputError(f"{', '.join(training_only)}: a training option; --inference plans a prompt of "
                             "--seq-len tokens on every GPU as one sequence group. Drop it.")
    if args.dtype == "fp32":
        raise PlanInputError("--inference plans bf16 generation (--dtype bf16).")
    try:
        hw = hardware_from_args(args)
        cluster = make_cluster(hw, args.gpus, args.nodes, args.gpus_per_node if not args.link else None)
        model = model_shape(args.model)
    except ValueError as err:
        raise PlanInputError(str(err)) from None
    why = inference_refusal(model)
    if why:
        raise PlanInputError(why)
    if model.family == "doge":  # every token generation runs, the new ones too (seqmesh.inference refuses the same)
        window = dict(model.extra).get("keep_window_size", DOGE_WINDOW)
        if problem := doge_window_problem(args.seq_len + args.new_tokens - 1, window):
            raise PlanInputError(f"{model.name}: the prompt and the new tokens: {problem}.")
    # a table of positions (seqmesh.inference refuses the same)
    if problem := position_problem(args.seq_len + args.new_tokens - 1, model.position_rows, model.family):
        raise PlanInputError(f"{model.name}: the prompt and the new tokens: {problem}.")
    try:
        work = inference_workload(model, args.seq_len, args.batch, True, int(args.reserve_gib * GiB))
    except ValueError as err:
        raise PlanInputError(str(err)) from None
    return work, cluster


def cmd_plan_inference(args: argparse.Namespace) -> int:
    from .inference import format_inference, inference_plan

    try:
        work, cluster = check_inference_args(args)
    except PlanInputError as err:
        print(f"seqmesh plan: error: {err}", file=sys.stderr)
        return 2
    result = inference_plan(work, cluster, args.new_tokens, args.shard_weights)
    print(json.dumps(result.as_dict(), indent=1) if args.json else format_inference(result))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.inference:
        return cmd_plan_inference(args)
    try:
        work, cluster, target = check_args(args)
    except PlanInputError as err:
        print(f"seqmesh plan: error: {err}", file=sys.stderr)
        return 2
    if args.calibrate:
        from .calibrate import apply_calibration, calibrate, format_calibration

        measured = calibrate(dtype=work.dtype)
        print(format_calibration(measured), file=sys.stderr if args.json else sys.stdout)
        cluster = replace(cluster, hardware=apply_calibration(cluster.hardware, measured, work.dtype))
    if args.max_seq_len:
        result = longest_plan(work, cluster, target)
        print(json.dumps(result, indent=1) if args.json else format_longest(result, work, cluster, args.top))
        return 0
    result = plan(work, cluster, target)
    print(json.dumps(result.as_dict(), indent=1) if args.json else format_plan(result, args.top))
    return 0
