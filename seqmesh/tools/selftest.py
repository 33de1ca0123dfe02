"""``seqmesh selftest``: everything the first GPU run should tell us, from one command.

On a machine with a CUDA device it installs nothing and runs, in order:

1. ``environment``: torch, CUDA, the device, whether flash-attn is importable;
2. ``gpu_tests``: the CUDA tests of the checkout (``tests/attention/test_gpu.py``) when there is one;
3. ``kernels``: each local attention kernel's forward+backward against torch's own
   ``scaled_dot_product_attention`` on the same shapes (bf16, causal, GQA), timed with CUDA events,
   with the largest difference from SDPA's output;
4. ``memory``: ``seqmesh bench memory`` on one GPU with every memory technique: the tracked tensor
   peak, ``torch.cuda.max_memory_allocated`` and the planner's prediction, side by side;
5. ``rehearsal``: the same model's step at the longest of those lengths, trained for real (``seqmesh train``'s
   own step, tracked) and rehearsed on fake tensors (``seqmesh rehearse``, :mod:`seqmesh.rehearsal`), side by
   side: the tracked peak, the allocator's and the rehearsal's, and where each fell;
6. ``longest``: the longest Llama-3.1-8B-shaped sequence (the ``llama3-8b`` preset) that trains a step
   on one GPU with every memory technique, by doubling then bisection, each trial in a fresh process,
   an out-of-memory error counting as not fitting; bounded by ``--minutes`` (the best found so far is
   reported, marked ``bounded``).

It writes one JSON (``--out``) and prints a short table. On a machine without CUDA it prints what it
would run and exits 0; ``--rehearse`` runs the same steps on the CPU at toy sizes (what ``make test``
checks). docs/gpu.md says how to read the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .rehearse import Launch, launch_process

ALL_TECHNIQUES = dict(checkpointing=True, offload_checkpoints=True, tiled_mlp=True, efficient_norm=True,
                      fsdp_cpu_offload=True)


@dataclass
class SelftestPlan:
    device: str  # cuda, or cpu for the rehearsal
    dtype: str
    kernel_shapes: list[tuple[int, int, int, int]]  # (seq_len, q heads, kv heads, head dim), batch 1
    memory_model: str
    memory_seq_lens: list[int]
    longest_model: str
    longest_start: int
    longest_resolution: int
    longest_limit: int
    budget_bytes: int  # what one trial may hold (CUDA: the device's memory; the rehearsal: a tracked budget)
    minutes: float
    gpu_tests: list[str] = field(default_factory=list)


STEPS = ("gpu_tests", "kernels", "memory", "rehearsal", "longest")  # in the order run_selftest runs them
HOST_BYTES_PER_PARAMETER = 16 * 1.15  # FSDP2 CPU offload: fp32 weights, gradients, two AdamW states; 15% spare


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def longest_model(host_bytes: int) -> tuple[str, str]:
    """Llama-3.1-8B's shape when the host can hold its offloaded training state, else the largest preset that
    fits; and why."""
    from ..model.presets import MODELS

    for name in ("llama3-8b", "llama3.2-1b"):
        need = MODELS[name].params * HOST_BYTES_PER_PARAMETER
        if need <= host_bytes:
            return name, f"{name}: its offloaded state needs {need / 2**30:.0f} GiB of the host's {host_bytes / 2**30:.0f}"
    return "llama-tiny", f"the host's {host_bytes / 2**30:.0f} GiB hold no larger preset's offloaded state"


def cuda_plan(minutes: float) -> SelftestPlan:
    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 80 << 30
    model, _ = longest_model(host_memory_bytes())
    return SelftestPlan("cuda", "bfloat16", [(8192, 32, 8, 128), (32768, 32, 8, 128)], "llama3.2-1b",
                        [8192, 16384, 32768], model, 32768, 32768, 1 << 22, total, minutes,
                        ["tests/attention/test_gpu.py", "tests/attention/test_sparse_latent_kernel.py",
                         "tests/attention/test_flash_triton.py"])


def rehearsal_plan() -> SelftestPlan:
    return SelftestPlan("cpu", "float32", [(256, 4, 2, 32)], "llama-tiny", [256, 512], "llama-tiny", 256, 256, 2048,
                        4 << 20, 5.0)


def describe(plan: SelftestPlan) -> str:
    lines = [f"seqmesh selftest on {plan.device} would run:",
             f"  gpu_tests  pytest {' '.join(plan.gpu_tests) or '(none)'}",
             f"  kernels    every local kernel vs torch SDPA, fwd+bwd, {plan.dtype}, causal, shapes (S, Hq, Hk, D): "
             f"{plan.kernel_shapes}",
             f"  memory     {plan.memory_model} at {plan.memory_seq_lens} tokens, every memory technique: tracked "
             "peak, allocator peak, planner",
             f"  rehearsal  {plan.memory_model} at {plan.memory_seq_lens[-1]} tokens, every memory technique but the "
             "CPU offload: the tracked step beside seqmesh rehearse's",
             f"  longest    {plan.longest_model}, every memory technique: doubling from {plan.longest_start:,} then "
             f"bisection to {plan.longest_resolution:,} tokens, at most {plan.longest_limit:,}, "
             f"{plan.budget_bytes / 2**30:.1f} GiB, {plan.minutes:g} minutes at most "
             f"({longest_model(host_memory_bytes())[1]})"]
    return "\n".join(lines)


# --- the steps -------------------------------------------------------------------------------------------------
def environment() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None, "memory_bytes": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, memory_bytes=props.total_memory, capability=list(torch.cuda.get_device_capability()))
        out["recurrent_kernels"] = recurrent_kernels(torch.device("cuda", 0))
        out["triton_kernels"] = triton_kernels(torch.device("cuda", 0))
    try:
        import flash_attn  # noqa: F401

        out["flash_attn"] = getattr(flash_attn, "__version__", "present")
    except ImportError:
        out["flash_attn"] = None
    return out


def recurrent_kernels(device: torch.device) -> dict[str, str]:
    """Each optional recurrent-mixer kernel on ``device``: "runs", "absent" (not installed) or "fails" (probed: the
    torch rule runs instead, and the probe has warned with the error and the fix)."""
    from ..linear_attention.kernels import KERNELS, probe_kernels

    return {name: "runs" if works else "absent" if KERNELS[name].load() is None else "fails"
            for name, works in probe_kernels(device).items()}


def triton_kernels(device: torch.device) -> dict[str, str]:
    """seqmesh's Triton kernels on ``device``: DeepSeek Sparse Attention's two (the indexer's scores, the latent
    attention), the flash kernel ALiBi runs on (``triton_flash``), and the recurrent rules' loops over chunks
    (``carry``: Gated DeltaNet's and KDA's; ``scan``: Mamba2's and lightning attention's): "runs", "absent" (no
    Triton) or "fails" (probed: the torch form or the math kernel runs instead, and the probe has warned)."""
    from ..kernels import flash_triton_kernel, sparse_latent
    from ..linear_attention import carry, decay_scan

    return {name: "runs" if works else "absent" if probe.kernels[name].load() is None else "fails"
            for probe in (sparse_latent.PROBE, flash_triton_kernel.PROBE, carry.CARRY_PROBE,
                          decay_scan.SCAN_PROBE)
            for name, works in probe.probe_all(device).items()}


def run_gpu_tests(plan: SelftestPlan) -> dict:
    """pytest on the checkout's CUDA tests; the summary line and the exit code."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = [f for f in plan.gpu_tests if os.path.isfile(os.path.join(root, f))]
    if not files:
        return {"ran": False, "why": "no test files in this installation (run from a checkout)"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=root,
                          capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    return {"ran": True, "exit_code": done.returncode, "summary": summary}


def _timed(fn, device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def time_kernels(plan: SelftestPlan) -> list[dict]:
    """Each kernel that supports the shape, forward+backward, against SDPA on the same tensors."""
    import torch.nn.functional as F

    from ..kernels import AUTO_ORDER, KERNELS, BlockMask

    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    mask = BlockMask(causal=True)
    rows = []
    for seq_len, hq, hk, d in plan.kernel_shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, seq_len, hq, d, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(1, seq_len, hk, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        dout = torch.randn_like(q)
        scale = d ** -0.5

        def sdpa():  # torch's own GQA: compact K/V, as seqmesh's kernels get them
            qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            out.backward(dout.transpose(1, 2))
            return out.transpose(1, 2)

        want = sdpa().detach()
        baseline = _timed(sdpa, device)
        rows.append({"shape": [seq_len, hq, hk, d], "kernel": "torch_sdpa", "seconds": baseline, "vs_sdpa": 1.0,
                     "max_diff": 0.0})
        for name in AUTO_ORDER:
            kernel = KERNELS[name]
            why = kernel.unsupported(q, k, mask, v)
            if name == "math" and device.type == "cuda":  # it builds the whole score matrix: 128 GiB at 32K
                why = "the reference kernel holds every score at once; timed on the CPU only"
            if why is not None:
                rows.append({"shape": [seq_len, hq, hk, d], "kernel": name, "skipped": why})
                continue

            def run(kernel=kernel):
                out, lse = kernel.forward(q, k, v, mask, scale)
                kernel.backward(dout, q, k, v, out, lse, mask, scale)
                return out

            try:
                diff = float((run().float() - want.float()).abs().max())
                seconds = _timed(run, device)
            except torch.OutOfMemoryError as err:
                rows.append({"shape": [seq_len, hq, hk, d], "kernel": name, "skipped": f"out of memory: {err}"[:200]})
                continue
            rows.append({"shape": [seq_len, hq, hk, d], "kernel": name, "seconds": seconds,
                         "vs_sdpa": seconds / baseline, "max_diff": diff})
        rows.append(_alibi_row(q, k, v, dout, scale, baseline))
        del q, k, v, dout, want
        if device.type == "cuda":  # the steps after this run in other processes on the same GPU
            torch.cuda.empty_cache()
    return rows


def _alibi_row(q, k, v, dout, scale: float, baseline: float) -> dict:
    """seqmesh's Triton flash kernel with ALiBi (BLOOM's slopes) on the causal call, forward+backward, over SDPA's
    time without a bias; ``max_diff`` over its first 1,024 queries, which see only the first 1,024 keys, against
    SDPA given that block's bias as a mask."""
    import torch.nn.functional as F

    from ..kernels import KERNELS, BlockMask

    heads, shape = q.shape[2], [q.shape[1], q.shape[2], k.shape[2], q.shape[3]]  # tokens, q and kv heads, width
    slopes = tuple(2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads))
    mask, kernel = BlockMask(causal=True, alibi=slopes), KERNELS["triton_flash"]
    if (why := kernel.unsupported(q, k, mask, v)) is not None:
        return {"shape": shape, "kernel": "triton+alibi", "skipped": why}

    def run():
        out, lse = kernel.forward(q, k, v, mask, scale)
        kernel.backward(dout, q, k, v, out, lse, mask, scale)
        return out

    n = min(1024, q.shape[1])
    gap = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]
    bias = -torch.tensor(slopes, device=q.device)[:, None, None] * gap
    bias = bias.masked_fill(gap < 0, float("-inf")).to(q.dtype)  # (H, n, n)
    want = F.scaled_dot_product_attention(*(t[:, :n].transpose(1, 2) for t in (q, k, v)), attn_mask=bias,
                                          scale=scale, enable_gqa=True).transpose(1, 2)
    diff = float((run()[:, :n].float() - want.float()).abs().max())
    seconds = _timed(run, q.device)
    return {"shape": shape, "kernel": "triton+alibi", "seconds": seconds, "vs_sdpa": seconds / baseline,
            "max_diff": diff}


def memory_rows(plan: SelftestPlan) -> list[dict]:
    """``seqmesh bench memory`` on one device with every technique (FSDP2 on one process, as the planner models)."""
    from ..bench.memory import MemoryBench, sweep

    bench = MemoryBench(model=plan.memory_model, seq_lens=plan.memory_seq_lens, world=1, options=ALL_TECHNIQUES,
                        device=plan.device)
    return sweep(bench)


def _trial(model: str, seq_len: int, device: str) -> dict:
    """On a fresh rank: two training steps of ``model`` at ``seq_len`` with every technique; the peak."""
    from ..bench.baseline import BaselineBench, run_method

    bench = BaselineBench(model=model, world=1, start=8, resolution=8)
    try:
        if device == "cuda":  # bf16 as the planner assumes; one step, its allocator peak (the optimizer is on the host)
            torch.cuda.reset_peak_memory_stats()
            run_method(bench, "seqmesh_all_bf16", seq_len, track=False)
            return {"peak_bytes": torch.cuda.max_memory_allocated(), "oom": False}
        # the CPU rehearsal: two fp32 steps, the second's tracked tensor peak
        return {"peak_bytes": run_method(bench, "seqmesh_all", seq_len, track=True)["peak_bytes"], "oom": False}
    except torch.OutOfMemoryError:
        return {"peak_bytes": None, "oom": True}


def _tracked_training(cfg) -> dict:
    """On a fresh rank: ``seqmesh train``'s run of ``cfg`` (``track_memory`` set); the last step's tracked tensors."""
    import torch.distributed as dist

    from ..training.train import train

    train(cfg)
    if dist.get_rank() != 0:
        return {}
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    return steps[-1]["tensor_memory"]


def rehearsal_rows(plan: SelftestPlan, launch: Launch = launch_process) -> list[dict]:
    """The real step beside its rehearsal: :data:`ALL_TECHNIQUES` but the CPU offload (the step ``seqmesh train``
    takes on one device: on a GPU in bf16, under FSDP2's mixed precision), two steps, the second tracked; then
    ``seqmesh rehearse`` of
    the same run on fake tensors. Where the two differ, the rehearsal (and the planner, which models the same
    tensors) misses what this device's kernels keep."""
    import dataclasses
    import tempfile

    from ..comm.launch import WorkerPool
    from ..training.config import TrainConfig
    from .rehearse import run_rehearsal

    techniques = {k: v for k, v in ALL_TECHNIQUES.items() if k != "fsdp_cpu_offload"}
    seq_len = plan.memory_seq_lens[-1]
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=plan.memory_model, seq_len=seq_len, steps=2, log_every=1, track_memory=True,
                          bf16=plan.device == "cuda", out=out, **techniques)
        backend = "nccl" if plan.device == "cuda" else "gloo"
        with WorkerPool(1, threads=max(1, os.cpu_count() or 1), backend=backend) as pool:
            real = pool.run(_tracked_training, cfg, timeout=1800)[0]
    fake = run_rehearsal(dataclasses.replace(cfg, out="unused"), 1, timeout=1800, device=plan.device, top=3,
                         launch=launch)
    return [{"seq_len": seq_len, "tracked_peak_bytes": real["peak_bytes"],
             "allocator_peak_bytes": real["cuda_max_allocated"],
             "tracked_by_category": {k.removesuffix("_bytes"): v for k, v in real.items()
                                     if k.endswith("_bytes") and k != "peak_bytes"},
             "rehearsed_peak_bytes": fake["measured_peak_bytes"], "rehearsed_by_category": fake["measured_by_category"],
             "rehearsed_phase": fake["peak_phase"], "kernels": fake["kernels"],
             "rehearsed_over_tracked": fake["measured_peak_bytes"] / real["peak_bytes"]}]


