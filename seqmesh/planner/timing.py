"""Seconds per training step: FLOPs over achieved throughput, bytes over link bandwidth, and which of
them overlap. The assumptions are listed in docs/planner.md ("Modelling assumptions", "Time").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .hardware import HardwareSpec
from .experts import exchange_seconds, layer_fsdp_seconds, moe_layers
from .memory import local_tokens
from .activations import tp_heads
from .layers import Attention, attention_average, attention_pairs, layer_kinds
from .network import axis_all_to_all_seconds, every_group, fsdp_seconds, ring_hop_seconds
from ..rules.padding import padded_length
from ..rules.heads import HeadDeal
from ..rules.overlap import ASYNC_PIECES, pipelined_exposed
from .tensor_parallel import layer_seconds, split_params, step_seconds
from .traffic import call_bytes, fsdp_traffic, ring_block_bytes
from ..rules.degrees import Degrees
from .workload import Workload, layer_matmul_params

__all__ = ["ATTENTION_BACKWARD", "StepTime", "attention_pairs", "ring_attention_seconds", "ring_hop_count", "step_time"]

ATTENTION_BACKWARD = 2.5  # flash-attention backward FLOPs / forward FLOPs


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on the slowest GPU."""

    total: float
    compute: float  # matmuls + attention (recompute included), as if nothing waited on communication
    exposed_comm: float  # total - compute: communication not hidden behind compute
    layer_forward: float  # one layer forward, FSDP overlap applied
    layer_backward: float  # one layer backward (recompute included), FSDP overlap applied
    serial_comm: float  # every collective of the step end to end, as if nothing overlapped
    ring_hop_forward: float = 0.0  # one forward ring hop (a K/V block); 0 without a ring
    ring_block_forward: float = 0.0  # attention compute of one forward ring step
    ring_hop_backward: float = 0.0  # one backward ring hop (a K/V block and a dK/dV partial)
    ring_block_backward: float = 0.0  # attention compute of one backward ring step

    @property
    def ring_exposed(self) -> bool:
        """True when a ring hop takes longer than the block compute it should hide behind."""
        return self.ring_hop_forward > self.ring_block_forward or self.ring_hop_backward > self.ring_block_backward

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def step_time(work: Workload, layout: Degrees, hw: HardwareSpec) -> StepTime:
    """One step of ``work`` on ``layout``; docs/planner.md ("Time") lists what is counted and what overlaps."""
    m, b = work.model, work.batch
    peak = hw.flops_for(work.dtype)
    mm_rate, attn_rate = peak * hw.matmul_efficiency, peak * hw.attention_efficiency
    tokens = b * local_tokens(work, layout)  # between the layers; inside the TP regions tp times as many
    mm_fwd = 2 * tokens * layer_matmul_params(m) / mm_rate  # = the TP group's tokens x 1/tp of the weights
    pairs = attention_average(work, layout, Attention.pairs)
    heads = HeadDeal(*tp_heads(m, layout), layout.ulysses).max_q
    attn_fwd = 2 * (m.head_dim + m.value_dim) * heads * b * pairs / layout.ring / attn_rate  # q.k and p.v
    attn_bwd = ATTENTION_BACKWARD * attn_fwd
    if layout.ring > 1:  # smaller kernels and the merges: the split-and-merge efficiency
        block = padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout, layout.tp) // layout.ring
        efficiency = hw.ring_efficiency.at(block)  # of query tokens
        attn_fwd, attn_bwd = attn_fwd / efficiency, attn_bwd / efficiency
    else:  # seqmesh's merge into float32 accumulators, one step
        attn_fwd += ring_merge_seconds(work, layout, hw, "forward")
        attn_bwd += ring_merge_seconds(work, layout, hw, "backward")

    a2a_fwd, a2a_bwd = (ulysses_exposed_seconds(work, layout, hw, phase) for phase in ("forward", "backward"))
    a2a_serial_fwd, a2a_serial_bwd = (_ulysses_seconds(work, layout, hw, phase) for phase in ("forward", "backward"))
    ring_fwd, p2p_fwd = ring_attention_seconds(work, layout, hw, attn_fwd, "forward")
    ring_bwd, p2p_bwd = ring_attention_seconds(work, layout, hw, attn_bwd, "backward")
    tp = layer_seconds(work, layout, hw)  # TP collectives: on the critical path, nothing hides them
    fwd = mm_fwd + a2a_fwd + ring_fwd + tp["forward"]
    bwd = 2 * mm_fwd + a2a_bwd + ring_bwd + tp["backward"]
    comm_fwd, comm_bwd = a2a_serial_fwd + p2p_fwd + tp["forward"], a2a_serial_bwd + p2p_bwd + tp["backward"]
    if work.checkpointing:  # the recompute stops before the MLP's reduce-scatter
        bwd += fwd - tp["forward"] + tp["recompute"]
    # the tiled MLP recomputes each tile's forward in backward: one more MLP forward per layer
    mlp_recompute = mm_fwd * 3 * m.hidden * m.intermediate / layer_matmul_params(m) if work.tiled_mlp else 0.0
    bwd += mlp_recompute
    compute_layer = (mm_fwd + attn_fwd) * (2 if work.checkpointing else 1) + 2 * mm_fwd + attn_bwd + mlp_recompute
    # offloaded checkpoints: each layer's input crosses PCIe once each way, on a side stream (hidden when shorter)
    offload = tokens * m.hidden * work.act_bytes / hw.host_bandwidth if work.offload_checkpoints else 0.0

    fsdp_ranks = [r for group in every_group(layout, "sequence") for r in group]

    def unit_seconds(params: int) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of an FSDP unit of ``params`` on one TP rank."""
        sent = fsdp_traffic(params, layout.fsdp_group, work.torch_dtype, work.reduce_dtype)
        return fsdp_seconds(sent, hw, fsdp_ranks)

    split = split_params(m, layout.tp)
    # split["layer"] but in a Mamba2 hybrid; under EP the rest over every rank, the rank's experts over their holders
    ag, rs = layer_fsdp_seconds(Attention(work, layout).params(), work, layout, hw, fsdp_ranks)
    layer_fwd, layer_bwd = max(fwd, ag, offload), max(bwd, ag + rs, offload)

    # the chunked loss recomputes the logits in backward; under TP the head is vocabulary-parallel (same FLOPs)
    head = (8 if work.chunked_loss else 6) * tokens * m.vocab * m.hidden / mm_rate
    root_comm = sum(unit_seconds(split["root"]))  # gathered once, kept gathered for backward, reduce-scattered
    # an untied embedding's own unit: gathered before the first layer (exposed), gathered again behind the
    # first layer's backward (prefetched in place of a next layer's) and reduce-scattered at the end (exposed)
    emb_ag, emb_rs = unit_seconds(split["embedding"])
    emb_comm = emb_ag + emb_rs + max(bwd, emb_ag + rs) - layer_bwd if split["embedding"] else 0.0
    tp_step = step_seconds(work, layout, hw)  # the embedding's, the loss's and the norm gradients' TP collectives
    full = m.layers - m.non_attention_layers - m.indexed_layers  # seqmesh attention's layers, full or sliding
    total = full * (layer_fwd + layer_bwd) + head + root_comm + emb_comm + tp_step
    compute = full * compute_layer + head
    recompute = comm_fwd - tp["forward"] + tp["recompute"] if work.checkpointing else 0.0
    serial = (full * (comm_fwd + recompute + comm_bwd + 2 * ag + rs) + root_comm + 2 * emb_ag + emb_rs + tp_step)
    for kind, count in layer_kinds(work, layout):  # the layers that time themselves: Gated DeltaNet, indexed, Mamba2
        if not isinstance(kind, Attention):
            own = kind.seconds(hw, fsdp_ranks)
            total += count * own["total"]
            compute += count * own["compute"]
            serial += count * own["serial"]
    if layout.ep > 1:  # each MoE layer's dispatch and combine: the experts wait for them, nothing hides them
        exchange = moe_layers(m) * sum(exchange_seconds(work, layout, hw).values())
        total, serial = total + exchange, serial + exchange
    hops = {}
    if layout.ring > 1 and full:
        t_kv, t_dkv = ring_hops(work, layout, hw)
        steps = ring_hop_count(work, layout) + 1
        hops = dict(ring_hop_forward=t_kv, ring_block_forward=attn_fwd / steps,
                    ring_hop_backward=t_kv + t_dkv, ring_block_backward=attn_bwd / steps)
    return StepTime(total, compute, total - compute, layer_fwd, layer_bwd, serial, **hops)


def ring_merge_seconds(work: Workload, layout: Degrees, hw: HardwareSpec, phase: str) -> float:
    """GPU-memory time of the ring's accumulations in one layer (every step, ring=1 included). Per step forward:
    read and write the float32 output and LSE accumulators, read the block's output and LSE; backward: add the
    block's dQ into the float32 dQ, zero the dK/dV partial, add the block's dK/dV and the incoming partial."""
    m = work.model
    deal = HeadDeal(*tp_heads(m, layout), layout.ulysses)
    tokens = work.batch * layout.ulysses * layout.tp * local_tokens(work, layout)  # one ring block
    e, d = work.act_bytes, m.head_dim
    if phase == "forward":
        per_step = tokens * deal.max_q * (d * (8 + e) + 12)
    else:
        per_step = tokens * (deal.max_q * d * (8 + e) + 2 * deal.max_kv * d * (4 + 8 + e + 12))
    return layout.ring * per_step / hw.memory_bandwidth


def _ulysses_seconds(work: Workload, layout: Degrees, hw: HardwareSpec, phase: str) -> float:
    """One attention layer's Ulysses all-to-alls in ``phase``, one after another."""
    if layout.ulysses == 1:
        return 0.0
    calls = call_bytes(Attention(work, layout).ranks(), "all_to_all", phase)
    return axis_all_to_all_seconds(calls, hw, layout, "ulysses")


