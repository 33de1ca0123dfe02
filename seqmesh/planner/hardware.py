"""Clusters the planner reasons about: GPUs with memory and peak FLOP/s, a hierarchy of links, the node's
``fabric`` (:mod:`.fabric`), and how ring attention's kernels slow down on smaller blocks (``RingEfficiency``).

Links are listed innermost first: level ``i`` joins aligned blocks of ``group`` consecutive ranks, the outermost
every rank (``group=0``), and two ranks talk over the innermost level whose block holds both. Bandwidths are
achievable bytes/s one GPU sends. Sources and derating of the presets: docs/planner.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from .fabric import GB, Fabric

GiB = 2**30


@dataclass(frozen=True)
class RingEfficiency:
    """Split-and-merge efficiency as a function of ring block tokens: measured ``points``, or, without
    points, the fixed-overhead form ``b / (b + overhead_tokens)``."""

    points: tuple[tuple[int, float], ...] = ()  # (block tokens, efficiency), ascending tokens
    overhead_tokens: float = 0.0  # t0 of the fixed-overhead form; used when there are no points
    source: str = ""

    def __post_init__(self) -> None:
        tokens = [b for b, _ in self.points]
        if tokens != sorted(set(tokens)) or any(b < 1 for b in tokens):
            raise ValueError(f"ring efficiency points {self.points}: block tokens must be positive, distinct and "
                             "ascending.")
        for b, eff in self.points:  # above 1 is possible: smaller blocks can fit caches better (CPU: up to 1.04)
            if not eff > 0:
                raise ValueError(f"ring efficiency {eff} at {b} block tokens must be positive (one call's time over "
                                 "the split-and-merge time); check the bench output.")
        if self.overhead_tokens < 0:
            raise ValueError(f"ring efficiency overhead {self.overhead_tokens} tokens cannot be negative.")

    @classmethod
    def through(cls, block_tokens: int, efficiency: float, source: str = "") -> RingEfficiency:
        """The fixed-overhead form that keeps ``efficiency`` at ``block_tokens``."""
        if not 0 < efficiency <= 1:
            raise ValueError(f"ring efficiency {efficiency} must be in (0, 1] for the fixed-overhead form.")
        return cls(overhead_tokens=block_tokens * (1 / efficiency - 1), source=source)

    def at(self, block_tokens: float) -> float:
        """Efficiency of a ring whose blocks hold ``block_tokens`` query tokens."""
        if not self.points:
            return block_tokens / (block_tokens + self.overhead_tokens)
        if block_tokens <= self.points[0][0]:
            return self.points[0][1]
        for (b0, e0), (b1, e1) in zip(self.points, self.points[1:]):
            if block_tokens <= b1:
                w = (math.log2(block_tokens) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return e0 + w * (e1 - e0)
        return self.points[-1][1]

    def as_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "overhead_tokens": self.overhead_tokens,
                "source": self.source}


DEFAULT_RING_EFFICIENCY = RingEfficiency.through(  # the published figure: 90.2% at 8K-token blocks
    8192, 0.902, "ring-flash-attention README: zigzag ring fwd+bwd 90.2% of ideal on 8 x H800 (89.8% on 8 x A100), "
    "Llama-3.1-8B attention, 8K tokens per GPU; efficiency = b / (b + t0) through it")
IDEAL_RING = RingEfficiency(points=((1, 1.0),), source="ideal: no loss on smaller blocks")


def from_merge_bench(rows: Iterable[dict], source: str = "seqmesh bench merge") -> RingEfficiency:
    """The measured curve from ``seqmesh bench merge --json`` rows (``block_tokens`` and ``efficiency``;
    rows of one block size are averaged)."""
    by_block: dict[int, list[float]] = {}
    for i, row in enumerate(rows):
        if "block_tokens" not in row or "efficiency" not in row:
            raise ValueError(f"ring efficiency row {i} {row} lacks block_tokens or efficiency; give the output of "
                             "`seqmesh bench merge --json`.")
        by_block.setdefault(int(row["block_tokens"]), []).append(float(row["efficiency"]))
    if not by_block:
        raise ValueError("ring efficiency: the bench output has no rows; run `seqmesh bench merge --json` with "
                         "--rings.")
    points = tuple((b, sum(e) / len(e)) for b, e in sorted(by_block.items()))
    return RingEfficiency(points=points, source=source)


def load_ring_efficiency(path: str) -> RingEfficiency:
    """Read ``seqmesh bench merge --json``'s output from ``path``."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--ring-efficiency {path}: cannot read it as JSON ({err}); save `seqmesh bench merge "
                         "--json > FILE` and pass FILE.") from None
    if not isinstance(rows, list):
        raise ValueError(f"--ring-efficiency {path}: expected a list of rows as `seqmesh bench merge --json` prints.")
    return from_merge_bench(rows, source=f"seqmesh bench merge ({path})")


