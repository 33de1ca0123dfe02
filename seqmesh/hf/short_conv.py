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

Generation (``seqmesh.inference``): the prompt's prefill leaves the conv's last ``K - 1`` inputs on every rank (one
all-reduce; the layer has no other state), and each decode step runs the token's conv over them on every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention import halo
from ..linear_attention.decode import conv_step, sequence_tail
from ..mesh import SPMesh
from .mixer_kind import MixerKind, check_mixer_context, refuse_tensor_parallel


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
    refuse_tensor_parallel(layers, mesh, "is a gated short convolution, which seqmesh's tensor parallelism does not "
                           "split (it would cut in_proj's B | C | x)")
    return layers


def gated_short_conv(module: nn.Module, hidden_states: torch.Tensor, place: halo.Placement,
                     keep: dict | None = None) -> torch.Tensor:
    """The layer at this rank's tokens: ``hidden_states`` (B, L, D) in shard order -> (B, L, D); ``keep`` (a
    prefill's) is given ``keep["conv_in"]``, the conv's input (B, L, D)."""
    gate_in, gate_out, x = module.in_proj(hidden_states).chunk(3, dim=-1)  # (B, L, D) each
    weight = module.conv.weight.squeeze(1)  # (D, 1, K) -> (D, K)
    mixed = halo.halo_causal_conv(gate_in * x, weight, module.conv.bias, place, activation=None)  # (B, L, D)
    if keep is not None:
        keep["conv_in"] = gate_in * x
    return module.out_proj(gate_out * mixed)


def short_conv_step(module: nn.Module, hidden_states: torch.Tensor,
                    tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens on every rank alike (one in generation's decode; a chunk's every token in a prefill onto a kept cache):
    ``hidden_states`` (B, T, D) and the conv's last ``K - 1`` inputs ``tail`` (B, K - 1, D) -> (out (B, T, D), the next
    tail)."""
    gate_in, gate_out, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    mixed, tail = conv_step(tail, gate_in * x, module.conv.weight.squeeze(1), module.conv.bias, None)
    return module.out_proj(gate_out * mixed), tail


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = module.conv.weight.shape[-1]

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache if cache is not None else kwargs.get("past_key_values"), attention_mask)
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token from the tail the prefill left: no state
            state, tail = generation.get(self)
            out, tail = short_conv_step(self, hidden_states, tail)
            generation.put(self, state, tail)
            return out
        if generation is not None and generation.extension is not None:  # new tokens whole, after the kept tail
            def run(hidden_all: torch.Tensor) -> torch.Tensor:
                state, tail = generation.get(self)
                out, tail = short_conv_step(self, hidden_all, tail)
                generation.put(self, state, tail)
                return out

            return generation.whole(run, hidden_states)
        place = halo.placement(mesh, hidden_states.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=kernel)
        keep = {} if generation is not None else None
        out = gated_short_conv(self, hidden_states, place, keep)
        if keep is not None:  # the conv's last K - 1 inputs, on every rank; a short conv has no state (empty)
            tail = sequence_tail(keep["conv_in"], mesh, layout=info.layout, seq_len=info.seq_len, width=kernel - 1)
            generation.put(self, tail.new_zeros(tail.shape[0], 0), tail)
        return out

    return forward


KIND = MixerKind("gated short convolution", ("conv",), short_conv_layers, _make_forward)
