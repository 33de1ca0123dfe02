"""Inkling 2's layers (transformers' ``inkling2`` and ``inkling2_loop``) exact under sequence parallelism.

What differs from Inkling (:mod:`.inkling`), and how each part runs on a shard:

- **Short convolutions** (``Inkling2ShortConvolution``: the sliding layers' keys and values, every layer's attention
  and MLP outputs): ``(conv(x) + x) / sqrt(K + 1)`` in float32, a depthwise causal conv. Each runs on its halo
  (:func:`seqmesh.linear_attention.halo.halo_causal_conv`).
- **Dynamic short convolutions** (``Inkling2DynamicShortConvolution``: the full layers' keys and values): each token's
  taps are static per-channel weights plus weights projected from that token's own input, shared within a key-value
  head: ``(sum_lag x[t - lag] w_t[lag] + x[t]) / sqrt(2K + 1)``. The taps are the token's, so only the ``K - 1``
  earlier inputs are another rank's: the same halo brings them (:func:`seqmesh.linear_attention.halo.with_halo`),
  and a lag never reaches across a document's start.
- **Attention** (``Inkling2SlidingAttention``, ``Inkling2FullAttention``): q L2-clipped per head (and, in a full layer,
  scaled by ``1 + alpha log(max((i + 1) / n, 1))`` of its index ``i`` in the document), keys clipped, values
  RMS-normed; to each score at distance ``d = q - k < E`` a bias ``(r_q P)[h, d]`` of the query's clipped relative
  states; a sink logit per query and head (``sink_proj``); the output gated by the query's input. As Inkling's, each
  rank all-gathers the row's keys and values and each block of its queries attends its document's keys up to
  itself (its window's in a sliding layer), recomputed in backward.
- **Depth attention** (``Inkling2BlockAttentionResidual``, Inkling2-Loop's ``MessageAttentionResidual``): learned
  queries attend over each token's own stack of block states. It calls transformers' attention interface with
  tokens as its batch, which would reach seqmesh's sequence-parallel attention: it runs on the implementation the
  model had before (:func:`install`), token by token, as transformers computes it.

- **Distances**: the text model builds each layer kind's ``(L, L)`` int64 distances from a query to a key
  (``get_relative_distance``) and hands them to every layer, which its attention alone reads; seqmesh's reads the
  row's positions instead. While a parallelized model runs its forward, that function of its module gives a
  broadcast view of one element (:func:`unread_distances`): built, two such tensors were 16 GiB at 32K tokens on a
  rank, kept as an input by every checkpointed layer.

Tensor parallelism, a padding mask, a cache and generation are refused by name.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..linear_attention.gated_delta import positions_in_segments
from ..mesh import SPMesh
from ..model.lm import attends_over_depth as is_depth_attention
from ..sequence.batch import document_places
from .indexed_attention import entry_of, replace_forward, restore_forward, whole_row
from .inkling import attend_row, relative_attention_layers, short_convolution
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

_ATTR = "_seqmesh_inkling2"
_DEPTH_ATTR = "_seqmesh_inkling2_depth"
LAYER_TYPES = ("hybrid_sliding", "hybrid")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "sink_proj", "relative_position_bias", "is_sliding",
              "rel_extent", "scaling", "num_heads", "num_key_value_heads", "head_dim")


def _named(module: nn.Module, *suffixes: str) -> bool:
    name = type(module).__name__
    return name.startswith("Inkling2") and name.endswith(suffixes)


def is_short_convolution(module: nn.Module) -> bool:
    """Whether ``module`` is one of Inkling 2's static short convolutions."""
    return _named(module, "ShortConvolution") and isinstance(getattr(module, "conv1d", None), nn.Conv1d)


