"""transformers' Mamba (v1) mixers (Jamba's, Mamba's, Falcon-Mamba's, and Zamba's multi-head one) run
sequence-parallel, exactly.

The mixer's own projections act per token on the local shard; its depthwise causal conv runs with
its halo (:func:`seqmesh.linear_attention.halo.halo_causal_conv`) and its selective scan by state
passing (:func:`seqmesh.linear_attention.selective_scan.state_passing_selective_scan`)::

    in_proj -> x, z (B, L, I) | conv(x) with halo, silu | x_proj -> dt_low, B, C (norms: Jamba, Falcon-Mamba)
      | dt = softplus(dt_proj(dt_low)) | y = scan(x, dt, A, B, C) + D x | y * silu(z) | out_proj

Zamba's mixer (``ZambaMambaMixer``) splits the channels into ``n_mamba_heads`` heads of ``P``, each with its own
x_proj and dt_proj (``x_proj_weight`` (H, R + 2N, P), ``dt_proj_weight`` (H, P, R)) and its own B and C; its in_proj
interleaves x and z channel by channel. Its scan is the same diagonal recurrence over ``(H, P, N)``
(:func:`seqmesh.linear_attention.selective_scan.state_passing_diagonal_scan`).

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
from ..linear_attention.gated_delta import compute_dtype
from ..linear_attention.halo import Placement, halo_causal_conv, placement
from ..linear_attention.selective_scan import state_passing_diagonal_scan, state_passing_selective_scan
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context

MIXERS = ("JambaMambaMixer", "MambaMixer", "FalconMambaMixer")  # whose slow_forward this module follows
HEADED_MIXERS = ("ZambaMambaMixer",)  # x_proj and dt_proj per head
_PARTS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "A_log", "D")
_HEADED_PARTS = ("in_proj", "conv1d", "x_proj_weight", "dt_proj_weight", "dt_proj_bias", "out_proj", "A_log", "D",
                 "n_mamba_heads")
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")  # Jamba (weighted), Falcon-Mamba (weightless)


def is_mamba1(module: nn.Module) -> bool:
    """Whether ``module`` is one of the Mamba (v1) mixers of :data:`MIXERS` with its parts where expected, or a
    multi-head one of :data:`HEADED_MIXERS`."""
    name = type(module).__name__
    return (name in MIXERS and all(hasattr(module, p) for p in _PARTS)) or (
        name in HEADED_MIXERS and all(hasattr(module, p) for p in _HEADED_PARTS))


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


def _conv(m: nn.Module, x: torch.Tensor, info, mesh: SPMesh) -> tuple[torch.Tensor, Placement]:
    """The mixer's depthwise causal conv of ``x`` (B, L, I) with its activation, across ranks by its halo -> the conv's
    output and the placement its scan passes states by (on one rank, only its segments)."""
    weight = m.conv1d.weight.squeeze(1)  # (I, K)
    place = placement(mesh, x.shape[1], layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens,
                      kernel=weight.shape[-1])
    return halo_causal_conv(x, weight, m.conv1d.bias, place, m.activation), place


def _mamba1(m: nn.Module, hidden_states: torch.Tensor, info, mesh: SPMesh) -> torch.Tensor:
    """A Mamba (v1) mixer of :data:`MIXERS` at this rank's tokens (B, L, D) -> (B, L, D)."""
    x, z = m.in_proj(hidden_states).chunk(2, dim=-1)  # (B, L, I) each
    x, place = _conv(m, x, info, mesh)
    dt, b_in, c_in = _scan_inputs(m, x)
    A = -torch.exp(m.A_log.to(dt.dtype))  # (I, N)
    y = state_passing_selective_scan(x, dt, A, b_in, c_in, place)  # (B, L, I)
    y = (y + x.to(y.dtype) * m.D.to(y.dtype)) * F.silu(z.to(y.dtype))
    return m.out_proj(y.to(hidden_states.dtype))


def _headed_mamba1(m: nn.Module, hidden_states: torch.Tensor, info, mesh: SPMesh) -> torch.Tensor:
    """Zamba's multi-head Mamba (v1) mixer at this rank's tokens (B, L, D) -> (B, L, D): heads of P channels, each
    with its own x_proj, dt_proj, B and C, scanned together over (H, P, N)."""
    b, n, _ = hidden_states.shape
    heads = m.n_mamba_heads
    x, z = m.in_proj(hidden_states).view(b, n, -1, 2).unbind(-1)  # x and z interleaved channel by channel: (B, L, I)
    x, place = _conv(m, x, info, mesh)
    dtype = compute_dtype(x.dtype)
    xh = x.view(b, n, heads, -1)  # (B, L, H, P)
    states = m.A_log.shape[-1]
    params = torch.einsum("blhp,hkp->blhk", xh, m.x_proj_weight)  # (B, L, H, R + 2N)
    dt_low, b_in, c_in = params.split([params.shape[-1] - 2 * states, states, states], dim=-1)
    dt = torch.einsum("blhr,hpr->blhp", dt_low, m.dt_proj_weight).to(dtype) + m.dt_proj_bias.to(dtype)
    dt = F.softplus(dt)  # (B, L, H, P)
    A = -torch.exp(m.A_log.to(dtype))  # (H, P, N)
    log_decay = dt[..., None] * A
    inp = (dt * xh.to(dtype))[..., None] * b_in.to(dtype)[:, :, :, None, :]  # (B, L, H, P, N)
    h = state_passing_diagonal_scan(log_decay, inp, place)
    y = torch.einsum("blhpn,blhn->blhp", h, c_in.to(dtype)) + xh.to(dtype) * m.D.to(dtype)
    y = y * F.silu(z.view(b, n, heads, -1).to(dtype))
    return m.out_proj(y.reshape(b, n, -1).to(hidden_states.dtype))


def _make_mixer_forward(mesh: SPMesh, headed: bool):
    run = _headed_mamba1 if headed else _mamba1

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache if cache is not None else kwargs.get("cache_params"), attention_mask)
        return run(self, hidden_states, info, mesh)

    return forward


def _forward_for(module: nn.Module, mesh: SPMesh, design: str):
    return _make_mixer_forward(mesh, type(module).__name__ in HEADED_MIXERS)


KIND = MixerKind("Mamba", ("linear_attention", "hybrid"), mamba_layers, _forward_for)
