"""``seqmesh plan --calibrate``: measure this machine's matmul and attention throughput (with the planner's FLOP
formulas) and seqmesh's all-to-all and ring exchange over two gloo ranks, instead of trusting a preset. What is
measured and where it replaces the preset: docs/planner.md ("Calibration").
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace

from .hardware import GB, HardwareSpec
from .attention_layer import ATTENTION_BACKWARD, attention_pairs
from .workload import COMPUTE_DTYPES


@dataclass(frozen=True)
class Calibration:
    """What this machine achieved."""

    device: str
    dtype: str
    matmul_flops: float  # achieved FLOP/s of a square matmul
    attention_flops: float  # achieved FLOP/s of causal attention forward+backward (planner's FLOP count)
    all_to_all_bandwidth: float  # bytes/s one rank sends in a 2-rank all-to-all
    all_to_all_latency: float  # seconds per small all-to-all
    p2p_bandwidth: float  # bytes/s one rank sends in a ring exchange
    p2p_latency: float  # seconds per small ring exchange
    seconds: float  # wall time of the calibration


def _timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_compute(device: str = "cpu", dtype: str = "fp32", size: int | None = None,
                    seq_len: int | None = None) -> tuple[float, float, str]:
    """``(matmul FLOP/s, attention FLOP/s, torch dtype name)`` on ``device`` in ``dtype`` ("bf16", "fp32")."""
    import torch

    from ..kernels import kernel_chooser
    from ..kernels.base import BlockMask

    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"calibration dtype {dtype!r}: choose one of {', '.join(COMPUTE_DTYPES)}.")
    cuda = device.startswith("cuda")
    torch_dtype = getattr(torch, COMPUTE_DTYPES[dtype])
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    n = size or (8192 if cuda else 1024)
    a, b = (torch.randn(n, n, device=device, dtype=torch_dtype) for _ in range(2))
    mm = 2 * n**3 / _timed(lambda: a @ b, 5, sync)

    s = seq_len or (8192 if cuda else 1024)
    heads, d = (16, 128) if cuda else (8, 64)
    q, k, v, dout = (torch.randn(1, s, heads, d, device=device, dtype=torch_dtype) for _ in range(4))
    mask, scale = BlockMask(causal=True), d**-0.5
    kernel = kernel_chooser("auto")(q, k, mask)

    def fwd_bwd() -> None:
        out, lse = kernel.forward(q, k, v, mask, scale)
        kernel.backward(dout, q, k, v, out, lse, mask, scale)

    flops = 4 * d * heads * attention_pairs(s, True) * (1 + ATTENTION_BACKWARD)
    attn = flops / _timed(fwd_bwd, 3, sync)
    return mm, attn, COMPUTE_DTYPES[dtype]


def measure_links(small: int = 1024, large: int = 8 * 2**20, repeats: int = 5) -> dict:
    """Runs on each of 2 ranks: seconds of a small and a large all-to-all and ring exchange, and the
    bytes seqmesh's counters saw this rank send for one large call of each."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from ..comm.collectives import all_to_all_rows
    from ..comm.p2p import RingExchange
    from ..comm.stats import comm_stats

    group = dist.group.WORLD
    world = dist.get_world_size(group)
    exchange, barrier = RingExchange(group, "forward"), partial(dist.barrier, group)
    out = {}
    for name, nbytes in (("small", small), ("large", large)):
        rows = max(1, nbytes // 4 // 256)  # float32 rows of 256 elements, per destination
        x = torch.randn(world * rows, 256)
        with comm_stats() as stats:
            out[f"a2a_{name}_s"] = _timed(lambda: all_to_all_rows(x, group, [rows] * world, [rows] * world, "forward"),
                                          repeats, barrier)
            out[f"p2p_{name}_s"] = _timed(lambda: exchange.start(x[:rows]).wait(), repeats, barrier)
        calls = repeats + 1
        out[f"a2a_{name}_bytes"] = stats.sent("all_to_all") // calls
        out[f"p2p_{name}_bytes"] = stats.sent("p2p") // calls
    return out


def _bandwidth(r: dict, kind: str) -> float:
    """Bytes/s of ``kind`` ("a2a" or "p2p") in :func:`measure_links`' figures: the large message's extra bytes over
    its extra time."""
    extra = max(r[f"{kind}_large_s"] - r[f"{kind}_small_s"], 1e-9)
    return max(r[f"{kind}_large_bytes"] - r[f"{kind}_small_bytes"], 1) / extra


def calibrate(device: str | None = None, dtype: str = "bf16") -> Calibration:
    """Measure compute in ``dtype`` on ``device`` (cuda if present, else cpu) and links over 2 local gloo ranks."""
    import torch

    from ..comm.launch import spawn

    start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    if device == "cpu":  # a CPU "device" is one of the 2 measured processes: half the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        mm, attn, measured_dtype = measure_compute(device, dtype)
    finally:
        torch.set_num_threads(threads)
    ranks = spawn(measure_links, 2, timeout=120.0, threads=max(1, (os.cpu_count() or 2) // 2))
    r = {k: max(x[k] for x in ranks) for k in ranks[0]}
    return Calibration(device=device, dtype=measured_dtype, matmul_flops=mm, attention_flops=attn,
                       all_to_all_bandwidth=_bandwidth(r, "a2a"), all_to_all_latency=r["a2a_small_s"],
                       p2p_bandwidth=_bandwidth(r, "p2p"), p2p_latency=r["p2p_small_s"],
                       seconds=time.perf_counter() - start)


def apply_calibration(hw: HardwareSpec, cal: Calibration, dtype: str) -> HardwareSpec:
    """``hw`` with the measured rates: matmul throughput becomes the peak (efficiency 1), attention its
    ratio to it; on the CPU the levels inside a node take the measured all-to-all bandwidth and the
    larger of the two latencies. The measurement must be in the planned ``dtype`` ("bf16" or "fp32")."""
    if cal.dtype != COMPUTE_DTYPES.get(dtype):
        raise ValueError(f"the calibration measured {cal.dtype} but the plan computes in {dtype}; calibrate with "
                         f"dtype={dtype!r} (seqmesh plan --calibrate does).")
    peak = {"peak_flops": cal.matmul_flops} if dtype == "bf16" else {"peak_flops_fp32": cal.matmul_flops}
    links = hw.links
    if cal.device == "cpu":
        latency = max(cal.all_to_all_latency, cal.p2p_latency)
        links = tuple(replace(lv, bandwidth=cal.all_to_all_bandwidth, latency=latency)
                      if lv.group and lv.group <= hw.gpus_per_node else lv for lv in hw.links)
    return replace(hw, name=f"{hw.name} (calibrated on {cal.device})", links=links, matmul_efficiency=1.0,
                   attention_efficiency=min(1.0, cal.attention_flops / cal.matmul_flops), **peak)


def format_calibration(cal: Calibration) -> str:
    return (f"calibrated on {cal.device} ({cal.dtype}) in {cal.seconds:.1f} s: matmul {cal.matmul_flops / 1e12:.3g} "
            f"TFLOP/s, attention fwd+bwd {cal.attention_flops / 1e12:.3g} TFLOP/s; 2-rank gloo all-to-all "
            f"{cal.all_to_all_bandwidth / GB:.3g} GB/s ({cal.all_to_all_latency * 1e6:.0f} us), ring P2P "
            f"{cal.p2p_bandwidth / GB:.3g} GB/s ({cal.p2p_latency * 1e6:.0f} us)")
