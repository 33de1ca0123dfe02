"""Qwen4-Exp's PLE layers (``ple_layer_ids``: hashed n-gram embeddings added to the residual streams) run
sequence-parallel, exactly.

A PLE layer reads the sequence in two places; everything else in it is per token::

    e_t = embedding(hash(ids t-n+1 .. t))          each earlier id within the n-gram, EOS before a row's start or
                                                   after an EOS token (transformers' _shift_right_ignore_eos)
    g_t = sigmoid(gate(hidden_t, e_t)) value(e_t)   per token
    out = g + silu(conv(norm(g)))                  a depthwise conv of kernel K, dilated by n: reads (K - 1) n
                                                   earlier tokens

Both run on this rank's runs preceded by their halo (:func:`seqmesh.linear_attention.halo.extend`, one all-gather of
``(K - 1) n`` rows each: the token ids, then the conv's input), each piece of the extended sequence through the
family's own code as a call of its own (``ple_embedding(ids, None)``, ``_short_conv(x, None)``): a piece that starts
a document starts as transformers' call does (EOS context, zero padding), and the halo covers every token a rank's
own rows read. Packed documents restart both at each. The n-gram ids are integers (no gradient); the conv's halo
returns its gradient by the adjoint reduce-scatter.

``parallelize`` gives each layer an instance-level ``forward`` (the class and transformers' code untouched);
``unparallelize`` deletes it. Tensor parallelism, a cache and a padding mask are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

_PARTS = ("ple_embedding", "key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d", "_short_conv",
          "hc_count", "hidden_size")


def is_ple_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a Qwen4-Exp PLE layer with its parts where expected."""
    return type(module).__name__.endswith("PLELayer") and all(hasattr(module, p) for p in _PARTS)


def ple_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The PLE layers of ``model`` (path, module), checked: a design name seqmesh does not know, and tensor
    parallelism, raise a ValueError."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if is_ple_layer(m)]
    refuse_tensor_parallel(layers, mesh, "is a PLE layer (hashed n-gram embeddings added to every residual stream), "
                           "whose streams seqmesh's tensor parallelism does not split")
    return layers


def reach(module: nn.Module) -> int:
    """How many earlier tokens a PLE layer's rows read: its dilated conv's ``(K - 1) n``, and its n-gram's ``n - 1``."""
    conv = module.conv1d
    return max((conv.kernel_size[0] - 1) * conv.dilation[0], module.ple_embedding.ngram_size - 1)


def _pieces(x: torch.Tensor, bounds: tuple[int, ...], run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``run`` on each piece ``[a, e)`` of ``bounds`` of ``x`` (B, E, ...) as a call of its own, side by side."""
    return torch.cat([run(x[:, a:e]) for a, e in zip(bounds[:-1], bounds[1:])], dim=1)


def ple_layer(module: nn.Module, hidden_states: torch.Tensor, input_ids: torch.Tensor,
              place: halo.Placement) -> torch.Tensor:
    """The layer at this rank's tokens: ``hidden_states`` (B, L, S x D) and ``input_ids`` (B, L) in shard order ->
    (B, L, S x D), S the residual streams."""
    own = place.mine.own.to(hidden_states.device)
    bounds = place.mine.conv_bounds
    with torch.no_grad():
        ids = halo.extend(input_ids.long()[..., None], place)[..., 0]  # (B, E): each run after its earlier ids
    embeddings = _pieces(ids, bounds, lambda piece: module.ple_embedding(piece, None)).index_select(1, own)
    key = module.norm_key(module.key_proj(embeddings)).unflatten(-1, (module.hc_count, module.hidden_size))
    value = module.value_proj(embeddings)
    query = module.norm_query(hidden_states).unflatten(-1, (module.hc_count, module.hidden_size))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(module.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)
    normed = module.norm_conv(gated.flatten(-2))
    conv = halo.with_halo(normed, place, lambda extended, pieces: _pieces(
        extended, pieces, lambda piece: module._short_conv(piece, None)))
    return gated.flatten(-2) + conv


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = reach(module) + 1

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, cache=None, conv_mask=None, **kwargs):
        # hidden_states (B, L, S x D), input_ids (B, L) in shard order -> (B, L, S x D)
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache, None if conv_mask is None or bool(conv_mask.all()) else conv_mask)
        place = halo.placement(mesh, hidden_states.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=kernel)
        return ple_layer(self, hidden_states, input_ids, place)

    return forward


KIND = MixerKind("n-gram PLE", (), ple_layers, _make_forward)
