"""Gated DeltaNet with the sequence sharded over ``P = ring x ulysses`` ranks by passing the recurrent
state, exactly: the second design beside the all-to-all of ``sequence_parallel.py``.

Every rank keeps all heads of its own tokens. Over a run of consecutive positions the delta rule is
affine in the state entering it (each column of the (Dk x Dv) state evolves alone)::

    S_out = A S_in + B         A (Dk x Dk): the run's gated (I - beta k k^T) factors; B: its state from zero
    o_t   = o_t(0) + S_in^T G_t   G_t = A_t^T q_t, A_t the factors up to t

One pass of the recurrence over the rank's runs with the values widened to ``[v | 0]`` and the
initial state ``[0 | I]`` gives all of it at once: outputs ``[o(0) | G]`` and final states
``[B | A]``. So, with no rank waiting for another::

    1. the conv with its halo (``halo.halo_causal_conv``: one all-gather)
    2. conv, gates, the widened recurrence on the rank's runs                    (all ranks at once)
    3. the state pass (``passing.pass_states``): every run's [B | A] (B, Hv, Dk, Dv + Dk) in float32 in one
       all-gather, the scan over the runs in global order, o += S_in^T G

Backward is autograd through the same steps; the all-gathers' adjoints (reduce-scatter) carry the
state's and the tails' gradients back to the ranks that produced them.

Cost against the all-to-all design, per layer and rank (``R`` runs per rank: 2 zigzag, 1 contiguous):
traffic ``(P - 1) R B Hv Dk (Dk + Dv)`` float32 received for the states plus the tails, whatever the
sequence length (the all-to-all moves ``~ B S (P - 1) / P^2`` channels of every head); compute: the
recurrence with ``Dv + Dk`` value columns instead of ``Dv`` (about twice the FLOPs of the rule, which
is a fraction of the layer's). No limit on heads: P may exceed the value heads. The choice between
the two designs is :func:`seqmesh.linear_attention.choice.choose_design`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..mesh import SPMesh
from ..sequence.runs import DEFAULT_MIN_CHUNK
from .decode import last_token_keep
from .gated_delta import segment_bounds
from .halo import halo_causal_conv, placement
from .kernels import gated_delta_rule_states
from .passing import pass_states
from .sequence_parallel import GateParams, LinearHeads, gated_delta_heads, rule_inputs


def state_passing_gated_delta(
    packed: torch.Tensor,
    params: GateParams,
    heads: LinearHeads,
    mesh: SPMesh,
    *,
    layout: str,
    seq_len: int,
    cu_seqlens: tuple[int, ...] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
    keep: dict | None = None,
) -> torch.Tensor:
    """As :func:`seqmesh.linear_attention.sequence_parallel.sequence_parallel_gated_delta` (same arguments,
    same result): ``packed`` (B, L, channels) in the layout's order -> (B, L, Hv, Dv). ``heads.ranks`` is
    ignored: every rank runs every head of its own tokens. ``keep`` (a prefill's, one document a row): given
    ``keep["state"]`` (B, Hv, Dk, Dv), the recurrent state after the whole sequence, on every rank."""
    p = mesh.sp_size
    whole = dataclasses.replace(heads, ranks=1)
    b, n, c = packed.shape
    if c != whole.channels:
        raise ValueError(f"packed input has {c} channels; the layer's q | k | v | b | a have {whole.channels}.")
    if p == 1 and keep is None:
        return gated_delta_heads(packed, params, whole, 0, segment_bounds(n, cu_seqlens, seq_len))
    place = placement(mesh, n, layout=layout, seq_len=seq_len, cu_seqlens=cu_seqlens, min_chunk=min_chunk,
                      kernel=params.conv_weight.shape[-1])
    mine, device = place.mine, packed.device
    dk, dv, hv = whole.key_dim, whole.value_dim, whole.value_heads

    # 1. conv over the rank's runs, each preceded by its halo from the ranks that hold it
    conv_in, beta_in, a_in = packed.split([whole.conv_dim, hv, hv], dim=-1)
    mixed = halo_causal_conv(conv_in, params.conv_weight, params.conv_bias, place, params.activation)

    # 2. the widened recurrence: values [v | 0], runs that receive a state start from [0 | I]
    q, k, v, g, beta = rule_inputs(mixed, beta_in, a_in, params, whole, 0)
    widened = torch.cat([v, v.new_zeros(b, n, hv, dk)], dim=-1)  # (B, L, Hv, Dv + Dk)
    segments = len(mine.segment_bounds) - 1
    initial = torch.zeros(segments, dk, dv + dk, dtype=torch.float64, device=device)
    initial[list(mine.incoming), :, dv:] = torch.eye(dk, dtype=torch.float64, device=device)
    initial = initial[None, :, None].expand(b, segments, hv, dk, dv + dk)
    out, finals = gated_delta_rule_states(q, k, widened, g, beta, mine.segment_bounds, initial)
    out, lift = out.split([dv, dk], dim=-1)  # o(0) (B, L, Hv, Dv), G (B, L, Hv, Dk)

    # 3. the state pass: [B | A] of each run, S_in = A S_in' + B, o += S_in^T G
    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        run = run.view(b, hv, dk, dv + dk)
        return run[..., dv:] @ state + run[..., :dv]  # (B, Hv, Dk, Dv)

    def read(g_t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthk,bhkv->bthv", g_t.to(state.dtype), state)

    if keep is not None:  # the row's last real token, on the rank that holds it
        keep.update(last_token_keep(mesh, layout=layout, seq_len=seq_len))
    return pass_states(out, lift, finals.flatten(2), place, finals.new_zeros(b, hv, dk, dv), carry=carry, read=read,
                       keep=keep)
