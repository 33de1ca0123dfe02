"""transformers' Mamba2 mixers (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1, Zamba2, Mamba2) run
sequence-parallel, exactly.

A Mamba2 layer projects each token to a gate ``z``, the conv's channels ``xBC`` and one ``dt`` per head;
the depthwise causal conv (with ``silu``) mixes neighbouring tokens; the state space dual then runs one
(head_dim x d_state) state per head with a scalar decay ``exp(dt A)``; a gated RMSNorm over groups and
the output projection act per token::

    tokens (B, L, hidden) --in_proj (local)--> z | xBC | dt
      --halo conv (halo.halo_causal_conv: one all-gather of K - 1 rows per run)--> x | B | C
      --dt = clamp(softplus(dt + dt_bias)), g = dt A--> decay_scan.pass_decay_states(q = C, k = B, v = dt x, g)
      --+ D x--> y (B, L, H, head_dim) --gated norm with z, out_proj (local)--> (B, L, hidden)

Packed documents restart the conv and the state (transformers passes ``seq_idx`` to mamba-ssm's kernels
for the same; its torch path has none, so a one-process reference runs each document alone). B and C
are shared by the heads of a group (``n_groups``), as key heads by query heads. ``linear_attention`` picks the
design (:mod:`seqmesh.linear_attention.mamba2`): ``state_passing`` (drawn above), ``all_to_all`` (whole sequences of
some heads per rank) or ``auto``, the one that sends fewer bytes for the call's shapes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention.choice import LinearDesign, parse_design
from ..linear_attention.decode import sequence_tail
from ..linear_attention.mamba2 import (SSDHeads, SSDParams, choose_ssd_design, ssd_all_to_all, ssd_state_passing,
                                        ssd_step)
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context

_NEEDS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "out_proj", "n_groups", "head_dim", "num_heads",
          "ssm_state_size", "intermediate_size", "time_step_limit")


def is_mamba2(module: nn.Module) -> bool:
    """A Mamba2 mixer: the parameters and sizes above (Mamba v1 mixers have ``x_proj`` and no groups)."""
    return all(hasattr(module, n) for n in _NEEDS) and not hasattr(module, "x_proj")


def mamba2_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The Mamba2 mixers of ``model``; a ValueError for heads the all-to-all design (when named) cannot split."""
    design = parse_design(design)
    layers = [(name, m) for name, m in model.named_modules() if is_mamba2(m)]
    for name, m in layers:
        if design is LinearDesign.ALL_TO_ALL and mesh.sp_size > m.num_heads:
            raise ValueError(f"{name} has {m.num_heads} Mamba2 heads, fewer than the {mesh.sp_size} ranks of the "
                             f"sequence group: the all-to-all design needs a sequence degree of at most {m.num_heads}; "
                             "choose linear_attention='state_passing' (or 'auto').")
    return layers


def _project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """in_proj's output (B, L, z | xBC | dt), with Falcon-H1's muP multipliers where the layer has them."""
    if hasattr(module, "mup_vector"):
        return module.in_proj(x * module.ssm_in_multiplier) * module.mup_vector
    return module.in_proj(x)


def _gate(module: nn.Module, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated norm (B, L, d_inner); Falcon-H1 without ``mamba_rms_norm`` gates with silu(z) alone."""
    if getattr(module, "mamba_rms_norm", True):
        return module.norm(y, z)
    return y * F.silu(z)


def mamba2_forward(module: nn.Module, hidden: torch.Tensor, mesh: SPMesh, info, design: str = "auto") -> torch.Tensor:
    """The layer at this rank's tokens: ``hidden`` (B, L, hidden) in the layout's order -> (B, L, hidden)."""
    b, n, _ = hidden.shape
    heads = SSDHeads(module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size)
    z, xbc, dt = _project(module, hidden).split([heads.inner, heads.conv_dim, heads.heads], dim=-1)
    params = SSDParams(module.conv1d.weight.squeeze(1), module.conv1d.bias, module.dt_bias, module.A_log, module.D,
                       tuple(module.time_step_limit), module.activation)
    kernel = params.conv_weight.shape[-1]
    generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
    if generation is not None and generation.decoding:  # one token, the same on every rank, from the prefill's
        y, state, tail = ssd_step(xbc, dt, params, heads, *generation.get(module))
        generation.put(module, state, tail)
    elif generation is not None and generation.extension is not None:  # new tokens whole, from the kept state
        def run(xbc_whole: torch.Tensor, dt_whole: torch.Tensor) -> torch.Tensor:
            out, state, tail = ssd_step(xbc_whole, dt_whole, params, heads, *generation.get(module))
            generation.put(module, state, tail)
            return out

        y = generation.whole(run, xbc, dt)
    elif generation is not None:  # the prompt by state passing, which leaves the state after it on every rank
        keep: dict = {}
        y = ssd_state_passing(xbc, dt, params, heads, mesh, layout=info.layout, seq_len=info.seq_len,
                              cu_seqlens=info.cu_seqlens, keep=keep)
        generation.put(module, keep["state"], sequence_tail(xbc, mesh, layout=info.layout, seq_len=info.seq_len,
                                                            width=kernel - 1))
    else:
        chosen = choose_ssd_design(heads, kernel, design, seq_len=n * mesh.sp_size, batch=b, ulysses=mesh.ulysses,
                                   ring=mesh.ring, layout=info.layout, dtype_bytes=hidden.element_size())
        run = ssd_all_to_all if chosen is LinearDesign.ALL_TO_ALL else ssd_state_passing
        y = run(xbc, dt, params, heads, mesh, layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens)
    out = _gate(module, y.reshape(b, n, heads.inner), z)  # (B, L, d_inner)
    return module.out_proj(out.to(hidden.dtype))


def _make_forward(module: nn.Module, mesh: SPMesh, design: str):
    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        check_mixer_context(self, kwargs.get("seqmesh"), cache if cache is not None else kwargs.get("cache_params"),
                            attention_mask)
        return mamba2_forward(self, hidden_states, mesh, kwargs["seqmesh"], design)

    return forward


KIND = MixerKind("Mamba2", ("linear_attention", "mamba", "hybrid"), mamba2_layers, _make_forward)