def async_applies(work: Workload, layout: Degrees) -> bool:
    """Whether ``work`` runs async Ulysses on ``layout``: asked for, a Ulysses axis, no TP (refused there), text."""
    return work.async_ulysses and layout.ulysses > 1 and layout.tp == 1 and work.media is None


def ulysses_exposed_seconds(work: Workload, layout: Degrees, hw: HardwareSpec, phase: str) -> float:
    """One attention layer's Ulysses all-to-alls in ``phase`` left on the critical path: all of them, or with
    async Ulysses what :func:`seqmesh.rules.overlap.pipelined_exposed` leaves of each beside the projection it is
    pipelined with. Forward: the q/k/v all-to-all beside the q/k/v projections, the output one beside the output
    projection; backward (issued output first): each beside its projection's backward, twice the forward matmuls."""
    if not async_applies(work, layout):
        return _ulysses_seconds(work, layout, hw, phase)
    m = work.model
    calls = call_bytes(Attention(work, layout).ranks(), "all_to_all", phase)
    comm = [axis_all_to_all_seconds([n], hw, layout, "ulysses") for n in calls]
    rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
    tokens = work.batch * local_tokens(work, layout)
    qkv = 2 * tokens * m.hidden * m.head_dim * (m.heads + 2 * m.kv_heads) / rate
    out = 2 * tokens * m.hidden * m.head_dim * m.heads / rate
    beside = [qkv, out] if phase == "forward" else [2 * out, 2 * qkv]
    return sum(pipelined_exposed(c, p, ASYNC_PIECES) for c, p in zip(comm, beside))


