"""What a MiniMax-01 lightning attention layer costs on the busiest rank (:mod:`seqmesh.model.minimax` reads its
shape), as ``seqmesh.hf.lightning`` runs it: its projections, norm and gate on the local tokens, the chunked decay
scan of every head over them, and one collective, the all-gather of every run's ``[S_0 | exp(sum g)]`` (backward its
reduce-scatter, the same bytes): :func:`seqmesh.linear_attention.decay_scan.decay_state_bytes`, the runtime's own,
in float32 (float64 for float64 inputs). There is no other design. The scan waits for nothing but the states'
read waits for the gather, so the layer's time is :func:`.layer_cost.serial_layer_seconds`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules.degrees import Degrees
from ..linear_attention.choice import LINEAR_CHUNK
from ..linear_attention.decay_scan import decay_state_bytes
from ..model.hybrid_shape import LIGHTNING, Mamba2Shape
from .activations import norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import gather_comm_seconds, gather_links, gather_phases, serial_layer_seconds
from .mamba2 import decay_scan_backward, decay_scan_saved, mamba2_scan_flops
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload

KEY = "lightning_state_gather"


@dataclass(frozen=True)
class LightningLayer:
    """A MiniMax-01 layer whose mixer is lightning attention, with its MoE block and two RMSNorms."""

    work: Workload
    layout: Degrees
    ffn: str = "moe"

    def params(self) -> int:
        m = self.work.model
        return m.hybrid.layer_params((LIGHTNING, self.ffn), m.hidden, m.attention_params)

    def sent_bytes(self) -> int:
        """Bytes each rank sends forward in the states' all-gather (its reduce-scatter the same backward)."""
        w, lay, mixer = self.work, self.layout, self.work.model.hybrid.lightning
        e = dtype_bytes(w.torch_dtype)
        return decay_state_bytes(mixer.heads, mixer.head_dim, mixer.head_dim, batch=w.batch, ulysses=lay.ulysses,
                                 ring=lay.ring, layout=w.layout, state_bytes=8 if e == 8 else 4)

    def ranks(self) -> list[RankTraffic]:
        lay, sent = self.layout, self.sent_bytes()
        calls = (Collective("all_gather", "forward", 1, sent), Collective("reduce_scatter", "backward", 1, sent))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        return gather_phases(self.ranks(), KEY, self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return gather_links(KEY, hw, self.layout)

    def saved_bytes(self) -> int:
        """Bytes saved for backward: per token its two norms, qkv_proj's input and output (before and after the
        activation), the scan's float32 tensors (:func:`.mamba2.decay_scan_saved`), the norm's input, the gate,
        out_proj's input, the MoE block's; per chunk and head one float32 ``D x D`` state."""
        w, m, mixer = self.work, self.work.model, self.work.model.hybrid.lightning
        e, t, q = w.act_bytes, tokens(w, self.layout), mixer.inner
        read_in = 4 * q if self.layout.ulysses * self.layout.ring > 1 else 0  # the state pass's exp(G_t) q_t
        per_token = (2 * norm_saved(m, e, w.efficient_norm) + e * (m.hidden + 6 * q + 3 * q) + read_in
                     + 4 * mixer.heads * decay_scan_saved(mixer.head_dim, mixer.head_dim)
                     + e * m.hybrid.ffn(self.ffn).kept)
        states = -(-t // w.batch // LINEAR_CHUNK) * w.batch * mixer.heads * mixer.head_dim ** 2 * 4
        return t * per_token + states

    def backward_bytes(self) -> int:
        """What the layer's backward holds beyond what it saved: the scan's (:func:`.mamba2.decay_scan_backward`). Its
        MoE's saved tensors, though freed before it, are not taken off: the plan then falls 6% under the rehearsal
        (MiniMax's bench-sized config at 8K), where it is 2% under without."""
        mixer = self.work.model.hybrid.lightning
        return tokens(self.work, self.layout) * 4 * mixer.heads * decay_scan_backward(mixer.head_dim, mixer.head_dim)

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: projections and MoE on the local tokens, the
        chunked decay scan of every head over them (:func:`.mamba2.mamba2_scan_flops`, the same kernel, with
        ``N = P = D``) and the entering state's read (``D^2`` a token and head), backward twice; the gather, which
        nothing overlaps."""
        work, m, mixer = self.work, self.work.model, self.work.model.hybrid.lightning
        peak = hw.flops_for(work.dtype)
        mm_rate, scan_rate = peak * hw.matmul_efficiency, peak * hw.attention_efficiency
        local = tokens(work, self.layout)
        mm_fwd = 2 * local * (mixer.matmul_params(m.hidden) + m.hybrid.ffn(self.ffn).macs) / mm_rate
        d = mixer.head_dim
        scan = mamba2_scan_flops(Mamba2Shape(mixer.heads, d, d, 1), local) + 2 * local * mixer.heads * d * d
        comm = gather_comm_seconds(self.ranks(), hw, self.layout)
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + scan / scan_rate, 2 * mm_fwd + 2 * scan / scan_rate),
                                    comm)
