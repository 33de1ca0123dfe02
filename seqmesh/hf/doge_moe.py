"""Doge's cross-domain mixture of experts (``is_moe=True``: ``DogeCDMoE``) run sequence-parallel, exactly.

Everything in the layer is per token but its routing. transformers views the call's router logits, ``(B, S, 2K)``
contiguous, as ``(2, N, K)`` with ``N = B x S`` (it keeps that view for its checkpoints' sake), so token ``n`` of the
call (flat over rows, ``n = b x S + s``) is routed by two halves of other tokens' logits::

    x_n = logits[(n // 2)         ][half n % 2]          the first half of the flat buffer
    y_n = logits[((N + n) // 2)   ][half (N + n) % 2]    its second half

A shard cannot read those rows, so each rank's ``(B, L, 2K)`` logits are all-gathered over the sequence group (the
adjoint reduce-scatter returns their gradients) and each token picks its two halves by their global places. Packed
documents are calls of their own (as the single-process reference runs each document): ``S`` and ``n`` count within
the document, every row's share of it in one call. The layout's padding routes by its own logits (its outputs score
nothing). Rows right-padded inside the sequence (the batch's ``attention_mask``) are refused: transformers routes
real tokens by the padding's logits, whose hidden states no other call reproduces.

The rest (the two top-k, the experts' embeddings, the shared MLP) is transformers' arithmetic on this rank's tokens.
Tensor parallelism, a cache and a padding mask are refused by name. Generation (``seqmesh.inference``): the
prompt's prefill routes as above (one call over the rows); each decode step runs transformers' layer on the
batch's tokens, whole on every rank, which routes each by the batch's ``(2, B, K)`` view as transformers'
``generate`` does. A prefill onto a kept cache is refused (``check_extension``): the routing depends on where a
row's calls are cut.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.collectives import all_gather
from ..mesh import SPMesh
from ..model.doge import is_doge_moe
from ..sequence.batch import SequenceInfo
from ..sequence.sharding import sequence_layout, sequence_positions
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

def doge_moe_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The ``DogeCDMoE`` layers of ``model`` (path, module); tensor parallelism refused by name. ``design`` does not
    apply (there is one way to route)."""
    layers = [(path, m) for path, m in model.named_modules() if is_doge_moe(m)]
    refuse_tensor_parallel(layers, mesh, "is Doge's cross-domain mixture of experts, which seqmesh's tensor "
                           "parallelism does not split (its router reads the whole call's logits)")
    return layers


def check_rows(info: SequenceInfo) -> None:
    """A ValueError, before the layer's work, for rows right-padded inside the batch: transformers routes their real
    tokens by the padding's router logits, whose hidden states no sharded call reproduces."""
    if info.lengths is not None and min(info.lengths) < info.seq_len:
        raise ValueError(f"Doge's cross-domain experts route real tokens by the router logits of the rows' padding "
                         f"(rows of {list(info.lengths)} real tokens), which no sharded call reproduces: pack the "
                         "documents into full rows (position_ids restarting at each) instead of padding them.")


def routing_sources(mesh: SPMesh, info: SequenceInfo, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Where each of this rank's ``(rows, L)`` tokens finds its two halves of router logits among the gathered
    ``(rows, P x L, 2, K)`` ones (shard order), flattened to ``rows x P x L x 2`` half-rows: ``(x, y)``, each
    ``(rows x L,)`` int64, row-major as the tokens."""
    layout = sequence_layout(mesh, info.seq_len, info.layout, info.cu_seqlens)
    slot = layout.indices(restore=True, device=device)  # global position -> row of the gathered logits
    padded = layout.padded_len
    positions = sequence_positions(info.seq_len, mesh, layout=info.layout, cu_seqlens=info.cu_seqlens,
                                   device=device)  # (L,)
    real = positions < info.seq_len
    bounds = torch.tensor(tuple(info.cu_seqlens or (0, info.seq_len)), device=device)
    doc = torch.bucketize(positions.masked_fill(~real, 0), bounds[1:], right=True)
    start, length = bounds[doc], bounds[doc + 1] - bounds[doc]  # each token's call: [start, start + length)
    row = torch.arange(rows, device=device)[:, None]  # (rows, 1)
    flat = row * length + (positions - start)  # (rows, L): the token's place in its call's (2, N, K) view

    def half_row(n: torch.Tensor) -> torch.Tensor:  # place n of the call's flat halves -> its gathered half-row
        owner, half = n // 2, n % 2
        return ((owner // length) * padded + slot[start + owner % length]) * 2 + half

    own = (row * padded + slot[positions]) * 2  # the padding's own halves
    x = torch.where(real, half_row(flat), own)
    y = torch.where(real, half_row(rows * length + flat), own + 1)
    return x.flatten(), y.flatten()


def routed(module: nn.Module, router_logits: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """Transformers' experts at given routing: ``router_logits`` (2, T, K) and ``hidden_states`` (T, D) -> (T, D),
    the routed experts' states without the shared MLP."""
    keys = module.num_keys
    (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(keys, dim=-1)
    all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)  # (T, keys^2)
    scores, picked = all_scores.topk(module.top_k, dim=-1)  # (T, top_k)
    del all_scores  # freed before the rows are gathered
    # transformers' expert of pair (i, j) is indices_x[i] x keys + indices_y[j]: read at the picks alone, never the
    # (T, keys^2) int64 table of every pair
    indices = indices_x.gather(-1, picked // keys) * keys + indices_y.gather(-1, picked % keys)
    weights = F.softmax(scores, dim=-1)
    if module.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    down, up = module.down_embed(indices), module.up_embed(indices)  # (T, top_k, D) each
    mixed = module.act_fn(torch.matmul(down, hidden_states.unsqueeze(-1)).squeeze(-1)) * weights  # (T, top_k)
    return torch.matmul(mixed.unsqueeze(-2), up).squeeze(-2)


def doge_moe(module: nn.Module, hidden_states: torch.Tensor, mesh: SPMesh,
             info: SequenceInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer at this rank's tokens: ``hidden_states`` (B, L, D) in shard order -> ((B, L, D), the (2, B x L, K)
    router logits each token was routed by)."""
    rows, local, width = hidden_states.shape
    logits = module.router_gate(hidden_states)  # (B, L, 2K)
    everyone = all_gather(logits, mesh.sp_group, dim=1) if mesh.sp_size > 1 else logits  # (B, P x L, 2K)
    halves = everyone.reshape(-1, module.num_keys)  # (B x P x L x 2, K)
    x, y = routing_sources(mesh, info, rows, hidden_states.device)
    router_logits = torch.stack([halves.index_select(0, x), halves.index_select(0, y)])  # (2, B x L, K)
    experts = routed(module, router_logits, hidden_states.reshape(-1, width)).view(rows, local, width)
    shared = module.down_proj(module.act_fn(module.gate_proj(hidden_states)) * module.up_proj(hidden_states))
    return shared + experts, router_logits


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache, attention_mask)
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # the batch's tokens, on every rank alike: transformers'
            return type(self).forward(self, hidden_states)  # call routes them by the batch's (2, B, K) view
        check_rows(info)
        return doge_moe(self, hidden_states, mesh, info)

    return forward


KIND = MixerKind("Doge cross-domain experts", (), doge_moe_layers, _make_forward)
