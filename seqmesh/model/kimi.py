"""Kimi Linear as the planner sizes it: each layer a mixer, Kimi Delta Attention (``layer_types``
"linear_attention") or MLA ("full_attention"), then a dense gated MLP or MoE experts (``mlp_layer_types``), two
RMSNorms a layer, read from a transformers ``config.json``.

A KDA mixer (transformers' ``KimiLinearDeltaAttention``, run by ``seqmesh.hf.kda``) of ``H`` heads of ``D``
channels (``q = H D``), unbiased, holds::

    q_proj, k_proj, v_proj   hidden x q each;  conv1d  3 q x K, depthwise, no bias
    forget gate   f_a  hidden x D, f_b  D x q, dt_bias  q, A_log  H;   b_proj  hidden x H
    output gate   g_a  hidden x D, g_b  D x q;  o_norm  D;  o_proj  q x hidden

The MoE layers hold ``num_local_experts`` gated experts of ``moe_intermediate_size``, ``n_shared_experts`` of them
as one shared gated MLP, and a router (its correction bias a buffer, not a parameter).
"""

from __future__ import annotations

from .hybrid_shape import ATTENTION, KDA, FeedForward, HybridShape, KdaShape


def _gated_mlp(hidden: int, width: int) -> FeedForward:
    """A SiLU-gated MLP, unbiased; kept: its input and four width-sized tensors."""
    return FeedForward(3 * hidden * width, 3 * hidden * width, hidden + 4 * width)


def _layer_types(cfg: dict, n: int) -> tuple[list[str], list[str]]:
    """(mixers, feed-forwards) of the ``n`` layers as ``KimiLinearConfig`` derives them: ``layer_types``, or the
    release's ``linear_attn_config`` (1-indexed ``kda_layers`` / ``full_attn_layers``), or every 4th layer but the
    first full; ``mlp_layer_types``, or the first ``first_k_dense_replace`` (1) dense."""
    types = cfg.get("layer_types")
    linear = cfg.get("linear_attn_config") or {}
    if not types and "full_attn_layers" in linear and "kda_layers" in linear:
        types = ["full_attention" if i + 1 in linear["full_attn_layers"] else "linear_attention" for i in range(n)]
    if not types:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise ValueError(f"layer_types {unknown} are neither KDA (\"linear_attention\") nor MLA (\"full_attention\"); "
                         "fix the config.json.")
    ffns = cfg.get("mlp_layer_types") or ["dense" if i < cfg.get("first_k_dense_replace", 1) else "sparse"
                                          for i in range(n)]
    return list(types), list(ffns)


def _first(cfg: dict, names: tuple[str, ...], default: int) -> int:
    """The first of ``names`` the config.json sets (``KimiLinearConfig.attribute_map``'s two names), else ``default``."""
    return next((cfg[name] for name in names if cfg.get(name) is not None), default)


def kimi_linear_fields(cfg: dict) -> dict:
    """The :class:`.hybrid.HybridShape` of a Kimi Linear config.json (``hybrid``, ``layers``, ``config``: the KDA
    sizes the release keeps in ``linear_attn_config`` under transformers' names)."""
    linear = cfg.get("linear_attn_config") or {}
    config = {k: linear[v] for k, v in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                                        ("linear_conv_kernel_dim", "short_conv_kernel_size")) if v in linear}
    cfg = {**cfg, **config}
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    types, ffn_types = _layer_types(cfg, n)
    e = _first(cfg, ("num_local_experts", "num_experts"), 256)  # transformers writes the second names
    k = _first(cfg, ("num_experts_per_tok", "num_experts_per_token"), 8)
    width, shared = cfg.get("moe_intermediate_size", 1024), _first(cfg, ("n_shared_experts", "num_shared_experts"), 1)
    moe = FeedForward(e * 3 * h * width + e * h + 3 * h * width * shared, k * 3 * h * width + e * h + 3 * h * width * shared,
                      h + (k + shared) * (h + 4 * width))
    ffns = {"mlp": _gated_mlp(h, cfg.get("intermediate_size", 9216)), "moe": moe}
    blocks = tuple((ATTENTION if t == "full_attention" else KDA, "mlp" if f == "dense" else "moe")
                   for t, f in zip(types, ffn_types))
    used = {f for _, f in blocks}
    kda = KdaShape(cfg.get("linear_num_heads", 32), cfg.get("linear_head_dim", 128), cfg.get("linear_conv_kernel_dim", 4))
    hybrid = HybridShape(None, blocks, tuple((name, f) for name, f in ffns.items() if name in used), norms=2, kda=kda,
                         attention_bias=bool(cfg.get("attention_bias")))
    return {"hybrid": hybrid, "layers": n, "config": config}
