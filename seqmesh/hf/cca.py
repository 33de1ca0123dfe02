"""ZAYA's Compressed Convolutional Attention projections (``ZayaCCAProjection``) run sequence-parallel, exactly.

The projection gives attention its q, k and v; everything in it is per token but two mixings of earlier tokens::

    q, k = q_proj(h), k_proj(h)                            per token
    qk   = grouped_conv(depthwise_conv(q | k))              causal: reads (t0 - 1) + (t1 - 1) earlier rows of q | k
    q'   = qk_q + (q + repeat(k)) / 2,  k' = qk_k + mean over each group of that
    v    = v_proj_current(h) | v_proj_delayed(h_{t-1})      the previous token's; v_proj_delayed(0) at a start

On a shard both read rows other ranks hold: the halo of ``q | k`` (``t0 + t1 - 2`` rows before each run) and of the
delayed value (one row), each brought by one all-gather (:func:`seqmesh.linear_attention.halo.with_halo`; its
reduce-scatter returns their gradients); the family's own two convs then run on each run with its halo. Packed
documents and the layout's padding restart both, as one model call per document does (zero rows before a
document's first token; the delayed value's projection of zeros, its bias). Attention itself goes through
transformers' interface, so seqmesh's attention runs it with the layer's own window.

Generation (``seqmesh.inference``): the prompt's prefill leaves, on every rank, the convs' last ``t0 + t1 - 2``
inputs and the last token's delayed value projection; each decode step runs the token's projection from them
(:func:`cca_step`), and attention keeps its cache as every other layer does.

``parallelize`` gives each projection an instance-level ``forward`` (the class and transformers' code untouched);
``unparallelize`` deletes it. ZAYA's attention calls the projection without its kwargs; the attention module, which
receives seqmesh's entry, hands it over (:func:`seqmesh.hf.mixers.carry_entry`). Tensor parallelism is refused by
name: seqmesh does not split the grouped conv.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..linear_attention.decode import sequence_tail
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

PROJECTIONS = ("ZayaCCAProjection",)  # whose forward this module follows
_PARTS = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "conv_qk_depthwise", "conv_qk_grouped",
          "conv_kernel_size", "num_key_value_groups", "head_dim")


def is_cca(module: nn.Module) -> bool:
    return type(module).__name__ in PROJECTIONS and all(hasattr(module, p) for p in _PARTS)


def cca_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The CCA projections of ``model`` (path, module); a ValueError for tensor parallelism (design: the halo is the
    only one, any name is accepted)."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if is_cca(m)]
    refuse_tensor_parallel(layers, mesh, "convolves q and k over time with a grouped conv, which seqmesh's tensor "
                           "parallelism does not split")
    return layers


def _by_segment(x: torch.Tensor, bounds: tuple[int, ...], each: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``each`` on every segment of ``x`` (B, E, C) alone, concatenated back."""
    return torch.cat([each(x[:, a:e]) for a, e in zip(bounds[:-1], bounds[1:])], dim=1)


def _residuals(m: nn.Module, queries: torch.Tensor, keys: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, ...]:
    """The q and k residual paths (B, L, heads, D): their mean, then its mean over each key head's group."""
    query_residual = queries.view(shape)
    key_residual = keys.view(shape).repeat_interleave(m.num_key_value_groups, dim=2)  # each kv head for its group
    query_residual = (query_residual + key_residual) * 0.5
    key_residual = query_residual.view(*shape[:2], -1, m.num_key_value_groups, m.head_dim).mean(dim=-2)
    return query_residual, key_residual