@dataclass(frozen=True)
class LinkLevel:
    """One level of the interconnect."""

    name: str
    group: int  # ranks in one aligned block joined by this level; 0 = every rank (the outermost level)
    bandwidth: float  # achievable bytes/s one GPU sends on this level (with shared_by > 1: one link carries)
    latency: float  # seconds of fixed cost per collective call (or per P2P hop) on this level
    shared_by: int = 1  # aligned GPUs whose traffic on this level shares one link (a PCIe switch's uplink: its 4)

    def __post_init__(self) -> None:
        if self.shared_by < 1:
            raise ValueError(f"link {self.name!r}: shared_by {self.shared_by} must be >= 1 (1: a link per GPU).")
        if self.group < 0:
            raise ValueError(f"link {self.name!r}: group {self.group} must be >= 1, or 0 for 'all ranks'.")
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"link {self.name!r}: bandwidth {self.bandwidth:g} B/s must be > 0 and latency "
                             f"{self.latency:g} s >= 0.")


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU model and how a cluster of them is wired."""

    name: str
    memory_bytes: int  # total memory of one GPU as the driver reports it
    peak_flops: float  # dense bf16 tensor-core FLOP/s of one GPU (fp32 training uses peak_flops_fp32)
    links: tuple[LinkLevel, ...]  # innermost first; the last has group=0
    gpus_per_node: int = 8
    peak_flops_fp32: float | None = None  # dense fp32 FLOP/s without tensor cores (TF32 off); None: unknown
    memory_bandwidth: float = 2e12  # achievable bytes/s of GPU memory (sets the cost of the ring's merges)
    matmul_efficiency: float = 0.5  # achieved / peak for the model's matmuls
    attention_efficiency: float = 0.5  # achieved / peak for flash attention, forward and backward
    source: str = ""  # where the figures come from
    host_bandwidth: float = 25e9  # bytes/s each way between one GPU and pinned host memory: PCIe 5.0 x16 is 64 GB/s
    # raw, ~50 GB/s measured for pinned copies; halved as two GPUs of an HGX board share a PCIe switch
    fabric: Fabric | None = None  # the node's NICs and the switches above; None: only the per-GPU link figures
    ring_efficiency: RingEfficiency = DEFAULT_RING_EFFICIENCY  # ring split-and-merge efficiency by block size

    def __post_init__(self) -> None:
        if not self.links or self.links[-1].group != 0:
            raise ValueError(f"hardware {self.name!r}: the outermost link must join every rank (group 0).")
        groups = [lv.group for lv in self.links[:-1]]
        for inner, outer in zip(groups, groups[1:]):
            if outer <= inner or outer % inner:
                raise ValueError(f"hardware {self.name!r}: link groups {groups} must grow outward, each a multiple of "
                                 f"the one inside it ({outer} is not a multiple of {inner} larger than it).")
        for what, eff in (("matmul", self.matmul_efficiency), ("attention", self.attention_efficiency)):
            if not 0 < eff <= 1:
                raise ValueError(f"hardware {self.name!r}: {what} efficiency {eff} must be in (0, 1].")
        if self.memory_bytes <= 0 or self.peak_flops <= 0 or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: memory {self.memory_bytes} B, peak {self.peak_flops:g} FLOP/s "
                             f"and {self.gpus_per_node} GPUs per node must all be positive.")

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` ("bf16" or "fp32")."""
        if dtype != "fp32":
            return self.peak_flops
        if self.peak_flops_fp32 is None:
            raise ValueError(f"hardware {self.name!r} has no fp32 peak; give --peak-tflops-fp32 (fp32 without tensor "
                             "cores is 1/16 to 1/2 of the bf16 peak depending on the part) or measure it with "
                             "--calibrate.")
        return self.peak_flops_fp32

    def level_of_pair(self, a: int, b: int) -> int:
        """Index of the innermost level that joins ranks ``a`` and ``b``."""
        for i, lv in enumerate(self.links):
            if lv.group == 0 or a // lv.group == b // lv.group:
                return i
        return len(self.links) - 1

    def level_of_group(self, ranks: Sequence[int]) -> int:
        """Index of the innermost level that joins every rank of ``ranks``: blocks are intervals, so their ends'."""
        return self.level_of_pair(min(ranks), max(ranks))

    def link_for_group(self, ranks: Sequence[int]) -> LinkLevel:
        """The level a collective over ``ranks`` crosses: the outermost one any two of them need."""
        return self.links[self.level_of_group(ranks)]

    def peers_by_level(self, rank: int, ranks: Sequence[int]) -> list[int]:
        """How many of ``ranks`` (other than ``rank``) ``rank`` reaches over each level."""
        counts = [0] * len(self.links)
        for r in ranks:
            if r != rank:
                counts[self.level_of_pair(rank, r)] += 1
        return counts

    def with_gpus_per_node(self, per_node: int) -> HardwareSpec:
        """The same GPUs ``per_node`` to a node: levels inside a node clipped to it, the fabric's NICs per GPU kept."""
        if per_node == self.gpus_per_node:
            return self
        inner = [lv for lv in self.links[:-1] if lv.group < per_node and per_node % lv.group == 0]
        exact = [lv for lv in self.links[:-1] if lv.group == per_node]
        node_level = [replace(lv, group=per_node) for lv in self.links[:-1] if lv.group == self.gpus_per_node]
        levels = [*inner, *(exact or node_level)[:1]]  # a level that joins the new node's GPUs, if any does
        fabric = self.fabric
        if fabric is not None:
            fabric = replace(fabric, nics_per_node=max(1, fabric.nics_per_node * per_node // self.gpus_per_node))
        return replace(self, gpus_per_node=per_node, links=(*levels, self.links[-1]), fabric=fabric)

    def describe(self) -> str:
        """One line: memory, FLOP/s and the links."""
        links = ", ".join(f"{lv.name} ({'all' if lv.group == 0 else lv.group}) {lv.bandwidth / GB:.3g} GB/s "
                          f"{lv.latency * 1e6:.0f} us" for lv in self.links)
        fp32 = f" ({self.peak_flops_fp32 / 1e12:.4g} fp32)" if self.peak_flops_fp32 else ""
        net = ""
        if self.fabric is not None:
            f = self.fabric
            switch = f" per {f.nodes_per_switch}-node leaf" if f.nodes_per_switch else ""
            net = (f"; {f.nics_per_node} NIC(s) x {f.nic_bandwidth / GB:.3g} GB/s per node, "
                   f"oversubscription {f.oversubscription:g}{switch}")
        return (f"{self.name}: {self.memory_bytes / GiB:.1f} GiB, {self.peak_flops / 1e12:.4g} TFLOP/s bf16{fp32}, "
                f"{self.gpus_per_node} per node; links {links}{net}")

    def as_dict(self) -> dict:
        keys = ("name", "memory_bytes", "peak_flops", "peak_flops_fp32", "gpus_per_node", "memory_bandwidth",
                "matmul_efficiency", "attention_efficiency", "source", "host_bandwidth")
        return {**{k: getattr(self, k) for k in keys}, "fabric": None if self.fabric is None else asdict(self.fabric),
                "ring_efficiency": self.ring_efficiency.as_dict(), "links": [asdict(lv) for lv in self.links]}


def _node(nvlink_name: str, nv_bw: float, nv_lat: float, net_name: str, net_bw: float, net_lat: float):
    return (LinkLevel(nvlink_name, 8, nv_bw, nv_lat), LinkLevel(net_name, 0, net_bw, net_lat))


# Peaks from NVIDIA datasheets, link and memory bandwidth ~80% of peak, DGX fabrics: docs/planner.md gives the sources.
_DGX_H100_FABRIC = Fabric(8, 40 * GB, 1.0, 32, source="DGX H100/H200: 8 x ConnectX-7 400 Gb/s (80% -> 40 GB/s "
                          "each); SuperPOD: non-blocking fat tree, 32-node scalable units")
_DGX_A100_FABRIC = Fabric(8, 20 * GB, 1.0, 20, source="DGX A100: 8 x ConnectX-6 200 Gb/s HDR (80% -> 20 GB/s each); "
                          "SuperPOD: non-blocking fat tree, 20-node scalable units")
_ROCE_NODE_FABRIC = Fabric(1, 40 * GB, source="one 400 Gb/s RoCE NIC per node (80% -> 40 GB/s), shared by its 8 GPUs")
PRESETS: dict[str, HardwareSpec] = {h.name: h for h in (
    HardwareSpec("h100-nvlink", int(79.6 * GiB), 989.4e12,
                 _node("nvlink4", 360 * GB, 5e-6, "infiniband-ndr", 40 * GB, 15e-6),
                 memory_bandwidth=2.7e12, peak_flops_fp32=67e12, fabric=_DGX_H100_FABRIC,  # HBM3 3.35 TB/s
                 source="H100 SXM5 80GB: 989.4 TFLOP/s dense bf16, NVLink4 450 GB/s per direction (900 GB/s both), "
                        "one 400 Gb/s NDR NIC per GPU"),
    HardwareSpec("h200-nvlink", int(140.4 * GiB), 989.4e12,
                 _node("nvlink4", 360 * GB, 5e-6, "infiniband-ndr", 40 * GB, 15e-6),
                 memory_bandwidth=3.8e12, peak_flops_fp32=67e12, fabric=_DGX_H100_FABRIC,  # HBM3e 4.8 TB/s
                 source="H200 SXM 141GB: same compute and NVLink as H100 SXM, one 400 Gb/s NIC per GPU"),
    HardwareSpec("a100-nvlink", int(80.0 * GiB), 312e12,
                 _node("nvlink3", 240 * GB, 5e-6, "infiniband-hdr", 20 * GB, 15e-6),
                 memory_bandwidth=1.6e12, peak_flops_fp32=19.5e12, fabric=_DGX_A100_FABRIC,  # HBM2e 2.04 TB/s
                 source="A100 SXM4 80GB: 312 TFLOP/s dense bf16, NVLink3 300 GB/s per direction, "
                        "one 200 Gb/s HDR NIC per GPU"),
    HardwareSpec("l20-pcie", int(45.0 * GiB), 119.5e12,
                 (LinkLevel("pcie-switch", 4, 24 * GB, 10e-6),  # PCIe 4.0 x16: 32 GB/s per direction
                  # across switches through the CPU root complex: a switch's 4 GPUs share its one uplink
                  LinkLevel("pcie-host", 8, 12 * GB, 15e-6, shared_by=4),
                  LinkLevel("ethernet", 0, 12 * GB, 25e-6)),  # one GPU to the node's NIC, through the host bridge
                 memory_bandwidth=0.7e12, peak_flops_fp32=59.4e12,  # GDDR6 864 GB/s
                 fabric=_ROCE_NODE_FABRIC,
                 source="L20 48GB: 119.5 TFLOP/s dense bf16, PCIe 4.0 x16, no NVLink; 4 GPUs per PCIe switch, "
                        "8 per node, 400 Gb/s RoCE per node"))}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``hardware.gpus_per_node`` GPUs (the last node may be partly used when there is one)."""

    hardware: HardwareSpec
    gpus: int
    nodes: int = field(default=1)

    def __post_init__(self) -> None:
        per_node = self.hardware.gpus_per_node
        if self.gpus < 1:
            raise ValueError(f"--gpus {self.gpus}: need at least one GPU.")
        if self.nodes > 1 and self.gpus != self.nodes * per_node:
            raise ValueError(f"--gpus {self.gpus} does not match --nodes {self.nodes} x --gpus-per-node {per_node} = "
                             f"{self.nodes * per_node}; give --gpus {self.nodes * per_node} or change "
                             "--nodes/--gpus-per-node.")
        if self.nodes == 1 and self.gpus > per_node:
            raise ValueError(f"--gpus {self.gpus} exceeds one node of {per_node} GPUs; give --nodes "
                             f"{-(-self.gpus // per_node)} with --gpus a multiple of {per_node}, or set "
                             "--gpus-per-node.")


def make_cluster(hardware: HardwareSpec, gpus: int | None = None, nodes: int | None = None,
                 gpus_per_node: int | None = None) -> Cluster:
    """Resolve ``--gpus``, ``--nodes`` and ``--gpus-per-node`` (any may be omitted) into a cluster; raises
    ValueError naming the numbers when they contradict each other."""
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node {gpus_per_node} must be at least 1.")
        hardware = hardware.with_gpus_per_node(gpus_per_node)
    per_node = hardware.gpus_per_node
    if nodes is not None and nodes < 1:
        raise ValueError(f"--nodes {nodes} must be at least 1.")
    if gpus is None:
        gpus = (nodes or 1) * per_node
    if nodes is None:
        if gpus > per_node and gpus % per_node:
            raise ValueError(f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes; use a multiple of "
                             f"{per_node} or set --gpus-per-node.")
        nodes = max(1, gpus // per_node) if gpus >= per_node else 1
    return Cluster(hardware, gpus, nodes)


def parse_link(text: str) -> LinkLevel:
    """``NAME:GROUP:GBPS:US``, e.g. ``pcie:4:24:10`` (4 GPUs per block, 24 GB/s per GPU, 10 us);
    GROUP ``all`` or ``0`` for the outermost level."""
    parts = text.split(":")
    try:
        name, group, bw, lat = parts
        g = 0 if group.lower() in ("all", "0") else int(group)
        return LinkLevel(name, g, float(bw) * GB, float(lat) / 1e6)
    except ValueError as err:
        raise ValueError(f"--link {text!r} must look like NAME:GROUP:GBPS:MICROSECONDS, e.g. pcie:4:24:10 or "
                         f"ib:all:40:15 ({err}).") from None
