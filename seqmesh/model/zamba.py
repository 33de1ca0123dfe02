"""Zamba (``zamba``) and Zamba2 (``zamba2``) as the planner sizes them, read from a transformers ``config.json``.

Every layer is an RMSNorm and a Mamba mixer (Zamba's multi-head Mamba (v1), ``seqmesh.hf.mamba``; Zamba2's Mamba2,
``seqmesh.hf.mamba2``) on the residual stream. A ``"hybrid"`` layer first runs a shared transformer block on its
input concatenated with the embeddings' output (``2 E`` wide), passes the block's output through its own
``E x E`` linear and adds it to its mixer's input. With hidden ``E``, ``H`` heads and ``Hkv`` kv heads of
``D = 2 E / H`` (Zamba: ``attention_head_dim`` and ``attention_hidden_size`` where the file gives them) and an MLP
of ``I``, a block holds::

    q_proj 2E x H D, k_proj and v_proj 2E x Hkv D, o_proj H D x E (unbiased)
    input_layernorm 2E, pre_ff_layernorm E
    Zamba: gate_proj, up_proj E x I, down_proj I x E (unbiased)
    Zamba2: gate_up_proj E x 2I, down_proj I x E (biased with add_bias_linear)

Zamba has one block; Zamba2 ``num_mem_blocks``, hybrid layer ``i`` running block ``i % num_mem_blocks``, each hybrid
layer with LoRA adapters of rank ``r`` (``adapter_rank``) held in its block: ``E x r`` and ``r x 2I`` on gate_up_proj,
and with ``use_shared_attention_adapter`` ``2E x r`` and ``r x 2E`` on each of q, k and v. Zamba's Mamba mixer
splits its ``mamba_expand x E`` channels into ``n_mamba_heads`` heads (x_proj and dt_proj per head: the same
parameters as one Mamba's); Zamba2's is a Mamba2 of ``n_mamba_heads`` heads, ``mamba_ngroups`` groups, its conv
always biased, in_proj and out_proj biased with ``add_bias_linear``. The embeddings are tied unless the file says
otherwise.
"""

from __future__ import annotations

import math

from .hybrid_shape import (MAMBA1, MAMBA2, SHARED_MAMBA1, SHARED_MAMBA2, SHARED_MIXERS, FeedForward, HybridShape,
                           Mamba1Shape, Mamba2Shape, SharedBlocks)

_HYBRID = "hybrid"
_MAMBA = ("linear_attention", "mamba")  # transformers' name and the releases' older one
SHARED_FFN = "linear"  # a hybrid layer's feed-forward slot: its own linear, its block's MLP and its adapters


def _zamba_types(cfg: dict, n: int) -> list[str]:
    """transformers' default layer pattern where the file has none: two Mamba layers, a hybrid one, then a hybrid
    layer every ``attn_layer_period`` from ``attn_layer_offset``."""
    period, offset = cfg.get("attn_layer_period", 6), cfg.get("attn_layer_offset", 4)
    return [_MAMBA[0], _MAMBA[0], _HYBRID] + [_HYBRID if i % period == offset else _MAMBA[0] for i in range(n - 3)]


def _zamba2_types() -> list[str]:
    """transformers' default Zamba2 pattern (54 layers, whatever num_hidden_layers says)."""
    mamba = _MAMBA[0]
    return ([mamba] + ([mamba] * 5 + [_HYBRID]) * 7 + [mamba] * 4 + [_HYBRID] + [mamba] * 3 + [_HYBRID]
            + [mamba] * 2)


def _layers(types: list[str], mixer: str, shared: str) -> tuple[tuple[str, str], ...]:
    unknown = sorted({t for t in types if t != _HYBRID and t not in _MAMBA})
    if unknown:
        raise ValueError(f"layers_block_type {unknown} are neither {_HYBRID!r} nor a Mamba layer ({', '.join(_MAMBA)}); "
                         "fix the config.json.")
    return tuple((shared, SHARED_FFN) if t == _HYBRID else (mixer, "") for t in types)


def _attention(cfg: dict, hidden: int, width: int, head_dim: int, heads: int, kv_default: int) -> tuple[int, int]:
    """(kv heads, the attention's parameters: q, k, v from ``width`` channels, o to ``hidden``)."""
    kv_heads = cfg.get("num_key_value_heads") or kv_default
    return kv_heads, width * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden


def _shared_ffn(hidden: int, mlp_macs: int, inner: int, attention_in: int, adapter: int, adapter_rank: int,
                attention_adapters: bool) -> FeedForward:
    """A hybrid layer's own linear beside its block's MLP and adapters: the linear's parameters (the rest are the
    block's, counted once), a token's multiply-adds through all of them (the block's attention projections apart:
    ``ModelShape.attention_params``), and what they keep a token: the concatenated input and its norm's output
    beyond the ``E`` an attention layer's counts, the pre-MLP norm's input and output, the MLP's gate and up, its
    activation's output and the product, the linear's input, and an adapter's rank-wide intermediates."""
    intermediates = adapter_rank * (4 if attention_adapters else 1) if adapter else 0
    kept = 2 * attention_in - hidden + 2 * hidden + 4 * inner + hidden + intermediates
    return FeedForward(hidden * hidden, mlp_macs + hidden * hidden + adapter, kept)


