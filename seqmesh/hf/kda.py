"""transformers' Kimi Delta Attention layers (Kimi Linear's ``KimiLinearDeltaAttention``, Ling/Ring hybrid's
``BailingHybridDeltaAttention``) run sequence-parallel.

The new forward keeps everything of the layer that acts per token on the local shard: the q, k, v
projections, the layer's own forget gate (its per-channel log decay g), beta, the output gate, the
gated norm and the output projection. Only the short conv of q | k | v and the recurrence see the
sequence; they run by one of two designs (``design``, parallelize's ``linear_attention``): ``state_passing``
(:func:`seqmesh.linear_attention.kda_state_passing.state_passing_kda`), ``all_to_all`` (by heads,
:func:`seqmesh.linear_attention.kda_all_to_all.all_to_all_kda`) or ``auto``, which
:func:`~seqmesh.linear_attention.kda_all_to_all.choose_kda_design` resolves per call from the shapes. The
sequence is read from the ``seqmesh`` entry of ``shard_batch``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention.choice import LinearDesign, parse_design
from ..linear_attention.decode import sequence_tail
from ..linear_attention.kda_all_to_all import all_to_all_kda, choose_kda_design
from ..linear_attention.kda_state_passing import KdaHeads, kda_step, state_passing_kda
from ..mesh import SPMesh
from .mixer_kind import MixerKind, check_mixer_context

_PARTS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "o_norm", "o_proj")


def _output_gate(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Kimi Linear: g_b_proj(g_a_proj(x)) (low rank); Bailing hybrid: g_proj(x)."""
    if hasattr(module, "g_a_proj") and hasattr(module, "g_b_proj"):
        return lambda x: module.g_b_proj(module.g_a_proj(x))
    if hasattr(module, "g_proj"):
        return module.g_proj
    return None


def _is_kda(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("DeltaAttention") and all(hasattr(module, p) for p in _PARTS)
            and _output_gate(module) is not None)


def kda_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> list[tuple[str, nn.Module]]:
    """The KDA layers of ``model`` that seqmesh runs sequence-parallel, checked (the all-to-all, when named, for
    heads it can split); every other mixer is left to ``check_layers``."""
    design = parse_design(design)
    layers = [(name, m) for name, m in model.named_modules() if _is_kda(m)]
    for name, m in layers:
        if design is LinearDesign.ALL_TO_ALL:  # raises if the ranks outnumber the heads
            choose_kda_design(KdaHeads(m.num_heads, m.head_dim, m.head_dim), mesh, design, batch=1, seq_len=1,
                              layout="zigzag", kernel=m.conv_kernel_size, dtype_bytes=2)
        if m.activation not in ("silu", "swish"):
            raise ValueError(f"{name} ({type(m).__name__}) applies {m.activation!r} after its short conv; seqmesh's "
                             "KDA conv takes 'silu' (set config.hidden_act = 'silu').")
    return layers


def _make_forward(module: nn.Module, mesh: SPMesh, design: str):
    gate = _output_gate(module)
    heads = KdaHeads(module.num_heads, module.head_dim, module.head_dim)
    design = parse_design(design)

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        cache = cache if cache is not None else kwargs.get("cache_params")  # its name before transformers 5.2x
        check_mixer_context(self, info, cache, attention_mask)
        b, n, _ = hidden_states.shape
        qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        g = self.forget_gate(hidden_states)  # (B, L, H, Dk): the layer's own per-channel log decay
        beta = torch.sigmoid(self.b_proj(hidden_states))  # (B, L, H)
        conv_weight, conv_bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token from the state and tail the prefill left
            core, state, tail = kda_step(qkv, g, beta, conv_weight, conv_bias, heads, *generation.get(self),
                                         activation=self.activation)
            generation.put(self, state, tail)
        elif generation is not None and generation.extension is not None:  # new tokens whole, from the kept state
            def run(qkv_all: torch.Tensor, g_all: torch.Tensor, beta_all: torch.Tensor) -> torch.Tensor:
                out, state, tail = kda_step(qkv_all, g_all, beta_all, conv_weight, conv_bias, heads,
                                            *generation.get(self), activation=self.activation)
                generation.put(self, state, tail)
                return out

            core = generation.whole(run, qkv, g, beta)
        elif generation is not None:  # the prompt by state passing, which leaves the state after it on every rank
            keep: dict = {}
            core = state_passing_kda(qkv, g, beta, conv_weight, conv_bias, heads, mesh, layout=info.layout,
                                     seq_len=info.seq_len, cu_seqlens=info.cu_seqlens, activation=self.activation,
                                     keep=keep)
            generation.put(self, keep["state"], sequence_tail(qkv, mesh, layout=info.layout, seq_len=info.seq_len,
                                                              width=self.conv_kernel_size - 1))
        else:
            chosen = choose_kda_design(heads, mesh, design, batch=b, seq_len=info.seq_len, layout=info.layout,
                                       kernel=self.conv_kernel_size, dtype_bytes=qkv.element_size(),
                                       g_bytes=g.element_size())
            run = all_to_all_kda if chosen is LinearDesign.ALL_TO_ALL and mesh.sp_size > 1 else state_passing_kda
            core = run(  # (B, L, H, Dv)
                qkv, g, beta, conv_weight, conv_bias, heads, mesh,
                layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens, activation=self.activation,
            )
        out = self.o_norm(core, gate(hidden_states).view(b, n, heads.heads, heads.value_dim)).reshape(b, n, -1)
        return self.o_proj(out)

    return forward


KIND = MixerKind("Kimi Delta Attention", ("linear_attention",), kda_layers, _make_forward)
