"""RecurrentGemma's recurrent blocks (Griffin's and Hawk's RG-LRU) run sequence-parallel, exactly.

The block, per token but for one depthwise causal conv of width ``K`` (``config.conv1d_width``) and the
RG-LRU's diagonal recurrence::

    y = act(linear_y(h))                                  (B, L, W) per token
    x = conv(linear_x(h))                                 depthwise, causal, with bias: reads K - 1 earlier tokens
    i, r = sigmoid(x W_i + b_i), sigmoid(x W_r + b_r)     block-diagonal gates, per token
    log a = -8 r softplus(c)                              (B, L, W), <= 0
    u = x i sqrt(1 - a^2)       (u = x i at position 0)   per token
    s_t = a_t s_{t-1} + u_t                               from zero at each document's start
    out = linear_out(s y)

The conv runs with its halo (:func:`seqmesh.linear_attention.halo.halo_causal_conv`, one all-gather) and the
recurrence by state passing (:func:`seqmesh.linear_attention.selective_scan.state_passing_diagonal_scan`, one
all-gather of every run's ``[S_0 | T]``, ``2 W`` values a row); everything else is per token. The recurrence runs
in float32 for half-precision inputs (transformers' own ``acc_dtype``), otherwise in the inputs' dtype. Every
``linear_attention`` design name runs state passing (an all-to-all by channels would also need the gates' input
after the exchange; not built).

transformers resets the state where ``position_ids == 0``; seqmesh restarts it at every document of
``shard_batch`` (whose documents begin where the positions do not count on, so at every 0 and more), as one model
call per document does. The square root keeps the family's own bounded derivative (its
``SqrtBoundDerivative``, looked up in the layer's own module).

``parallelize`` gives each block an instance-level ``forward`` (the class and transformers' code untouched);
``unparallelize`` deletes it. Tensor parallelism is refused by name: seqmesh does not split the block's gates.

Generation (``seqmesh.inference``): the prompt's prefill runs as above and leaves, on every rank, the state after the
prompt's last token and the conv's last ``K - 1`` inputs (one all-reduce each); each decode step then runs the same
token on every rank from them (:func:`rg_lru_step`), and nothing is sent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention import halo
from ..linear_attention.choice import parse_design
from ..linear_attention.decode import conv_step, last_token_keep, sequence_tail
from ..linear_attention.gated_delta import compute_dtype
from ..linear_attention.selective_scan import state_passing_diagonal_scan
from ..mesh import SPMesh
from .mixer_kind import Layers, MixerKind, check_mixer_context, refuse_tensor_parallel

BLOCKS = ("RecurrentGemmaRecurrentBlock",)  # whose forward this module follows
_PARTS = ("linear_x", "linear_y", "linear_out", "conv_1d", "rg_lru", "act_fn")
_LRU_PARTS = ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
              "recurrent_gate_bias")


def is_rg_lru_block(module: nn.Module) -> bool:
    """Whether ``module`` is one of :data:`BLOCKS` with its parts where expected."""
    return (type(module).__name__ in BLOCKS and all(hasattr(module, p) for p in _PARTS)
            and all(hasattr(module.rg_lru, p) for p in _LRU_PARTS))


def rg_lru_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> Layers:
    """The RG-LRU blocks of ``model`` (path, module), checked: a ValueError for a design name seqmesh does not
    know, and for tensor parallelism."""
    parse_design(design)
    layers = [(path, m) for path, m in model.named_modules() if is_rg_lru_block(m)]
    refuse_tensor_parallel(layers, mesh, "is an RG-LRU block, whose block-diagonal gates seqmesh's tensor parallelism "
                           "does not split")
    return layers


def _gates(lru: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and recurrence gates (B, L, W) of the conv's output ``x`` (B, L, W): one block-diagonal matrix
    per head, as the layer computes them."""
    b, n, width = x.shape
    heads = lru.input_gate_weight.shape[0]
    by_head = x.reshape(b * n, heads, width // heads).transpose(0, 1)  # (H, B L, W / H)

    def gate(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], by_head, weight).transpose(0, 1).reshape(b, n, width))

    return gate(lru.input_gate_weight, lru.input_gate_bias), gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)


