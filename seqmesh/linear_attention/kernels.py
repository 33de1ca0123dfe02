"""The fastest recurrent-mixer kernels available, behind the signatures of the torch reference.

On CUDA, flash-linear-attention's ``chunk_gated_delta_rule`` and the ``causal-conv1d`` package are
used when installed; both take variable-length documents (the batch rows are laid end to end with
``cu_seqlens``). Everywhere else, and for shapes those kernels refuse, the torch reference of
``gated_delta.py`` runs: same arguments, same results up to rounding.
"""

from __future__ import annotations

import functools

import torch

from . import gated_delta


@functools.lru_cache(maxsize=1)
def _fla_rule():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


@functools.lru_cache(maxsize=1)
def simple_gla_rule():
    """flash-linear-attention's ``chunk_simple_gla`` (linear attention with a scalar decay per head and token: the
    recurrence of :mod:`seqmesh.linear_attention.decay_scan`), or None where it is not installed."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return chunk_simple_gla


@functools.lru_cache(maxsize=1)
def _conv_fn():
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


def row_bounds(bounds: tuple[int, ...], rows: int, device: torch.device, dtype=torch.int32) -> torch.Tensor:
    """The segments of ``rows`` batch rows laid end to end, as flash-linear-attention's cu_seqlens."""
    length = bounds[-1]
    cuts = [r * length + c for r in range(rows) for c in bounds[:-1]] + [rows * length]
    return torch.tensor(cuts, dtype=dtype, device=device)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: tuple[int, ...]
) -> torch.Tensor:
    """As :func:`gated_delta.chunk_gated_delta_rule`: q, k (B, S, H, Dk), v (B, S, H, Dv), g, beta (B, S, H)."""
    rule = _fla_rule() if q.is_cuda else None
    if rule is None:
        return gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, bounds)
    b, s, h, _ = q.shape
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, beta)]
    out, _ = rule(*flat[:3], g=g.reshape(1, b * s, h).float(), beta=flat[3], scale=q.shape[-1] ** -0.5,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=row_bounds(bounds, b, q.device, torch.long))
    return out.reshape(b, s, h, -1)


def gated_delta_rule_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: tuple[int, ...],
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gated_delta.chunk_gated_delta_rule_states`: each of the ``N`` segments starts from
    ``initial_state`` (B, N, H, Dk, Dv) -> (out (B, S, H, Dv), final states (B, N, H, Dk, Dv) in float32 or float64)."""
    rule = _fla_rule() if q.is_cuda else None
    if rule is None:
        return gated_delta.chunk_gated_delta_rule_states(q, k, v, g, beta, bounds, initial_state)
    b, s, h, _ = q.shape
    segments = initial_state.shape[1]
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, beta)]
    out, final = rule(*flat[:3], g=g.reshape(1, b * s, h).float(), beta=flat[3], scale=q.shape[-1] ** -0.5,
                      initial_state=initial_state.float().flatten(0, 1), output_final_state=True,  # (B*N, H, Dk, Dv)
                      use_qk_l2norm_in_kernel=True, cu_seqlens=row_bounds(bounds, b, q.device, torch.long))
    return out.reshape(b, s, h, -1), final.reshape(b, segments, *final.shape[1:])


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bounds: tuple[int, ...], activation: str = "silu"
) -> torch.Tensor:
    """As :func:`gated_delta.causal_conv1d`: x (B, S, C), weight (C, K)."""
    fn = _conv_fn() if x.is_cuda and activation in ("silu", "swish", None) else None
    if fn is None:
        return gated_delta.causal_conv1d(x, weight, bias, bounds, activation)
    b, s, c = x.shape
    pos = gated_delta.positions_in_segments(bounds, x.device)
    seq_idx = (torch.cumsum((pos == 0).to(torch.int32), 0) - 1).expand(b, s).contiguous()  # segment of each token
    # causal-conv1d wants channel-last memory as a (B, C, S) view, and a segment index per token
    out = fn(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation)
    return out.transpose(1, 2)
