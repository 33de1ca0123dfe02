"""MiniMax-M3's block-sparse attention (its ``minimax_m3_sparse`` layers) exact under sequence parallelism.

A sparse layer is grouped-query attention in which each query sees only some blocks of ``index_block_size`` earlier
keys of its document: a lightning indexer (``index_n_heads`` heads, one shared key a token) scores the query against
every earlier key, each block's score is the largest of its keys', the ``index_local_blocks`` blocks ending at the
query's own are always kept, and the top ``index_topk_blocks`` blocks are the keys that indexer head's group of query
heads attends to (causally within the query's own block). transformers numbers the blocks from the row's first token,
which under seqmesh's packed batches is each document's first token (as the documents run one at a time). The
selection is integers: nothing trains the indexer through it.

On a shard the indexer would choose among the shard's own keys, and the attention would see the shard's only. Here
each rank all-gathers, in row order, the indexer's key (``index_head_dim`` values a token, no gradient) and the
layer's keys and values (``2 x Hkv x D``; their gradient back by the adjoint reduce-scatter); each block of its
queries scores the row, pools, selects, and attends over the keys of its selected blocks, gathered from the row and
recomputed in backward rather than kept. The group is flat: the same on Ulysses, ring, or both.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo, document_places
from .indexed_attention import BLOCK_ELEMENTS, entry_of, recomputed, replace_forward, restore_forward, whole_row
from .indexed_layouts import checked_layers, is_block_sparse, module_function, selection_problem

_ATTR = "_seqmesh_block_sparse"
LAYER_TYPE = "minimax_m3_sparse"
_INDEXER = ("q_proj", "k_proj", "q_norm", "k_norm", "block_size", "topk_blocks", "local_blocks", "build_block_mask")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
# what transformers 5.24's indexer computes, in its own statements
_SELECTION = ("scores.amax(dim=-1)", 'block_scores.scatter_(-1, local_idx, float("inf"))',
              "q_block = position_ids // self.block_size")


def block_sparse_layers(model: nn.Module, mesh: SPMesh) -> list[nn.Module]:
    """The block-sparse attention modules of ``model``; a ValueError naming the first seqmesh cannot compute."""
    return checked_layers(model, mesh, is_block_sparse, _problem,
                          "MiniMax-M3's block-sparse attention as transformers 5.24 defines it")


def _problem(module: nn.Module, mesh: SPMesh) -> str | None:
    problem = selection_problem(module, mesh, _ATTENTION, _INDEXER, _SELECTION, "MiniMax-M3", "block-sparse attention")
    if problem is None and module.config.num_attention_heads % module.indexer.num_heads:
        return (f"its {module.config.num_attention_heads} query heads are not groups of its "
                f"{module.indexer.num_heads} indexer heads")
    return problem


def _select(indexer: nn.Module, rotate, hidden: torch.Tensor, position_embeddings, row_keys: torch.Tensor,
            start: torch.Tensor, within: torch.Tensor, blocks: int) -> torch.Tensor:
    """(B, Hi, l, k) each indexer head's selected blocks (numbered from the query's document start; -1: none) for
    the queries of ``hidden`` (B, l, E), their document starts and indices within it (l,); ``row_keys`` (B, T, Di)
    the row's indexer keys; ``blocks`` the most blocks a document of the row holds."""
    b, length, _ = hidden.shape
    bs, di = indexer.block_size, indexer.head_dim
    q = indexer.q_norm(indexer.q_proj(hidden).view(b, length, -1, di)).transpose(1, 2)  # (B, Hi, l, Di)
    cos, sin = position_embeddings
    q = rotate(q, q, cos[..., :di], sin[..., :di])[0]
    scores = torch.matmul(q.float(), row_keys.float().transpose(-1, -2)[:, None])  # (B, Hi, l, T)
    # each query's keys of its own document, from its first: position start + j, j < blocks x bs
    slot = torch.arange(blocks * bs, device=hidden.device)
    keys = start[:, None] + slot[None]  # (l, blocks x bs)
    seen = slot[None] <= within[:, None]  # causal within the document (and so within the row)
    picked = scores.gather(-1, keys.clamp(max=scores.shape[-1] - 1).expand(b, scores.shape[1], -1, -1))
    picked = picked.masked_fill(~seen, float("-inf")).view(b, scores.shape[1], length, blocks, bs)
    block_scores = picked.amax(dim=-1)  # (B, Hi, l, blocks)
    if indexer.local_blocks > 0:
        local = (within[:, None] // bs - torch.arange(indexer.local_blocks, device=hidden.device)).clamp(min=0)
        block_scores.scatter_(-1, local.expand(b, block_scores.shape[1], -1, -1), float("inf"))
    values, chosen = block_scores.topk(min(indexer.topk_blocks, blocks), dim=-1)
    return chosen.masked_fill(values == float("-inf"), -1)


def _attend(module: nn.Module, query: torch.Tensor, row_k: torch.Tensor, row_v: torch.Tensor, chosen: torch.Tensor,
            start: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """query (B, Hq, l, D) over the keys of its chosen blocks: row_k, row_v (B, T, Hkv, D) the row's; chosen
    (B, Hi, l, k) from :func:`_select` -> (B, l, Hq, D)."""
    hq = query.shape[1]
    bs = module.indexer.block_size
    offsets = chosen[..., None] * bs + torch.arange(bs, device=query.device)  # (B, Hi, l, k, bs) within the document
    valid = (chosen[..., None] >= 0) & (offsets <= within[:, None, None])
    where = (start[:, None, None] + offsets.clamp(min=0)).flatten(-2)  # (B, Hi, l, K) in the row
    valid = valid.flatten(-2)
    per_head = hq // chosen.shape[1]
    where = where.repeat_interleave(per_head, dim=1)  # (B, Hq, l, K): each query head its indexer head's blocks
    valid = valid.repeat_interleave(per_head, dim=1)
    return gathered_attention(query, row_k, row_v, where, valid, module.scaling)


def gathered_attention(query: torch.Tensor, row_k: torch.Tensor, row_v: torch.Tensor, where: torch.Tensor,
                       valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """query (B, Hq, l, D) over the row's keys and values (B, T, Hkv, D) at the row indices ``where`` (B, Hq, l, K)
    where ``valid`` holds (each query head reads its key head's rows: GQA) -> (B, l, Hq, D)."""
    b, hq, length, d = query.shape
    total, kv_heads = row_k.shape[1], row_k.shape[2]
    kv_of = torch.arange(hq, device=query.device) // (hq // kv_heads)  # each query head's key head
    index = where.clamp(max=total - 1) * kv_heads + kv_of[None, :, None, None]  # into the row's (T x Hkv) rows
    index = index.reshape(b, -1, 1).expand(-1, -1, d)  # (B, Hq l K, D)
    k = row_k.reshape(b, total * kv_heads, d).gather(1, index).view(b, hq, length, -1, d)
    v = row_v.reshape(b, total * kv_heads, d).gather(1, index).view(b, hq, length, -1, d)
    scores = torch.einsum("bhld,bhlkd->bhlk", query, k) * scaling
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    return torch.einsum("bhlk,bhlkd->bhld", probs, v).transpose(1, 2)


def _make_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None, **kwargs):
        # hidden_states (B, L, E) -> ((B, L, E), None)
        info, _ = entry_of(self, cache, kwargs)
        b, length = hidden_states.shape[:-1]
        shape = (b, length, -1, self.head_dim)
        rotate = module_function(self, "apply_rotary_pos_emb")
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)  # (B, Hq, L, D)
        key = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)  # (B, Hkv, L, D)
        value = self.v_proj(hidden_states).view(shape)  # (B, L, Hkv, D)
        query, key = rotate(query, key, *position_embeddings)
        decode = getattr(info, "block_sparse_step", None)  # a decode step of seqmesh.inference.generate
        if decode is not None:
            out = decode(self, hidden_states, position_embeddings, query, key, value.transpose(1, 2))
            return self.o_proj(out.reshape(b, length, -1)), None
        indexer = self.indexer
        start, within, longest = document_places(mesh, info, hidden_states.device)
        blocks = -(-longest // indexer.block_size)  # the most blocks a document holds
        with torch.no_grad():  # the selection: integers, as transformers' (nothing trains the indexer through it)
            index_key = indexer.k_norm(indexer.k_proj(hidden_states).view(b, length, 1, indexer.head_dim))
            di = indexer.head_dim
            cos, sin = position_embeddings
            index_key = rotate(index_key.transpose(1, 2), index_key.transpose(1, 2), cos[..., :di], sin[..., :di])[0]
            row_index_keys = whole_row(index_key[:, 0], mesh, info)  # (B, T, Di)
        keep = getattr(info, "keep_block_sparse", None)  # a prefill of seqmesh.inference.generate: this rank's share
        if keep is not None:
            keep(self, key, value.transpose(1, 2), index_key)
        row_k = whole_row(key.transpose(1, 2), mesh, info)  # (B, T, Hkv, D): one gather each, one scatter back
        row_v = whole_row(value, mesh, info)
        keys_per_query = min(indexer.topk_blocks, blocks) * indexer.block_size
        step = max(1, BLOCK_ELEMENTS // max(1, b * query.shape[1] * max(keys_per_query * self.head_dim,
                                                                           row_index_keys.shape[1])))
        outputs = []
        for first in range(0, length, step):
            part = slice(first, first + step)
            with torch.no_grad():
                chosen = _select(indexer, rotate, hidden_states[:, part],
                                 tuple(t[:, part] for t in position_embeddings), row_index_keys, start[part],
                                 within[part], blocks)
            inputs = (query[:, :, part], row_k, row_v, chosen, start[part], within[part])
            outputs.append(recomputed(_attend, self, *inputs))
        out = torch.cat(outputs, dim=1).reshape(b, length, -1)
        return self.o_proj(out), None

    return forward


def install(layers: list[nn.Module], mesh: SPMesh) -> None:
    """Give ``layers`` (from :func:`block_sparse_layers`) the sequence-parallel forward; the class is untouched."""
    replace_forward(layers, _make_forward(mesh), _ATTR)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the class's own forward again."""
    restore_forward(model, _ATTR)
