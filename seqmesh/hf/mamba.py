"""transformers' Mamba (v1) mixers (Jamba's, Mamba's, Falcon-Mamba's, and Zamba's multi-head one) run
sequence-parallel, exactly.

The mixer's own projections act per token on the local shard; its depthwise causal conv runs with
its halo (:func:`seqmesh.linear_attention.halo.halo_causal_conv`) and its selective scan, a diagonal recurrence over
(channels, states), by state passing (:func:`seqmesh.linear_attention.selective_scan.state_passing_diagonal_scan`)::

    in_proj -> x, z (B, L, I) | conv(x) with halo, silu | x_proj -> dt_low, B, C (norms: Jamba, Falcon-Mamba)
      | dt = softplus(dt_proj(dt_low)) | y = scan(x, dt, A, B, C) + D x | y * silu(z) | out_proj

Zamba's mixer (``ZambaMambaMixer``) splits the channels into ``n_mamba_heads`` heads of ``P``, each with its own
x_proj and dt_proj (``x_proj_weight`` (H, R + 2N, P), ``dt_proj_weight`` (H, P, R)) and its own B and C; its in_proj
interleaves x and z channel by channel. Its scan is the same diagonal recurrence over ``(H, P, N)``
(:func:`seqmesh.linear_attention.selective_scan.state_passing_diagonal_scan`).

Every ``linear_attention`` design name runs state passing: the all-to-all by channels would need
x_proj's input (all channels of a token) after the exchange, so an all-to-all of x, dt, B and C after
x_proj; not built.

Generation (``seqmesh.inference``): the prompt's prefill leaves the scan's state after the prompt's last token and
the conv's last ``K - 1`` inputs on every rank; each decode step runs the token from them on every rank alike.

The ``seqmesh`` entry of ``shard_batch`` reaches the mixer in its kwargs where transformers' layers
pass them on; Jamba's decoder layer and Mamba's backbone call theirs without them, and the module
that still receives the entry hands it over (:func:`seqmesh.hf.mixers.carry_entry`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention.choice import parse_design
from ..linear_attention.decode import conv_step, last_token_keep, sequence_tail
from ..linear_attention.gated_delta import compute_dtype
from ..linear_attention.halo import halo_causal_conv, placement
from ..linear_attention.selective_scan import selective_terms, state_passing_diagonal_scan
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


Read = Callable[[torch.Tensor], torch.Tensor]  # the scan's states (B, L, *X) -> y (B, L, I), D x included


def _terms(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Read]:
    """The scan of a Mamba (v1) mixer of :data:`MIXERS` over the conv's output ``x`` (B, L, I): its log decay and
    input (B, L, I, N) and its read-out."""
    dt, b_in, c_in = _scan_inputs(m, x)
    dtype = dt.dtype
    log_decay, inp = selective_terms(x, dt, -torch.exp(m.A_log.to(dtype)), b_in)

    def read(states: torch.Tensor) -> torch.Tensor:
        return torch.einsum("blcn,bln->blc", states, c_in.to(dtype)) + x.to(dtype) * m.D.to(dtype)

    return log_decay, inp, read


def _headed_terms(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Read]:
    """As :func:`_terms` for Zamba's multi-head mixer: heads of P channels, each with its own x_proj, dt_proj, B and C,
    scanned together over (H, P, N)."""
    b, n, _ = x.shape
    dtype = compute_dtype(x.dtype)
    xh = x.view(b, n, m.n_mamba_heads, -1)  # (B, L, H, P)
    states = m.A_log.shape[-1]
    params = torch.einsum("blhp,hkp->blhk", xh, m.x_proj_weight)  # (B, L, H, R + 2N)
    dt_low, b_in, c_in = params.split([params.shape[-1] - 2 * states, states, states], dim=-1)
    dt = torch.einsum("blhr,hpr->blhp", dt_low, m.dt_proj_weight).to(dtype) + m.dt_proj_bias.to(dtype)
    dt = F.softplus(dt)  # (B, L, H, P)
    A = -torch.exp(m.A_log.to(dtype))  # (H, P, N)
    log_decay, inp = dt[..., None] * A, (dt * xh.to(dtype))[..., None] * b_in.to(dtype)[:, :, :, None, :]

    def read(h: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("blhpn,blhn->blhp", h, c_in.to(dtype)) + xh.to(dtype) * m.D.to(dtype)
        return y.reshape(b, n, -1)

    return log_decay, inp, read


def _split(m: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj's x (the conv's input) and z, (B, L, I) each: halves, or (Zamba) interleaved channel by channel."""
    if type(m).__name__ in HEADED_MIXERS:
        return m.in_proj(hidden_states).view(*hidden_states.shape[:2], -1, 2).unbind(-1)
    return m.in_proj(hidden_states).chunk(2, dim=-1)


