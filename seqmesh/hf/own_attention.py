"""transformers' attention layers that compute their attention themselves, outside transformers'
``AttentionInterface``, run sequence-parallel, exactly: BLOOM's and MPT's ALiBi attention, Falcon's rotary
attention, GPT-Neo's global and local attention, the original GPT's (OpenAI-GPT), XGLM's and GPT-NeoX-Japanese's
(its partial rotary), Doge's (its dynamic mask a bias of each key, folded into the keys), the BERT-style
self-attention of RemBERT, MegatronBERT, RoFormer and BigBird's full attention (causal where the config says
``is_decoder``; RoFormer's rotary at the table its encoder is given), and the decoders' of TrOCR and MVP.

``parallelize`` gives each such layer an instance-level ``forward`` (the class and transformers' code untouched;
``unparallelize`` deletes it) that keeps the layer's own projections and calls :func:`seqmesh.attention`::

    q, k, v = the layer's projections of hidden_states       (B, L, Hq, D), (B, L, Hk, D) x 2, per token
    q, k = the family's rotary at the model's position_embeddings (Falcon: from the batch's global position_ids)
    o = seqmesh.attention(q, k, v, scale, window, alibi=slopes)   ALiBi: each score - slope_h * distance
                                                                  window: GPT-Neo's local layers
    out = the layer's output projection of o (BLOOM: + residual)

ALiBi (BLOOM, MPT): the model builds ``slope * key position`` for the local tokens (a bias by distance up to a
constant per row, which the softmax does not see); seqmesh takes the family's own slopes (BLOOM's
``build_alibi_tensor``, MPT's ``build_mpt_alibi_tensor``, read once at two positions) and ignores the model's
bias. MPT's bias stops at ``config.max_seq_len`` positions; seqmesh's continues by the same rule. Falcon with
``alibi=True`` is refused: transformers rounds its bias (slope x position) to bfloat16, which depends on the
position itself, not the distance. While the model is parallelized its config names seqmesh's attention
implementation where that keeps the model from building an (L, L) causal mask (BLOOM, Falcon, GPT-Neo; MPT, XGLM and
the others that build their mask whatever the config names are handed one element instead: :func:`token_mask`), and
a padding mask given to the decoder is refused.

The entry reaches these layers as it reaches a layer that calls the interface without passing it on
(``seqmesh.hf._hook_entry``): these models call their blocks, and the blocks their attention, without
``**kwargs``. Tensor parallelism and attention dropout are refused by name. The layers attend with ``parallelize``'s
``backend`` (installed with it as the kind's design); the math kernel, the CPU flash op (fp32 and fp64) and on CUDA
seqmesh's Triton flash kernel (``triton_flash``) compute the ALiBi bias (``seqmesh.kernels.base.BlockMask.alibi``), so
an ALiBi model's ``backend`` is one of those or ``auto``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mesh import SPMesh
from ..rules.degrees import workable_degrees
from ..rules.own_attention import LAYER_CLASSES, doge_window_problem, tensor_parallel_refusal
from ..sharded_attention.api import attention
from ..tensor_values import real_tensors
from .layers import OWN_ATTENTION as NAME
from .mixer_kind import MixerKind, check_mixer_context

# the kernels that compute ALiBi's bias (the CPU op: fp32, fp64; the Triton kernel: CUDA)
ALIBI_BACKENDS = ("auto", "math", "cpu_flash", "triton_flash")


@dataclass(frozen=True)
class _Family:
    heads: Callable[[nn.Module], int]
    slopes: Callable[[nn.Module, int], torch.Tensor] | None  # (module, heads) -> (heads,) ALiBi's; None: no ALiBi
    dropout: Callable[[nn.Module], float]  # the attention dropout the layer would apply
    project: Callable  # (module, hidden_states) -> q (B, L, Hq, D), k, v (B, L, Hk, D)
    scale: Callable[[nn.Module], float]
    output: Callable  # (module, o (B, L, Hq * D), the layer's call's other arguments) -> the layer's result
    own_mask: bool = False  # the model builds its causal mask whatever the config names (MPT): the layer ignores it
    # (module, q, k (B, L, H, D), cos, sin) -> q, k rotated as the family does at the call's position_embeddings
    rotate: Callable | None = None
    window: Callable[[nn.Module], int | None] = lambda m: None  # a local layer's causal window (GPT-Neo)
    # (module, q, k, v, info) -> q, k, v after the rotary: Doge's bias per key folded into one more head channel
    fold: Callable | None = None
    refused: Callable[[nn.Module], str | None] = lambda m: None  # why a layer of the family is not computed
    # (module, the layer's call's other positional arguments) -> False: every token sees every other (an encoder's)
    causal: Callable[[nn.Module, tuple], bool] = lambda m, args: True
    # (module, q, k, v (B, L, H, D), the call's kwargs) -> q, k, v: a rotary whose table the layer is given as an
    # argument (RoFormer's sinusoidal_pos, made by its encoder at the tokens' positions)
    rotate_given: Callable | None = None
    # the model makes an empty cache on every call and hands it to each layer (XLM; a caller's is refused before, at
    # the model's call: seqmesh.hf.xlm): ignored while it is empty
    makes_cache: bool = False


def _family_function(module: nn.Module, name: str) -> Callable:
    return getattr(sys.modules[type(module).__module__], name)


def _bloom_slopes(module: nn.Module, heads: int) -> torch.Tensor:
    # (B * H, 1, S) = slope * position; at position 1 the slope itself
    return _family_function(module, "build_alibi_tensor")(torch.ones(1, 2), heads, torch.float64)[:, 0, 1]


def _bloom_project(module: nn.Module, hidden: torch.Tensor):
    b, n, _ = hidden.shape
    fused = module.query_key_value(hidden).view(b, n, module.num_heads, 3, module.head_dim)  # heads interleaved
    return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]


def _bloom_output(module: nn.Module, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, None]:
    if module.pretraining_tp > 1 and module.slow_but_exact:  # transformers sums the product by slices, without the bias
        dense = nn.functional.linear(o, module.dense.weight)
    else:
        dense = module.dense(o)
    out = nn.functional.dropout(dense, p=module.hidden_dropout, training=module.training)
    return out + residual, None  # BLOOM's dropout_add; no attention weights


def _mpt_slopes(module: nn.Module, heads: int) -> torch.Tensor:
    # (H, 1, S) = slope * (position - S + 1); at position 0 of 2, minus the slope
    return -_family_function(module, "build_mpt_alibi_tensor")(heads, 2)[:, 0, 0].double()


def _mpt_project(module: nn.Module, hidden: torch.Tensor):
    b, n, _ = hidden.shape
    mixed = module.Wqkv(hidden)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    return tuple(t.reshape(b, n, module.n_heads, module.head_dim) for t in mixed.chunk(3, dim=2))


def _falcon_project(module: nn.Module, hidden: torch.Tensor):
    b, n, _ = hidden.shape
    fused, h, d = module.query_key_value(hidden), module.num_heads, module.head_dim
    if module.new_decoder_architecture:  # per kv head: its group of query heads, then its key and its value
        qkv = fused.view(b, n, module.num_kv_heads, h // module.num_kv_heads + 2, d)
        return qkv[..., :-2, :].flatten(2, 3), qkv[..., -2, :], qkv[..., -1, :]
    if module.multi_query:  # the query heads, then one key and one value head
        qkv = fused.view(b, n, h + 2, d)
        return qkv[..., :-2, :], qkv[..., -2:-1, :], qkv[..., -1:, :]
    qkv = fused.view(b, n, h, 3, d)
    return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


def _falcon_refused(module: nn.Module) -> str | None:
    if module.config.alibi:
        return ("Falcon with alibi=True: transformers rounds its bias (slope x key position) to bfloat16, so the bias "
                "depends on the position itself, not only on the distance, and seqmesh would not reproduce it; Falcon "
                "with rotary positions (alibi=False, every released Falcon but the RW models) is exact")
    return None


def _gpt_neo_project(module: nn.Module, hidden: torch.Tensor):
    inner = module.attention  # GPTNeoAttention holds the layer (GPTNeoSelfAttention) and calls it
    shape = (*hidden.shape[:2], inner.num_heads, inner.head_dim)
    return inner.q_proj(hidden).view(shape), inner.k_proj(hidden).view(shape), inner.v_proj(hidden).view(shape)


def _gpt_neo_window(module: nn.Module) -> int | None:
    # a local layer keeps key j for query i when i - j < window_size (its mask: tril XOR tril(-window_size))
    return module.attention.config.window_size if module.attention_type == "local" else None


def _rotate_whole(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos, sin):
    rotate = _family_function(module, "apply_rotary_pos_emb")  # on (B, H, L, D)
    return (t.transpose(1, 2) for t in rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin))


def _rotate_leading(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos, sin):
    """GPT-NeoX-Japanese's partial rotary: the leading ``rotary_ndims`` of each head rotated, the rest passed."""
    r = module.rotary_ndims
    q_rot, k_rot = _rotate_whole(module, q[..., :r], k[..., :r], cos, sin)
    return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:  # (B, L, heads x D) -> (B, L, heads, D)
    return x.view(*x.shape[:2], heads, -1)


