"""MiniMax-01 (``minimax``) as the planner sizes it: each layer a mixer, lightning attention (``layer_types``
"linear_attention") or softmax attention ("full_attention"), then MoE experts, two RMSNorms a layer, read from a
transformers ``config.json``.

A lightning attention mixer (transformers' ``MiniMaxLightningAttention``, run by ``seqmesh.hf.lightning``) of ``H``
heads of ``D`` channels (``q = H D``), unbiased, holds::

    qkv_proj  hidden x 3 q;  output_gate  hidden x q;  norm  q;  out_proj  q x hidden

(its decay slopes are buffers, not parameters). Every layer's MoE block holds ``num_local_experts`` gated experts
of ``intermediate_size`` and a router.
"""

from __future__ import annotations

from .hybrid_shape import ATTENTION, LIGHTNING, FeedForward, HybridShape, LightningShape


def _layer_types(cfg: dict, n: int) -> list[str]:
    """Each layer's mixer as ``MiniMaxConfig`` derives it: ``layer_types``, or transformers' default (every other
    layer, the first full). The original release's ``attn_type_list`` is not read: transformers 5.24 ignores it and
    builds its default, so that is what seqmesh trains; a config.json must name its layers in ``layer_types``."""
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
    unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise ValueError(f"layer_types {unknown} are neither lightning attention (\"linear_attention\") nor softmax "
                         "attention (\"full_attention\"); fix the config.json.")
    return list(types)


def minimax_fields(cfg: dict) -> dict:
    """The :class:`.hybrid.HybridShape` of a MiniMax config.json (``hybrid``, ``layers``)."""
    h = cfg["hidden_size"]
    types = _layer_types(cfg, cfg.get("num_hidden_layers") or 0)
    e = cfg.get("num_local_experts") or cfg.get("num_experts") or 8
    k, width = cfg.get("num_experts_per_tok") or 2, cfg["intermediate_size"]
    moe = FeedForward(e * 3 * h * width + e * h, k * 3 * h * width + e * h, h + k * (h + 4 * width))
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    blocks = tuple((ATTENTION if t == "full_attention" else LIGHTNING, "moe") for t in types)
    hybrid = HybridShape(None, blocks, (("moe", moe),), norms=2,
                         lightning=LightningShape(cfg["num_attention_heads"], head_dim))
    return {"hybrid": hybrid, "layers": len(blocks)}
