"""What a Mamba2 hybrid's layers cost on the busiest rank (:mod:`seqmesh.model.hybrid` reads their shapes): a Mamba2
layer as ``seqmesh.hf.mamba2`` runs it (Falcon-H1's beside its attention), and Nemotron-H's MLP and MoE blocks,
which mix no tokens.

A Mamba2 layer, per rank and sequence (``L`` local tokens, ``H`` heads of ``P`` channels, state ``N``, groups ``G``)::

    in_proj, out_proj      local matmuls (no communication)
    halo conv              one all-gather of K - 1 rows of x | B | C per tail forward, its reduce-scatter backward
    chunked scan           local (decay_scan.chunk_decay_scan), every head on every rank
    state pass             one all-gather of every run's [S_0 | decay] (float32) forward, its reduce-scatter backward

The bytes are :func:`seqmesh.linear_attention.choice.mamba2_state_passing_bytes` (the runtime's own formula); they do
not grow with the sequence. Neither collective overlaps compute (the scan waits for the halo, the outputs for the
states), so the layer's time is :func:`.layers._serial_layer_seconds`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..degrees import Degrees
from ..linear_attention.choice import LINEAR_CHUNK, mamba2_state_passing_bytes
from ..model.hybrid import MAMBA2, FeedForward, Mamba2Shape
from ..padding import padded_length
from .activations import norm_saved, tokens
from .hardware import HardwareSpec
from .network import axis_groups, gather_seconds, link_name
from .traffic import Collective, RankTraffic, dtype_bytes, worst_rank
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


def _local_tokens(work: Workload, layout: Degrees) -> int:
    """Tokens of one sequence a rank holds (tp is 1: the planner refuses tensor parallelism on hybrids)."""
    p = layout.ulysses * layout.ring
    return padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout) // p


def _rates(work: Workload, hw: HardwareSpec) -> tuple[float, float]:
    """(matmul, scan) FLOP/s achieved: the scan's chunked products run at the attention kernels' efficiency."""
    peak = hw.flops_for(work.dtype)
    return peak * hw.matmul_efficiency, peak * hw.attention_efficiency


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

    def sent_bytes(self) -> int:
        """Bytes each rank sends in the layer's two all-gathers forward (the same again in the reduce-scatters)."""
        w, lay, mamba = self.work, self.layout, self.work.model.hybrid.mamba
        e = dtype_bytes(w.torch_dtype)
        return mamba2_state_passing_bytes(mamba.heads, mamba.head_dim, mamba.state, mamba.groups, batch=w.batch,
                                          ulysses=lay.ulysses, ring=lay.ring, layout=w.layout, kernel=mamba.conv,
                                          dtype_bytes=e, state_bytes=8 if e == 8 else 4)

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: two all-gathers forward, their reduce-scatters backward."""
        lay, sent = self.layout, self.sent_bytes()
        calls = (Collective("all_gather", "forward", 2, sent), Collective("reduce_scatter", "backward", 2, sent))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        from .layers import phases

        ranks = self.ranks()
        return phases({"mamba2_state_gather": worst_rank(ranks, "all_gather", "forward")},
                      {"mamba2_state_gather": worst_rank(ranks, "reduce_scatter", "backward")}, self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return {"mamba2_state_gather": link_name(hw, axis_groups(self.layout, "sequence")[:1])}

    def saved_bytes(self) -> int:
        """Bytes saved for backward (an estimate, not yet checked against a run): per token its norms, in_proj's input
        and output, the conv's input and output, dt, the scan's float32 tensors (q and k widened to every head, v,
        the chunk's decays and scores, the decayed reads and writes, both outputs), the gated norm and out_proj's
        input, the feed-forward's; per chunk and head one float32 ``N x P`` state. Beside attention (Falcon-H1): the
        whole layer's, the attention layer's saved tensors added (the step takes the largest kind as a layer's)."""
        w, m, mamba = self.work, self.work.model, self.work.model.hybrid.mamba
        e, t = w.act_bytes, tokens(w, self.layout)
        h, n, p, c = mamba.heads, mamba.state, mamba.head_dim, LINEAR_CHUNK
        proj = e * (m.hidden + 2 * mamba.inner + mamba.conv_dim + h) + e * 2 * mamba.conv_dim + 3 * 4 * h
        scan = 4 * h * (4 * n + 3 * p + 2 * c + 1)
        tail = e * 4 * mamba.inner
        norms = 0 if self.beside_attention else m.hybrid.norms * norm_saved(m, e, w.efficient_norm)
        per_token = norms + proj + scan + tail + e * self._ffn.kept
        states = -(-t // w.batch // c) * w.batch * h * n * p * 4
        if self.beside_attention:  # the whole Falcon-H1 layer: the attention layer's beside it
            from .layers import Attention

            states += Attention(w, self.layout).saved_bytes()
        return t * per_token + states

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: the projections and feed-forward, the scan
        (:func:`mamba2_mixing_flops`; backward twice), the halo's and the states' collectives, which nothing overlaps."""
        from .layers import _serial_layer_seconds

        work, m = self.work, self.work.model
        mm_rate, scan_rate = _rates(work, hw)
        local = work.batch * _local_tokens(work, self.layout)
        mm_fwd = 2 * local * (m.hybrid.mamba.matmul_params(m.hidden) + self._ffn.macs) / mm_rate
        scan_fwd = mamba2_mixing_flops(m.hybrid.mamba, local) / scan_rate
        group = axis_groups(self.layout, "sequence")[0]
        ranks = self.ranks()
        ag, rs = (gather_seconds(worst_rank(ranks, kind, ph), hw, group)
                  for kind, ph in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        return _serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + scan_fwd, 2 * mm_fwd + 2 * scan_fwd), (ag, rs))


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
        from .layers import phases

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
        from .layers import _serial_layer_seconds

        mm_rate, _ = _rates(self.work, hw)
        local = self.work.batch * _local_tokens(self.work, self.layout)
        mm_fwd = 2 * local * self.work.model.hybrid.ffn(self.ffn).macs / mm_rate
        return _serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd, 2 * mm_fwd), (0.0, 0.0))
