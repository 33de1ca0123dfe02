"""What an LFM2 gated short-convolution layer costs on the busiest rank (:mod:`seqmesh.model.lfm` reads its shape),
as ``seqmesh.hf.short_conv`` runs it: in_proj and out_proj on the rank's local tokens, the depthwise conv of width
``K`` over them, and one collective, the halo's all-gather (``K - 1`` hidden rows before each run the rank holds;
backward its reduce-scatter, the same bytes). There is no other design. The bytes are the runtime's own
:func:`seqmesh.linear_attention.choice.halo_bytes`. The conv waits for its halo, so nothing overlaps it: the layer's
time is :func:`.layer_cost.serial_layer_seconds`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules.degrees import Degrees
from ..linear_attention.choice import halo_bytes
from ..model.hybrid_shape import CONV
from .activations import norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import gather_comm_seconds, gather_links, gather_phases, serial_layer_seconds
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload

KEY = "conv_halo_gather"


@dataclass(frozen=True)
class ShortConvLayer:
    """An LFM2 layer whose mixer is a gated short convolution, with its feed-forward ``ffn`` and two RMSNorms."""

    work: Workload
    layout: Degrees
    ffn: str = "mlp"

    def params(self) -> int:
        m = self.work.model
        return m.hybrid.layer_params((CONV, self.ffn), m.hidden, m.attention_params)

    def sent_bytes(self) -> int:
        """Bytes each rank sends forward in the halo's all-gather (its reduce-scatter the same backward)."""
        w, lay, m = self.work, self.layout, self.work.model
        return halo_bytes(m.hidden, m.hybrid.conv.kernel, batch=w.batch, ulysses=lay.ulysses, ring=lay.ring,
                          layout=w.layout, dtype_bytes=dtype_bytes(w.torch_dtype))

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: the all-gather forward, its reduce-scatter backward."""
        lay, sent = self.layout, self.sent_bytes()
        calls = (Collective("all_gather", "forward", 1, sent), Collective("reduce_scatter", "backward", 1, sent))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        return gather_phases(self.ranks(), KEY, self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return gather_links(KEY, hw, self.layout)

    def saved_bytes(self) -> int:
        """Bytes saved for backward (an estimate, not yet checked against a run): per token its norms (two; LFM3's
        sandwich, four), in_proj's input and output (B | C | x), the conv's input (B x) and output, out_proj's input
        (C y), the feed-forward's."""
        w, m = self.work, self.work.model
        e = w.act_bytes
        per_token = (m.hybrid.norms * norm_saved(m, e, w.efficient_norm) + e * 7 * m.hidden
                     + e * m.hybrid.ffn(self.ffn).kept)
        return tokens(w, self.layout) * per_token

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: the projections, the feed-forward and the
        conv (``2 hidden K`` FLOPs a token, at the matmul rate: an upper bound on its speed) on the local tokens,
        backward twice; the halo's all-gather and reduce-scatter, which nothing overlaps."""
        work, m = self.work, self.work.model
        rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
        local = tokens(work, self.layout)
        macs = m.hybrid.conv.matmul_params(m.hidden) + m.hidden * m.hybrid.conv.kernel + m.hybrid.ffn(self.ffn).macs
        fwd = 2 * local * macs / rate
        comm = gather_comm_seconds(self.ranks(), hw, self.layout)
        return serial_layer_seconds(self, hw, fsdp_ranks, (fwd, 2 * fwd), comm)
