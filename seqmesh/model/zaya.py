"""ZAYA (``zaya``) as the planner sizes it, read from a transformers ``config.json``.

Every layer is attention whose q, k and v come from a Compressed Convolutional Attention projection (CCA,
``seqmesh.hf.cca``), then a mixture of experts; ``layer_types`` ``"hybrid"`` attends to the whole row,
``"hybrid_sliding"`` to a window. With hidden ``E``, ``H`` heads and ``Hkv`` key heads of ``D``, ``C = (H + Hkv) D``,
``E_x`` experts of ``I``, a router of ``R``, a layer holds::

    q_proj E x H D, k_proj E x Hkv D, v_proj_current and v_proj_delayed E x Hkv D / 2 each, o_proj H D x E (the
        q, k, v, o of ordinary attention; biased with attention_bias)
    conv_qk_depthwise  C x time0 + C;  conv_qk_grouped  C x D x time1 + C (groups of a head);  qk_norm.temp  Hkv
    two RMSNorms E; two residual scalings 4 E each
    router: down_proj E x R + R, router_states_scale R (not in layer 0), its MLP: an RMSNorm R, fc1 and fc2
        R x R + R each, out_proj R x (E_x + 1) (the last class: skip the experts)
    experts: E_x x 3 E I (gate | up, down)

and the model an embedding (tied to the head by default), the input scaling's 2 E, a final RMSNorm, the head's bias
with lm_head_bias. A token goes to ``num_experts_per_tok`` (ZAYA takes 1) experts.
"""

from __future__ import annotations

from .hybrid_shape import ATTENTION, SLIDING, CcaShape, FeedForward, HybridShape

_TYPES = {"hybrid": ATTENTION, "hybrid_sliding": SLIDING}


def _router(hidden: int, width: int, experts: int, states_scale: bool) -> int:
    return hidden * width + width + (width if states_scale else 0) + width + 2 * (width * width + width) \
        + width * (experts + 1)


def zaya_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of a ZAYA config.json (``hybrid``, ``layers``; the module docstring),
    and ``config``: its layers' windows under transformers' standard names, and ZAYA's defaults the file may leave
    out."""
    n, h = cfg.get("num_hidden_layers") or 40, cfg.get("hidden_size") or 2048
    types = list(cfg.get("layer_types") or ["hybrid"] * n)
    unknown = sorted({t for t in types if t not in _TYPES})
    if unknown:
        raise ValueError(f"layer_types {unknown} are none of ZAYA's {', '.join(map(repr, _TYPES))}; fix the "
                         "config.json.")
    heads, kv_heads = cfg.get("num_attention_heads") or 8, cfg.get("num_key_value_heads") or 2
    head_dim = cfg.get("head_dim") or 128
    cca = CcaShape(heads, kv_heads, head_dim, cfg.get("cca_time0", 2), cfg.get("cca_time1", 2))
    experts, width = cfg.get("num_experts") or 16, cfg.get("moe_intermediate_size") or 2048
    top, router = cfg.get("num_experts_per_tok") or 1, cfg.get("router_hidden_size") or 256
    moe = [FeedForward(experts * 3 * h * width + _router(h, router, experts, states), top * 3 * h * width
                       + h * router + 2 * router * router + router * (experts + 1), h + top * (h + 4 * width))
           for states in (False, True)]  # layer 0's router keeps no scale of the previous layer's router states
    blocks = tuple((_TYPES[t], "moe_first" if i == 0 else "moe") for i, t in enumerate(types))
    hybrid = HybridShape(None, blocks, (("moe_first", moe[0]), ("moe", moe[1])), norms=2,
                         attention_bias=bool(cfg.get("attention_bias", False)), cca=cca,
                         attention_norms=cca.conv_params() + kv_heads + 8 * h,
                         extra_params=2 * h + (cfg.get("vocab_size", 0) if cfg.get("lm_head_bias") else 0))
    sliding = SLIDING in {m for m, _ in blocks}
    config = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "tie_word_embeddings": cfg.get("tie_word_embeddings", True), "num_experts": experts,
              "num_experts_per_tok": top, "intermediate_size": width,
              "layer_types": ["sliding_attention" if _TYPES[t] == SLIDING else "full_attention" for t in types]}
    if not sliding:
        config["sliding_window"] = None
    return {"hybrid": hybrid, "layers": len(blocks), "config": config}