def _recurrence_inputs(lru: nn.Module, x: torch.Tensor,
                       position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log a`` and the gated, normalised input (B, L, W), in the recurrence's dtype, of the conv's output ``x``
    (B, L, W) at ``position_ids`` (B, L)."""
    input_gate, recurrent_gate = _gates(lru, x)
    log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param)  # (B, L, W)
    bounded_sqrt = sys.modules[type(lru).__module__].SqrtBoundDerivative.apply
    reset = (position_ids == 0)[:, :, None]
    multiplier = torch.where(reset, torch.ones_like(log_a), bounded_sqrt(1 - torch.exp(2 * log_a)))
    dtype = compute_dtype(x.dtype)
    return log_a.to(dtype), (x * input_gate * multiplier.to(x.dtype)).to(dtype)


def rg_lru_block(module: nn.Module, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                 place: halo.Placement, keep: dict | None = None) -> torch.Tensor:
    """The block at this rank's tokens: ``hidden_states`` (B, L, D) and ``position_ids`` (B, L) in shard order ->
    (B, L, D). ``keep`` (a prefill's): as :func:`state_passing_diagonal_scan`'s, and ``keep["conv_in"]``, the conv's
    input (B, L, W)."""
    y = module.act_fn(module.linear_y(hidden_states))  # (B, L, W)
    weight = module.conv_1d.weight.squeeze(1)  # (W, 1, K) -> (W, K)
    conv_in = module.linear_x(hidden_states)
    x = halo.halo_causal_conv(conv_in, weight, module.conv_1d.bias, place, activation=None)
    states = state_passing_diagonal_scan(*_recurrence_inputs(module.rg_lru, x, position_ids), place, keep=keep)
    if keep is not None:
        keep["conv_in"] = conv_in
    return module.linear_out(states.to(x.dtype) * y)


def rg_lru_step(module: nn.Module, hidden_states: torch.Tensor, position_ids: torch.Tensor, state: torch.Tensor,
                tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens on every rank alike (one in generation's decode; a chunk's every token in a prefill onto a kept cache):
    ``hidden_states`` (B, T, D) at ``position_ids`` (B, T), from ``state`` (B, W) and the conv's last ``K - 1`` inputs
    ``tail`` (B, K - 1, W) -> (out (B, T, D), the state after them, the next tail)."""
    y = module.act_fn(module.linear_y(hidden_states))
    x, tail = conv_step(tail, module.linear_x(hidden_states), module.conv_1d.weight.squeeze(1), module.conv_1d.bias, None)
    log_a, gated = _recurrence_inputs(module.rg_lru, x, position_ids)
    states = []
    for t in range(hidden_states.shape[1]):
        state = torch.exp(log_a[:, t]) * state.to(log_a.dtype) + gated[:, t]
        states.append(state)
    return module.linear_out(torch.stack(states, dim=1).to(x.dtype) * y), state, tail


def _make_forward(module: nn.Module, mesh: SPMesh, design: str) -> Callable:
    kernel = module.conv_1d.weight.shape[-1]

    def forward(self, input_states: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, use_cache=False,
                **kwargs) -> tuple[torch.Tensor, None]:
        info = kwargs.get("seqmesh")
        # attention_mask is the decoder's causal mask for its attention blocks, which transformers' block ignores too
        check_mixer_context(self, info, kwargs.get("cache"), None)
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token from the state the prefill left
            out, state, tail = rg_lru_step(self, input_states, position_ids, *generation.get(self))
            generation.put(self, state, tail)
            return out, None
        if generation is not None and generation.extension is not None:  # new tokens whole, from the kept state
            def run(hidden_all: torch.Tensor, positions_all: torch.Tensor) -> torch.Tensor:
                out, state, tail = rg_lru_step(self, hidden_all, positions_all, *generation.get(self))
                generation.put(self, state, tail)
                return out

            return generation.whole(run, input_states, position_ids), None
        place = halo.placement(mesh, input_states.shape[1], layout=info.layout, seq_len=info.seq_len,
                               cu_seqlens=info.cu_seqlens, kernel=kernel)
        # the prompt by state passing, which leaves the final state on every rank
        keep = last_token_keep(mesh, layout=info.layout, seq_len=info.seq_len) if generation is not None else None
        out = rg_lru_block(self, input_states, position_ids, place, keep)
        if keep is not None:
            generation.put(self, keep["state"], sequence_tail(keep["conv_in"], mesh, layout=info.layout,
                                                              seq_len=info.seq_len, width=kernel - 1))
        return out, None

    return forward


KIND = MixerKind("RG-LRU", ("linear_attention",), rg_lru_layers, _make_forward)
