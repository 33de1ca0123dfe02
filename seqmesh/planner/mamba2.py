"""What a Mamba2 hybrid's layers cost on the busiest rank (:mod:`seqmesh.model.hybrid` reads their shapes): a Mamba2
layer as ``seqmesh.hf.mamba2`` runs it (Falcon-H1's beside its attention), and Nemotron-H's MLP and MoE blocks,
which mix no tokens.

A Mamba2 layer runs in_proj and out_proj on its local tokens, and its token mixing by the design
``seqmesh.linear_attention.mamba2.choose_ssd_design`` picks (``work.linear_attention``; ``auto``: fewer bytes)::

    state_passing   every head of the local tokens: one all-gather of the conv halo (K - 1 rows of x | B | C per
                    tail), the chunked scan, one all-gather of every run's [S_0 | decay] (float32); backward their
                    reduce-scatters
    all_to_all      two all-to-alls (x | B | C | dt in, y out) forward and two backward; the conv and the scan of
                    the whole sequence for 1/P of the heads

The bytes are the runtime's own :func:`seqmesh.linear_attention.mamba2.ssd_design_bytes`. No collective overlaps
compute (the scan waits for its inputs, the outputs for the states), so the layer's time is
:func:`.layer_cost.serial_layer_seconds`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules.degrees import Degrees
from ..linear_attention.choice import LINEAR_CHUNK, LinearDesign
from ..linear_attention.mamba2 import SSDHeads, choose_ssd_design, ssd_design_bytes
from ..model.hybrid_shape import MAMBA2, FeedForward, Mamba2Shape
from .activations import decoder_layer_saved_bytes, norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import phases, serial_layer_seconds
from .placement import placement
from .network import axis_all_to_all_seconds, axis_groups, gather_seconds, link_name
from .traffic import Collective, RankTraffic, call_bytes, dtype_bytes, worst_rank
from .workload import Workload


def mamba2_scan_flops(mamba: Mamba2Shape, tokens: int, chunk: int = LINEAR_CHUNK) -> int:
    """Forward matmul FLOPs of one Mamba2 layer's chunked scan over ``tokens`` tokens (all heads), as
    ``decay_scan.chunk_decay_scan`` computes it: per token and head, its row of the chunk's ``C x C`` scores
    (``C N``), their product with v (``C P``), the state read and the state write (``N P`` each)."""
    h, n, p = mamba.heads, mamba.state, mamba.head_dim
    return 2 * tokens * h * (chunk * (n + p) + 2 * n * p)


def mamba2_mixing_flops(mamba: Mamba2Shape, tokens: int) -> int:
    """Forward FLOPs of all a Mamba2 layer's token mixing on a rank: the scan (:func:`mamba2_scan_flops`), the
    entering state's read by state passing (``N P`` per token and head) and the depthwise conv (``conv_dim x K``)."""
    extra = 2 * tokens * (mamba.heads * mamba.state * mamba.head_dim + mamba.conv_dim * mamba.conv)
    return mamba2_scan_flops(mamba, tokens) + extra


def decay_scan_saved(key_dim: int, value_dim: int, chunk: int = LINEAR_CHUNK) -> int:
    """Values a token and head the scalar-decay rule (``seqmesh.linear_attention.decay_scan.chunk_decay_scan``:
    Mamba2's scan, MiniMax's lightning attention) keeps for backward in its compute dtype, beside one ``Dk x Dv``
    state a chunk (counted per chunk by the callers): q, k, the lifted q and the decayed k (``Dk`` each), v, the
    chunk's scores, decays and their product (``C`` each), and the decays. Tracked on the CPU (``MemoryTracker``,
    bf16 inputs) for ``Dk`` 32 to 256 and ``Dv`` 32 to 128: within 0.5% at every size."""
    return 4 * key_dim + value_dim + 3 * chunk + 4


def decay_scan_backward(key_dim: int, value_dim: int, chunk: int = LINEAR_CHUNK) -> int:
    """Values a token and head the scalar-decay rule's backward holds at its peak beyond what it kept (the gradients of
    the states and of what each chunk wrote, of the lifted q, of the scores, of v): a least-squares fit of the same
    twelve tracked runs, within 65 values of each (7% of the rule's whole peak at worst, a key width of 32)."""
    return round(1.7 * key_dim * value_dim / chunk + 0.4 * key_dim + 1.7 * value_dim + 43)


# float32 values a channel the gated RMSNorm's backward holds beyond what it kept (tracked: the gradients through the
# weight, the rescale, the square and the gate's product)
GATED_NORM_BACKWARD = 5


def gated_norm_saved(act_bytes: int) -> int:
    """Bytes a token and channel the gated RMSNorm of transformers' Mamba2 layers (Mamba2, Nemotron-H, Bamba, Granite-4,
    Falcon-H1's ``mamba_rms_norm``) keeps: it computes in float32, its input, its gate, the gate's silu and their
    product (4 bytes each), then the normalised output and out_proj's input in the activations' dtype."""
    return 4 * 4 + 2 * act_bytes


