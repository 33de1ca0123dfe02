"""Gated DeltaNet one token at a time, from the state a sharded prefill left: what generation's decode runs.

After the prefill (state passing, :func:`.state_passing.state_passing_gated_delta` with ``keep``), every rank holds
the recurrent state after the whole prompt and the conv's last ``K - 1`` inputs (:func:`sequence_tail`, one
all-reduce). Each decode step then runs the same token on every rank: the conv over the tail and the token, the
delta rule one step from the state (the chunked rule on a segment of one token, from that state), and both move on
by one token. Every rank computes the same values; nothing is sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import SPMesh
from ..sequence.sharding import sequence_positions
from .gated_delta import causal_conv1d
from .kernels import gated_delta_rule_states
from .sequence_parallel import GateParams, LinearHeads, rule_inputs


def sequence_tail(conv_in: torch.Tensor, mesh: SPMesh, *, layout: str, seq_len: int, width: int) -> torch.Tensor:
    """The last ``width`` rows of the whole sequence's ``conv_in`` (B, L, C), this rank's in the layout's order ->
    (B, width, C) on every rank (rows before the sequence's start are zero, as the conv's own padding)."""
    b, _, c = conv_in.shape
    tail = conv_in.new_zeros(b, width, c)
    if width == 0:
        return tail
    positions = sequence_positions(seq_len, mesh, layout=layout, device=conv_in.device)
    slot = positions - (seq_len - width)  # where each local token lands in the tail
    mine = (slot >= 0) & (positions < seq_len)
    tail[:, slot[mine]] = conv_in[:, mine].detach()
    dist.all_reduce(tail, group=mesh.sp_group)  # each row held by one rank: the sum is that rank's
    return tail


def last_token_keep(mesh: SPMesh, *, layout: str, seq_len: int) -> dict:
    """A prefill's ``keep`` for :func:`.passing.pass_states`: ``{"end": the local index of the row's last real token}``
    on the rank that holds it, ``{"end": None}`` elsewhere; the state pass then gives every rank ``keep["state"]``."""
    at = (sequence_positions(seq_len, mesh, layout=layout) == seq_len - 1).nonzero()
    return {"end": int(at[0]) if at.numel() else None}


def conv_step(tail: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of a depthwise causal conv after the last ``K - 1`` inputs ``tail`` (B, K - 1, C): the tokens' ``x``
    (B, T, C) (one in a decode step), ``weight`` (C, K) -> (their output (B, T, C), the next tail)."""
    window = torch.cat([tail.to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
    t = x.shape[1]
    return causal_conv1d(window, weight, bias, (0, window.shape[1]), activation)[:, -t:], window[:, t:]


def decode_gated_delta(packed: torch.Tensor, params: GateParams, heads: LinearHeads, state: torch.Tensor,
                       tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens after ``state`` (B, Hv, Dk, Dv) and the conv's last inputs ``tail`` (B, K - 1, conv channels): ``packed``
    (B, T, channels: conv | b | a of every head; one token in a decode step, a chunk's every token in a prefill onto a
    kept cache) -> (out (B, T, Hv, Dv), the state after them, the next tail)."""
    conv_in, beta_in, a_in = packed.split([heads.conv_dim, heads.value_heads, heads.value_heads], dim=-1)
    mixed, tail = conv_step(tail, conv_in, params.conv_weight, params.conv_bias, params.activation)
    q, k, v, g, beta = rule_inputs(mixed, beta_in, a_in, params, heads, 0)
    out, final = gated_delta_rule_states(q, k, v, g, beta, (0, packed.shape[1]), state[:, None])
    return out, final[:, 0], tail