def _openai_project(module: nn.Module, hidden: torch.Tensor):
    q, k, v = module.c_attn(hidden).split(module.split_size, dim=2)
    return tuple(_split_heads(t, module.n_head) for t in (q, k, v))


def _xglm_project(module: nn.Module, hidden: torch.Tensor):
    return tuple(_split_heads(proj(hidden), module.num_heads)
                 for proj in (module.q_proj, module.k_proj, module.v_proj))


def _doge_project(module: nn.Module, hidden: torch.Tensor):
    shape = (*hidden.shape[:2], -1, module.head_dim)
    return (module.q_norm(module.q_proj(hidden).view(shape)), module.k_norm(module.k_proj(hidden).view(shape)),
            module.v_proj(hidden).view(shape))


def _doge_fold(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info):
    """Doge's dynamic mask adds to each score a bias of its key alone, ``exp(A softplus(dt_proj(values)))`` per kv
    head; ``(q . k) s + b = ([q, 1] . [k, b / s]) s``, so the bias travels as one more channel of each key (the
    values get a zero channel, cut from the output), through every layout and the cache alike. Past
    ``keep_window_size`` keys Doge keeps only each query's keys of largest bias, which seqmesh does not compute."""
    problem = None if info is None else doge_window_problem(info.seq_len, module.keep_window_size)
    if problem:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}): {problem}.")
    b, n = v.shape[:2]
    dt = torch.exp(module.A * F.softplus(module.dt_proj(v.reshape(b, n, -1))))  # (B, L, Hk): each key's bias
    q = torch.cat([q, q.new_ones(*q.shape[:-1], 1)], dim=-1)
    k = torch.cat([k, (dt / module.scaling).unsqueeze(-1).to(k.dtype)], dim=-1)
    return q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], 1)], dim=-1)


