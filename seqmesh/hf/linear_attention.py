"""transformers' Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid) run sequence-parallel.

These layers do not go through the attention interface, so ``parallelize`` gives each one an
instance-level ``forward`` (the class and transformers' code are untouched) and ``unparallelize``
deletes it again. The new forward keeps the layer's own projections, gated norm and output
projection, which act per token on the local shard, and replaces the conv and the recurrence by
one of the two sequence-parallel designs (``design``: ``all_to_all``, ``state_passing`` or ``auto``, which
:func:`seqmesh.linear_attention.choice.choose_design` resolves per call from the shapes). It reads the sequence from the ``seqmesh`` entry
of ``shard_batch`` that the decoder layers pass down in their kwargs.

A layer with recurrent state that seqmesh does not know (Mamba mixers, other linear attentions) would,
run on a shard, silently compute another recurrence: the one check of
:func:`seqmesh.hf.layers.check_layers` refuses such models before anything is changed, given the
layers found here as the ones seqmesh handles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..linear_attention.choice import LinearDesign, LinearShape, choose_design, parse_design
from ..linear_attention.sequence_parallel import GateParams, LinearHeads, sequence_parallel_gated_delta
from ..linear_attention.decode import decode_gated_delta, sequence_tail
from ..linear_attention.state_passing import state_passing_gated_delta
from ..mesh import SPMesh
from .mixer_kind import MixerKind, check_mixer_context


Projection = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _split_projections(m: nn.Module, x: torch.Tensor):
    """Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
    return m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)


def _fused_projections(m: nn.Module, x: torch.Tensor):
    """Qwen3-Next: in_proj_qkvz and in_proj_ba, interleaved per key head (the layer's own reordering)."""
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    mixed = torch.cat([t.reshape(*x.shape[:2], -1) for t in (q, k, v)], dim=-1)
    return mixed, z, b, a


def _separate_projections(m: nn.Module, x: torch.Tensor):
    """OLMo-hybrid: q_proj, k_proj, v_proj, g_proj (the gate), b_proj, a_proj."""
    mixed = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
    return mixed, m.g_proj(x), m.b_proj(x), m.a_proj(x)


def _projection(module: nn.Module) -> Projection | None:
    if not type(module).__name__.endswith("GatedDeltaNet"):
        return None
    if hasattr(module, "in_proj_qkv") and hasattr(module, "in_proj_z"):
        return _split_projections
    if hasattr(module, "in_proj_qkvz") and hasattr(module, "fix_query_key_value_ordering"):
        return _fused_projections
    if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")):
        return _separate_projections
    return None


def gated_delta_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> list[tuple[str, nn.Module]]:
    """The Gated DeltaNet layers of ``model`` that seqmesh runs sequence-parallel; a ValueError for heads
    the all-to-all design (when named) cannot split. Every other token mixer is left to ``check_layers``."""
    design = parse_design(design)
    layers = [(name, m) for name, m in model.named_modules() if _projection(m) is not None]
    for _, module in layers:
        if design is LinearDesign.ALL_TO_ALL:
            _heads(module, mesh)  # raises if P exceeds the value heads
    return layers


def _heads(module: nn.Module, mesh: SPMesh) -> LinearHeads:
    if mesh.sp_size > module.num_v_heads:  # the message names the other design
        choose_design(_shape(module, mesh, 1, 1, torch.float32), LinearDesign.ALL_TO_ALL)
    return LinearHeads(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim, mesh.sp_size)


def _shape(module: nn.Module, mesh: SPMesh, seq_len: int, batch: int, dtype: torch.dtype, layout: str = "zigzag"):
    return LinearShape(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                       module.conv1d.weight.shape[-1], seq_len, batch, mesh.ulysses, mesh.ring, layout,
                       torch.finfo(dtype).bits // 8, 8 if dtype == torch.float64 else 4)


def _make_forward(mesh: SPMesh, project: Projection, design: LinearDesign):
    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs) -> torch.Tensor:
        info = kwargs.get("seqmesh")
        cache = cache_params if cache_params is not None else kwargs.get("cache")  # its name from transformers 5.2x
        check_mixer_context(self, info, cache, attention_mask)
        b, n, _ = hidden_states.shape
        mixed, z, beta_in, a_in = project(self, hidden_states)  # (B, L, conv_dim), (B, L, Hv*Dv), (B, L, Hv) x 2
        params = GateParams(self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.dt_bias, self.activation,
                            2.0 if getattr(self, "allow_neg_eigval", False) else 1.0)
        packed = torch.cat([mixed, beta_in, a_in], dim=-1)
        whole = LinearHeads(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, 1)
        generation = getattr(info, "recurrent_state", None)  # seqmesh.inference's entries: a prefill, or a decode step
        if generation is not None and generation.decoding:  # one token from the state the prefill left
            core, state, tail = decode_gated_delta(packed, params, whole, *generation.get(self))
            generation.put(self, state, tail)
        elif generation is not None and generation.extension is not None:  # new tokens whole, from the kept state
            def run(chunk: torch.Tensor) -> torch.Tensor:
                out, state, tail = decode_gated_delta(chunk, params, whole, *generation.get(self))
                generation.put(self, state, tail)
                return out

            core = generation.whole(run, packed)
        elif generation is not None:  # the prompt by state passing, which leaves the final state on every rank
            keep: dict = {}
            core = state_passing_gated_delta(packed, params, whole, mesh, layout=info.layout, seq_len=info.seq_len,
                                             cu_seqlens=info.cu_seqlens, keep=keep)
            width = self.conv1d.weight.shape[-1] - 1
            generation.put(self, keep["state"], sequence_tail(mixed, mesh, layout=info.layout, seq_len=info.seq_len,
                                                              width=width))
        else:
            chosen = choose_design(_shape(self, mesh, info.seq_len, b, mixed.dtype, info.layout), design)
            if chosen is LinearDesign.STATE_PASSING:
                run, heads = state_passing_gated_delta, whole
            else:
                run, heads = sequence_parallel_gated_delta, _heads(self, mesh)
            core = run(packed, params, heads, mesh, layout=info.layout, seq_len=info.seq_len,  # (B, L, Hv, Dv)
                       cu_seqlens=info.cu_seqlens)
        norm = self.norm if hasattr(self, "norm") else self.o_norm
        out = norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(b, n, -1)
        return (self.out_proj if hasattr(self, "out_proj") else self.o_proj)(out)

    return forward


def _forward_for(module: nn.Module, mesh: SPMesh, design: str):
    return _make_forward(mesh, _projection(module), parse_design(design))


KIND = MixerKind("Gated DeltaNet", ("linear_attention",), gated_delta_layers, _forward_for)
