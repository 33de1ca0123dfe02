"""An Inkling layer (the shape: :mod:`seqmesh.model.inkling`) as ``seqmesh.hf.inkling`` runs it on one flat group (the
same for every ``ulysses x ring`` split): its attention with a relative bias over the gathered row, its four short
convolutions, its MLP.

Forward, each rank all-gathers the row's keys and values (``Hkv x D`` each, their gradients reduce-scattered
backward), and each of its four short convolutions (the keys' and values' inside the attention, the attention's and
the MLP's outputs; float32) all-gathers its ``K - 1``-row halo (:func:`seqmesh.linear_attention.choice.halo_bytes`;
their gradients reduce-scattered). Its queries run in blocks of ``l = BLOCK_ELEMENTS / (H x T x D)`` (at least one),
each scoring the keys of the row its documents reach, up to its last query (the whole row on the busiest rank: a
sliding layer reads it as a full one does, its window a mask), recomputed block by block in backward: for each
(query, key) pair and head, a score, its bias read from the query's profile, the masks, float32 probabilities; each
block's keys and values repeated for every query head.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hf.indexed_attention import BLOCK_ELEMENTS
from ..linear_attention.choice import halo_bytes
from ..model.inkling import SLIDING
from ..rules.degrees import Degrees
from .activations import local_tokens, mlp_saved_bytes, norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import Phases, gather_comm_seconds, gather_links, phases, serial_layer_seconds
from .placement import placement
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload, mlp_matmul_params

ROWS, HALOS = "relative_row_gather", "conv_halo_gather"
INT64 = 8


@dataclass(frozen=True)
class RelativeAttention:
    """An Inkling layer of ``kind`` (``hybrid_sliding`` or ``hybrid``) over the whole sequence group."""

    work: Workload
    layout: Degrees
    kind: str

    def _heads(self) -> tuple[int, int, int]:
        m = self.work.model
        return m.inkling.heads(self.kind, m.heads, m.kv_heads, m.head_dim)

    def params(self) -> int:  # tp is 1: seqmesh refuses tensor parallelism with Inkling's attention
        m = self.work.model
        return m.inkling_layer_params(self.kind, dense=not m.experts)

    def _sent(self) -> tuple[int, int]:
        """Bytes each rank sends forward in the row's gathers and in the four halos' (backward the same again)."""
        w, lay, m = self.work, self.layout, self.work.model
        p = lay.ulysses * lay.ring
        _, hk, d = self._heads()
        rows = 2 * (p - 1) * w.batch * local_tokens(w, lay) * hk * d * dtype_bytes(w.torch_dtype)
        halo = dict(kernel=m.inkling.kernel, batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout,
                    dtype_bytes=4)
        return rows, 2 * halo_bytes(hk * d, **halo) + 2 * halo_bytes(m.hidden, **halo)

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: six all-gathers forward (the keys, the values, the four halos),
        their six reduce-scatters backward; the same on every rank."""
        lay = self.layout
        if lay.ulysses * lay.ring == 1:
            return [RankTraffic(0, 0, ())]
        rows, halos = self._sent()
        calls = (Collective("all_gather", "forward", 6, rows + halos),
                 Collective("reduce_scatter", "backward", 6, rows + halos))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> Phases:
        if self.layout.ulysses * self.layout.ring == 1:
            return phases({}, {}, self.work.checkpointing)
        rows, halos = self._sent()
        sent = {ROWS: rows, HALOS: halos}
        return phases(sent, dict(sent), self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return gather_links(ROWS, hw, self.layout) | gather_links(HALOS, hw, self.layout)

    def _row(self) -> int:
        """Tokens of the row every rank gathers, all ``batch`` sequences."""
        return self.work.batch * self.work.seq_len

    def _queries(self) -> int:
        """``l``: the queries of one block, as the runtime sizes it."""
        h, _, d = self._heads()
        w = self.work
        return min(max(1, BLOCK_ELEMENTS // (w.batch * h * w.seq_len * d)), local_tokens(w, self.layout))

    def saved_bytes(self) -> int:
        """Bytes the layer keeps for backward: its two norms and the normed input the projections read; the queries
        normed (each head's float32 input and scale, the normed head) and the keys likewise, the values; each
        query's bias profile (``H x extent``) and ``r_proj``'s output; the row's keys and values; ``o_proj``'s input;
        the four convolutions' float32 inputs with their halo and their ``K - 1`` shifted products; the MLP's."""
        w, lay, m, e = self.work, self.layout, self.work.model, self.work.act_bytes
        h, hk, d = self._heads()
        ink = m.inkling
        per_token = (norm_saved(m, e, w.efficient_norm) + e * m.hidden  # the first norm, the projections' input
                     + (h + hk) * (4 * d + 4 + e * d) + e * hk * d  # q and k norms, v
                     + e * h * (ink.extent(self.kind) + ink.d_rel)  # the bias profiles, r_proj's output
                     + self._after_blocks()  # o_proj's input, the second norm, the layer's two convolutions
                     + 4 * ink.kernel * 2 * hk * d)  # the attention's two convolutions
        return tokens(w, lay) * per_token + 2 * self._row() * hk * d * e + mlp_saved_bytes(w, lay)

    def _after_blocks(self) -> int:
        """Bytes a token keeps for what runs after the attention's blocks in forward (and so before them in backward):
        ``o_proj``'s input, the second norm, the two convolutions of ``E`` channels (the MLP apart)."""
        m, e = self.work.model, self.work.act_bytes
        h, _, d = self._heads()
        return e * h * d + norm_saved(m, e, self.work.efficient_norm) + 4 * m.inkling.kernel * 2 * m.hidden

    def backward_bytes(self) -> int:
        """Peak bytes of one block beyond what the layer keeps (less what runs after the blocks in forward, whose
        backward is done: :meth:`_after_blocks`, the MLP's), in its backward (at its softmax's): its keys and
        values repeated for every query head (``H x T x D`` each), and per (query, key) pair and head its bias read
        from the profile and its masked copy, its float32 probabilities and their float32 gradient; per (query, key)
        pair the distance and its clamped copy (int64) and three masks; the row's key and value gradients, and the
        gradients of the bias profiles and the queries, summed over the blocks. A full layer that scales its queries
        and their bias by the log of their index (in float32) holds after its blocks the bias profiles' gradient
        twice in float32 (its cast and its product), when that is more."""
        w, m, e = self.work, self.work.model, self.work.act_bytes
        h, hk, d = self._heads()
        t, extent = tokens(w, self.layout), m.inkling.extent(self.kind)
        pairs = w.batch * self._queries() * h * w.seq_len
        repeated = 2 * w.batch * h * w.seq_len * d * e
        block = pairs * (2 * e + 2 * 4) + self._queries() * w.seq_len * (2 * INT64 + 3)
        summed = t * h * (extent + d) * e
        peak = repeated + block + summed + 2 * self._row() * hk * d * e
        if self.kind != SLIDING and m.inkling.log_scaling:
            peak = max(peak, 2 * 4 * t * h * (extent + d))
        return max(0, peak - mlp_saved_bytes(w, self.layout) - t * self._after_blocks())

    def _macs(self) -> int:
        """Multiply-adds a token of the layer's projections, convolutions and MLP."""
        m = self.work.model
        h, hk, d = self._heads()
        projections = m.hidden * (d * (2 * h + 2 * hk) + h * m.inkling.d_rel) + mlp_matmul_params(m)
        return projections + m.inkling.kernel * (2 * hk * d + 2 * m.hidden)

    @property
    def backward_op(self) -> str:
        return "relative attention block"

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: the projections and the MLP on the local tokens
        (backward twice); each query head against every key of the row its block reaches (the whole row: sliding
        layers too) for its scores and output, at the attention rate, and its bias read, in forward, again in the
        blocks' recompute and twice in backward; the convolutions' multiply-adds; the gathers, which nothing
        overlaps."""
        w, lay, m = self.work, self.layout, self.work.model
        h, hk, d = self._heads()
        local = placement(w, lay).sequence_padded // (lay.ulysses * lay.ring)
        peak = hw.flops_for(w.dtype)
        mm = 2 * w.batch * local * self._macs() / (peak * hw.matmul_efficiency)
        pairs = w.batch * local * h * w.seq_len
        attend = 4 * pairs * d / (peak * hw.attention_efficiency) + pairs * 3 * w.act_bytes / hw.memory_bandwidth
        comm = gather_comm_seconds(self.ranks(), hw, lay)
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm + attend, 2 * mm + 3 * attend), comm)