class _OutOfTime(Exception):
    pass


def longest_sequence(plan: SelftestPlan) -> dict:
    """The longest length that trains within the budget (doubling, then bisection), trial by trial."""
    from ..bench.baseline import longest_within
    from ..comm.launch import WorkerPool

    deadline = time.monotonic() + 60 * plan.minutes
    trials: dict[int, dict] = {}

    def peak_of(seq_len: int) -> int:
        if time.monotonic() > deadline:
            raise _OutOfTime
        began = time.monotonic()
        backend = "nccl" if plan.device == "cuda" else "gloo"
        try:
            with WorkerPool(1, threads=max(1, os.cpu_count() or 1), backend=backend) as pool:
                result = pool.run(_trial, plan.longest_model, seq_len, plan.device,
                                  timeout=max(60.0, deadline - time.monotonic()))[0]
        except RuntimeError as err:  # the trial's time ran out, or the host killed it (no CUDA OOM to catch)
            trials[seq_len] = {"peak_bytes": None, "oom": False, "failed": str(err)[-300:],
                               "seconds": time.monotonic() - began}
            raise _OutOfTime from None
        trials[seq_len] = {**result, "seconds": time.monotonic() - began}
        return plan.budget_bytes + 1 if result["oom"] else result["peak_bytes"]

    bounded = False
    try:
        longest, _ = longest_within(peak_of, plan.budget_bytes, plan.longest_start, plan.longest_resolution,
                                    plan.longest_limit)
    except _OutOfTime:
        bounded = True
        fitting = [n for n, t in trials.items() if t["peak_bytes"] is not None and t["peak_bytes"] <= plan.budget_bytes]
        longest = max(fitting) if fitting else None
    return {"model": plan.longest_model, "longest": longest, "bounded": bounded,
            "trials": {str(n): t for n, t in sorted(trials.items())}}


