"""Async Ulysses for transformers' attention modules: the projections overlapped with the all-to-alls.

The attention interface that ``parallelize`` swaps is called after transformers has projected q, k and
v, so overlapping the projections with the all-to-alls needs the module's whole forward. ``install``
gives each attention module of a known family an instance-level ``forward`` (the class and transformers'
code are untouched; ``uninstall`` deletes it again) that runs the module's own layers, in pieces of
tokens, through ``seqmesh.sharded_attention.api.projected_attention``:

    q_proj, k_proj, v_proj -> per-head q_norm / k_norm (Qwen3, Gemma 3) -> the family's own
    apply_rotary_pos_emb -> [all-to-all, attention (window, sinks, documents), inverse all-to-all] -> o_proj

Families whose attention forward is exactly that are listed in ``ASYNC_FAMILIES``; every other attention
module (fused qkv projections, MLA, gated attention outputs, vision towers) is refused by name before any
work, as is tensor parallelism (its column-wise projections run inside DTensor regions).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..rules.overlap import ASYNC_PIECES
from ..sequence.batch import SequenceInfo
from ..sharded_attention.api import projected_attention

_ATTR = "_seqmesh_async_ulysses"


def is_async(module: nn.Module) -> bool:
    """Whether ``module``'s attention forward is the async Ulysses one (``parallelize(..., async_ulysses=True)``)."""
    return hasattr(module, _ATTR)

# attention classes whose forward is q/k/v_proj, optional per-head q/k norms, apply_rotary_pos_emb, the attention
# interface, o_proj (checked against transformers 5.15 and 5.24); the value says where the window comes from
ASYNC_FAMILIES = {
    "LlamaAttention": None,
    "MistralAttention": "config",  # getattr(config, "sliding_window"), every layer
    "Qwen2Attention": "layer",  # self.sliding_window: None on full-attention layers
    "Qwen3Attention": "layer",
    "Qwen3MoeAttention": "layer",
    "GptOssAttention": "layer",
    "Gemma3Attention": "layer",
}


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that compute attention (class name ending in ``Attention``, the outermost)."""
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__.endswith("Attention")]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]


def check_async(model: nn.Module, mesh: SPMesh) -> list[tuple[str, nn.Module]]:
    """The attention modules async Ulysses runs; a ValueError naming the model, the layer and the fix for
    anything it would not compute exactly. Raises before anything is changed."""
    name = type(model).__name__
    if getattr(mesh, "tp", 1) > 1:
        raise ValueError(f"async Ulysses with tensor parallelism (tp={mesh.tp}) is not supported for {name}: the q/k/v "
                         "projections are column-wise DTensor regions there. Use tp=1 or turn async_ulysses off "
                         "(--async-ulysses removed).")
    modules = attention_modules(model)
    for path, module in modules:
        cls = type(module).__name__
        if cls not in ASYNC_FAMILIES:
            raise ValueError(f"async Ulysses cannot run {name}: {path} is a {cls}, whose forward it does not reproduce "
                             f"(it knows {', '.join(ASYNC_FAMILIES)}; fused q/k/v projections, MLA and gated outputs are "
                             "not among them). Turn async_ulysses off (--async-ulysses removed) for this model.")
        head_dim = module.head_dim
        for norm in ("q_norm", "k_norm"):
            weight = getattr(getattr(module, norm, None), "weight", None)
            if weight is not None and weight.numel() != head_dim:
                raise ValueError(f"async Ulysses cannot run {name}: {path}.{norm} normalizes {weight.numel()} features, "
                                 f"not one head ({head_dim}); turn async_ulysses off for this model.")
        if not hasattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb"):
            raise ValueError(f"async Ulysses cannot run {name}: {cls}'s module has no apply_rotary_pos_emb; turn "
                             "async_ulysses off for this model.")
    if not modules:
        raise ValueError(f"async Ulysses found no attention module in {name}; turn async_ulysses off.")
    return modules


def _make_forward(mesh: SPMesh, backend: str, pieces: int):
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        # hidden_states (B, L, E) -> ((B, L, E), None)
        info: SequenceInfo | None = kwargs.get("seqmesh")
        if info is None:
            raise ValueError(f"{type(self).__name__} runs async Ulysses but was called without the 'seqmesh' entry; call "
                             "the model with the batch returned by seqmesh.shard_batch (model(**batch)), or "
                             "seqmesh.hf.unparallelize(model) first.")
        cache = next((kwargs[n] for n in ("cache", "past_key_values") if kwargs.get(n) is not None), None)
        if cache is not None:
            raise ValueError(f"{type(self).__name__} runs sequence-parallel and keeps no cache, but was given a "
                             f"{type(cache).__name__}: call the model without one (leave use_cache unset).")
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} received an attention mask of shape {tuple(attention_mask.shape)}; "
                             "seqmesh describes padding and packed documents through shard_batch instead.")
        if self.training and self.attention_dropout:
            raise ValueError(f"attention dropout ({self.attention_dropout}) is not supported by seqmesh; set "
                             "attention_dropout=0.")
        rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
        cos, sin = position_embeddings  # (B, L, rotary dim) each

        def project(x: torch.Tensor, tokens: slice):  # x (B, l, E) -> q (B, l, Hq, D), k, v (B, l, Hk, D)
            heads = (*x.shape[:2], -1, self.head_dim)
            q, k, v = self.q_proj(x).view(heads), self.k_proj(x).view(heads), self.v_proj(x).view(heads)
            if getattr(self, "q_norm", None) is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos[:, tokens], sin[:, tokens])  # (B, H, l, D)
            return q.transpose(1, 2), k.transpose(1, 2), v

        def output(o: torch.Tensor) -> torch.Tensor:  # (B, l, Hq, D) -> (B, l, E)
            return self.o_proj(o.reshape(*o.shape[:2], -1))

        source = ASYNC_FAMILIES[type(self).__name__]
        window = {None: None, "config": getattr(self.config, "sliding_window", None),
                  "layer": getattr(self, "sliding_window", None)}[source]
        out = projected_attention(
            hidden_states, project, output, mesh, pieces=pieces, causal=getattr(self, "is_causal", True),
            layout=info.layout, cu_seqlens=info.cu_seqlens, seq_len=info.seq_len if info.cu_seqlens is None else None,
            softmax_scale=self.scaling, backend=backend, validate=id(mesh) not in info.validated, window=window,
            sinks=getattr(self, "sinks", None), image_blocks=info.image_blocks,
        )
        info.validated.add(id(mesh))
        return out, None

    return forward


def install(modules: list[tuple[str, nn.Module]], mesh: SPMesh, backend: str, pieces: int = ASYNC_PIECES) -> int:
    """Give ``modules`` (from :func:`check_async`) the async Ulysses forward; returns how many."""
    if pieces < 1:
        raise ValueError(f"async_pieces={pieces}: async Ulysses needs at least 1 piece of tokens per layer.")
    for _, module in modules:
        module.forward = types.MethodType(_make_forward(mesh, backend, pieces), module)
        setattr(module, _ATTR, True)
    return len(modules)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the class's own forward again."""
    for module in model.modules():
        if getattr(module, _ATTR, False):
            del module.forward
            delattr(module, _ATTR)
