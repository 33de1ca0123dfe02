"""transformers' Mamba (v1) mixers (Jamba's, Mamba's, Falcon-Mamba's) run sequence-parallel, exactly.

The mixer's own projections act per token on the local shard; its depthwise causal conv runs with
its halo (:func:`seqmesh.linear_attention.halo.halo_causal_conv`) and its selective scan by state
passing (:func:`seqmesh.linear_attention.selective_scan.state_passing_selective_scan`)::

    in_proj -> x, z (B, L, I) | conv(x) with halo, silu | x_proj -> dt_low, B, C (norms: Jamba, Falcon-Mamba)
      | dt = softplus(dt_proj(dt_low)) | y = scan(x, dt, A, B, C) + D x | y * silu(z) | out_proj

Every ``linear_attention`` design name runs state passing: the all-to-all by channels would need
x_proj's input (all channels of a token) after the exchange, so an all-to-all of x, dt, B and C after
x_proj; not built.

The ``seqmesh`` entry of ``shard_batch`` reaches the mixer in its kwargs where transformers' layers
pass them on; Jamba's decoder layer and Mamba's backbone call theirs without them, and the module
that still receives the entry hands it over (:func:`seqmesh.hf.mixers.carry_entry`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention.choice import parse_design
from ..linear_attention.gated_delta import compute_dtype, segment_bounds
from ..linear_attention.halo import halo_causal_conv, placement
from ..linear_attention.kernels import causal_conv
from ..linear_attention.selective_scan import selective_scan, state_passing_selective_scan
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context

MIXERS = ("JambaMambaMixer", "MambaMixer", "FalconMambaMixer")  # whose slow_forward this module follows
_PARTS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "A_log", "D")
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")  # Jamba (weighted), Falcon-Mamba (weightless)


def is_mamba1(module: nn.Module) -> bool:
    """Whether ``module`` is one of the Mamba (v1) mixers of :data:`MIXERS` with its parts where expected."""
    return type(module).__name__ in MIXERS and all(hasattr(module, p) for p in _PARTS)


def mamba_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The Mamba (v1) mixers of ``model``; a ValueError for a design name seqmesh does not know (every name runs
    state passing: module docstring)."""
    parse_design(design)
    return [(path, m) for path, m in model.named_modules() if is_mamba1(m)]


def _scan_inputs(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_proj, the family's norms and dt_proj of the conv's output (B, L, I) -> dt (B, L, I) after softplus, B, C
    (B, L, N); dt's bias added in the scan's dtype, as transformers does (its ``dt_proj.bias.float()``)."""
    states = m.A_log.shape[-1]
    dt_low, b, c = m.x_proj(x).split([m.dt_proj.in_features, states, states], dim=-1)
    if all(hasattr(m, n) for n in _NORMS):
        dt_low, b, c = m.dt_layernorm(dt_low), m.b_layernorm(b), m.c_layernorm(c)
    dtype = compute_dtype(x.dtype)
    dt = F.linear(dt_low, m.dt_proj.weight).to(dtype)
    if m.dt_proj.bias is not None:
        dt = dt + m.dt_proj.bias.to(dtype)
    return F.softplus(dt), b, c


def _make_mixer_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache if cache is not None else kwargs.get("cache_params"), attention_mask)
        b, n, _ = hidden_states.shape
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, L, I) each
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # (I, K), (I,)
        if mesh.sp_size == 1:
            bounds = segment_bounds(n, info.cu_seqlens, info.seq_len)
            x = causal_conv(x, weight, bias, bounds, self.activation)
        else:
            place = placement(mesh, n, layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens,
                              kernel=weight.shape[-1])
            x = halo_causal_conv(x, weight, bias, place, self.activation)
        dt, b_in, c_in = _scan_inputs(self, x)
        A = -torch.exp(self.A_log.to(dt.dtype))  # (I, N)
        if mesh.sp_size == 1:
            y = selective_scan(x, dt, A, b_in, c_in, bounds)[0]
        else:
            y = state_passing_selective_scan(x, dt, A, b_in, c_in, place)  # (B, L, I)
        y = (y + x.to(y.dtype) * self.D.to(y.dtype)) * F.silu(z.to(y.dtype))
        return self.out_proj(y.to(hidden_states.dtype))

    return forward


def _forward_for(module: nn.Module, mesh: SPMesh, design: str):
    return _make_mixer_forward(mesh)


KIND = MixerKind("Mamba", ("linear_attention",), mamba_layers, _forward_for)
