"""A decoder layer of seqmesh attention (Ulysses, ring or both, full or a causal sliding window, tensor parallelism
inside): its FSDP unit, its collectives' bytes per phase, its saved tensors and its time, which it owns as every layer
kind of :mod:`.layers` does. docs/planner.md ("Time") lists what is counted and what overlaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..model.hybrid_shape import SLIDING
from ..rules.degrees import Degrees
from ..rules.overlap import ASYNC_PIECES, pipelined_exposed
from .activations import decoder_layer_saved_bytes, local_tokens
from .cca import KEY as CCA_KEY
from .cca import cca_saved_bytes, cca_seconds, cca_traffic
from .cross_domain import KEY as ROUTER_KEY
from .cross_domain import router_seconds, router_traffic, rows_seconds
from .experts import layer_fsdp_seconds
from .hardware import HardwareSpec
from .layer_cost import Phases, phases
from .network import axis_all_to_all_seconds, axis_groups, link_name, ring_hop_seconds
from .placement import placement, tp_heads
from .tensor_parallel import layer_seconds, layer_traffic
from .traffic import attention_traffic, call_bytes, ring_block_bytes, ring_steps, worst_rank
from .workload import Workload, layer_matmul_params

ATTENTION_BACKWARD = 2.5  # flash-attention backward FLOPs / forward FLOPs


def attention_pairs(seq_len: int, causal: bool, window: int | None = None) -> int:
    """Visible (query, key) pairs of one sequence; a causal ``window`` keeps each query's last
    ``window`` keys (itself included): ``w(w+1)/2 + (S - w) w`` with ``w = min(window, S)``."""
    if window is not None and causal:
        w = min(window, seq_len)
        return w * (w + 1) // 2 + (seq_len - w) * w
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


@dataclass(frozen=True)
class Attention:
    """A decoder layer with seqmesh attention over ``ulysses x ring`` (each TP rank its ``1 / tp`` of the heads);
    ``window``: a causal sliding window."""

    work: Workload
    layout: Degrees
    window: int | None = None

    def params(self) -> int:
        """Parameters of the layer's FSDP unit on one TP rank (a Mamba2 hybrid's attention layer: its own; a Zamba
        hybrid layer's: its linear and norm and its share of the shared blocks' units, the same bytes a step)."""
        m = self.work.model
        if m.hybrid is not None and m.hybrid.shared is not None:  # Zamba's hybrid layer beside its mixer
            return m.hybrid.shared_layer_params(m.hidden)
        if m.hybrid is not None:
            return m.hybrid.layer_params(("attention", m.hybrid.attention_ffn()), m.hidden, m.attention_params)
        return placement(self.work, self.layout).split["layer"]

    def ranks(self):
        """Each sequence rank's traffic in one layer (:func:`.traffic.attention_traffic`), over this TP rank's heads
        and its sequence share (padded so that tp divides it)."""
        w, lay, m = self.work, self.layout, self.work.model
        padded = placement(w, lay).padded
        return attention_traffic(*tp_heads(m, lay), m.head_dim, seq_len=padded, batch=w.batch,
                                 ulysses=lay.ulysses, ring=lay.ring, dtype=w.torch_dtype, layout=w.layout,
                                 validate=w.validate and self.window is None, window=self.window,
                                 value_dim=m.value_dim)

    def traffic(self) -> Phases:
        ranks = self.ranks()
        fwd, bwd = ({"ulysses_all_to_all": worst_rank(ranks, "all_to_all", ph),
                     "ring_p2p": worst_rank(ranks, "p2p", ph)} for ph in ("forward", "backward"))
        if self.cca:  # ZAYA's projection: its halo's all-gathers and reduce-scatters
            halo_fwd, halo_bwd = cca_traffic(self.work, self.layout)
            fwd, bwd = fwd | halo_fwd, bwd | halo_bwd
        if self.work.model.cross_domain is not None:  # Doge's experts: the router logits' all-gather, reduce-scatter
            router_fwd, router_bwd = router_traffic(self.work, self.layout)
            fwd, bwd = fwd | router_fwd, bwd | router_bwd
        sent = phases(fwd, bwd, self.work.checkpointing)
        if self.work.keep_attention:  # the recompute takes the kept output: the ring's blocks do not travel again
            sent["recompute"]["ring_p2p"] = 0
        if self.layout.tp > 1:  # the TP regions' gathers and reduce-scatters
            for phase, tp in layer_traffic(self.work, self.layout).items():
                sent[phase] |= tp
        return sent

    def input_check(self) -> int:
        """seqmesh's input check: one tiny all-gather per step (the first attention call of a batch)."""
        return worst_rank(self.ranks(), "control", "forward")

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        links = {"ulysses_all_to_all": link_name(hw, axis_groups(self.layout, "ulysses")),
                 "ring_p2p": link_name(hw, axis_groups(self.layout, "ring")),
                 "input_check_all_gather": link_name(hw, axis_groups(self.layout, "sequence")[:1])}
        if self.cca:
            links[CCA_KEY] = link_name(hw, axis_groups(self.layout, "sequence")[:1])
        if self.work.model.cross_domain is not None:
            links[ROUTER_KEY] = link_name(hw, axis_groups(self.layout, "sequence")[:1])
        if self.layout.tp > 1:
            tp = link_name(hw, axis_groups(self.layout, "tp"))
            links |= {"tp_all_gather": tp, "tp_reduce_scatter": tp, "tp_all_reduce": tp}
        return links

    def pairs(self) -> int:
        return attention_pairs(self.work.seq_len, self.work.causal, self.window)

    def ring_hops(self) -> int:
        """K/V hops of one ring pass: the ring steps that compute anything, less the local one."""
        padded = placement(self.work, self.layout).padded
        return ring_steps(self.layout.ring, padded, self.work.layout, self.window) - 1

    @property
    def cca(self) -> bool:
        """Whether the layer's q, k and v come from ZAYA's CCA projection (:mod:`.cca`)."""
        return self.work.model.hybrid is not None and self.work.model.hybrid.cca is not None

    def saved_bytes(self) -> int:
        return decoder_layer_saved_bytes(self.work, self.layout) + (cca_saved_bytes(self.work, self.layout)
                                                                if self.cca else 0)

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """One seqmesh-attention layer of the step, as :func:`.timing.step_time` counts it (the model's full and
        sliding layers together: their pairs and ring hops averaged, whatever this kind's window): ``total``
        (forward and backward with FSDP2's gathers overlapped), ``compute``, ``serial`` (every collective end to
        end), and the parts the step reads besides: ``forward``, ``backward``, ``backward_compute`` (backward
        before the overlap), ``reduce_scatter``, ``attention_forward``, ``attention_backward``."""
        work, layout, m, b = self.work, self.layout, self.work.model, self.work.batch
        peak = hw.flops_for(work.dtype)
        mm_rate, attn_rate = peak * hw.matmul_efficiency, peak * hw.attention_efficiency
        tokens = b * local_tokens(work, layout)  # between the layers; inside the TP regions tp times as many
        mm_fwd = 2 * tokens * layer_matmul_params(m) / mm_rate  # = the TP group's tokens x 1/tp of the weights
        pairs = attention_average(work, layout, Attention.pairs)
        heads = placement(work, layout).heads.max_q
        attn_fwd = 2 * (m.head_dim + m.value_dim) * heads * b * pairs / layout.ring / attn_rate  # q.k and p.v
        attn_bwd = ATTENTION_BACKWARD * attn_fwd
        if layout.ring > 1:  # smaller kernels and the merges: the split-and-merge efficiency
            block = placement(work, layout).padded // layout.ring
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
        halo = cca_seconds(work, layout, hw) if self.cca else 0.0  # ZAYA's halo: the convs wait for it
        halo += router_seconds(work, layout, hw) if m.cross_domain is not None else 0.0  # Doge's routing waits too
        fwd, bwd, comm_fwd, comm_bwd = fwd + halo, bwd + halo, comm_fwd + halo, comm_bwd + halo
        rows_fwd, rows_bwd = rows_seconds(work, layout, hw) if m.cross_domain is not None else (0.0, 0.0)
        fwd, bwd = fwd + rows_fwd, bwd + rows_bwd  # Doge's experts' rows, gathered and read by memory
        # with keep_attention the recompute skips the attention (its kernel, the ring's hops), not the all-to-alls
        kept = ring_fwd if work.keep_attention else 0.0
        if work.checkpointing:  # the recompute stops before the MLP's reduce-scatter
            bwd += fwd - kept - tp["forward"] + tp["recompute"]
        # the tiled MLP recomputes each tile's forward in backward: one more MLP forward per layer
        mlp_recompute = (mm_fwd * m.mlp_matrices * m.hidden * m.intermediate / layer_matmul_params(m)
                         if work.tiled_mlp else 0.0)
        bwd += mlp_recompute
        runs = 2 if work.checkpointing else 1
        compute = ((mm_fwd + rows_fwd) * runs + attn_fwd * (1 if work.keep_attention else runs) + 2 * mm_fwd
                   + attn_bwd + rows_bwd + mlp_recompute)
        # offloaded checkpoints: each layer's input crosses PCIe once each way, on a side stream (hidden when shorter)
        offload = tokens * m.hidden * work.act_bytes / hw.host_bandwidth if work.offload_checkpoints else 0.0
        # split["layer"] but in a Mamba2 hybrid; under EP the rest over every rank, the rank's experts over their holders
        ag, rs = layer_fsdp_seconds(self.params(), work, layout, hw, fsdp_ranks)
        layer_fwd, layer_bwd = max(fwd, ag, offload), max(bwd, ag + rs, offload)
        recompute = (comm_fwd - (p2p_fwd if work.keep_attention else 0.0) - tp["forward"] + tp["recompute"]
                     if work.checkpointing else 0.0)
        return {"total": layer_fwd + layer_bwd, "compute": compute, "serial": comm_fwd + recompute + comm_bwd + 2 * ag + rs,
                "forward": layer_fwd, "backward": layer_bwd, "backward_compute": bwd, "reduce_scatter": rs,
                "attention_forward": attn_fwd, "attention_backward": attn_bwd}