def _local_tokens(work: Workload, layout: Degrees) -> int:
    """Tokens of one sequence a rank holds (tp is 1: the planner refuses tensor parallelism on hybrids)."""
    p = layout.ulysses * layout.ring
    return placement(work, layout).sequence_padded // p


def _rates(work: Workload, hw: HardwareSpec) -> tuple[float, float]:
    """(matmul, scan) FLOP/s achieved: the scan's chunked products run at the attention kernels' efficiency."""
    peak = hw.flops_for(work.dtype)
    return peak * hw.matmul_efficiency, peak * hw.attention_efficiency


def recurrent_traffic(ranks: list[RankTraffic], key: str, design: LinearDesign,
                      checkpointing: bool) -> dict[str, dict[str, int]]:
    """A recurrent layer's traffic by phase, the busiest rank's (Mamba2's and KDA's): state passing's all-gather
    forward and reduce-scatter backward, or the all-to-alls both ways."""
    if design is LinearDesign.STATE_PASSING:
        return phases({key: worst_rank(ranks, "all_gather", "forward")},
                      {key: worst_rank(ranks, "reduce_scatter", "backward")}, checkpointing)
    return phases(*({key: worst_rank(ranks, "all_to_all", ph)} for ph in ("forward", "backward")), checkpointing)


