"""LFM2, LFM2-MoE and LFM3 as the planner sizes them: each layer a mixer, a gated short convolution (``layer_types``
"conv") or attention, then its feed-forward, two RMSNorms a layer, read from a transformers ``config.json``.

A gated short convolution (transformers' ``Lfm2ShortConv``, run by ``seqmesh.hf.short_conv``) of width
``K = conv_L_cache`` holds, biased by ``conv_bias``::

    in_proj   hidden x 3 hidden     (B | C | x)
    conv      hidden x K, depthwise
    out_proj  hidden x hidden

Attention's q, k, v and out projections are unbiased, with an RMSNorm of the head dim on q and on k. LFM2's gated
MLP is ``intermediate_size`` wide, or with ``block_auto_adjust_ff_dim`` two thirds of it, times
``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``; LFM2-MoE's first ``num_dense_layers`` have a gated
MLP of ``intermediate_size``, the rest ``num_experts`` gated experts of ``moe_intermediate_size`` and a router (its
expert bias is a buffer, not a parameter).

LFM3 lays out the same convolutions beside attention of two kinds, ``sliding_attention`` (a window of
``sliding_window``) and ``full_attention``; its attention has an RMSNorm of the head dim on q and on k and, with
``use_attention_gate``, a sigmoid gate a head (``g_proj``, hidden x heads); with ``use_sandwich_norm`` each layer norms
its mixer's and its MLP's outputs too (four RMSNorms a layer); its MLP is ``intermediate_size`` wide as written.
"""

from __future__ import annotations

from .hybrid_shape import ATTENTION, CONV, SLIDING, FeedForward, HybridShape, ShortConvShape

_ATTENTION_NAMES = ("full_attention", "attention")


def _gated_mlp(hidden: int, width: int) -> FeedForward:
    """A SiLU-gated MLP (w1, w3: hidden -> width; w2 back), unbiased; kept: its input and four width-sized tensors."""
    return FeedForward(3 * hidden * width, 3 * hidden * width, hidden + 4 * width)


def _lfm2_width(cfg: dict) -> int:
    """The gated MLP's width as ``Lfm2MLP`` computes it from the config (the module docstring)."""
    width = cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if cfg.get("block_ffn_dim_multiplier", 1.0) is not None:
            width = int(cfg.get("block_ffn_dim_multiplier", 1.0) * width)
            multiple = cfg.get("block_multiple_of", 256)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def _layer_types(cfg: dict) -> list[str]:
    """Each layer's mixer: ``layer_types``, or (LFM2's original releases) attention at ``full_attn_idxs``."""
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if not types and cfg.get("model_type") == "lfm2" and n:
        full = cfg.get("full_attn_idxs")
        full = range(n) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    if not types:
        raise ValueError("an LFM2 config.json names its layers' mixers in layer_types (\"conv\" or \"full_attention\").")
    unknown = sorted({t for t in types if t != CONV and t not in _ATTENTION_NAMES})
    if unknown:
        raise ValueError(f"layer_types {unknown} are neither a gated short convolution (\"conv\") nor attention "
                         f"({', '.join(_ATTENTION_NAMES)}); fix the config.json.")
    return list(types)


def lfm2_fields(cfg: dict) -> dict:
    """The :class:`.hybrid.HybridShape` of an LFM2 or LFM2-MoE config.json (``hybrid``, ``layers``), and ``config``:
    the entries the model reads under their transformers names (the original releases' ``tie_embedding`` and
    ``block_ff_dim``)."""
    config = {}
    if "tie_embedding" in cfg:
        config["tie_word_embeddings"] = cfg["tie_embedding"]
    if cfg.get("block_ff_dim") is not None:
        config["intermediate_size"] = cfg["block_ff_dim"]
    if "tie_word_embeddings" not in cfg and "tie_embedding" not in cfg:
        config["tie_word_embeddings"] = True  # transformers' default for both
    cfg = {**cfg, **config}
    types = _layer_types(cfg)
    h = cfg["hidden_size"]
    mixers = [CONV if t == CONV else ATTENTION for t in types]
    if cfg.get("model_type") == "lfm2_moe":
        dense = cfg.get("num_dense_layers", 2)
        e, k, width = cfg.get("num_experts", 32), cfg.get("num_experts_per_tok", 4), cfg["moe_intermediate_size"]
        moe = FeedForward(e * 3 * h * width + e * h, k * 3 * h * width + e * h, h + k * (h + 4 * width))
        ffns = {"mlp": _gated_mlp(h, cfg["intermediate_size"]), "moe": moe}
        blocks = tuple((m, "mlp" if i < dense else "moe") for i, m in enumerate(mixers))
    else:
        ffns = {"mlp": _gated_mlp(h, _lfm2_width(cfg))}
        blocks = tuple((m, "mlp") for m in mixers)
    used = {f for _, f in blocks}
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    hybrid = HybridShape(None, blocks, tuple((n, f) for n, f in ffns.items() if n in used), norms=2,
                         conv=ShortConvShape(cfg.get("conv_L_cache", 3), bool(cfg.get("conv_bias", False))),
                         attention_norms=2 * head_dim)
    return {"hybrid": hybrid, "layers": len(blocks), "config": config}


def lfm3_fields(cfg: dict) -> dict:
    """The :class:`.hybrid.HybridShape` of an LFM3 config.json (``hybrid``, ``layers``; the module docstring)."""
    n, h = cfg.get("num_hidden_layers") or 24, cfg["hidden_size"]
    types = cfg.get("layer_types") or ["full_attention" if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else CONV
                                       for i in range(n)]  # transformers' default pattern
    unknown = sorted({t for t in types if t not in (CONV, SLIDING, "full_attention")})
    if unknown:
        raise ValueError(f"layer_types {unknown} are none of LFM3's \"conv\", \"sliding_attention\" and "
                         "\"full_attention\"; fix the config.json.")
    mixers = [ATTENTION if t == "full_attention" else t for t in types]
    heads = cfg.get("num_attention_heads", 16)
    head_dim = cfg.get("head_dim") or 128  # LFM3's defaults, where the file leaves them out
    gate = h * heads if cfg.get("use_attention_gate", True) else 0
    hybrid = HybridShape(None, tuple((m, "mlp") for m in mixers), (("mlp", _gated_mlp(h, cfg["intermediate_size"])),),
                         norms=4 if cfg.get("use_sandwich_norm", True) else 2,
                         attention_bias=bool(cfg.get("attention_bias", False)),
                         conv=ShortConvShape(cfg.get("conv_L_cache", 7), bool(cfg.get("conv_bias", False))),
                         attention_norms=2 * head_dim + gate)
    defaults = {"num_attention_heads": heads, "num_key_value_heads": cfg.get("num_key_value_heads") or 4,
                "head_dim": head_dim, "sliding_window": cfg.get("sliding_window") or 256}
    return {"hybrid": hybrid, "layers": len(mixers),
            "config": {**defaults, "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
                       "layer_types": list(types)}}