def ring_hops(work: Workload, layout: Degrees, hw: HardwareSpec) -> tuple[float, float]:
    """Seconds of one K/V-block hop and of one dK/dV-partial hop on the slowest ring link."""
    m = work.model
    padded = padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout, layout.tp)
    kv, dkv = ring_block_bytes(*tp_heads(m, layout), m.head_dim, seq_len=padded, batch=work.batch,
                               ulysses=layout.ulysses, ring=layout.ring, dtype=work.torch_dtype, layout=work.layout,
                               value_dim=m.value_dim)
    return ring_hop_seconds(kv, hw, layout), ring_hop_seconds(dkv, hw, layout)


def ring_hop_count(work: Workload, layout: Degrees) -> float:
    """K/V hops of one layer's ring pass, averaged over full and sliding-window layers."""
    return attention_average(work, layout, Attention.ring_hops)


def ring_attention_seconds(work: Workload, layout: Degrees, hw: HardwareSpec, attention: float,
                           phase: str) -> tuple[float, float]:
    """(attention of one layer with the ring's P2P overlapped, the P2P time alone); docs/planner.md, "Time"."""
    if layout.ring == 1:
        return attention, 0.0
    hops = ring_hop_count(work, layout)
    step = attention / (hops + 1)
    t_kv, t_dkv = ring_hops(work, layout, hw)
    if phase == "forward":
        return hops * max(step, t_kv) + step, hops * t_kv
    return hops * max(step, t_kv + t_dkv) + step + t_dkv, hops * (t_kv + t_dkv)
