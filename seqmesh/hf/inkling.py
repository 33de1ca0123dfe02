"""Inkling's layers (transformers' ``inkling``) exact under sequence parallelism: its short convolutions and its
attention with a relative bias conditioned on each query.

- **Short convolutions** (``InklingShortConvolution``: the keys' and values' inside attention, the attention's and
  the MLP's outputs): ``y = conv(x) + x`` in float32, a depthwise causal conv of kernel ``K``. Each runs on its
  halo (:func:`seqmesh.linear_attention.halo.halo_causal_conv`, one all-gather of ``K - 1`` rows a run): a
  :class:`.mixer_kind.MixerKind` of their own.
- **Attention** (``InklingAttention``): q and k RMS-normed per head (scores over ``D``, no rotary), and to each
  score of query ``q`` and key ``k`` at distance ``d = q - k < E`` a bias ``(r_q P)[h, d]``, ``r_q`` the query's
  projection and ``P`` a trained bank of profiles (``E``: the window on a sliding layer, ``rel_extent`` on a full
  one); a full layer may scale the query and its bias by ``1 + alpha log(max((i + 1) / n, 1))`` of its index ``i``
  in the document. The bias is a function of the query and the distance, which no kernel takes: each rank
  all-gathers the row's keys and values (their gradient back by the adjoint reduce-scatter) and each block of its
  queries scores its document's keys up to itself (its window's on a sliding layer), adds the bias, and attends,
  recomputed in backward rather than kept (a dense product: the sliding layers, whose keys a halo of ``W - 1`` rows
  would hold, read the row as the full ones do).

Layer types ``hybrid_sliding`` and ``hybrid`` are accepted where these run. Tensor parallelism, a padding mask, a
cache and generation are refused by name. Inkling 2's layers (its dynamic convolutions, L2 clips and block
residuals) are another layout: :mod:`.inkling2`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..mesh import SPMesh
from ..sequence.batch import document_places
from ..tensor_values import host_ints
from .indexed_attention import BLOCK_ELEMENTS, entry_of, recomputed, replace_forward, restore_forward, whole_row
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

_ATTR = "_seqmesh_inkling"
LAYER_TYPES = ("hybrid_sliding", "hybrid")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj", "k_sconv", "v_sconv", "q_norm", "k_norm",
              "rel_logits_proj", "is_sliding", "rel_extent", "scaling", "num_heads", "num_key_value_heads")


def is_short_convolution(module: nn.Module) -> bool:
    """Whether ``module`` is one of Inkling's residual short convolutions."""
    return type(module).__name__ == "InklingShortConvolution" and isinstance(getattr(module, "conv1d", None), nn.Conv1d)


def short_convolutions(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """Inkling's short convolutions in ``model`` (path, module), checked: a design name seqmesh does not know, and
    tensor parallelism, raise a ValueError."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if is_short_convolution(m)]
    refuse_tensor_parallel(layers, mesh, "is one of Inkling's short convolutions, whose channels seqmesh's tensor "
                           "parallelism does not split")
    return layers


def short_convolution(module: nn.Module, x: torch.Tensor, place: halo.Placement, scale: float = 1.0) -> torch.Tensor:
    """``(conv(x) + x) / scale`` of the whole sequence at this rank's tokens (float32, back to ``x``'s dtype): x
    (B, L, C) in shard order -> (B, L, C). Inkling's ``scale`` is 1, Inkling 2's ``sqrt(K + 1)``."""
    wide = x.float()
    conv = halo.halo_causal_conv(wide, module.conv1d.weight.squeeze(1), module.conv1d.bias, place, activation=None)
    return ((conv + wide) / scale).to(x.dtype)


def _make_conv_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = module.conv1d.kernel_size[0]

    def forward(self, hidden_states: torch.Tensor, cache=None, conv_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        check_mixer_context(self, info, cache, None if conv_mask is None or bool(conv_mask.all()) else conv_mask)
        place = halo.placement(mesh, hidden_states.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=kernel)
        return short_convolution(self, hidden_states, place)

    return forward


KIND = MixerKind("Inkling short convolution", LAYER_TYPES, short_convolutions, _make_conv_forward)


def is_relative_attention(module: nn.Module) -> bool:
    """Whether ``module`` is Inkling's attention with its relative bias."""
    return type(module).__name__ == "InklingAttention" and all(hasattr(module, n) for n in _ATTENTION)


def relative_attention_layers(model: nn.Module, mesh: SPMesh,
                              is_layer: Callable[[nn.Module], bool] = is_relative_attention) -> list[nn.Module]:
    """Inkling's attention modules of ``model`` (or those ``is_layer`` names: Inkling 2's); tensor parallelism refused
    by name."""
    found = [m for m in model.modules() if is_layer(m)]
    if found and getattr(mesh, "tp", 1) > 1:
        raise ValueError(f"seqmesh cannot run {type(found[0]).__name__} with tensor parallelism (tp={mesh.tp}): its "
                         "relative bias is computed over the gathered row; use tp=1.")
    return found