def _neox_japanese_project(module: nn.Module, hidden: torch.Tensor):
    qkv = _split_heads(module.query_key_value(hidden), module.num_attention_heads)  # per head: q, k, v
    return qkv.split(module.head_size, dim=-1)


def _bert_project(module: nn.Module, hidden: torch.Tensor):
    return tuple(_split_heads(proj(hidden), module.num_attention_heads)
                 for proj in (module.query, module.key, module.value))


def _roformer_rotate(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict):
    """RoFormer's rotary at its encoder's table (``sinusoidal_pos``), on the values too where it says so."""
    table = kwargs.get("sinusoidal_pos")
    if table is None:
        return q, k, v
    heads_first = [t.transpose(1, 2) for t in ((q, k, v) if module.rotary_value else (q, k))]  # (B, H, L, D)
    rotated = [t.transpose(1, 2) for t in module.apply_rotary_position_embeddings(table, *heads_first)]
    return (*rotated, v) if len(rotated) == 2 else tuple(rotated)


def _xlm_project(module: nn.Module, hidden: torch.Tensor):
    return tuple(_split_heads(proj(hidden), module.n_heads) for proj in (module.q_lin, module.k_lin, module.v_lin))


def _xlm_causal(module: nn.Module, args: tuple) -> bool:
    # XLM hands each layer its mask: (B, L, L) where the config says causal=True, the keys' (B, L) where not
    return args[0].dim() == 3