def _convolve(m: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The two convs over one segment of q | k (B, n, C), zero rows before it -> (B, n, C)."""
    padded = F.pad(rows.transpose(1, 2), (m.conv_kernel_size, 0))
    return m.conv_qk_grouped(m.conv_qk_depthwise(padded)).transpose(1, 2)


def cca_projection(m: nn.Module, hidden_states: torch.Tensor, place: halo.Placement, previous_place: halo.Placement,
                   keep: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v (B, L, heads, D) of this rank's tokens ``hidden_states`` (B, L, hidden), shard order; ``place``
    serves the q | k convs' halo, ``previous_place`` (kernel 2) the delayed value's one row. ``keep`` (a prefill's) is
    given ``keep["qk"]`` and ``keep["delayed"]``, the convs' input and the delayed projection (B, L, C)."""
    shape = (*hidden_states.shape[:2], -1, m.head_dim)
    queries, keys = m.q_proj(hidden_states), m.k_proj(hidden_states)
    query_residual, key_residual = _residuals(m, queries, keys, shape)
    qk = torch.cat([queries, keys], dim=-1)
    mixed = halo.with_halo(qk, place, lambda rows, bounds: _by_segment(rows, bounds, lambda r: _convolve(m, r)))
    query = mixed[..., :queries.shape[-1]].view(shape) + query_residual
    key = mixed[..., queries.shape[-1]:].view(shape) + key_residual

    delayed = m.v_proj_delayed(hidden_states)
    start = m.v_proj_delayed(hidden_states.new_zeros(hidden_states.shape[0], 1, hidden_states.shape[-1]))

    def previous(rows: torch.Tensor) -> torch.Tensor:  # one segment: the row before each, the projected zeros first
        return torch.cat([start.to(rows.dtype), rows[:, :-1]], dim=1)

    value_delayed = halo.with_halo(delayed, previous_place, lambda rows, bounds: _by_segment(rows, bounds, previous))
    value = torch.cat([m.v_proj_current(hidden_states), value_delayed], dim=-1).view(shape)
    if keep is not None:
        keep["qk"], keep["delayed"] = qk, delayed
    return query, key, value


def cca_step(m: nn.Module, hidden_states: torch.Tensor, delayed: torch.Tensor, tail: torch.Tensor):
    """Tokens on every rank alike (one in generation's decode; a chunk's every token in a prefill onto a kept cache):
    ``hidden_states`` (B, T, hidden), the delayed value projection of the token before them ``delayed`` (B, 1, C) and
    the convs' last ``t0 + t1 - 2`` inputs ``tail`` (B, K, C) -> (q, k, v (B, T, heads, D), the last token's delayed
    projection, the next tail)."""
    t = hidden_states.shape[1]
    shape = (*hidden_states.shape[:2], -1, m.head_dim)
    queries, keys = m.q_proj(hidden_states), m.k_proj(hidden_states)
    query_residual, key_residual = _residuals(m, queries, keys, shape)
    window = torch.cat([tail.to(queries.dtype), torch.cat([queries, keys], dim=-1)], dim=1)  # (B, K + T, C)
    mixed = m.conv_qk_grouped(m.conv_qk_depthwise(window.transpose(1, 2))).transpose(1, 2)  # (B, T, C): no padding
    query = mixed[..., :queries.shape[-1]].view(shape) + query_residual
    key = mixed[..., queries.shape[-1]:].view(shape) + key_residual
    projected = m.v_proj_delayed(hidden_states)  # (B, T, C): each token's, read by the token after it
    before = torch.cat([delayed.to(hidden_states.dtype), projected[:, :-1]], dim=1)
    value = torch.cat([m.v_proj_current(hidden_states), before], dim=-1).view(shape)
    return query, key, value, projected[:, -1:], window[:, t:]


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = module.conv_kernel_size + 1

    def forward(self, hidden_states: torch.Tensor, cache=None, conv_mask=None, **kwargs):
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache, conv_mask)
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token from what the prefill left
            query, key, value, delayed, tail = cca_step(self, hidden_states, *generation.get(self))
            generation.put(self, delayed, tail)
            return query, key, value
        if generation is not None and generation.extension is not None:  # new tokens whole, from what was kept
            widths = []

            def run(hidden_all: torch.Tensor) -> torch.Tensor:
                *qkv, delayed, tail = cca_step(self, hidden_all, *generation.get(self))
                generation.put(self, delayed, tail)
                widths.extend(part.shape[2] for part in qkv)
                return torch.cat(qkv, dim=2)  # (B, T, Hq + 2 Hk, D): one gather back

            return tuple(generation.whole(run, hidden_states).split(widths, dim=2))
        where = dict(layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens)
        keep = {} if generation is not None else None
        out = cca_projection(self, hidden_states, halo.placement(mesh, hidden_states.shape[1], kernel=kernel, **where),
                             halo.placement(mesh, hidden_states.shape[1], kernel=2, **where), keep)
        if keep is not None:  # the prompt's last delayed projection and the convs' last inputs, on every rank
            ends = dict(layout=info.layout, seq_len=info.seq_len)
            generation.put(self, sequence_tail(keep["delayed"], mesh, width=1, **ends),
                           sequence_tail(keep["qk"], mesh, width=kernel - 1, **ends))
        return out

    return forward


KIND = MixerKind("compressed convolutional attention", ("hybrid", "hybrid_sliding"), cca_layers, _make_forward)