def hybrid_attention_split(m) -> tuple[int, int]:
    """(full, windowed) attention layers of the hybrid ``m``: LFM3's ``sliding_attention`` layers windowed beside its
    full ones, every attention layer windowed where the model has a window and no full layers among them
    (RecurrentGemma's local attention), none otherwise. The one rule of :func:`.layers.hybrid_layer_kinds` and of the
    attention time's average."""
    n = m.hybrid.attention_layers
    if not m.sliding_window:
        return n, 0
    if not m.full_every:
        return 0, n
    sliding = m.hybrid.count(SLIDING)
    return n - sliding, sliding


def attention_average(work: Workload, layout: Degrees, cost: Callable[[Attention], int]) -> float:
    """``cost`` of one attention layer averaged over the model's full and sliding attention layers (pairs, ring
    hops); a hybrid's over its attention layers alone (:func:`hybrid_attention_split`)."""
    m = work.model
    full = cost(Attention(work, layout))
    if m.hybrid is not None:
        n_full, n_windowed = hybrid_attention_split(m)
    else:
        # V4's compressed, M3's block-sparse, the indexed and the linear layers: their own
        n_full = (m.layers - m.sliding_layers - m.compressed_layers - m.block_sparse_layers - m.indexed_layers
                  - m.linear_layers)
        n_windowed = m.sliding_layers
    if not m.sliding_window or not n_windowed:
        return full
    windowed = cost(Attention(work, layout, m.sliding_window))
    return (n_full * full + n_windowed * windowed) / (n_full + n_windowed)


def ring_merge_seconds(work: Workload, layout: Degrees, hw: HardwareSpec, phase: str) -> float:
    """GPU-memory time of the ring's accumulations in one layer (every step, ring=1 included). Per step forward:
    read and write the float32 output and LSE accumulators, read the block's output and LSE; backward: add the
    block's dQ into the float32 dQ, zero the dK/dV partial, add the block's dK/dV and the incoming partial."""
    m = work.model
    deal = placement(work, layout).heads
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
    padded = placement(work, layout).padded
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