def is_dynamic_convolution(module: nn.Module) -> bool:
    """Whether ``module`` is one of Inkling 2's dynamic short convolutions (the full layers' keys and values)."""
    return _named(module, "DynamicShortConvolution") and all(
        hasattr(module, n) for n in ("static_weight", "weight_proj", "num_heads", "conv_kernel_size"))


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` is Inkling 2's sliding or full attention."""
    return _named(module, "SlidingAttention", "FullAttention") and all(hasattr(module, n) for n in _ATTENTION)


def convolutions(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """Inkling 2's short convolutions, static and dynamic, in ``model`` (path, module), checked: a design name
    seqmesh does not know, and tensor parallelism, raise a ValueError."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if is_short_convolution(m) or is_dynamic_convolution(m)]
    refuse_tensor_parallel(layers, mesh, "is one of Inkling 2's short convolutions, whose channels seqmesh's tensor "
                           "parallelism does not split")
    return layers


def lagged(x: torch.Tensor, place: halo.Placement, kernel: int) -> torch.Tensor:
    """Each of this rank's tokens with the ``kernel - 1`` before it in the whole sequence: x (B, L, C) in shard order
    -> (B, L, C, kernel), ``[..., lag]`` the token ``lag`` back, zero where that would cross its document's start."""
    def windows(extended: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:  # (B, E, C) -> (B, E, C * kernel)
        offset = positions_in_segments(bounds, extended.device)  # (E,): each row's index in its segment
        rows = extended.shape[1]
        lags = [extended]
        for lag in range(1, kernel):
            if lag >= rows:
                lags.append(torch.zeros_like(extended))
                continue
            keep = (offset[lag:] >= lag).to(extended.dtype)[None, :, None]  # (1, E - lag, 1)
            lags.append(F.pad(extended[:, :-lag] * keep, (0, 0, lag, 0)))
        return torch.stack(lags, dim=-1).flatten(-2)

    return halo.with_halo(x, place, windows).unflatten(-1, (x.shape[-1], kernel))


def dynamic_convolution(module: nn.Module, x: torch.Tensor, dynamic_input: torch.Tensor,
                        place: halo.Placement) -> torch.Tensor:
    """Inkling 2's dynamic short convolution of the whole sequence at this rank's tokens: x (B, L, C) and the input
    its taps are projected from (B, L, E), both in shard order -> (B, L, C) in ``x``'s dtype, in float32 inside."""
    b, length, channels = x.shape
    kernel, heads = module.conv_kernel_size, module.num_heads
    dynamic = module.weight_proj(dynamic_input).float().view(b, length, heads, 1, kernel)
    taps = module.static_weight.float().T.view(heads, -1, kernel) + dynamic  # (B, L, heads, C / heads, K)
    wide = x.float()
    windows = lagged(wide, place, kernel).view(b, length, heads, -1, kernel)
    out = (windows * taps).sum(-1).reshape(b, length, channels)
    return ((out + wide) / math.sqrt(2 * kernel + 1)).to(x.dtype)


def _make_conv_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = module.conv_kernel_size
    dynamic = is_dynamic_convolution(module)

    def forward(self, hidden_states: torch.Tensor, dynamic_input: torch.Tensor | None = None, cache=None,
                conv_mask=None, cache_offset: int = 0, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache, None if conv_mask is None or bool(conv_mask.all()) else conv_mask)
        place = halo.placement(mesh, hidden_states.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=kernel)
        if dynamic:
            return dynamic_convolution(self, hidden_states, dynamic_input, place)
        return short_convolution(self, hidden_states, place, math.sqrt(kernel + 1))  # Inkling's, scaled

    return forward


KIND = MixerKind("Inkling 2 short convolution", LAYER_TYPES, convolutions, _make_conv_forward)


def attention_layers(model: nn.Module, mesh: SPMesh) -> list[nn.Module]:
    """Inkling 2's attention modules of ``model``; tensor parallelism refused by name."""
    return relative_attention_layers(model, mesh, is_attention)


def log_scale_index(starts: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """(1, L): the index a full layer's log scale reads for each of the (L,) local queries (documents starting at
    ``starts`` in the row, each query ``within`` its own): its index in its document, as each document run alone."""
    return within[None, :]


def _make_attention_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, key_hidden_states: torch.Tensor | None = None,
                value_hidden_states: torch.Tensor | None = None, attention_mask=None, relative_distance=None,
                conv_mask=None, cache=None, cache_offset: int = 0, **kwargs):
        # hidden_states (B, L, E) in shard order -> ((B, L, E), None); transformers' relative_distance and mask are
        # the local block's, unread: the bias and the mask come from the row's positions
        info, _ = entry_of(self, cache, kwargs)
        b, length = hidden_states.shape[:-1]
        keys_in = hidden_states if key_hidden_states is None else key_hidden_states
        values_in = hidden_states if value_hidden_states is None else value_hidden_states
        starts, within, _ = document_places(mesh, info, hidden_states.device)
        index = log_scale_index(starts, within)  # (1, L)
        query = self.q_proj(hidden_states, index)  # (B, Hq, L, D)
        key = self.k_proj(keys_in, conv_mask=conv_mask, seqmesh=info).transpose(1, 2)  # (B, L, Hkv, D)
        value = self.v_proj(values_in, conv_mask=conv_mask, seqmesh=info).transpose(1, 2)
        bias = self.relative_position_bias
        states = bias.linear(hidden_states).view(b, length, self.num_heads, -1)
        rel = bias.norm(states, index) @ bias.proj  # (B, L, Hq, E)
        sinks = self.sink_proj(hidden_states)  # (B, L, Hq)
        row_k, row_v = whole_row(key, mesh, info), whole_row(value, mesh, info)  # (B, T, Hkv, D)
        attended = attend_row(self, query, rel, row_k, row_v, starts, within, sinks)  # (B, L, Hq, D)
        return self.o_proj(attended.reshape(b, length, -1), hidden_states), None

    return forward


def _make_depth_forward(module: nn.Module, implementation: str) -> Callable:
    """The module's own forward with transformers' attention interface of ``implementation`` (the model's before
    seqmesh registered its own) in place of the config's: each token's stack attended on its own rank."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    message = type(module).__name__.endswith("MessageAttentionResidual")

    def forward(self, block_states: torch.Tensor, partial_block_states: torch.Tensor,
                loop_layer_idx: int | None = None):
        # block_states (B, L, n, E), partial_block_states (B, L, E): per token, so the shard's rows alone
        stacked = self.norm(torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float())
        width = stacked.shape[-1]
        query = (self.query[loop_layer_idx] if message else self.query).float().view(-1, width)
        query = query.expand(*stacked.shape[:-2], -1, -1)  # (B, L, q, E): the same queries at every token
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
        out, _ = attend(self, query, stacked, stacked, None, scaling=width ** -0.5)
        return out.transpose(1, 2) if message else out.transpose(1, 2).unbind(-2)

    return forward


def depth_layers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The modules of ``model`` that attend over each token's stack of block states, each with its config's attention
    implementation (read before ``parallelize`` names seqmesh's)."""
    return [(m, m.config._attn_implementation) for m in model.modules() if is_depth_attention(m)]


def _unread_distance(inputs_embeds: torch.Tensor, cache, is_sliding: bool) -> torch.Tensor:
    """``get_relative_distance``'s shape, (L, L), as a broadcast view of one int64 zero: no layer reads it while
    seqmesh runs the attention (a cache is refused by the convolutions)."""
    length = inputs_embeds.shape[1]
    return torch.zeros((), dtype=torch.long, device=inputs_embeds.device).expand(length, length)


def unread_distances(decoder: nn.Module, layers: list[nn.Module]) -> list:
    """Hooks on ``decoder`` (an Inkling 2 text model whose attention ``layers`` seqmesh runs) that swap its module's
    ``get_relative_distance`` for :func:`_unread_distance` while its forward runs, and put the function back after
    it (on an exception too): another model of the family, run meanwhile by transformers alone, never sees the
    swap. Their handles; none for another model."""
    namespace = sys.modules[type(decoder).__module__]
    if not layers or not callable(getattr(namespace, "get_relative_distance", None)):
        return []
    previous: list[Callable] = []

    def swap(module: nn.Module, args: tuple) -> None:
        previous.append(namespace.get_relative_distance)
        namespace.get_relative_distance = _unread_distance

    def restore(module: nn.Module, args: tuple, output) -> None:
        namespace.get_relative_distance = previous.pop()

    return [decoder.register_forward_pre_hook(swap), decoder.register_forward_hook(restore, always_call=True)]


def install(layers: list[nn.Module], depth: list[tuple[nn.Module, str]], mesh: SPMesh) -> None:
    """Give ``layers`` (:func:`attention_layers`) the sequence-parallel forward and each of ``depth``
    (:func:`depth_layers`) its own on the implementation it had; the classes untouched."""
    replace_forward(layers, _make_attention_forward(mesh), _ATTR)
    for module, implementation in depth:
        replace_forward([module], _make_depth_forward(module, implementation), _DEPTH_ATTR)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the classes' own forwards again."""
    restore_forward(model, _ATTR)
    restore_forward(model, _DEPTH_ATTR)