def run_selftest(plan: SelftestPlan, out: str | None, launch: Launch = launch_process) -> dict:
    """Every step in order; a step that fails is recorded (``{"error": ...}``) and the next one runs; the
    report is written after each step, so a run cut short still leaves what it measured. ``launch``: how the
    rehearsal's process starts (``seqmesh.tools.rehearse.run_rehearsal``'s)."""
    report = {"plan": asdict(plan), "environment": {**environment(), "host_bytes": host_memory_bytes(),
                                                    "longest_model": longest_model(host_memory_bytes())[1]}}
    steps = {"gpu_tests": lambda: run_gpu_tests(plan) if plan.device == "cuda" else {"ran": False, "why": "no CUDA device"},
             "kernels": lambda: time_kernels(plan), "memory": lambda: memory_rows(plan),
             "rehearsal": lambda: rehearsal_rows(plan, launch), "longest": lambda: longest_sequence(plan)}
    for name in STEPS:
        try:
            report[name] = steps[name]()
        except Exception as err:  # noqa: BLE001  the other steps still tell us something
            report[name] = {"error": f"{type(err).__name__}: {err}"[-2000:]}
        if out:
            with open(out, "w") as f:
                json.dump(report, f, indent=1, default=str)
    return report


def format_report(report: dict) -> str:
    env = report["environment"]
    lines = [f"seqmesh selftest: {env['device'] or 'CPU (rehearsal)'}, torch {env['torch']}, CUDA {env['cuda']}, "
             f"flash-attn {env['flash_attn'] or 'absent'}"]
    if env.get("recurrent_kernels"):
        lines.append("recurrent kernels: " + ", ".join(f"{name} {verdict}" + (" (seqmesh's torch rule runs instead)"
                                                                             if verdict == "fails" else "")
                                                       for name, verdict in env["recurrent_kernels"].items()))
    if env.get("triton_kernels"):
        lines.append("seqmesh's Triton kernels: " + ", ".join(
            f"{name} {verdict}" + (" (seqmesh's torch form runs instead)" if verdict == "fails" else "")
            for name, verdict in env["triton_kernels"].items()))
    failed = [name for name in STEPS if isinstance(report[name], dict)
              and "error" in report[name]]
    for name in failed:
        lines.append(f"{name}: FAILED: {report[name]['error'][-300:]}")
    report = {**report, **{name: ({"ran": False, "why": "failed"} if name == "gpu_tests" else
                                  {"model": "-", "longest": None, "bounded": True} if name == "longest" else [])
                           for name in failed}}
    tests = report["gpu_tests"]
    lines.append(f"gpu tests: {tests['summary'] if tests['ran'] else 'not run (' + tests['why'] + ')'}")
    lines.append(f"{'kernel':<16}{'S, Hq, Hk, D':>22}{'ms':>10}{'/ sdpa':>8}{'max diff':>10}")
    for r in report["kernels"]:
        if "skipped" in r:
            lines.append(f"{r['kernel']:<16}{str(r['shape']):>22}  skipped: {r['skipped'][:60]}")
        else:
            lines.append(f"{r['kernel']:<16}{str(r['shape']):>22}{1000 * r['seconds']:>10.2f}{r['vs_sdpa']:>8.2f}"
                         f"{r['max_diff']:>10.1e}")
    lines.append(f"{'memory seq_len':<16}{'tracked MiB':>12}{'allocator MiB':>15}{'planner MiB':>13}{'planner/tracked':>17}")
    for r in report["memory"]:
        allocator = f"{r['allocator_peak_bytes'] / 2**20:15.1f}" if "allocator_peak_bytes" in r else f"{'-':>15}"
        lines.append(f"{r['seq_len']:<16}{r['peak_bytes'] / 2**20:>12.1f}{allocator}{r['predicted_bytes'] / 2**20:>13.1f}"
                     f"{r['predicted_ratio']:>17.3f}")
    lines.append(f"{'rehearsal seq_len':<18}{'tracked MiB':>12}{'allocator MiB':>15}{'rehearsed MiB':>15}"
                 f"{'rehearsed/tracked':>19}")
    for r in report["rehearsal"]:
        allocator = "-" if r["allocator_peak_bytes"] is None else f"{r['allocator_peak_bytes'] / 2**20:.1f}"
        lines.append(f"{r['seq_len']:<18}{r['tracked_peak_bytes'] / 2**20:>12.1f}{allocator:>15}"
                     f"{r['rehearsed_peak_bytes'] / 2**20:>15.1f}{r['rehearsed_over_tracked']:>19.3f}")
    longest = report["longest"]
    lines.append(f"longest {longest['model']} sequence with every memory technique: "
                 f"{longest['longest'] if longest['longest'] is not None else 'none'} tokens"
                 + (" (bounded by --minutes)" if longest["bounded"] else ""))
    return "\n".join(lines)


def add_command(sub) -> None:
    """``seqmesh selftest``."""

    def run(args: argparse.Namespace) -> int:
        if args.rehearse:
            plan = rehearsal_plan()
        else:
            plan = cuda_plan(args.minutes)
            if args.dry_run or not torch.cuda.is_available():
                print(describe(plan))
                if not torch.cuda.is_available():
                    print("no CUDA device here: nothing run (--rehearse runs the same steps on the CPU at toy sizes).")
                return 0
        report = run_selftest(plan, args.out)
        print(format_report(report))
        if args.out:
            print(f"report: {args.out}")
        return 0

    p = sub.add_parser("selftest", help="the first GPU run: GPU tests, kernels vs SDPA, memory vs the planner and "
                                        "the rehearsal, the longest sequence on one GPU")
    p.add_argument("--out", default="selftest.json", help="the JSON report (default %(default)s)")
    p.add_argument("--minutes", type=float, default=30.0, help="time bound of the longest-sequence search")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--rehearse", action="store_true", help="run every step on the CPU at toy sizes")
    p.set_defaults(func=run)
