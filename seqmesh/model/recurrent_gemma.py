"""RecurrentGemma (``recurrent_gemma``: Griffin) as the planner sizes it: each layer a temporal block, a recurrent
block or local attention, in the repeating pattern ``block_types`` ("recurrent", "attention"), then a gated MLP, two
RMSNorms a layer, read from a transformers ``config.json``.

A recurrent block (transformers' ``RecurrentGemmaRecurrentBlock``, run by ``seqmesh.hf.rg_lru``) of ``W =
lru_width`` channels, ``H = num_attention_heads`` gate blocks and a conv of ``K = conv1d_width`` taps holds::

    linear_x, linear_y   hidden x W each, biased;  linear_out  W x hidden, biased
    conv_1d              W x K, depthwise, biased
    rg_lru               recurrent_param W; input and recurrence gates H x (W/H)^2 each, biased

The attention layers attend within ``attention_window_size`` (transformers' ``sliding_window``): q, k and v unbiased
(``attention_bias``), o_proj biased. The MLP is gated, ``intermediate_size // 2`` wide, every projection biased. The
head dim is ``hidden_size // num_attention_heads`` whatever the file says; the embeddings are tied unless the file
says otherwise.
"""

from __future__ import annotations

from .hybrid_shape import ATTENTION, RG_LRU, FeedForward, HybridShape, RgLruShape

_BLOCKS = {"recurrent": RG_LRU, "attention": ATTENTION}


def _block_types(cfg: dict, n: int) -> list[str]:
    """Each layer's temporal block, as ``RecurrentGemmaConfig.layers_block_type`` repeats ``block_types``."""
    pattern = cfg.get("block_types") or ["recurrent", "recurrent", "attention"]
    unknown = sorted({t for t in pattern if t not in _BLOCKS})
    if unknown:
        raise ValueError(f"block_types {unknown} are neither a recurrent block (\"recurrent\") nor local attention "
                         "(\"attention\"); fix the config.json.")
    return [pattern[i % len(pattern)] for i in range(n)]


def recurrent_gemma_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of a RecurrentGemma config.json (``hybrid``, ``layers``), and
    ``config``: the entries the model reads under the names the rest of the planner reads (its window, each layer's
    kind, its head dim, tied embeddings)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n = cfg.get("num_hidden_layers") or 26
    types = _block_types(cfg, n)
    width = cfg.get("intermediate_size", 7680) // 2
    mlp = FeedForward(3 * h * width + 2 * width + h, 3 * h * width, h + 4 * width)
    blocks = tuple((_BLOCKS[t], "mlp") for t in types)
    biased = bool(cfg.get("attention_bias", False))  # q, k, v and o biased; o_proj's bias alone otherwise
    hybrid = HybridShape(None, blocks, (("mlp", mlp),), norms=2, attention_bias=biased, attention_norms=0 if biased else h,
                         rg_lru=RgLruShape(cfg.get("lru_width") or h, heads, cfg.get("conv1d_width", 4)))
    config = {"head_dim": h // heads, "sliding_window": cfg.get("attention_window_size", 2048),
              "layer_types": ["sliding_attention" if t == "attention" else "linear_attention" for t in types],
              "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
    return {"hybrid": hybrid, "layers": n, "config": config}