# the self-attention of the BERT-style encoders: scores / sqrt(D) over the mask the model builds itself, causal
# where the config says is_decoder (as a causal LM), both ways where not; the layer returns the heads' outputs and
# leaves the projection to its caller
_BERT = _Family(lambda m: m.num_attention_heads, None, lambda m: m.dropout.p, _bert_project,
                lambda m: m.attention_head_size ** -0.5, lambda m, o, residual: (o, None), own_mask=True,
                causal=lambda m, args: bool(m.is_decoder))


FAMILIES: dict[str, _Family] = {
    "BloomAttention": _Family(lambda m: m.num_heads, _bloom_slopes, lambda m: m.attention_dropout.p, _bloom_project,
                              lambda m: m.inv_norm_factor, _bloom_output),
    "MptAttention": _Family(lambda m: m.n_heads, _mpt_slopes, lambda m: m.attn_dropout_p, _mpt_project,
                            lambda m: m.softmax_scale, lambda m, o, residual: (m.out_proj(o), None), own_mask=True),
    # rotary Falcon applies no attention dropout (its alibi branch does)
    "FalconAttention": _Family(lambda m: m.num_heads, None, lambda m: 0.0, _falcon_project, lambda m: m.inv_norm_factor,
                               lambda m, o, residual: (m.dense(o), None), rotate=_rotate_whole,
                               refused=_falcon_refused),
    # GPT-Neo does not scale its scores; its local layers see a causal window
    "GPTNeoAttention": _Family(lambda m: m.attention.num_heads, None, lambda m: m.attention.attn_dropout.p,
                               _gpt_neo_project, lambda m: 1.0,
                               lambda m, o, residual: (m.attention.resid_dropout(m.attention.out_proj(o)), None),
                               window=_gpt_neo_window),
    # the original GPT (its class is named Attention): scores over the causal mask filled with -1e4, which float32's
    # and float64's softmax turn into exact zeros, as the causal mask's -inf
    "openai.Attention": _Family(lambda m: m.n_head, None, lambda m: m.attn_dropout.p, _openai_project,
                                lambda m: (m.split_size // m.n_head) ** -0.5 if m.scale else 1.0,
                                lambda m, o, residual: ([m.resid_dropout(m.c_proj(o))]), own_mask=True),
    # the query scaled before its product (the same values up to rounding); it builds its causal mask itself
    "XGLMAttention": _Family(lambda m: m.num_heads, None, lambda m: m.dropout, _xglm_project, lambda m: m.scaling,
                             lambda m, o, residual: (m.out_proj(o), None), own_mask=True),
    # a bias of each key (its dynamic mask) folded into the keys
    "DogeAttention": _Family(lambda m: m.config.num_attention_heads, None, lambda m: m.attention_dropout, _doge_project,
                             lambda m: m.scaling, lambda m, o, residual: (m.o_proj(o), None), own_mask=True,
                             rotate=_rotate_whole, fold=_doge_fold),
    "GPTNeoXJapaneseAttention": _Family(lambda m: m.num_attention_heads, None, lambda m: m.attention_dropout.p,
                                        _neox_japanese_project, lambda m: 1.0 / m.norm_factor,
                                        lambda m, o, residual: (m.dense(o), None, m.dense_bias), own_mask=True,
                                        rotate=_rotate_leading),
    "RemBertSelfAttention": _BERT,
    "MegatronBertSelfAttention": _BERT,
    # the decoders of TrOCR and MVP: BART's attention of old, the query scaled first (MVP's prompts refused at the call)
    "RoFormerSelfAttention": dataclasses.replace(_BERT, rotate_given=_roformer_rotate),
    # BigBird's full attention (attention_type="original_full"); its block-sparse layers are another class, refused
    "BigBirdSelfAttention": _BERT,
    "TrOCRAttention": _Family(lambda m: m.num_heads, None, lambda m: m.dropout, _xglm_project, lambda m: m.scaling,
                              lambda m, o, residual: (m.out_proj(o), None), own_mask=True),
    # XLM's (its class is named MultiHeadAttention): the query scaled first, the mask its model builds (the padding its
    # model marks from the whole row: seqmesh.hf.xlm) ignored, causal or both ways as the config says
    "xlm.MultiHeadAttention": _Family(lambda m: m.n_heads, None, lambda m: m.dropout, _xlm_project,
                                      lambda m: m.head_dim ** -0.5, lambda m, o, residual: (m.out_lin(o),),
                                      own_mask=True, causal=_xlm_causal, makes_cache=True),
    "MvpAttention": _Family(lambda m: m.num_heads, None, lambda m: m.dropout, _xglm_project, lambda m: m.scaling,
                            lambda m, o, residual: (m.out_proj(o), None), own_mask=True),
}


def family_key(module: nn.Module) -> str | None:
    """``module``'s key in :data:`FAMILIES` (its class name; a class named only ``Attention``: with its family's
    module, ``openai.Attention``), or None."""
    name = type(module).__name__
    if name in FAMILIES:
        return name
    family = type(module).__module__.rsplit(".", 2)[-2] if type(module).__module__.count(".") >= 2 else ""
    return f"{family}.{name}" if f"{family}.{name}" in FAMILIES else None


# families computed as the named transformers release lays them out, refused on older ones: GPT-NeoX-Japanese's
# rotary tables and Doge's dynamic mask read otherwise at 5.15 (a size mismatch; a loss 1.6e-3 off), RemBERT,
# MegatronBERT and RoFormer as decoders attend both ways there (their logits 4.8e-3 and 8.6e-3 from seqmesh's causal
# ones), and no release between was measured
NEWEST_ONLY = {"GPTNeoXJapaneseAttention": "5.24", "DogeAttention": "5.24", "RemBertSelfAttention": "5.24",
               "MegatronBertSelfAttention": "5.24", "RoFormerSelfAttention": "5.24", "BigBirdSelfAttention": "5.24"}


def _too_old(key: str) -> str | None:
    """Why ``key``'s family is refused with the installed transformers, or None."""
    from importlib import metadata

    from ..versions import release

    wanted = NEWEST_ONLY.get(key)
    installed = metadata.version("transformers")
    if wanted is None or release(installed) >= release(wanted):
        return None
    return (f"seqmesh computes {key} as transformers {wanted} lays it out, and this transformers is {installed}, "
            f"whose layout of it differs; upgrade transformers to {wanted} or later")


def own_attention_layers(model: nn.Module, mesh: SPMesh, design: str = "auto") -> list[tuple[str, nn.Module]]:
    """The attention layers of ``model`` that seqmesh runs itself (path, module), checked for ``mesh``: tensor
    parallelism, too few heads for the Ulysses degree, attention dropout and a variant seqmesh does not compute are
    refused here, naming the fix. ``design`` does not apply."""
    layers = [(path, m) for path, m in model.named_modules() if family_key(m) is not None]
    if not layers:
        return []
    path, first = layers[0]
    family, cls = FAMILIES[family_key(first)], family_key(first)
    reason = _too_old(cls) or family.refused(first)
    if reason:
        raise ValueError(f"seqmesh cannot run {path} ({cls}) exactly: {reason}.")
    if getattr(mesh, "tp", 1) > 1:
        family_type = next(t for t, c in LAYER_CLASSES.items() if c == cls)
        raise ValueError(f"{path} ({cls}): {tensor_parallel_refusal(family_type)}; train this model with tp=1 (its "
                         "sequence parallelism is exact).")
    heads = family.heads(first)
    if mesh.ulysses > heads:
        options = ", ".join(f"ulysses={u} x ring={r}" for u, r in workable_degrees(heads, mesh.sp_size))
        raise ValueError(f"{cls} has {heads} heads, too few for ulysses={mesh.ulysses}. For a sequence degree of "
                         f"{mesh.sp_size} use one of: {options}.")
    for path, module in layers:
        _check_dropout(module, family, path)
    return layers


def _check_dropout(module: nn.Module, family: _Family, name: str) -> None:
    """Refuse attention dropout where it would apply (in training; an evaluated model's is off)."""
    if module.training and family.dropout(module):
        raise ValueError(f"{name} ({family_key(module)}) has attention dropout {family.dropout(module)}, which seqmesh "
                         "does not apply in training; set the config's attention dropout to 0.")


def _make_forward(module: nn.Module, mesh: SPMesh, backend: str) -> Callable:
    """The layer's forward on ``mesh``, attending with the kernel ``backend`` (``parallelize``'s)."""
    family = FAMILIES[family_key(module)]
    heads = family.heads(module)
    with real_tensors():  # the model's own slope function on two positions: real even in a rehearsal's fake mode
        slopes = None if family.slopes is None else tuple(float(s) for s in family.slopes(module, heads))
    scale = float(family.scale(module))
    window = family.window(module)

    def forward(self, hidden_states: torch.Tensor, *args, attention_mask=None, **kwargs):
        # hidden_states (B, L, E) in shard order -> the layer's own result
        info = kwargs.get("seqmesh")
        cache = next((kwargs[n] for n in ("cache", "layer_past", "past_key_values") if kwargs.get(n) is not None), None)
        if family.makes_cache and cache is not None and not cache.get_seq_length():
            cache = None
        # MPT's causal mask of the shard, built by the model whatever the config names (a user's padding mask is
        # refused before, at the decoder's call: refuse_padding_masks)
        check_mixer_context(self, info, cache, None if family.own_mask else attention_mask)
        if kwargs.get("output_attentions"):
            raise ValueError(f"{type(self).__name__} runs sequence-parallel and returns no attention weights; call the "
                             "model with output_attentions=False.")
        _check_dropout(self, family, type(self).__name__)  # the model may have been put in training since
        if kwargs.get("attn_prompt") is not None:  # MVP's prompts (use_prompt=True): refused at the call
            raise ValueError(f"{type(self).__name__} was called with prompts (attn_prompt), which seqmesh does not "
                             "place; set use_prompt=False.")
        if kwargs.get("key_value_states") is not None or kwargs.get("encoder_hidden_states") is not None:
            # XGLM's encoder_attn, a BERT-style crossattention (add_cross_attention)
            raise ValueError(f"{type(self).__name__} was called as cross-attention (key_value_states), which seqmesh "
                             "does not compute; train the decoder without encoder_hidden_states.")
        q, k, v = family.project(self, hidden_states)
        if family.rotate is not None:  # as the family rotates them, at the batch's global positions
            q, k = family.rotate(self, q, k, *kwargs["position_embeddings"])
        if family.rotate_given is not None:  # at the table the layer is given (made at the tokens' positions)
            q, k, v = family.rotate_given(self, q, k, v, kwargs)
        width = v.shape[-1]  # the output's, after a fold's extra channel is cut
        if family.fold is not None:
            q, k, v = family.fold(self, q, k, v, info)
        residual = args[0] if args else kwargs.get("residual")
        intercept = getattr(info, "intercept_attention", None)  # seqmesh.inference's entries: a prefill keeps this
        if intercept is not None:  # rank's keys and values, a decode step attends to its share of the cache
            done = intercept(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mesh, scale,
                             {"sliding_window": window, "alibi": slopes})
            if done is not None:  # (B, 1, Hq, Dv)
                return family.output(self, done[..., :width].flatten(2), residual)
        causal = family.causal(self, args)
        if not causal and info.lengths is not None:
            raise ValueError(f"{type(self).__name__} attends both ways (is_decoder=False) and the batch's rows have "
                             f"real lengths {info.lengths}: each row's tokens would see the padding after it; give "
                             "rows of one length, or a decoder (is_decoder=True).")
        first = id(mesh) not in info.validated
        o = attention(q, k, v, mesh, causal=causal, layout=info.layout, cu_seqlens=info.cu_seqlens,
                      seq_len=info.seq_len if info.cu_seqlens is None else None, softmax_scale=scale,
                      backend=backend, validate=first, window=window, alibi=slopes)
        info.validated.add(id(mesh))
        return family.output(self, o[..., :width].flatten(2), residual)

    return forward


def needs_no_mask(found: list) -> bool:
    """Whether the model of ``found``'s layers builds no causal mask once its config names seqmesh's attention
    implementation (BLOOM, Falcon, GPT-Neo; MPT builds one whatever the config names: :func:`token_mask`)."""
    return bool(found) and not any(FAMILIES[family_key(m)].own_mask for _, m in found)


def token_mask(*, device: torch.device | str | None = None, **_) -> torch.Tensor:
    """The causal mask a model that builds its own whatever the config names gets while seqmesh runs its attention
    (registered as the mask function of seqmesh's implementation, for that model only): one ``True``, nothing of size
    (L, L). MPT casts what ``create_causal_mask`` gives it; XGLM, GPT-NeoX-Japanese, TrOCR and MVP pass it to their
    layers. Given transformers' eager mask they held an (L, L) tensor through the forward, and their checkpointed
    layers kept it as an input until the backward (16 GiB in bool at 128K tokens on a rank, twice that in bf16 with
    its gradient), beside attention that ignores it."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def _no_padding_mask(module: nn.Module, args: tuple, kwargs: dict) -> None:
    mask = kwargs.get("attention_mask")
    if mask is not None:
        raise ValueError(f"{type(module).__name__} was called with an attention_mask of shape {tuple(mask.shape)}, "
                         "which its attention layers, run by seqmesh, would not see; describe padding and packed "
                         "documents through seqmesh.shard_batch instead (pass position_ids, not attention_mask).")


def refuse_padding_masks(decoder: nn.Module, found: list) -> list:
    """A forward pre-hook on ``decoder`` of a model with such layers that refuses a padding mask (the layers ignore
    the masks the model builds); its handle, or none."""
    return [decoder.register_forward_pre_hook(_no_padding_mask, with_kwargs=True)] if found else []


def check_backend(found: list, backend: str) -> None:
    """Refuse a named kernel that does not compute ALiBi for a model with ALiBi layers."""
    if any(FAMILIES[family_key(m)].slopes is not None for _, m in found) and backend not in ALIBI_BACKENDS:
        raise ValueError(f"backend={backend!r} cannot compute ALiBi (the math kernel adds a bias by distance, the CPU "
                         "flash op in fp32 and fp64, and seqmesh's Triton kernel on CUDA); parallelize this model "
                         "with backend='auto'.")


KIND = MixerKind(NAME, (), own_attention_layers, _make_forward)
assert set(FAMILIES) == set(LAYER_CLASSES.values()), "seqmesh.rules.own_attention names the same families"

