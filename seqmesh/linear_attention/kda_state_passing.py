"""Kimi Delta Attention with the sequence sharded over ``P = ring x ulysses`` ranks by passing the recurrent
state, exactly: Gated DeltaNet's state passing (``state_passing.py``) with a decay per key channel.

Every rank keeps all heads of its own tokens. The decay ``diag(exp(g_t))`` is still a (Dk x Dk) matrix
acting on the state's rows, so over a run of consecutive positions the rule stays affine in the state
entering it, each of its Dv columns on its own::

    S_out = A S_in + B         A (Dk x Dk): the run's (I - beta k k^T) diag(exp(g)) factors; B: its state from zero
    o_t   = o_t(0) + S_in^T G_t   G_t = A_t^T q_t, A_t the factors up to t

and one pass of the chunked rule (``kernels.kda_rule_states``) with the values widened to ``[v | 0]`` and
the initial states ``[0 | I]`` gives outputs ``[o(0) | G]`` and final states ``[B | A]``. Per layer::

    1. the short conv of q | k | v with its halo (``halo.halo_causal_conv``: one all-gather; transformers'
       one depthwise Conv1d over the three, which is the three convs side by side)
    2. the widened recurrence on the rank's runs                                 (all ranks at once)
    3. the state pass (``passing.pass_states``): every run's [B | A] (B, H, Dk, Dv + Dk) in one all-gather,
       the scan over the runs in global order, o += S_in^T G

The decay g (B, L, H, Dk) and beta (B, L, H) are per token: the layer computes them on its own shard.
Backward is autograd through the same steps; the all-gathers' adjoints (reduce-scatters) return the
states' and the halos' gradients to the ranks that produced them.

Bytes each rank sends per layer forward (the same again backward), ``R`` runs and ``T`` halo blocks on
the busiest rank (``choice.runs_and_tails``), ``K`` the conv width::

    (P - 1) B (R H Dk (Dk + Dv) state_bytes + T (K - 1) 3 H Dk dtype_bytes)

independent of the sequence length: :func:`kda_state_passing_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mesh import SPMesh
from ..sequence.runs import DEFAULT_MIN_CHUNK
from .choice import halo_bytes, runs_and_tails
from .gated_delta import segment_bounds
from .halo import halo_causal_conv, placement
from .decode import conv_step, last_token_keep
from .kda import chunk_kda_states
from .kernels import kda_rule_states
from .kernels import causal_conv
from .passing import pass_states


@dataclass(frozen=True)
class KdaHeads:
    """The head shapes of one KDA layer (as many key heads as value heads)."""

    heads: int
    key_dim: int
    value_dim: int

    @property
    def conv_dim(self) -> int:
        return self.heads * (2 * self.key_dim + self.value_dim)


def kda_state_passing_bytes(heads: KdaHeads, *, batch: int, ulysses: int, ring: int, layout: str, kernel: int,
                            dtype_bytes: int, state_bytes: int = 4) -> int:
    """Bytes each rank sends forward (and again backward) in the two all-gathers of one KDA layer."""
    runs, _ = runs_and_tails(ulysses, ring, layout)
    states = runs * heads.heads * heads.key_dim * (heads.key_dim + heads.value_dim) * state_bytes
    return (ulysses * ring - 1) * batch * states + halo_bytes(heads.conv_dim, kernel, batch=batch, ulysses=ulysses,
                                                             ring=ring, layout=layout, dtype_bytes=dtype_bytes)


def _split_heads(mixed: torch.Tensor, heads: KdaHeads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, conv_dim) after the conv -> q, k (B, L, H, Dk), v (B, L, H, Dv)."""
    b, n, _ = mixed.shape
    h, dk, dv = heads.heads, heads.key_dim, heads.value_dim
    q, k, v = mixed.split([h * dk, h * dk, h * dv], dim=-1)
    return q.reshape(b, n, h, dk), k.reshape(b, n, h, dk), v.reshape(b, n, h, dv)