def _finish(m: nn.Module, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return m.out_proj((y * F.silu(z.to(y.dtype))).to(dtype))


STEP_BLOCK = 256  # tokens whose states mamba_step holds at once (each channels x states values a token)


def mamba_step(m: nn.Module, x_in: torch.Tensor, state: torch.Tensor,
               tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of the mixer ``m`` (one in generation's decode; a chunk's every token in a prefill onto a kept cache):
    the conv's input ``x_in`` (B, T, I), the scan's ``state`` (B, *X) and the conv's last ``K - 1`` inputs ``tail``
    (B, K - 1, I) -> (y (B, T, I) before the gate, the state after them, the next tail)."""
    x, tail = conv_step(tail, x_in, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.activation)
    terms = _headed_terms if type(m).__name__ in HEADED_MIXERS else _terms
    ys = []
    for a in range(0, x.shape[1], STEP_BLOCK):  # a block's (B, T', channels, states) terms and states at a time
        log_decay, inp, read = terms(m, x[:, a:a + STEP_BLOCK])
        states = []
        for t in range(log_decay.shape[1]):
            state = torch.exp(log_decay[:, t]) * state + inp[:, t]
            states.append(state)
        ys.append(read(torch.stack(states, dim=1)))
    return torch.cat(ys, dim=1), state, tail


def _make_mixer_forward(mesh: SPMesh, headed: bool):
    scan_terms = _headed_terms if headed else _terms

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache if cache is not None else kwargs.get("cache_params"), attention_mask)
        x_in, z = _split(self, hidden_states)
        weight = self.conv1d.weight.squeeze(1)  # (I, K)
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token, the same on every rank, from the prefill's
            y, state, tail = mamba_step(self, x_in, *generation.get(self))
            generation.put(self, state, tail)
            return _finish(self, y, z, hidden_states.dtype)
        if generation is not None and generation.extension is not None:  # new tokens whole, from the kept state
            def run(x_all: torch.Tensor) -> torch.Tensor:
                y, state, tail = mamba_step(self, x_all, *generation.get(self))
                generation.put(self, state, tail)
                return y

            return _finish(self, generation.whole(run, x_in), z, hidden_states.dtype)
        place = placement(mesh, x_in.shape[1], layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens,
                          kernel=weight.shape[-1])
        x = halo_causal_conv(x_in, weight, self.conv1d.bias, place, self.activation)
        log_decay, inp, read = scan_terms(self, x)
        # the prompt: the state after its last token, on every rank
        keep = last_token_keep(mesh, layout=info.layout, seq_len=info.seq_len) if generation is not None else None
        y = read(state_passing_diagonal_scan(log_decay, inp, place, keep=keep))
        if keep is not None:
            generation.put(self, keep["state"], sequence_tail(x_in, mesh, layout=info.layout, seq_len=info.seq_len,
                                                              width=weight.shape[-1] - 1))
        return _finish(self, y, z, hidden_states.dtype)

    return forward


def _forward_for(module: nn.Module, mesh: SPMesh, design: str):
    return _make_mixer_forward(mesh, type(module).__name__ in HEADED_MIXERS)


KIND = MixerKind("Mamba", ("linear_attention", "hybrid"), mamba_layers, _forward_for)