def _hidden(cfg: dict) -> int:
    hidden = cfg.get("hidden_size")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
        raise ValueError(f"hidden_size = {hidden!r}: a {cfg.get('model_type')} config.json gives its width as a "
                         "positive integer; fix the config.json.")
    return hidden


def _blocks(layers: tuple[tuple[str, str], ...], ids: int, block: int, attention: int, adapter: int,
            tied: bool) -> SharedBlocks:
    """The shared blocks as transformers builds them: hybrid layer ``i`` runs block ``i % ids``, which holds an adapter
    set for each hybrid layer that runs it; tied (the embeddings tied: transformers ties nothing otherwise), a block
    of each id, else one a hybrid layer, each with the adapter sets of its id."""
    n = sum(m in SHARED_MIXERS for m, _ in layers)
    ids = max(1, min(ids, n))  # a block only where a layer runs it
    served = [len(range(i, n, ids)) for i in range(ids)]  # the hybrid layers each id serves
    sets = [served[i % ids] for i in range(n)]  # the adapter sets in each layer's block (untied)
    if tied:
        return SharedBlocks(ids, block, attention, adapters=n if adapter else 0, adapter=adapter, served=tuple(served))
    return SharedBlocks(n, block, attention, adapters=sum(sets) if adapter else 0, adapter=adapter, tied=False,
                        unit_adapters=max(sets, default=0) if adapter else 0)


def zamba_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of a Zamba config.json (``hybrid``, ``layers``; the module docstring)
    and ``config``: the attention's head size, the kv heads and the MLP width under transformers' standard names."""
    h = _hidden(cfg)
    n = cfg.get("num_hidden_layers") or 76
    types = list(cfg.get("layers_block_type") or cfg.get("layer_types") or _zamba_types(cfg, n))
    width = cfg.get("attention_hidden_size") or 2 * h
    heads = cfg.get("num_attention_heads") or 16
    head_dim = cfg.get("attention_head_dim") or 2 * h // heads
    kv_heads, attention = _attention(cfg, h, width, head_dim, heads, kv_default=16)  # ZambaConfig's default
    inner = cfg.get("intermediate_size") or 14848
    block = attention + 3 * h * inner + width + h
    rank = cfg.get("mamba_dt_rank", "auto")
    expand = cfg.get("mamba_expand", 2)
    mamba = Mamba1Shape(int(expand * h), cfg.get("mamba_d_state", 16), math.ceil(h / 16) if rank == "auto" else rank,
                        cfg.get("mamba_d_conv", 4), bool(cfg.get("mamba_conv_bias", True)),
                        bool(cfg.get("mamba_proj_bias", False)), norms=False, heads=cfg.get("n_mamba_heads") or 2)
    ffn = _shared_ffn(h, 3 * h * inner, inner, width, 0, 0, False)
    blocks = _layers(types, MAMBA1, SHARED_MAMBA1)
    tied = cfg.get("tie_word_embeddings", True)
    hybrid = HybridShape(None, blocks, ((SHARED_FFN, ffn),), norms=1, mamba1=mamba,
                         shared=_blocks(blocks, 1, block, attention, 0, tied))
    config = {"head_dim": head_dim, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": inner, "tie_word_embeddings": tied}
    return {"hybrid": hybrid, "layers": len(types), "config": config}


def zamba2_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of a Zamba2 config.json (as :func:`zamba_fields`)."""
    h = _hidden(cfg)
    types = list(cfg.get("layers_block_type") or cfg.get("layer_types") or _zamba2_types())
    heads = cfg.get("num_attention_heads") or 32
    head_dim = 2 * h // heads  # transformers derives it, whatever the file says
    kv_heads, attention = _attention(cfg, h, 2 * h, head_dim, heads, kv_default=heads)
    inner = cfg.get("intermediate_size") or 4 * h
    bias = bool(cfg.get("add_bias_linear", False))
    mlp = 3 * h * inner + (2 * inner + h if bias else 0)
    rank = cfg.get("adapter_rank") or 128
    attention_adapters = bool(cfg.get("use_shared_attention_adapter", False))
    adapter = h * rank + rank * 2 * inner + (3 * 2 * (2 * h * rank) if attention_adapters else 0)
    mamba_heads = cfg.get("n_mamba_heads") or 8
    expand = cfg.get("mamba_expand", 2)
    mamba = Mamba2Shape(mamba_heads, int(expand * h) // mamba_heads, cfg.get("mamba_d_state", 64),
                        cfg.get("mamba_ngroups", 1), cfg.get("mamba_d_conv", 4), conv_bias=True, proj_bias=bias)
    blocks = _layers(types, MAMBA2, SHARED_MAMBA2)
    ffn = _shared_ffn(h, 3 * h * inner, inner, 2 * h, adapter, rank, attention_adapters)
    tied = cfg.get("tie_word_embeddings", True)
    hybrid = HybridShape(mamba, blocks, ((SHARED_FFN, ffn),), norms=1,
                         shared=_blocks(blocks, cfg.get("num_mem_blocks") or 1, attention + mlp + 3 * h, attention,
                                        adapter, tied))
    config = {"head_dim": head_dim, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": inner, "tie_word_embeddings": tied}
    return {"hybrid": hybrid, "layers": len(types), "config": config}