def state_passing_kda(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    heads: KdaHeads,
    mesh: SPMesh,
    *,
    layout: str,
    seq_len: int,
    cu_seqlens: tuple[int, ...] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
    activation: str | None = "silu",
    keep: dict | None = None,
) -> torch.Tensor:
    """KDA of the whole sequence at this rank's tokens: ``qkv`` (B, L, 3 H D) the projections before the conv,
    ``g`` (B, L, H, Dk) the log decays, ``beta`` (B, L, H), all in the layout's order (``layout``, ``cu_seqlens``
    and ``min_chunk`` as ``seqmesh.shard_sequence`` placed them; ``seq_len`` real tokens); ``conv_weight``
    (3 H D, K) -> (B, L, H, Dv), before the gated norm. The conv and the state restart at every document. ``keep``
    (a prefill's, one document a row): given ``keep["state"]`` (B, H, Dk, Dv), the state after the row's last real
    token, on every rank (:func:`.passing.pass_states`)."""
    b, n, c = qkv.shape
    if c != heads.conv_dim:
        raise ValueError(f"qkv has {c} channels; the layer's q | k | v have {heads.conv_dim}.")
    h, dk, dv = heads.heads, heads.key_dim, heads.value_dim
    if mesh.sp_size == 1 and keep is None:
        bounds = segment_bounds(n, cu_seqlens, seq_len)
        mixed = causal_conv(qkv, conv_weight, conv_bias, bounds, activation).to(qkv.dtype)
        return kda_rule_states(*_split_heads(mixed, heads), g, beta, bounds)[0]
    place = placement(mesh, n, layout=layout, seq_len=seq_len, cu_seqlens=cu_seqlens, min_chunk=min_chunk,
                      kernel=conv_weight.shape[-1])
    mine = place.mine

    # 1. the conv over the rank's runs, each preceded by its halo
    mixed = halo_causal_conv(qkv, conv_weight, conv_bias, place, activation)  # in a float32 weight's dtype, as
    q, k, v = _split_heads(mixed.to(qkv.dtype), heads)  # transformers' (Bailing keeps its conv in float32)

    # 2. the widened recurrence: values [v | 0], runs that receive a state start from [0 | I]
    widened = torch.cat([v, v.new_zeros(b, n, h, dk)], dim=-1)  # (B, L, H, Dv + Dk)
    segments = len(mine.segment_bounds) - 1
    initial = torch.zeros(segments, dk, dv + dk, dtype=torch.float64, device=qkv.device)
    initial[list(mine.incoming), :, dv:] = torch.eye(dk, dtype=torch.float64, device=qkv.device)
    initial = initial[None, :, None].expand(b, segments, h, dk, dv + dk)
    out, finals = kda_rule_states(q, k, widened, g, beta, mine.segment_bounds, initial)
    out, lift = out.split([dv, dk], dim=-1)  # o(0) (B, L, H, Dv), G (B, L, H, Dk)

    # 3. the state pass: [B | A] of each run, S_in = A S_in' + B, o += S_in^T G
    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        run = run.view(b, h, dk, dv + dk)
        return run[..., dv:] @ state + run[..., :dv]  # (B, H, Dk, Dv)

    def read(g_t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthk,bhkv->bthv", g_t.to(state.dtype), state)

    if keep is not None:  # the row's last real token, on the rank that holds it
        keep.update(last_token_keep(mesh, layout=layout, seq_len=seq_len))
    return pass_states(out, lift, finals.flatten(2), place, finals.new_zeros(b, h, dk, dv), carry=carry, read=read,
                       keep=keep)


def kda_step(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
             conv_bias: torch.Tensor | None, heads: KdaHeads, state: torch.Tensor, tail: torch.Tensor,
             activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens on every rank alike (one in generation's decode; a chunk's every token in a prefill onto a kept cache):
    ``qkv`` (B, T, 3 H D) before the conv, ``g`` (B, T, H, Dk), ``beta`` (B, T, H), from ``state`` (B, H, Dk, Dv) and the
    conv's last ``K - 1`` inputs ``tail`` (B, K - 1, 3 H D) -> (out (B, T, H, Dv), the state after them, the next tail):
    the chunked rule on one segment from the state."""
    mixed, tail = conv_step(tail, qkv, conv_weight, conv_bias, activation)
    out, finals = chunk_kda_states(*_split_heads(mixed.to(qkv.dtype), heads), g, beta, (0, qkv.shape[1]),
                                   state[:, None])
    return out, finals[:, 0], tail
