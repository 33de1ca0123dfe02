"""transformers' gated short convolutions (LFM2, LFM2-MoE, LFM3: their ``conv`` layers) run sequence-parallel,
exactly.

The layer, per token but for one depthwise causal conv of width ``K`` (``config.conv_L_cache``)::

    B, C, x = in_proj(h).chunk(3)          (B, L, D) each, per token
    y = conv(B * x)                         depthwise, causal, no activation, optional bias: reads K - 1 earlier tokens
    out = out_proj(C * y)                   per token

On a shard, the conv of a run's first ``K - 1`` tokens reads tokens other ranks hold: the halo, brought by one
all-gather of ``(P - 1) x max_tail x D`` rows (:func:`seqmesh.linear_attention.halo.halo_causal_conv`; its
reduce-scatter returns their gradients). Packed documents and the layout's padding restart the conv, as
transformers' one call per document does. There is no other design: ``parallelize``'s ``linear_attention``
argument does not apply here and any value is accepted.

``parallelize`` gives each layer an instance-level ``forward`` (the class and transformers' code untouched);
``unparallelize`` deletes it. The projections and the gates are the layer's own modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention import halo
from ..mesh import SPMesh
from .mixer_kind import MixerKind, check_mixer_context


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` is a gated short conv of a decoder: a ``...ShortConv`` whose ``conv`` is a depthwise
    ``nn.Conv1d`` over the sequence, with ``in_proj`` giving B | C | x and ``out_proj`` (a vision tower's 2D
    ``Lfm3VlVisionShortConv`` is not one)."""
    conv, in_proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
    return (type(module).__name__.endswith("ShortConv") and isinstance(conv, nn.Conv1d)
            and conv.groups == conv.in_channels == conv.out_channels and isinstance(in_proj, nn.Linear)
            and in_proj.out_features == 3 * conv.in_channels
            and isinstance(getattr(module, "out_proj", None), nn.Linear))


def short_conv_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> list[tuple[str, nn.Module]]:
    """The gated short-conv layers of ``model`` (path, module). ``design`` does not apply (the halo is the only
    design for a conv). Tensor parallelism is refused by name: it would split ``in_proj``'s B | C | x."""
    layers = [(name, m) for name, m in model.named_modules() if is_short_conv(m)]
    if layers and getattr(mesh, "tp", 1) > 1:
        raise ValueError(f"{layers[0][0]} ({type(layers[0][1]).__name__}) is a gated short convolution, which "
                         "seqmesh's tensor parallelism does not split (it would cut in_proj's B | C | x); train this "
                         "model with tp=1 (its sequence parallelism is exact).")
    return layers


def gated_short_conv(module: nn.Module, hidden_states: torch.Tensor, place: halo.Placement) -> torch.Tensor:
    """The layer at this rank's tokens: ``hidden_states`` (B, L, D) in shard order -> (B, L, D)."""
    gate_in, gate_out, x = module.in_proj(hidden_states).chunk(3, dim=-1)  # (B, L, D) each
    weight = module.conv.weight.squeeze(1)  # (D, 1, K) -> (D, K)
    mixed = halo.halo_causal_conv(gate_in * x, weight, module.conv.bias, place, activation=None)  # (B, L, D)
    return module.out_proj(gate_out * mixed)


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = module.conv.weight.shape[-1]

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache if cache is not None else kwargs.get("past_key_values"), attention_mask)
        place = halo.placement(mesh, hidden_states.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=kernel)
        return gated_short_conv(self, hidden_states, place)

    return forward


KIND = MixerKind("gated short convolution", ("conv",), short_conv_layers, _make_forward)
