"""xLSTM's mLSTM layers (transformers' ``xlstm``) run sequence-parallel, exactly.

An mLSTM layer is per token but for its matrix memory, per head::

    q, k, v, gates = projections of x                                  per token (the gates soft-capped)
    m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)                           the stabiliser (log scale)
    C_t = e^{logsigmoid(f_t) + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T      (scaled by e^{-m_t})
    n_t = the same with k_t
    h_t = (q_t C_t) / (max(|q_t . n_t|, e^{-m_t}) + eps)               then the heads' norm, the output gate

The memory is affine in the entering state and the output a ratio, as RWKV's: the runs pass their final
``(C, n, m)`` and total log forget gate in log space (:func:`seqmesh.linear_attention.passing.rerun_states`), each
run that receives a state is run again from it, and the stabiliser combines as transformers' own recurrence
(``max(m_in + F, m_0)``), so the state each run enters is the one the whole sequence gives it: a run that receives
a state is first run from an empty one (``m = -1e38``: only its own tokens in ``m_0``), a run that starts a
document from transformers' (``m = 0``). Both runs go through the layer's own backend (its chunkwise kernel over
whole chunks, its recurrent kernel for the rest, states in ``inference_state_dtype``).

Packed documents restart the memory at each (transformers, given a packed row, would carry it across); tensor
parallelism, generation and a state passed in are refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..linear_attention.passing import rerun_states
from ..mesh import SPMesh
from .indexed_layouts import module_function
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

_PARTS = ("mlstm_backend", "multihead_norm", "out_proj", "ogate_act_fn", "config")
_NONE = -1e38  # the stabiliser of an empty memory


def is_mlstm_layer(module: nn.Module) -> bool:
    """Whether ``module`` is an xLSTM mLSTM layer with its parts where expected."""
    return type(module).__name__ == "xLSTMLayer" and all(hasattr(module, p) for p in _PARTS)


def xlstm_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The mLSTM layers of ``model`` (path, module), checked: a design name seqmesh does not know, and tensor
    parallelism, raise a ValueError."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if is_mlstm_layer(m)]
    refuse_tensor_parallel(layers, mesh, "is an mLSTM layer, whose heads seqmesh's tensor parallelism does not split")
    return layers


def _projections(module: nn.Module, x: torch.Tensor):
    """q, k, v (B, H, L, D), the input and forget gates' preactivations (B, H, L) and the output gate's (B, L, V) of
    ``x`` (B, L, E), as the layer computes them."""
    config, b, length = module.config, x.shape[0], x.shape[1]
    soft_cap = module_function(module, "soft_cap")
    if config.weight_mode == "single":
        query, key, value, o_preact = module.q(x), module.k(x), module.v(x), module.ogate_preact(x)
        i_preact = soft_cap(module.igate_preact(x), cap_value=config.gate_soft_cap)
        f_preact = soft_cap(module.fgate_preact(x), cap_value=config.gate_soft_cap)
    else:
        query, key, value, o_preact = torch.tensor_split(
            module.qkv_opreact(x), (module.qk_dim, 2 * module.qk_dim, 2 * module.qk_dim + module.v_dim), dim=-1)
        i_preact, f_preact = torch.tensor_split(soft_cap(module.ifgate_preact(x), cap_value=config.gate_soft_cap),
                                                (config.num_heads,), dim=-1)
    heads = lambda t: t.reshape(b, length, config.num_heads, -1).transpose(1, 2)  # noqa: E731
    return heads(query), heads(key), heads(value), i_preact.transpose(1, 2), f_preact.transpose(1, 2), o_preact


def mlstm_state_passing(module: nn.Module, query, key, value, igate, fgate, place: halo.Placement) -> torch.Tensor:
    """The memory's outputs of the whole sequence at this rank's tokens: q, k, v (B, H, L, D) and the gates
    (B, H, L) in shard order -> h (B, H, L, Dv). One all-gather of every run's ``[C0 | n0 | m0 | F]`` forward."""
    b, h, _, dk = key.shape
    dv = value.shape[-1]
    bounds = place.mine.segment_bounds
    incoming = set(place.mine.incoming)
    backend = module.mlstm_backend
    dtype = torch.promote_types(key.dtype, torch.float32)  # the states' (float32 at least, as transformers keeps them)

    def run(a: int, e: int, state: tuple | None):
        c, n, m = state if state is not None else (None, None, None)
        return backend(query[:, :, a:e], key[:, :, a:e], value[:, :, a:e], igate[:, :, a:e], fgate[:, :, a:e],
                       c_initial=c, n_initial=n, m_initial=m, return_last_states=True, mode="inference")

    outs, finals = [], []
    for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if i in incoming:  # its own tokens only (m from -1e38); its outputs come from the rerun
            states = (key.new_zeros(b, h, dk, dv, dtype=dtype), key.new_zeros(b, h, dk, dtype=dtype),
                      key.new_full((b, h, 1), _NONE, dtype=dtype))
            out, (c, n, m) = run(a, e, states)
            forget = F.logsigmoid(fgate[:, :, a:e].to(dtype)).sum(-1, keepdim=True)  # (B, H, 1)
        else:  # a document's start: transformers' own zero state
            out, (c, n, m) = run(a, e, None)
            forget = m.new_full(m.shape, _NONE)
        outs.append(out)
        finals.append(torch.cat([c.flatten(2), n, m, forget], dim=-1).flatten(1).to(dtype))  # (B, H (Dk Dv + Dk + 2))
    width = dk * dv + dk

    def unpack(row: torch.Tensor, extra: int):
        parts = row.view(b, h, width + extra)
        return parts[..., :dk * dv].reshape(b, h, dk, dv), parts[..., dk * dv:width], parts[..., width:]

    def carry(packed: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # [C0|n0|m0|F], [C|n|m] -> [C|n|m]
        c0, n0, tail = unpack(packed, 2)
        m0, forget = tail[..., :1], tail[..., 1:]
        c, n, m = unpack(state, 1)
        moved = m + forget
        top = torch.maximum(moved, m0)
        old, new = torch.exp(moved - top), torch.exp(m0 - top)
        return torch.cat([(old[..., None] * c + new[..., None] * c0).flatten(2), old * n + new * n0, top],
                         dim=-1).flatten(1)

    def rerun(segment: int, state: torch.Tensor) -> torch.Tensor:
        c, n, m = unpack(state, 1)
        return run(bounds[segment], bounds[segment + 1], (c, n, m))[0]

    empty = torch.zeros(b, h * (width + 1), dtype=dtype, device=key.device)  # transformers' zero state
    done = rerun_states(torch.cat(outs, 2).transpose(1, 2), torch.stack(finals, 1), place, empty, carry=carry,
                        rerun=lambda segment, state: rerun(segment, state).transpose(1, 2))
    return done.transpose(1, 2)


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    def forward(self, x: torch.Tensor, state=None, **kwargs):
        # x (B, L, E) in shard order -> ((B, L, E), None)
        info = kwargs.get("seqmesh")
        if state is not None and info is not None and not self.training:
            raise ValueError(f"{type(self).__name__} was given its memory by the model: an evaluating xLSTMModel runs "
                             f"a call longer than max_inference_chunksize ({self.config.max_inference_chunksize}) in "
                             "pieces with a cache, which seqmesh does not; raise config.max_inference_chunksize above "
                             f"this rank's {x.shape[1]} tokens, or evaluate in training mode (model.train()).")
        check_mixer_context(self, info, state, None)
        place = halo.placement(mesh, x.shape[1], layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens)
        query, key, value, igate, fgate, o_preact = _projections(self, x)
        out = mlstm_state_passing(self, query, key, value, igate, fgate, place)  # (B, H, L, Dv)
        b, length = x.shape[:2]
        normed = self.multihead_norm(out.transpose(1, 2)).reshape(b, length, -1)
        return self.out_proj(self.ogate_act_fn(o_preact) * normed), None

    return forward


KIND = MixerKind("mLSTM", (), xlstm_layers, _make_forward)
