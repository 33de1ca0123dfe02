"""Qwen4-Exp's QSA layer (the shape: :mod:`seqmesh.model.qwen4_exp`) as ``seqmesh.hf.qsa_attention`` runs it on one
flat group (the same for every ``ulysses x ring`` split), priced as MiniMax-M3's block-sparse layer
(:mod:`.block_sparse`) with its own selection.

Forward, each rank all-gathers the row's raw indexer keys (``Di`` a token) and its rotary tables (two of the rotary
width; all without gradient), its keys and values (``Hkv x D`` each; backward, their gradients' reduce-scatters).
It pools the row's complete blocks of ``ratio`` tokens (``NB = T / ratio`` keys of ``Di``, in float32 while they are
averaged), then runs its queries in blocks of ``l`` (their ``Hq x max(K x D, NB)`` elements within
``BLOCK_ELEMENTS``): the indexer scores a block's queries against every pooled key in float32 (``Hi x Di`` a pair),
and each query head reads its ``K`` gathered keys and values (its picked blocks' slots and its tail), recomputed block
by block in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import gated_residual_saved, tokens
from .block_sparse import INT64, BlockSparseAttention, block_queries

KEY = "qsa_row_gather"


@dataclass(frozen=True)
class QsaAttention(BlockSparseAttention):
    """A Qwen4-Exp QSA layer over the whole sequence group (module docstring)."""

    key = KEY

    def _gathered(self) -> tuple[int, ...]:
        """The raw indexer keys and the rotary tables (cos, sin)."""
        q = self.work.model.qwen_exp
        return q.index_head_dim, q.rotary, q.rotary

    def _keys(self) -> int:
        return self.work.model.qwen_exp.keys_per_query

    def _queries(self) -> int:
        return block_queries(self.work, self.layout, self._keys(), self.work.model.qwen_exp.blocks(self.work.seq_len))

    def _picks(self) -> int:
        """Bytes a token's picks keep for the blocks' recompute: its chosen blocks (int64), its document's start and
        its place in it."""
        return (self.work.model.qwen_exp.block_topk + 2) * INT64

    def _select_bytes(self) -> int:
        """The selection's working set of one block of queries: the row's raw indexer keys and rotary tables, the
        pooled keys (a block's tokens gathered and their float32 mean; normed, rotated), and the block's float32
        scores against them (each indexer head's, their ReLU and sum)."""
        w, e, q = self.work, self.work.act_bytes, self.work.model.qwen_exp
        blocks, l, b = w.batch * q.blocks(w.seq_len), self._queries(), w.batch
        row = self._row() * (q.index_head_dim * (e + 4) + 2 * q.rotary * e)
        scores = b * l * q.blocks(w.seq_len) * (2 * q.index_heads + 1) * 4
        return row + blocks * q.index_head_dim * (2 * e + 4) + scores

    def backward_bytes(self) -> int:
        """:meth:`.block_sparse.BlockSparseAttention.backward_bytes`, less the layer's second gated residual's saved
        tensors, which neither moment holds either: it runs after the attention in forward (the selection comes
        before it) and its backward before the attention's."""
        return max(0, super().backward_bytes() - tokens(self.work, self.layout) * gated_residual_saved(self.work))

    def _indexer_params(self) -> int:
        return self.work.model.qwen_exp.indexer_params(self.work.model.hidden)

    def _scored(self) -> int:
        """Multiply-adds of one query's selection: each indexer head against every pooled block of the row."""
        q = self.work.model.qwen_exp
        return q.blocks(self.work.seq_len) * q.index_heads * q.index_head_dim

    @property
    def backward_op(self) -> str:
        return "QSA block"
