"""RWKV's blocks (transformers' ``rwkv``, RWKV-4) run sequence-parallel, exactly.

Each block mixes tokens in two places, both per token but for the previous token's state and, in its time mix, a
recurrence over the whole sequence::

    x' = the previous token's x (zero at a document's start)          the token shift: a halo of one token
    time mix:     k, v, r = key/value/receptance(x m + x' (1 - m))    per token, a mix m of each
                  wkv_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t})
                  a_t = e^{w} a_{t-1} + e^{k_t} v_t,  b_t = e^{w} b_{t-1} + e^{k_t}     w = -exp(time_decay) < 0
                  out = output(sigmoid(r) wkv)
    channel mix:  out = sigmoid(receptance(...)) value(relu(key(...))^2)

The shift reads its halo (:func:`seqmesh.linear_attention.halo.with_halo`, one all-gather of one row a run). The
recurrence is affine in its state ``(a, b)``, but its output is their ratio, and its terms grow as ``e^k``: as
transformers does, the state is kept scaled by ``e^{-p}``, ``p`` the largest exponent so far, as the triple
``(a, b, p)``. Each rank runs its runs from the zero state (``p = -1e38``, transformers' own), which gives each run's
final triple; those travel in one all-gather (:func:`seqmesh.linear_attention.passing.rerun_states`) with each run's
total log decay ``w x length``, and combine in order in log space::

    (a, b, p) then a run (a0, b0, p0, log T):  q = max(p + log T, p0);  a <- e^{p + log T - q} a + e^{p0 - q} a0; ...

which is associative. Each run that receives a state is then run again from it. The recurrence runs in float32 for
half-precision inputs, otherwise in the inputs' dtype (transformers' CPU loop keeps float32 states throughout).

The recurrence is a loop over tokens, as transformers' own CPU path (its CUDA kernel is not used here); a chunked
form would make it faster, not different. Packed documents restart the shift and the state at each (transformers,
given a packed row, would carry both across); tensor parallelism, generation and a state passed in are refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..linear_attention.gated_delta import compute_dtype
from ..linear_attention.passing import rerun_states
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

TIME_MIX, CHANNEL_MIX = "RwkvSelfAttention", "RwkvFeedForward"
_NONE = -1e38  # the exponent of an empty state (transformers' own start)


def rwkv_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """RWKV's time-mix and channel-mix modules of ``model`` (path, module), checked: a design name seqmesh does not
    know, and tensor parallelism, raise a ValueError."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if type(m).__name__ in (TIME_MIX, CHANNEL_MIX)]
    refuse_tensor_parallel(layers, mesh, "is an RWKV block's token mix, whose channels seqmesh's tensor parallelism "
                           "does not split")
    return layers


def shifted(hidden: torch.Tensor, place: halo.Placement) -> torch.Tensor:
    """``hidden`` (B, L, C) in shard order -> each token's predecessor in the whole sequence (B, L, C), zero at a
    segment's start (transformers' ``time_shift``)."""
    def shift(extended: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros_like(extended)
        for a, e in zip(bounds[:-1], bounds[1:]):
            out[:, a + 1:e] = extended[:, a:e - 1]
        return out

    return halo.with_halo(hidden, place, shift)


def wkv(decay: torch.Tensor, first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one segment, token by token: ``decay`` (C,) = -exp(time_decay), ``first`` (C,) the bonus
    ``u``, ``key``/``value`` (B, T, C) in the compute dtype; ``state`` (B, 3 C) the entering ``[a | b | p]`` (None:
    empty) -> (wkv (B, T, C), the leaving state (B, 3 C))."""
    b, t, c = key.shape
    if state is None:
        num, den, top = key.new_zeros(b, c), key.new_zeros(b, c), key.new_full((b, c), _NONE)
    else:
        num, den, top = state.view(b, 3, c).unbind(1)
    out = []
    for i in range(t):
        k, v = key[:, i], value[:, i]
        q = torch.maximum(top, k + first)
        old, new = torch.exp(top - q), torch.exp(k + first - q)
        out.append((old * num + new * v) / (old * den + new))
        q = torch.maximum(top + decay, k)
        old, new = torch.exp(top + decay - q), torch.exp(k - q)
        num, den, top = old * num + new * v, old * den + new, q
    return torch.stack(out, 1), torch.cat([num, den, top], dim=-1)


def wkv_state_passing(module: nn.Module, key: torch.Tensor, value: torch.Tensor, place: halo.Placement) -> torch.Tensor:
    """The time mix's recurrence of the whole sequence at this rank's tokens: ``key``/``value`` (B, L, C) in shard
    order -> wkv (B, L, C) in the compute dtype. One all-gather of every run's ``[a0 | b0 | p0 | log T]`` forward."""
    dtype = compute_dtype(key.dtype)
    key, value = key.to(dtype), value.to(dtype)
    decay, first = -torch.exp(module.time_decay.to(dtype)), module.time_first.to(dtype)
    b, _, c = key.shape
    bounds = place.mine.segment_bounds
    incoming = set(place.mine.incoming)
    outs, finals = [], []
    for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):  # every segment from the empty state
        out, final = wkv(decay, first, key[:, a:e], value[:, a:e])
        outs.append(out)
        # the run's total log decay where it receives a state; where it starts a segment, none passes
        log_t = decay.expand(b, c) * (e - a) if i in incoming else key.new_full((b, c), _NONE)
        finals.append(torch.cat([final, log_t], dim=-1))

    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # (B, 4 C), (B, 3 C) -> (B, 3 C)
        num0, den0, top0, log_t = run.view(b, 4, c).unbind(1)
        num, den, top = state.view(b, 3, c).unbind(1)
        moved = top + log_t
        q = torch.maximum(moved, top0)
        old, new = torch.exp(moved - q), torch.exp(top0 - q)
        return torch.cat([old * num + new * num0, old * den + new * den0, q], dim=-1)

    def rerun(segment: int, state: torch.Tensor) -> torch.Tensor:
        a, e = bounds[segment], bounds[segment + 1]
        return wkv(decay, first, key[:, a:e], value[:, a:e], state)[0]

    empty = torch.cat([key.new_zeros(b, 2 * c), key.new_full((b, c), _NONE)], dim=-1)
    return rerun_states(torch.cat(outs, 1), torch.stack(finals, 1), place, empty, carry=carry, rerun=rerun)


def _mixed(hidden: torch.Tensor, previous: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    return hidden * mix + previous * (1 - mix)


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    time_mix = type(module).__name__ == TIME_MIX

    def forward(self, hidden: torch.Tensor, state=None, use_cache=False, **kwargs):
        # hidden (B, L, D) in shard order -> ((B, L, D), None)
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, state, None)
        place = halo.placement(mesh, hidden.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=2)
        previous = shifted(hidden, place)
        if not time_mix:  # the channel mix
            key = torch.square(torch.relu(self.key(_mixed(hidden, previous, self.time_mix_key))))
            return torch.sigmoid(self.receptance(_mixed(hidden, previous, self.time_mix_receptance))) * self.value(key), None
        key = self.key(_mixed(hidden, previous, self.time_mix_key))
        value = self.value(_mixed(hidden, previous, self.time_mix_value))
        receptance = torch.sigmoid(self.receptance(_mixed(hidden, previous, self.time_mix_receptance)))
        return self.output(receptance * wkv_state_passing(self, key, value, place).to(key.dtype)), None

    return forward


KIND = MixerKind("RWKV", (), rwkv_layers, _make_forward)
