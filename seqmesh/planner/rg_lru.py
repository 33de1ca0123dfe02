"""What a RecurrentGemma recurrent block costs on the busiest rank (:mod:`seqmesh.model.recurrent_gemma` reads its
shape), as ``seqmesh.hf.rg_lru`` runs it: its projections and gates on the local tokens, the depthwise conv of width
``K`` and the RG-LRU's diagonal recurrence over them, and two collectives, each an all-gather forward and its
reduce-scatter backward (the same bytes): the conv's halo (``K - 1`` rows of ``lru_width`` before each run the rank
holds, :func:`seqmesh.linear_attention.choice.halo_bytes`) and every run's ``[S_0 | T]``
(:func:`seqmesh.linear_attention.selective_scan.diagonal_state_bytes`, in float32, float64 for float64 inputs), both
the runtime's own formulas. There is no other design. The conv waits for its halo and the states' read for theirs,
so the layer's time is :func:`.layer_cost.serial_layer_seconds`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..linear_attention.choice import halo_bytes
from ..linear_attention.selective_scan import diagonal_state_bytes
from ..model.hybrid_shape import RG_LRU
from ..rules.degrees import Degrees
from .activations import norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import phases, serial_layer_seconds
from .network import axis_groups, gather_seconds, link_name
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload

HALO, STATES = "rg_lru_halo_gather", "rg_lru_state_gather"
SCAN_FLOPS = 12  # elementwise operations a channel and token of the gates' tail and the two-level scan (an estimate)


@dataclass(frozen=True)
class RgLruLayer:
    """A RecurrentGemma layer whose temporal block is recurrent, with its MLP and two RMSNorms."""

    work: Workload
    layout: Degrees
    ffn: str = "mlp"

    def params(self) -> int:
        m = self.work.model
        return m.hybrid.layer_params((RG_LRU, self.ffn), m.hidden, m.attention_params)

    def _state_bytes(self) -> int:
        return 8 if dtype_bytes(self.work.torch_dtype) == 8 else 4

    def sent(self) -> dict[str, int]:
        """Bytes each rank sends forward in each all-gather (its reduce-scatter the same backward)."""
        w, lay, block = self.work, self.layout, self.work.model.hybrid.rg_lru
        where = dict(batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout)
        return {HALO: halo_bytes(block.width, block.conv, dtype_bytes=dtype_bytes(w.torch_dtype), **where),
                STATES: diagonal_state_bytes(block.width, state_bytes=self._state_bytes(), **where)}

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: the two all-gathers forward, their reduce-scatters backward."""
        lay, sent = self.layout, self.sent()
        calls = tuple(Collective(kind, phase, 1, sent[key]) for key in (HALO, STATES)
                      for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        """Each collective's bytes by phase, on the busiest rank (each rank sends the same here)."""
        sent = self.sent()
        return phases(dict(sent), dict(sent), self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        link = link_name(hw, axis_groups(self.layout, "sequence")[:1])
        return {HALO: link, STATES: link}

    def saved_bytes(self) -> int:
        """Bytes saved for backward (checked against tracked CPU peaks, tests/planner/test_planner_measured.py:
        within 3% of three RecurrentGemma runs): per token its two norms, the
        block's input, linear_y's output before and after its activation, linear_x's and the conv's outputs, the two
        gates, the decay, the normaliser and the gated input, linear_out's input; the recurrence's decay, input and
        states and the scan's chunk terms in its state dtype; the MLP's."""
        w, m, block = self.work, self.work.model, self.work.model.hybrid.rg_lru
        e, s = w.act_bytes, self._state_bytes()
        per_token = (2 * norm_saved(m, e, w.efficient_norm) + e * (m.hidden + 10 * block.width)
                     + 6 * s * block.width + e * m.hybrid.ffn(self.ffn).kept)
        return tokens(w, self.layout) * per_token

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: the projections, gates and MLP at the matmul
        rate, the conv (``2 W K`` FLOPs a token, at the matmul rate: an upper bound on its speed) and the recurrence
        (:data:`SCAN_FLOPS` a channel) on the local tokens, backward twice; the two gathers, which nothing overlaps."""
        work, m, block = self.work, self.work.model, self.work.model.hybrid.rg_lru
        rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
        local = tokens(work, self.layout)
        macs = block.matmul_params(m.hidden) + block.width * block.conv + m.hybrid.ffn(self.ffn).macs
        fwd = (2 * local * macs + SCAN_FLOPS * local * block.width) / rate
        group = axis_groups(self.layout, "sequence")[0]
        comm = sum(gather_seconds(sent, hw, group) for sent in self.sent().values())  # each way, one call each
        return serial_layer_seconds(self, hw, fsdp_ranks, (fwd, 2 * fwd), (comm, comm))
