"""The Gated DeltaNet token mixer on whole sequences, in plain PyTorch: the reference every faster
kernel is compared with, and the CPU path.

Per value head, a state ``S`` (Dk x Dv) runs over the sequence::

    S_t = exp(g_t) * S_{t-1}                          # decay
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T    # delta rule: write the part of v_t S_t misses
    o_t = S_t^T q_t                                   # q, k L2-normalised, q scaled by Dk^-1/2

Packed documents are *segments*: ``bounds = (0, b1, ..., S)``; the state and the short causal conv
both restart at every bound, so a document never sees another one's tokens.

The chunked form (as in flash-linear-attention) processes ``C`` tokens at a time: inside a chunk
the delta-rule updates solve one unit-lower-triangular system; across chunks the state is carried.
Segments are laid out so that each starts a new chunk (zero-padded to a multiple of ``C``; a
padded slot has beta = 0 and g = 0, so it leaves the state untouched), and the carried state is
zeroed at the first chunk of each segment: all documents run in the same batched matmuls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .carry import carry_chunks
from .choice import LINEAR_CHUNK as CHUNK  # tokens per chunk: the one value, which the planner reads too


def segment_bounds(total: int, cu_seqlens: Sequence[int] | None, seq_len: int | None = None) -> tuple[int, ...]:
    """``(0, ..., total)``: document starts from ``cu_seqlens`` (global), plus ``seq_len`` where the
    layout's padding begins, so padding is a segment of its own and never reaches a real token."""
    cuts = {0, total}
    if cu_seqlens is not None:
        cuts.update(int(c) for c in cu_seqlens if 0 < c < total)
    if seq_len is not None and 0 < seq_len < total:
        cuts.add(seq_len)
    return tuple(sorted(cuts))


def positions_in_segments(bounds: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """``(S,)`` int64: each token's offset from the start of its segment."""
    return _positions(bounds, torch.device(device))


@functools.lru_cache(maxsize=64)
def _positions(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]).to(device)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bounds: tuple[int, ...], activation: str = "silu"
) -> torch.Tensor:
    """Depthwise causal conv, restarting at every segment bound. ``x`` (B, S, C), ``weight`` (C, K).

    ``out[t] = sum_s weight[:, K-1-s] * x[t-s]`` over the shifts ``s`` that stay inside t's segment
    (what ``F.conv1d(x, w, padding=K-1)[..., :S]`` computes on each document alone)."""
    b, s, c = x.shape
    kernel = weight.shape[-1]
    pos = positions_in_segments(bounds, x.device)  # (S,)
    out = x * weight[:, kernel - 1]
    for shift in range(1, min(kernel, s)):
        keep = (pos[shift:] >= shift).to(x.dtype)[None, :, None]  # (1, S-shift, 1)
        shifted = x[:, :-shift] * keep * weight[:, kernel - 1 - shift]  # (B, S-shift, C)
        out = out + F.pad(shifted, (0, 0, shift, 0))
    if bias is not None:
        out = out + bias
    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is None:
        return out
    raise ValueError(f"conv activation {activation!r} is not supported; seqmesh's Gated DeltaNet takes 'silu'.")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrence runs in float32 for half-precision inputs, otherwise in the input's dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types seqmesh runs that have an autocast


def without_autocast(rule):
    """``rule(q, ...)`` in its own compute dtype under any autocast its caller holds (``seqmesh train --bf16`` without
    FSDP2, transformers' Trainer in bf16, checkpointing's recomputation): autocast would run the recurrence's float32
    products in bf16, and mix dtypes inside its autograd functions, whose in-place products refuse them."""

    @functools.wraps(rule)
    def run(q: torch.Tensor, *args, **kwargs):
        # a fixed list, not torch.amp.is_autocast_available: torch 2.9's dynamo cannot trace that call
        if q.device.type not in AUTOCAST_DEVICES:
            return rule(q, *args, **kwargs)
        with torch.autocast(q.device.type, enabled=False):
            return rule(q, *args, **kwargs)

    return run


def chunk_layout(bounds: tuple[int, ...], chunk: int,
                  device: torch.device) -> tuple[torch.Tensor, int, list[int]]:
    """Where each token goes when every segment starts a chunk: ``(dest (S,), padded, the chunk each segment starts
    at)``; the last as plain integers, so torch.compile traces them as constants."""
    dest, offset, firsts = [], 0, []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = -(-(b - a) // chunk)
        dest.append(torch.arange(b - a) + offset)
        firsts.append(offset // chunk)
        offset += n * chunk
    return torch.cat(dest).to(device), offset, firsts


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: tuple[int, ...],
    *,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The gated delta rule over segments. q, k (B, S, H, Dk) (not yet normalised; one key head per
    value head), v (B, S, H, Dv), g and beta (B, S, H) -> (B, S, H, Dv) in v's dtype."""
    return chunk_gated_delta_rule_states(q, k, v, g, beta, bounds, None, chunk=chunk)[0]


@without_autocast
def chunk_gated_delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: tuple[int, ...],
    initial_state: torch.Tensor | None,
    *,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`chunk_gated_delta_rule`, each segment starting from ``initial_state[:, i]`` (B, N, H, Dk, Dv)
    (zero when None) instead of zero: ``(out (B, S, H, Dv) in v's dtype, final states (B, N, H, Dk, Dv) in the
    compute dtype)`` for the ``N = len(bounds) - 1`` segments."""
    out_dtype = v.dtype
    dt = compute_dtype(q.dtype)
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    q = l2norm(q.to(dt)) * dk**-0.5
    k = l2norm(k.to(dt))
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)

    dest, total, first_chunks = chunk_layout(bounds, chunk, q.device)
    n = total // chunk

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, *D) -> (B, H, N, C, *D), segments chunk-aligned
        padded = x.new_zeros(b, total, *x.shape[2:]).index_copy(1, dest, x)
        return padded.transpose(1, 2).reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))
    gc = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk start to each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, H, N, C, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # unit lower-triangular system of the chunk's delta-rule updates
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, dtype=dt, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # (B, H, N, C, Dv)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    intra = q @ k.transpose(-1, -2) * decay  # (B, H, N, C, C)
    q_read = q * gc.exp()[..., None]  # reads the state entering the chunk
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # writes decayed to the chunk's end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    out, finals = carry_chunks(u, w, q_read, intra, k_write, chunk_decay, first_chunks, initial_state)
    return out.index_select(1, dest).to(out_dtype), finals  # (B, S, H, Dv), (B, N, H, Dk, Dv)
