"""Qwen4-Exp's QSA attention (its ``indexed_attention`` layers) exact under sequence parallelism.

A QSA layer is gated grouped-query attention in which each query sees only some of its earlier keys. Its indexer
splits the tokens the query sees (its document's, from the first) into blocks of ``compress_ratio``; each complete
block's key is the mean of its tokens' raw indexer keys (in float32), normed and rotated at the block's first token;
the query's indexer heads score every complete block (``relu(q . k)`` summed over the heads, over ``sqrt(D)``), and
the top ``token_budget / compress_ratio`` blocks, with the incomplete block at the query's end (its *tail*), are the
keys every head attends to. The selection is integers: nothing trains the indexer through it (transformers' indexer
returns a mask).

On a shard the indexer would choose among the shard's own tokens, and the attention would see the shard's only. Here
each rank all-gathers, in row order, the indexer's raw keys and the rotary tables (no gradient) and the layer's keys
and values (their gradient back by the adjoint reduce-scatter); it pools every document's blocks, and each block of
its queries scores them, selects, and attends over its selected tokens, gathered from the row and recomputed in
backward rather than kept. The group is flat: the same on Ulysses, ring, or both.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo, document_places
from ..tensor_values import has_values
from .block_sparse_attention import gathered_attention
from .indexed_attention import BLOCK_ELEMENTS, entry_of, recomputed, replace_forward, restore_forward, whole_row
from .indexed_layouts import checked_layers, module_function, selection_problem

_ATTR = "_seqmesh_qsa"
LAYER_TYPE = "indexed_attention"
_INDEXER = ("index_qk_proj", "q_layernorm", "k_layernorm", "token_budget", "compress_ratio", "block_topk",
            "index_n_heads", "index_kv_heads", "index_head_dim")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim", "scaling")
# what transformers 5.24's indexer computes, in its own statements
_SELECTION = ("pooled_keys = key_groups.float().mean(dim=1).to(raw_keys.dtype)",
              "scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.index_head_dim)",
              "tail = local_visible_indices[num_complete_blocks * self.compress_ratio :]")


def is_qsa(module: nn.Module) -> bool:
    """Whether ``module`` is the attention of a QSA layer (its indexer pools blocks of ``compress_ratio`` tokens)."""
    indexer = getattr(module, "indexer", None)
    return indexer is not None and hasattr(indexer, "compress_ratio") and hasattr(indexer, "token_budget")


def qsa_layers(model: nn.Module, mesh: SPMesh) -> list[nn.Module]:
    """The QSA attention modules of ``model``; a ValueError naming the first seqmesh cannot compute."""
    return checked_layers(model, mesh, is_qsa, _problem, "Qwen4-Exp's QSA attention as transformers 5.24 defines it")


def _problem(module: nn.Module, mesh: SPMesh) -> str | None:
    problem = selection_problem(module, mesh, _ATTENTION, _INDEXER, _SELECTION, "Qwen4-Exp", "QSA attention")
    if problem is None and module.indexer.index_kv_heads != 1:
        return f"its indexer has {module.indexer.index_kv_heads} key heads (transformers' indexer reads one)"
    return problem


def _blocks(info: SequenceInfo, ratio: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every complete block of every document of the row, in row order: its first token's index in the row (NB,) and
    the index of its document's first block among them (one per document, (D,))."""
    cuts = tuple(info.cu_seqlens or (0, info.seq_len))
    starts, firsts = [], []
    for a, e in zip(cuts, cuts[1:]):
        firsts.append(len(starts))
        starts += range(a, a + (e - a) // ratio * ratio, ratio)
    return (torch.tensor(starts, dtype=torch.long, device=device),
            torch.tensor(firsts, dtype=torch.long, device=device))


def _pooled(indexer: nn.Module, rotate, row_raw: torch.Tensor, row_cos: torch.Tensor, row_sin: torch.Tensor,
            block_starts: torch.Tensor) -> torch.Tensor:
    """(B, NB, Di) each complete block's key: the mean of its tokens' raw keys (float32, back to their dtype), normed,
    rotated at its first token, as transformers pools them."""
    ratio = indexer.compress_ratio
    tokens = block_starts[:, None] + torch.arange(ratio, device=block_starts.device)  # (NB, r)
    groups = row_raw[:, tokens]  # (B, NB, r, Di)
    pooled = indexer.k_layernorm(groups.float().mean(dim=2).to(row_raw.dtype))
    cos, sin = row_cos[:, block_starts], row_sin[:, block_starts]  # (B, NB, D)
    return rotate(pooled.unsqueeze(1), cos=cos, sin=sin).squeeze(1)


def _select(indexer: nn.Module, q: torch.Tensor, pooled: torch.Tensor, block_starts: torch.Tensor,
            first_block: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """(B, l, k) each query's selected blocks (indices into the row's blocks; -1: none) from its indexer query ``q``
    (B, l, Hi, Di), the row's pooled block keys (B, NB, Di), each query's document's first block (l,) and its index
    within the document (l,)."""
    complete = (within + 1) // indexer.compress_ratio  # (l,) the query's complete blocks
    scores = torch.matmul(q.float(), pooled.float().transpose(-1, -2)[:, None]).transpose(-1, -2)  # (B, l, NB, Hi)
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(indexer.index_head_dim)  # (B, l, NB)
    b, length = scores.shape[:2]
    chosen = scores.new_full((b, length, indexer.block_topk), -1, dtype=torch.long)
    # ReLU's zeros tie often: each query's top-k over exactly its own complete blocks, as transformers takes it (queries
    # with the same document and count at once), so that ties fall alike
    if not has_values(first_block):  # a rehearsal: every query over every block at once (the busiest block's sizes)
        top = scores.topk(min(indexer.block_topk, scores.shape[-1]), dim=-1).indices
        chosen[:, :, :top.shape[-1]] = top
        return chosen
    for first, count in sorted(set(zip(first_block.tolist(), complete.tolist()))):
        if count == 0:
            continue
        rows = ((first_block == first) & (complete == count)).nonzero().flatten()
        top = scores[:, rows, first:first + count].topk(min(indexer.block_topk, count), dim=-1).indices + first
        chosen[:, rows, :top.shape[-1]] = top
    return chosen


def _attend(module: nn.Module, query: torch.Tensor, row_k: torch.Tensor, row_v: torch.Tensor, chosen: torch.Tensor,
            block_starts: torch.Tensor, start: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """query (B, Hq, l, D) over its selected tokens: its chosen blocks (B, l, k) and its tail (the tokens after its
    last complete block, up to itself); row_k, row_v (B, T, Hkv, D) -> (B, l, Hq, D)."""
    b = query.shape[0]
    ratio = module.indexer.compress_ratio
    slot = torch.arange(ratio, device=query.device)
    starts = block_starts if block_starts.numel() else block_starts.new_zeros(1)  # no complete block: tails only
    picked = starts[chosen.clamp(min=0)][..., None] + slot  # (B, l, k, r) in the row
    picked_ok = (chosen >= 0)[..., None].expand_as(picked)
    tail_start = start + (within + 1) // ratio * ratio  # (l,)
    tail = tail_start[:, None] + slot[:-1]  # (l, r - 1)
    tail_ok = tail <= (start + within)[:, None]
    where = torch.cat([picked.flatten(-2), tail.expand(b, -1, -1)], dim=-1)  # (B, l, K): every head alike
    valid = torch.cat([picked_ok.flatten(-2), tail_ok.expand(b, -1, -1)], dim=-1)
    heads = query.shape[1]
    return gathered_attention(query, row_k, row_v, where[:, None].expand(-1, heads, -1, -1),
                              valid[:, None].expand(-1, heads, -1, -1), module.scaling)


def _make_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None, **kwargs):
        # hidden_states (B, L, E) -> ((B, L, E), None)
        info, _ = entry_of(self, cache, kwargs)
        b, length = hidden_states.shape[:-1]
        shape = (b, length, -1, self.head_dim)
        rotate = module_function(self, "apply_rotary_pos_emb")
        cos, sin = position_embeddings  # this rank's tokens (no cache: transformers' "full" tables are these)
        query, gate = torch.chunk(self.q_proj(hidden_states).view(b, length, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(b, length, -1)
        query = self.q_norm(query.reshape(shape)).transpose(1, 2)  # (B, Hq, L, D)
        key = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)  # (B, Hkv, L, D)
        value = self.v_proj(hidden_states).view(shape)  # (B, L, Hkv, D)
        query, key = rotate(query, key, cos, sin)
        indexer = self.indexer
        start, within, _ = document_places(mesh, info, hidden_states.device)
        with torch.no_grad():  # the selection: integers, as transformers' mask (nothing trains the indexer through it)
            di = indexer.index_head_dim
            q_index, raw = indexer.index_qk_proj(hidden_states).split(
                [indexer.index_n_heads * di, indexer.index_kv_heads * di], dim=-1)
            q_index = rotate(indexer.q_layernorm(q_index.reshape(b, length, -1, di)), cos=cos, sin=sin,
                             unsqueeze_dim=2)  # (B, L, Hi, Di)
            row_raw = whole_row(raw.reshape(b, length, -1, di).squeeze(2), mesh, info)  # (B, T, Di)
            row_cos, row_sin = whole_row(cos, mesh, info), whole_row(sin, mesh, info)  # (B, T, D)
            block_starts, firsts = _blocks(info, indexer.compress_ratio, hidden_states.device)
            pooled = _pooled(indexer, rotate, row_raw, row_cos, row_sin, block_starts)  # (B, NB, Di)
            bounds = torch.tensor(tuple(info.cu_seqlens or (0, info.seq_len)), device=hidden_states.device)
            first_block = firsts[torch.bucketize(start, bounds[1:], right=True)]  # (L,) each query's document's
        row_k = whole_row(key.transpose(1, 2), mesh, info)  # (B, T, Hkv, D): one gather each, one scatter back
        row_v = whole_row(value, mesh, info)
        keys_per_query = indexer.token_budget + indexer.compress_ratio - 1
        step = max(1, BLOCK_ELEMENTS // max(1, b * query.shape[1] * max(keys_per_query * self.head_dim,
                                                                           max(1, block_starts.shape[0]))))
        outputs = []
        for first in range(0, length, step):
            part = slice(first, first + step)
            with torch.no_grad():
                chosen = _select(indexer, q_index[:, part], pooled, block_starts, first_block[part], within[part])
            inputs = (query[:, :, part], row_k, row_v, chosen, block_starts, start[part], within[part])
            outputs.append(recomputed(_attend, self, *inputs))
        out = torch.cat(outputs, dim=1).reshape(b, length, -1)
        return self.o_proj(out * torch.sigmoid(gate)), None

    return forward


def install(layers: list[nn.Module], mesh: SPMesh) -> None:
    """Give ``layers`` (from :func:`qsa_layers`) the sequence-parallel forward; the class is untouched."""
    replace_forward(layers, _make_forward(mesh), _ATTR)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the class's own forward again."""
    restore_forward(model, _ATTR)
