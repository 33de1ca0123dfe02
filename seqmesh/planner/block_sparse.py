"""MiniMax-M3's block-sparse layer (the shape: :mod:`seqmesh.model.minimax_m3`) as ``seqmesh.hf.block_sparse_attention``
runs it on one flat group (the same for every ``ulysses x ring`` split): its FSDP unit, its collectives' bytes per
phase, what it keeps for backward, its backward's working set, and its time, as every layer kind of :mod:`.layers`
gives them.

Forward, each rank all-gathers the row's indexer keys (``Di`` a token, without gradient), keys and values
(``Hkv x D`` each; backward, their gradients' reduce-scatters), then runs its queries in blocks of ``l`` (their
``Hq x max(K x D, T)`` elements within ``BLOCK_ELEMENTS``): the indexer scores a block against every key of the row in
float32 (``Hi x Di`` a pair), and each query head reads its ``K`` gathered keys and values (``K``:
:meth:`~seqmesh.model.minimax_m3.BlockSparseShape.keys_per_query`), recomputed block by block in backward (a
block's forward once more, then its backward), where each block's gathered rows' gradients are added into the
row's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hf.indexed_attention import BLOCK_ELEMENTS
from ..rules.degrees import Degrees
from .activations import (attention_saved, decoder_layer_saved_bytes, local_tokens, mlp_saved_bytes, qk_norm_saved,
                          tokens)
from .hardware import HardwareSpec
from .layer_cost import Phases, gather_links, gather_phases, serial_layer_seconds
from .network import axis_groups, gather_seconds
from .placement import placement
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload, layer_matmul_params, layer_params

KEY = "block_sparse_row_gather"
INT64 = 8


def block_queries(work: Workload, layout: Degrees, keys: int, beside: int) -> int:
    """``l``: the queries of one block, as the runtime sizes it, for ``keys`` keys a query head and ``beside`` the
    other extent it bounds a block by (MiniMax-M3's row, Qwen4-Exp's blocks)."""
    m = work.model
    per_query = work.batch * m.heads * max(keys * m.head_dim, beside)
    return min(max(1, BLOCK_ELEMENTS // per_query), local_tokens(work, layout))


@dataclass(frozen=True)
class BlockSparseAttention:
    """A MiniMax-M3 block-sparse layer over the whole sequence group (module docstring)."""

    work: Workload
    layout: Degrees

    key = KEY  # the plan's name of its row gathers

    def params(self) -> int:  # tp is 1: seqmesh refuses tensor parallelism with block-sparse attention
        return layer_params(self.work.model)

    def _kv_width(self) -> int:
        """Values a token of the row's keys (or values) all-gather."""
        m = self.work.model
        return m.kv_heads * m.head_dim

    def _gathered(self) -> tuple[int, ...]:
        """Values a token in each of the row's forward all-gathers without gradient (the indexer's keys)."""
        return (self.work.model.block_sparse.index_head_dim,)

    def _keys(self) -> int:
        """Keys each query head reads."""
        return self.work.model.block_sparse.keys_per_query(self.work.seq_len)

    def _queries(self) -> int:
        """``l``: the queries of one block."""
        return block_queries(self.work, self.layout, self._keys(), self.work.seq_len)

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: the all-gathers forward (:meth:`_gathered`'s, the keys, the
        values), two reduce-scatters backward; ``(P - 1) x`` this rank's share each, the same on every rank."""
        w, lay = self.work, self.layout
        p = lay.ulysses * lay.ring
        if p == 1:
            return [RankTraffic(0, 0, ())]
        unit = (p - 1) * w.batch * local_tokens(w, lay) * dtype_bytes(w.torch_dtype)
        plain, kv = self._gathered(), self._kv_width()
        calls = (Collective("all_gather", "forward", len(plain) + 2, (sum(plain) + 2 * kv) * unit),
                 Collective("reduce_scatter", "backward", 2, 2 * kv * unit))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(p)]

    def traffic(self) -> Phases:
        return gather_phases(self.ranks(), self.key, self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return gather_links(self.key, hw, self.layout)

    def _row(self) -> int:
        """Tokens of the row every rank gathers, all ``batch`` sequences."""
        return self.work.batch * self.work.seq_len

    def attention_saved(self) -> int:
        """Bytes the layer's attention keeps for backward: its queries (each block's input) and output (``o_proj``'s
        input), ``Hq x D`` a token each, each indexer head's picked blocks (int64), the row's gathered keys and
        values, and what its q and k norms keep (:func:`.activations.qk_norm_saved`)."""
        w, m = self.work, self.work.model
        e, sparse = w.act_bytes, m.block_sparse
        own = (tokens(w, self.layout) * (2 * m.heads * m.head_dim * e + self._picks())
               + self._row() * 2 * self._kv_width() * e)
        return own + qk_norm_saved(w, self.layout)

    def _picks(self) -> int:
        """Bytes a token's picks keep: each indexer head's picked blocks (int64)."""
        sparse = self.work.model.block_sparse
        return sparse.index_heads * min(sparse.topk_blocks, sparse.blocks(self.work.seq_len)) * INT64

    def saved_bytes(self) -> int:
        w, lay = self.work, self.layout
        return decoder_layer_saved_bytes(w, lay) - attention_saved(w, lay) + self.attention_saved()

    def backward_bytes(self) -> int:
        """Peak bytes of the layer beyond what it keeps (less its MLP's tensors, which neither moment holds), the larger
        of two moments of a block (in forward, and again in backward where the layer is checkpointed, or in the
        blocks' own recompute). Its selection: the row's indexer keys and their float32 copy, the float32 scores of
        the block's queries against the row (``l x Hi x T``), the same read at every slot of the longest document's
        blocks and masked (two more of ``l x Hi x W``, ``W`` its blocks' slots), the slots' int64 places and two bool
        masks (``l x W``; the places' clamped copy, read by the gather, is gone by the mask, as the rehearsal shows). Its attention's backward: the row's key and value gradients (summed
        over the blocks) and the block's two added into them (the row's size each); the gradient of ``o_proj``'s
        input and a block's slice of the queries' (``Hq x D`` a local token each, as the rehearsal holds them); its gathered
        keys and values and the gradient of one (``l x Hq x K x D`` each; the values' is added into the row's before
        the keys' is made), their int64 row indices, and its scores, float32 probabilities and their gradients
        (``l x Hq x K`` each)."""
        w, m, e = self.work, self.work.model, self.work.act_bytes
        pairs = w.batch * self._queries() * m.heads * self._keys()
        block = pairs * (3 * m.head_dim * e + INT64 + 3 * 4)
        queries = 2 * tokens(w, self.layout) * m.heads * m.head_dim * e
        # the layer's MLP has not run yet at the selection (the recompute's forward) and is done at the attention's
        # backward: what it keeps is not there at either
        peak = max(self._select_bytes(), 2 * 2 * self._row() * self._kv_width() * e + queries + block)
        return max(0, peak - mlp_saved_bytes(w, self.layout))

    def _select_bytes(self) -> int:
        """The selection's working set of one block of queries (:meth:`backward_bytes`)."""
        w, e, sparse = self.work, self.work.act_bytes, self.work.model.block_sparse
        l, b = self._queries(), w.batch
        slots = sparse.blocks(w.seq_len) * sparse.block_size
        return (self._row() * sparse.index_head_dim * (e + 4)
                + b * l * sparse.index_heads * (w.seq_len + 2 * slots) * 4 + l * slots * (INT64 + 2))

    @property
    def backward_op(self) -> str:
        """Where the layer's peak falls, as the plan names it."""
        return "block-sparse block"

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer, as :class:`.layers.IndexedAttention` counts
        them: the projections (the indexer's in forward only); each query head's ``K`` keys, scored and read, in
        forward, once more in backward, then twice in its backward, with the gathered rows' bytes (keys and values
        each written once and read by its product); the indexer's float32 scores of this rank's queries against the whole row (no backward; run
        again with a checkpointed layer's recompute); the row's all-gathers before them and the reduce-scatters of its
        gradients, which nothing overlaps (:func:`.layer_cost.serial_layer_seconds`)."""
        w, lay, m = self.work, self.layout, self.work.model
        b = w.batch
        local = placement(w, lay).sequence_padded // (lay.ulysses * lay.ring)
        peak = hw.flops_for(w.dtype)
        mm_bwd = 2 * 2 * b * local * layer_matmul_params(m) / (peak * hw.matmul_efficiency)  # not the indexer's
        mm_fwd = 2 * b * local * (layer_matmul_params(m) + self._indexer_params()) / (peak * hw.matmul_efficiency)
        pairs = b * local * m.heads * self._keys()
        attend = (4 * pairs * m.head_dim / (peak * hw.attention_efficiency)
                  + 2 * 2 * pairs * m.head_dim * w.act_bytes / hw.memory_bandwidth)
        select = 2 * b * local * self._scored() / (hw.flops_for("fp32") * hw.matmul_efficiency)
        group = axis_groups(lay, "sequence")[0]
        unit = b * local * dtype_bytes(w.torch_dtype) * (lay.ulysses * lay.ring - 1)
        kv = self._kv_width()
        ag = sum(gather_seconds(n * unit, hw, group) for n in self._gathered()) + 2 * gather_seconds(kv * unit, hw, group)
        rs = 2 * gather_seconds(kv * unit, hw, group)
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + select + attend, mm_bwd + 3 * attend), (ag, rs))

    def _indexer_params(self) -> int:
        return self.work.model.block_sparse.indexer_params(self.work.model.hidden)

    def _scored(self) -> int:
        """Multiply-adds of one query's selection: each indexer head against every key of the row."""
        sparse = self.work.model.block_sparse
        return self.work.seq_len * sparse.index_heads * sparse.index_head_dim
