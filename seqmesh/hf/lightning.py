"""transformers' lightning attention layers (MiniMax-01, ``minimax``) run sequence-parallel, exactly.

A lightning attention layer is linear attention with a fixed decay per head: per head a state ``S``
(Dk x Dv) runs over the sequence as::

    S_t = exp(-slope) S_{t-1} + k_t v_t^T        o_t = S_t^T q_t

with q, k, v = act(qkv_proj(x)) (no scaling of q), and the output normed, gated by
sigmoid(output_gate(x)) and projected by out_proj. transformers computes it in blocks of
``config.block_size`` tokens: inside a block the token's own ``k_t v_t^T`` weighs 1 and an earlier
token's ``exp(-slope (t - s))``; the block's entering state is read through ``exp(-slope (i + 1))``,
``i`` the token's index in the block. That is the recurrence above read at ``S_t`` (decay first,
then ``k_t v_t^T`` added, then read), which is the convention of
:func:`seqmesh.linear_attention.decay_scan.chunk_decay_scan` with ``g_t = -slope``; no adjustment
of q, k or g is needed. The slope is the layer's own ``slope_rate`` buffer (transformers builds it
from the head index and ``layer_idx / (num_hidden_layers - 1)``), read at every call.

``parallelize`` gives each layer an instance-level ``forward`` (the class and transformers' code are
untouched; ``unparallelize`` deletes it) that keeps the projections, norm and gate, which act per
token on the local shard, and replaces the recurrence by the state pass across ranks
(:func:`seqmesh.linear_attention.decay_scan.pass_decay_states`): each rank runs its runs from zero,
then one all-gather of every run's ``[S_0 | exp(sum g)]`` per layer, ``(P - 1) x runs x B x H x
(Dk Dv + 1)`` values a rank receives. Every ``linear_attention`` design name runs this state pass:
there is no conv, so the all-to-all by heads would move ``3 x B x L x H x D`` values per layer
against a state of ``H x D x D`` per run, and would limit P to the heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..linear_attention.choice import parse_design
from ..linear_attention.decay_scan import decay_scan_states, pass_decay_states
from ..linear_attention.decode import last_token_keep
from ..linear_attention.gated_delta import compute_dtype, segment_bounds
from ..linear_attention.halo import placement
from ..mesh import SPMesh
from .mixer_kind import MixerKind, check_mixer_context

# what a lightning attention module must have for seqmesh to read it (transformers 5.24's MiniMaxLightningAttention)
_PARTS = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate", "num_attention_heads", "head_dim")


def _is_lightning(module: nn.Module) -> bool:
    return type(module).__name__.endswith("LightningAttention") and all(hasattr(module, p) for p in _PARTS)


def lightning_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> list[tuple[str, nn.Module]]:
    """The lightning attention layers of ``model`` that seqmesh runs sequence-parallel (by state passing, whatever
    ``design`` names; an unknown name is a ValueError). A lightning layer laid out otherwise is not taken, and
    ``check_layers`` refuses it by name."""
    parse_design(design)
    layers = [(name, m) for name, m in model.named_modules() if _is_lightning(m)]
    for name, module in layers:
        h, d = module.num_attention_heads, module.head_dim
        if module.slope_rate.numel() != h:
            raise ValueError(f"{name} has {module.slope_rate.numel()} decay slopes for {h} heads; seqmesh reads one "
                             "slope per head (slope_rate of shape (H, 1, 1)), as transformers builds it.")
        if module.qkv_proj.out_features != 3 * h * d:
            raise ValueError(f"{name}'s qkv_proj gives {module.qkv_proj.out_features} features; seqmesh splits "
                             f"3 x {h} heads x {d} (q | k | v per head), as transformers lays them out.")
    return layers


def lightning_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, mesh: SPMesh, *,
                         layout: str, seq_len: int, cu_seqlens: tuple[int, ...] | None = None,
                         keep: dict | None = None) -> torch.Tensor:
    """The whole sequence's lightning attention at this rank's tokens: q, k (B, L, H, Dk), v (B, L, H, Dv) in the
    layout's order, ``slope`` (H,) the decay per head -> (B, L, H, Dv); the state restarts at each document of
    ``cu_seqlens`` and at the layout's padding (from ``seq_len``). ``keep`` (a prefill's): given ``keep["state"]``,
    the state (B, H, Dk, Dv) after the row's last real token, on every rank."""
    b, n, h, _ = q.shape
    g = (-slope.reshape(1, 1, h).to(compute_dtype(q.dtype))).expand(b, n, h)  # (B, L, H): log decay per token
    if mesh.sp_size == 1 and keep is None:
        return decay_scan_states(q, k, v, g, segment_bounds(n, cu_seqlens, seq_len))[0]
    place = placement(mesh, n, layout=layout, seq_len=seq_len, cu_seqlens=cu_seqlens)
    if keep is not None:  # the row's last real token, on the rank that holds it
        keep.update(last_token_keep(mesh, layout=layout, seq_len=seq_len))
    return pass_decay_states(q, k, v, g, place, keep=keep)


def lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens on every rank alike (one in generation's decode; a chunk's every token in a prefill onto a kept cache):
    q, k (B, T, H, Dk), v (B, T, H, Dv) from ``state`` (B, H, Dk, Dv) -> (out (B, T, H, Dv), the state after them)."""
    dtype, outs = state.dtype, []
    decay = torch.exp(-slope.reshape(1, -1, 1, 1).to(dtype))  # (1, H, 1, 1)
    for t in range(q.shape[1]):
        state = decay * state + k[:, t].to(dtype)[..., :, None] * v[:, t].to(dtype)[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].to(dtype), state))
    return torch.stack(outs, dim=1).to(v.dtype), state


def _make_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs) -> tuple[torch.Tensor, None]:
        info = kwargs.get("seqmesh")
        cache = cache if cache is not None else kwargs.get("past_key_values")  # its name before transformers 5.2x
        check_mixer_context(self, info, cache, attention_mask)
        b, n, _ = hidden_states.shape
        h, d = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states)).view(b, n, h, 3 * d)  # (B, L, H, 3D): q | k | v per head
        q, k, v = qkv.split(d, dim=-1)  # (B, L, H, D) each
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token from the state the prefill left
            state, tail = generation.get(self)
            core, state = lightning_step(q, k, v, self.slope_rate, state)
            generation.put(self, state, tail)
        elif generation is not None and generation.extension is not None:  # new tokens whole, from the kept state
            def run(q_all: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
                state, tail = generation.get(self)
                out, state = lightning_step(q_all, k_all, v_all, self.slope_rate, state)
                generation.put(self, state, tail)
                return out

            core = generation.whole(run, q, k, v)
        else:
            keep = {} if generation is not None else None
            core = lightning_recurrence(q, k, v, self.slope_rate, mesh, layout=info.layout, seq_len=info.seq_len,
                                        cu_seqlens=info.cu_seqlens, keep=keep)  # (B, L, H, D)
            if keep is not None:  # no conv: an empty tail
                generation.put(self, keep["state"], keep["state"].new_zeros(b, 0, h * d))
        out = self.norm(core.reshape(b, n, h * d)) * torch.sigmoid(self.output_gate(hidden_states))
        return self.out_proj(out), None  # transformers' layer returns (output, its state); seqmesh keeps no state

    return forward


def _forward_for(module: nn.Module, mesh: SPMesh, design: str):
    parse_design(design)
    return _make_forward(mesh)


KIND = MixerKind("lightning attention", ("linear_attention",), lightning_layers, _forward_for)
