"""Seconds per training step: FLOPs over achieved throughput, bytes over link bandwidth, and which of
them overlap. The assumptions are listed in docs/planner.md ("Modelling assumptions", "Time").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .attention_layer import Attention, ring_hop_count, ring_hops
from .experts import exchange_seconds, moe_layers
from .hardware import HardwareSpec
from .layers import attention_kind, layer_kinds
from .memory import local_tokens
from .network import every_group, fsdp_seconds
from .placement import placement
from .tensor_parallel import step_seconds
from .traffic import fsdp_traffic
from ..rules.degrees import Degrees
from .workload import Workload

__all__ = ["StepTime", "step_time"]


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
    """One step of ``work`` on ``layout``: each layer kind's own time (:meth:`.attention_layer.Attention.seconds` for
    seqmesh attention's layers, full or sliding; ``seconds`` of the other kinds), the loss, the units FSDP2 gathers
    outside the layers and the MoE exchanges; docs/planner.md ("Time") lists what is counted and what overlaps."""
    m = work.model
    mm_rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
    tokens = work.batch * local_tokens(work, layout)  # between the layers; inside the TP regions tp times as many
    fsdp_ranks = [r for group in every_group(layout, "sequence") for r in group]

    def unit_seconds(params: int) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of an FSDP unit of ``params`` on one TP rank."""
        sent = fsdp_traffic(params, layout.fsdp_group, work.torch_dtype, work.reduce_dtype)
        return fsdp_seconds(sent, hw, fsdp_ranks)

    split = placement(work, layout).split
    layer = attention_kind(work, layout).seconds(hw, fsdp_ranks)
    layer_fwd, layer_bwd, rs = layer["forward"], layer["backward"], layer["reduce_scatter"]
    attn_fwd, attn_bwd = layer["attention_forward"], layer["attention_backward"]

    # the chunked loss makes its gradients in its forward (6 FLOPs a weight and token, as full logits); under TP the
    # head is vocabulary-parallel (the same FLOPs)
    head = 6 * tokens * m.head_vocab * m.hidden / mm_rate
    root_comm = sum(unit_seconds(split["root"]))  # gathered once, kept gathered for backward, reduce-scattered
    # an untied embedding's own unit: gathered before the first layer (exposed), gathered again behind the
    # first layer's backward (prefetched in place of a next layer's) and reduce-scattered at the end (exposed)
    emb_ag, emb_rs = unit_seconds(split["embedding"])
    emb_comm = emb_ag + emb_rs + max(layer["backward_compute"], emb_ag + rs) - layer_bwd if split["embedding"] else 0.0
    tp_step = step_seconds(work, layout, hw)  # the embedding's, the loss's and the norm gradients' TP collectives
    full = m.seqmesh_attention_layers  # full or sliding
    total = full * layer["total"] + head + root_comm + emb_comm + tp_step
    compute = full * layer["compute"] + head
    serial = (full * layer["serial"] + root_comm + 2 * emb_ag + emb_rs + tp_step)
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
    if layout.ring > 1 and full:  # the attention layers' own (dots.llm3's sliding ones at their sizes)
        attending = attention_kind(work, layout).work
        t_kv, t_dkv = ring_hops(attending, layout, hw)
        steps = ring_hop_count(attending, layout) + 1
        hops = dict(ring_hop_forward=t_kv, ring_block_forward=attn_fwd / steps,
                    ring_hop_backward=t_kv + t_dkv, ring_block_backward=attn_bwd / steps)
    return StepTime(total, compute, total - compute, layer_fwd, layer_bwd, serial, **hops)

