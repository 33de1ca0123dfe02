"""What a Kimi Linear KDA layer costs on the busiest rank (:mod:`seqmesh.model.kimi` reads its shape), as
``seqmesh.hf.kda`` runs it: its projections and gates on the local tokens, its token mixing by the design
``seqmesh.linear_attention.kda_all_to_all.choose_kda_design`` picks (``work.linear_attention``; ``auto``: the
runtime's rule, with its H100 defaults, as the layer itself calls it)::

    state_passing   every head of the local tokens: one all-gather of the conv halo (K - 1 rows of q | k | v per
                    tail), the chunked recurrence, one all-gather of every run's float32 states; backward their
                    reduce-scatters (:func:`~seqmesh.linear_attention.kda_state_passing.kda_state_passing_bytes`)
    all_to_all      all-to-alls of q | k | v | beta and g in, the output back; the same backward
                    (:func:`~seqmesh.linear_attention.kda_all_to_all.kda_all_to_all_bytes`); the conv and the
                    recurrence of the whole sequence for 1/P of the heads

The gate g travels in float32 (transformers' Kimi gate). No collective overlaps compute: the layer's time is
:func:`.layer_cost.serial_layer_seconds`'s. The recurrence's FLOPs are Gated DeltaNet's chunked form per head (an
estimate: KDA's per-channel decay adds sub-chunk products not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules.degrees import Degrees
from ..linear_attention.choice import LINEAR_CHUNK, LinearDesign
from ..linear_attention.kda_all_to_all import choose_kda_design, kda_all_to_all_bytes
from ..linear_attention.kda_state_passing import KdaHeads, kda_state_passing_bytes
from ..model.hybrid_shape import KDA
from .activations import norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import serial_layer_seconds
from .mamba2 import recurrent_traffic
from .placement import placement
from .network import axis_all_to_all_seconds, axis_groups, gather_seconds, link_name
from .traffic import Collective, RankTraffic, call_bytes, dtype_bytes, worst_rank
from .workload import Workload


KIMI_FLOAT32_GATES = 7  # float32 values a channel transformers' forget gate (3) and gated output norm (4) keep


def kda_rule_saved(head_dim: int, chunk: int = LINEAR_CHUNK) -> int:
    """float32 values a token and head the KDA rule (``seqmesh.linear_attention.kda.chunk_kda_states``, chunks of
    ``C`` = 64 in sub-chunks of 16) keeps for backward, its inputs apart: its normalised, chunked and gated copies of
    q, k, v and g, the two pairwise decayed products' sub-chunk reads and writes, the triangular solves and the
    carried chunks' values (some 31 of ``D``), one ``D x D`` state a chunk and the chunk's ``C x C`` products. Tracked
    on the CPU (``MemoryTracker``, bf16 inputs) for ``D`` 16 to 256: exact to a value."""
    return round(31.2 * head_dim + 1.0625 * head_dim * head_dim / chunk + 134)


def kda_rule_backward(head_dim: int) -> int:
    """float32 values a token and head the KDA rule's backward holds at its peak beyond what it kept: the carried
    chunks' gradients (``carry._CarryChunks``) all at once (some 6.5 of ``D``: the gradients of u, w, q_read and
    k_write, the outputs' gradient laid out by chunk and the pairwise scores'). Tracked as above for ``D`` 16 to 256
    at 32 chunks: exact to a value beside one ``D x D`` state a head, whatever the length (``D^2 / S`` a token: 0.5 at
    ``D`` 128 and 32K tokens), which is left out. The reverse loop's two state gradients are freed before that peak
    since the loop became a function of its own (it was ``0.1875 D^2 / C`` more)."""
    return round(6.515625 * head_dim + 64)


def kda_flops(heads: int, head_dim: int, tokens: int, chunk: int = LINEAR_CHUNK) -> int:
    """Forward FLOPs of a KDA recurrence over ``tokens`` tokens of ``heads`` heads, chunked as Gated DeltaNet's
    (:func:`.layers.linear_flops`): per token and head ``2 (4 C D + C D + 4 D^2)``."""
    return 2 * tokens * heads * (5 * chunk * head_dim + 4 * head_dim * head_dim)


@dataclass(frozen=True)
class KdaLayer:
    """A Kimi Linear layer whose mixer is KDA, with its feed-forward ``ffn`` and two RMSNorms."""

    work: Workload
    layout: Degrees
    ffn: str = "moe"

    def params(self) -> int:
        m = self.work.model
        return m.hybrid.layer_params((KDA, self.ffn), m.hidden, m.attention_params)

    def _heads(self) -> KdaHeads:
        kda = self.work.model.hybrid.kda
        return KdaHeads(kda.heads, kda.head_dim, kda.head_dim)

    def design(self) -> LinearDesign:
        """The design the layer runs: the runtime's rule on the real sequence length, as ``seqmesh.hf.kda`` calls it."""
        w = self.work
        return choose_kda_design(self._heads(), self.layout, w.linear_attention, batch=w.batch, seq_len=w.seq_len,
                                 layout=w.layout, kernel=w.model.hybrid.kda.conv,
                                 dtype_bytes=dtype_bytes(w.torch_dtype))

    def sent_bytes(self) -> int:
        """Bytes each rank sends forward by the layer's design (the same again backward)."""
        w, lay = self.work, self.layout
        e = dtype_bytes(w.torch_dtype)
        if self.design() is LinearDesign.STATE_PASSING:
            return kda_state_passing_bytes(self._heads(), batch=w.batch, ulysses=lay.ulysses, ring=lay.ring,
                                           layout=w.layout, kernel=w.model.hybrid.kda.conv, dtype_bytes=e,
                                           state_bytes=8 if e == 8 else 4)
        padded = placement(w, lay).sequence_padded
        return kda_all_to_all_bytes(self._heads(), batch=w.batch, seq_len=padded, ranks=lay.ulysses * lay.ring,
                                    dtype_bytes=e)

    def _key(self) -> str:
        return "kda_state_gather" if self.design() is LinearDesign.STATE_PASSING else "kda_all_to_all"

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: two all-gathers forward and their reduce-scatters backward (state
        passing), or the all-to-alls' bytes each way (the calls' split among them is not modelled: one call)."""
        lay, sent = self.layout, self.sent_bytes()
        if self.design() is LinearDesign.STATE_PASSING:
            calls = (Collective("all_gather", "forward", 2, sent), Collective("reduce_scatter", "backward", 2, sent))
        else:
            calls = tuple(Collective("all_to_all", ph, 1, sent) for ph in ("forward", "backward"))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        return recurrent_traffic(self.ranks(), self._key(), self.design(), self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return {self._key(): link_name(hw, axis_groups(self.layout, "sequence")[:1])}

    def saved_bytes(self) -> int:
        """Bytes saved for backward: per token its two norms, the projections' outputs (q | k | v before the conv,
        its ``K - 1`` shifted products and its output, beta, the output gate), transformers' float32 forget gate (g,
        the sum with its exponential, the softplus, a bool) and gated norm (its input, the normalised values, the gate
        and its sigmoid), the rule's float32 tensors (:func:`kda_rule_saved`, its chunk states included), the
        recurrence's output, o_proj's input and the feed-forward's. Against tracked CPU peaks of three KDA layers with
        an MLP each (bf16, checkpointing, 2,048 tokens a rank): 1.067 on one rank, 0.934 on ring 2 (state passing's
        own tensors are not counted yet)."""
        w, m, kda = self.work, self.work.model, self.work.model.hybrid.kda
        e, t = w.act_bytes, tokens(w, self.layout)
        q = kda.inner
        conv = 3 * q * (kda.conv + 1)  # its padded input, K - 1 shifted products, output
        per_token = (2 * norm_saved(m, e, w.efficient_norm) + e * (m.hidden + conv + kda.heads + 3 * q)
                     + (4 * KIMI_FLOAT32_GATES + 1) * q + 4 * kda.heads * kda_rule_saved(kda.head_dim)
                     + e * m.hybrid.ffn(self.ffn).kept)
        return t * per_token

    def backward_bytes(self) -> int:
        """What the layer's backward holds beyond what it saved: the rule's (:func:`kda_rule_backward`), less what
        the feed-forward after it kept, freed by then."""
        w, kda, t = self.work, self.work.model.hybrid.kda, tokens(self.work, self.layout)
        after = w.act_bytes * self.work.model.hybrid.ffn(self.ffn).kept
        return max(0, t * (4 * kda.heads * kda_rule_backward(kda.head_dim) - after))

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: projections and feed-forward on the local tokens,
        the recurrence (state passing: every head of the local tokens; all-to-all: the whole sequence of this rank's
        share of the heads), backward twice; the design's collectives, which nothing overlaps."""
        work, layout, m = self.work, self.layout, self.work.model
        kda = m.hybrid.kda
        peak = hw.flops_for(work.dtype)
        mm_rate, core_rate = peak * hw.matmul_efficiency, peak * hw.attention_efficiency
        local = tokens(work, layout)
        mm_fwd = 2 * local * (kda.matmul_params(m.hidden) + m.hybrid.ffn(self.ffn).macs) / mm_rate
        ranks, p = self.ranks(), layout.ulysses * layout.ring
        if self.design() is LinearDesign.STATE_PASSING:
            core_fwd = kda_flops(kda.heads, kda.head_dim, local) / core_rate
            group = axis_groups(layout, "sequence")[0]
            comm = tuple(gather_seconds(worst_rank(ranks, kind, ph), hw, group)
                         for kind, ph in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        else:
            core_fwd = kda_flops(-(-kda.heads // p), kda.head_dim, local * p) / core_rate
            comm = tuple(axis_all_to_all_seconds(call_bytes(ranks, "all_to_all", ph), hw, layout, "sequence")
                         for ph in ("forward", "backward"))
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + core_fwd, 2 * mm_fwd + 2 * core_fwd), comm)