def _attend(module: nn.Module, query: torch.Tensor, rel: torch.Tensor, row_k: torch.Tensor, row_v: torch.Tensor,
            positions: torch.Tensor, starts: torch.Tensor, first: int, last: int,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query (B, Hq, l, D) and its bias profiles rel (B, l, Hq, E) at row positions (l,) in documents starting at
    (l,), over the row's keys ``first .. last`` (row_k, row_v (B, T, Hkv, D)) -> (B, l, Hq, D); ``sinks`` (B, l, Hq):
    a logit per query and head that takes probability and adds nothing (Inkling 2's), one more softmax column in at
    least float32, as transformers' eager attention."""
    b, hq, length, d = query.shape
    keys = torch.arange(first, last + 1, device=query.device)
    k = row_k[:, first:last + 1].transpose(1, 2).repeat_interleave(hq // row_k.shape[2], dim=1)  # (B, Hq, n, D)
    v = row_v[:, first:last + 1].transpose(1, 2).repeat_interleave(hq // row_v.shape[2], dim=1)
    distance = positions[:, None] - keys[None]  # (l, n)
    seen = (distance >= 0) & (keys[None] >= starts[:, None])
    if module.is_sliding:
        seen &= distance < module.sliding_window
    extent = rel.shape[-1]
    near = (distance >= 0) & (distance < extent)
    bias = rel.permute(0, 2, 1, 3).gather(-1, distance.clamp(0, extent - 1).expand(b, hq, -1, -1))  # (B, Hq, l, n)
    scores = torch.matmul(query, k.transpose(-1, -2)) * module.scaling + bias.masked_fill(~near, 0.0)
    scores = scores.masked_fill(~seen, float("-inf"))  # (B, Hq, l, n)
    wide = torch.promote_types(scores.dtype, torch.float32)  # float64 stays float64 (transformers': float32)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=wide).to(query.dtype)
    else:
        logits = torch.cat([scores, sinks.transpose(1, 2)[..., None].to(scores.dtype)], dim=-1).to(wide)
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(query.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def attend_row(module: nn.Module, query: torch.Tensor, rel: torch.Tensor, row_k: torch.Tensor, row_v: torch.Tensor,
               starts: torch.Tensor, within: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries (B, Hq, L, D) with their bias profiles (B, L, Hq, E) over the gathered row's keys and
    values (B, T, Hkv, D), in blocks of queries recomputed in backward, each block over the keys its documents (its
    window, on a sliding layer) let it see -> (B, L, Hq, D). ``starts``, ``within`` (L,): each query's document start
    in the row and its index in the document; ``sinks`` (B, L, Hq) as :func:`_attend`'s."""
    b, length = query.shape[0], query.shape[2]
    positions = starts + within  # (L,) each query's index in the row
    step = max(1, BLOCK_ELEMENTS // max(1, b * module.num_heads * row_k.shape[1] * max(module.head_dim, 1)))
    outputs = []
    for at in range(0, length, step):
        part = slice(at, at + step)
        # the keys the block may see, from its documents' starts to its last query (a rehearsal, without values:
        # the whole row, the busiest block's)
        first, low, last = host_ints(torch.stack([starts[part].min(), positions[part].min(), positions[part].max()]),
                                     lambda: [0, 0, row_k.shape[1] - 1])
        if module.is_sliding:
            first = max(first, low - module.sliding_window + 1)
        block_sinks = None if sinks is None else sinks[:, part]
        outputs.append(recomputed(_attend, module, query[:, :, part], rel[:, part], row_k, row_v, positions[part],
                                  starts[part], first, last, block_sinks))
    return torch.cat(outputs, dim=1)


def _make_attention_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, attention_mask=None, conv_mask=None, cache=None, **kwargs):
        # hidden_states (B, L, E) in shard order -> ((B, L, E), None)
        info, _ = entry_of(self, cache, kwargs)
        b, length = hidden_states.shape[:-1]
        shape = (b, length, -1, self.head_dim)
        key = self.k_sconv(self.k_proj(hidden_states), conv_mask=conv_mask, seqmesh=info)
        value = self.v_sconv(self.v_proj(hidden_states), conv_mask=conv_mask, seqmesh=info)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)  # (B, Hq, L, D)
        key = self.k_norm(key.view(shape))  # (B, L, Hkv, D)
        value = value.view(shape)
        rel = self.r_proj(hidden_states).view(b, length, self.num_heads, -1) @ self.rel_logits_proj.proj  # (B, L, H, E)
        starts, within, _ = document_places(mesh, info, hidden_states.device)
        if not self.is_sliding and self.config.log_scaling_n_floor is not None:  # in float32, as transformers does
            tau = 1.0 + self.config.log_scaling_alpha * torch.log(
                ((within + 1).float() / self.config.log_scaling_n_floor).clamp(min=1.0))  # (L,)
            query = (query.float() * tau[:, None]).to(query.dtype)
            rel = (rel.float() * tau[:, None, None]).to(rel.dtype)
        row_k, row_v = whole_row(key, mesh, info), whole_row(value, mesh, info)  # (B, T, Hkv, D)
        return self.o_proj(attend_row(self, query, rel, row_k, row_v, starts, within).reshape(b, length, -1)), None

    return forward


def install(layers: list[nn.Module], mesh: SPMesh) -> None:
    """Give ``layers`` (from :func:`relative_attention_layers`) the sequence-parallel forward; the class untouched."""
    replace_forward(layers, _make_attention_forward(mesh), _ATTR)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the class's own forward again."""
    restore_forward(model, _ATTR)