@dataclass(frozen=True)
class Mamba2Layer:
    """A Mamba2 layer of a hybrid with its feed-forward ``ffn`` (``""``: Nemotron-H's, the mixer alone);
    ``beside_attention``: Falcon-H1's mixer alone, its layer's norms and MLP counted with the attention beside it."""

    work: Workload
    layout: Degrees
    ffn: str = ""
    beside_attention: bool = False

    @property
    def _ffn(self) -> FeedForward:
        return self.work.model.hybrid.ffn(self.ffn)

    def params(self) -> int:
        m = self.work.model
        if self.beside_attention:
            return m.hybrid.mamba.params(m.hidden)
        return m.hybrid.layer_params((MAMBA2, self.ffn), m.hidden, m.attention_params)

    def _shape(self) -> tuple[SSDHeads, dict]:
        """The layer's heads and the call's shape as the runtime passes them to ``choose_ssd_design``."""
        w, lay, mamba = self.work, self.layout, self.work.model.hybrid.mamba
        heads = SSDHeads(mamba.heads, mamba.head_dim, mamba.groups, mamba.state)
        padded = placement(w, lay).sequence_padded
        return heads, dict(seq_len=padded, batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout,
                           dtype_bytes=dtype_bytes(w.torch_dtype))

    def design(self) -> LinearDesign:
        """The design the layer runs (the runtime's rule, given ``work.linear_attention``)."""
        heads, shape = self._shape()
        return choose_ssd_design(heads, self.work.model.hybrid.mamba.conv, self.work.linear_attention, **shape)

    def sent_bytes(self) -> int:
        """Bytes each rank sends forward in the layer's two collectives (the same again backward)."""
        heads, shape = self._shape()
        return ssd_design_bytes(heads, self.work.model.hybrid.mamba.conv, **shape)[self.design()]

    def _key(self) -> str:
        return "mamba2_state_gather" if self.design() is LinearDesign.STATE_PASSING else "mamba2_all_to_all"

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: two all-gathers forward and their reduce-scatters backward
        (state passing), or two all-to-alls each way, half the bytes each (an even split of the heads)."""
        lay, sent = self.layout, self.sent_bytes()
        if self.design() is LinearDesign.STATE_PASSING:
            calls = (Collective("all_gather", "forward", 2, sent), Collective("reduce_scatter", "backward", 2, sent))
        else:
            calls = tuple(Collective("all_to_all", ph, 1, half) for ph in ("forward", "backward")
                          for half in (sent // 2, sent - sent // 2))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        return recurrent_traffic(self.ranks(), self._key(), self.design(), self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return {self._key(): link_name(hw, axis_groups(self.layout, "sequence")[:1])}

    def saved_bytes(self) -> int:
        """Bytes saved for backward: per token its norms, in_proj's input and output, the conv's input and output, dt,
        the scan's float32 tensors (:func:`decay_scan_saved`, q and k widened to every head; under state passing the
        read-in and q), the gated norm's (:func:`gated_norm_saved`; ungated, its input, gate and product) and
        out_proj's input, the feed-forward's; per chunk and head one float32 ``N x P`` state. Beside attention
        (Falcon-H1): the whole layer's, the attention layer's saved tensors added."""
        w, m, mamba = self.work, self.work.model, self.work.model.hybrid.mamba
        e, t = w.act_bytes, tokens(w, self.layout)
        h, n, p, c = mamba.heads, mamba.state, mamba.head_dim, LINEAR_CHUNK
        f = 4 if mamba.float32_mixing else e  # the mixer's tensors after in_proj
        proj = e * m.hidden + f * (2 * mamba.inner + mamba.conv_dim + h) + f * 2 * mamba.conv_dim + 3 * 4 * h
        if mamba.float32_mixing:  # in_proj's own output too, which the muP multiply keeps
            proj += e * (2 * mamba.inner + mamba.conv_dim + h)
        scan = 4 * h * decay_scan_saved(n, p)
        if self.layout.ulysses * self.layout.ring > 1 and self.design() is LinearDesign.STATE_PASSING:
            scan += (4 + f) * h * n  # the state pass's read-in, exp(G_t) q_t, and q (decay_scan.pass_decay_states)
        tail = gated_norm_saved(f) * mamba.inner if mamba.gated_norm else f * 4 * mamba.inner
        norms = 0 if self.beside_attention else m.hybrid.norms * norm_saved(m, e, w.efficient_norm)
        per_token = norms + proj + scan + tail + e * self._ffn.kept
        states = -(-t // w.batch // c) * w.batch * h * n * p * 4
        if self.beside_attention:  # the whole Falcon-H1 layer: the attention layer's beside it
            states += decoder_layer_saved_bytes(w, self.layout)
        return t * per_token + states

    def backward_bytes(self) -> int:
        """What the layer's backward holds beyond what it saved, at the larger of two moments: the gated norm's
        backward (:data:`GATED_NORM_BACKWARD` float32 values a channel), and the scan's (:func:`decay_scan_backward`,
        float32), by when the norm's float32 tensors are freed. Checked against rehearsals of the Nemotron-H shape of
        ``seqmesh bench families`` (docs/planner.md)."""
        w, mamba, t = self.work, self.work.model.hybrid.mamba, tokens(self.work, self.layout)
        scan = t * 4 * mamba.heads * decay_scan_backward(mamba.state, mamba.head_dim)
        if mamba.gated_norm:  # its four float32 tensors a channel are freed before the scan's backward
            scan = max(t * 4 * GATED_NORM_BACKWARD * mamba.inner, scan - t * 4 * 4 * mamba.inner)
        # the feed-forward after the mixer in the same layer (Bamba, Granite-4) has freed what it kept by then
        after = 0 if self.beside_attention or not self.ffn else t * w.act_bytes * self._ffn.kept
        return max(0, scan - after)

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: the projections and feed-forward, the token mixing
        (state passing: :func:`mamba2_mixing_flops` of the local tokens; all-to-all: the scan and conv of the whole
        sequence for this rank's share of the heads; backward twice), the design's collectives, which nothing
        overlaps."""
        work, layout, m = self.work, self.layout, self.work.model
        mamba = m.hybrid.mamba
        mm_rate, scan_rate = _rates(work, hw)
        local = work.batch * _local_tokens(work, layout)
        mm_fwd = 2 * local * (mamba.matmul_params(m.hidden) + self._ffn.macs) / mm_rate
        ranks = self.ranks()
        if self.design() is LinearDesign.STATE_PASSING:
            scan_fwd = mamba2_mixing_flops(mamba, local) / scan_rate
            group = axis_groups(layout, "sequence")[0]
            comm = tuple(gather_seconds(worst_rank(ranks, kind, ph), hw, group)
                         for kind, ph in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        else:  # the whole sequence of this rank's share of the heads, no state read
            p = layout.ulysses * layout.ring
            share = -(-mamba.heads // p) / mamba.heads
            whole = local * p
            scan_fwd = share * (mamba2_scan_flops(mamba, whole) + 2 * whole * mamba.conv_dim * mamba.conv) / scan_rate
            comm = tuple(axis_all_to_all_seconds(call_bytes(ranks, "all_to_all", ph), hw, layout, "sequence")
                         for ph in ("forward", "backward"))
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + scan_fwd, 2 * mm_fwd + 2 * scan_fwd), comm)


@dataclass(frozen=True)
class FeedForwardBlock:
    """A Nemotron-H MLP or MoE block: an RMSNorm and the feed-forward ``ffn``, per token, no sequence traffic."""

    work: Workload
    layout: Degrees
    ffn: str

    def params(self) -> int:
        m = self.work.model
        return m.hybrid.layer_params(("", self.ffn), m.hidden, m.attention_params)

    def traffic(self) -> dict[str, dict[str, int]]:
        return phases({}, {}, self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return {}

    def saved_bytes(self) -> int:
        """Bytes saved for backward (an estimate): the norm's, and the feed-forward's (:class:`FeedForward.kept`)."""
        w, m = self.work, self.work.model
        e = w.act_bytes
        per_token = m.hybrid.norms * norm_saved(m, e, w.efficient_norm) + e * m.hybrid.ffn(self.ffn).kept
        return tokens(w, self.layout) * per_token

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        mm_rate, _ = _rates(self.work, hw)
        local = self.work.batch * _local_tokens(self.work, self.layout)
        mm_fwd = 2 * local * self.work.model.hybrid.ffn(self.ffn).macs / mm_rate
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd, 2 * mm_fwd), (0.0, 0.0))
