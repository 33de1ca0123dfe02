"""Jamba (``jamba``), and pure Mamba (``mamba``, ``falcon_mamba``), as the planner sizes them. Jamba: each layer a mixer, a Mamba (v1) mixer or attention (every
``attn_layer_period``-th layer from ``attn_layer_offset``), then a gated MLP or MoE experts (every
``expert_layer_period``-th from ``expert_layer_offset``), two RMSNorms a layer, read from a transformers
``config.json``.

A Mamba (v1) mixer (transformers' ``JambaMambaMixer``, run by ``seqmesh.hf.mamba``) of ``I = mamba_expand x hidden``
channels, a state of ``N = mamba_d_state``, ``R = mamba_dt_rank`` and a conv of ``K = mamba_d_conv`` taps holds::

    in_proj   hidden x 2I (biased with mamba_proj_bias);  conv1d  I x K, depthwise (biased with mamba_conv_bias)
    x_proj    I x (R + 2N);  dt_proj  R x I, biased;  out_proj  I x hidden (biased with mamba_proj_bias)
    A_log     I x N;  D  I;  RMSNorms on dt (R), B (N) and C (N)

Pure Mamba's layers are each an RMSNorm and a Mamba mixer of ``I = expand x hidden`` (transformers' own
``intermediate_size``, whatever the file says), ``N =
state_size``, ``R = time_step_rank`` (``ceil(hidden / 16)`` for ``"auto"``) and ``K = conv_kernel``, its projections
biased with ``use_bias``, its conv with ``use_conv_bias``; no norms on dt, B and C (FalconMamba's are there, without
weights); the embeddings tied unless the file says otherwise.

Attention's q, k, v and o are unbiased and unrotated. An MoE layer holds ``num_experts`` gated experts of
``intermediate_size`` and a router; the embeddings are untied unless the file says otherwise.
"""

from __future__ import annotations

import math

from .hybrid_shape import ATTENTION, MAMBA1, FeedForward, HybridShape, Mamba1Shape


def jamba_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of a Jamba config.json (``hybrid``, ``layers``)."""
    n, h = cfg.get("num_hidden_layers") or 32, cfg["hidden_size"]
    attention = (cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4))
    experts = (cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1))
    width = cfg.get("intermediate_size", 14336)
    e, k = cfg.get("num_experts", 16), cfg.get("num_experts_per_tok", 2)
    mixers = [ATTENTION if i % attention[0] == attention[1] else MAMBA1 for i in range(n)]
    ffn_names = ["moe" if e > 1 and i % experts[0] == experts[1] else "mlp" for i in range(n)]
    ffns = {"mlp": FeedForward(3 * h * width, 3 * h * width, h + 4 * width),
            "moe": FeedForward(e * 3 * h * width + e * h, k * 3 * h * width + e * h, h + k * (h + 4 * width))}
    rank = cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(h / 16) if rank == "auto" else rank
    mamba = Mamba1Shape(int(cfg.get("mamba_expand", 2) * h), cfg.get("mamba_d_state", 16), rank,
                        cfg.get("mamba_d_conv", 4), bool(cfg.get("mamba_conv_bias", True)),
                        bool(cfg.get("mamba_proj_bias", False)))
    blocks = tuple(zip(mixers, ffn_names))
    used = {f for _, f in blocks}
    hybrid = HybridShape(None, blocks, tuple((name, f) for name, f in ffns.items() if name in used), norms=2,
                         mamba1=mamba)
    return {"hybrid": hybrid, "layers": n}


def mamba_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of a pure Mamba or FalconMamba config.json (``hybrid``, ``layers``)."""
    n, h = cfg.get("num_hidden_layers") or 32, cfg["hidden_size"]
    rank = cfg.get("time_step_rank", "auto")
    falcon = cfg.get("model_type") == "falcon_mamba"
    # transformers sets intermediate_size from expand, whatever the file says
    mamba = Mamba1Shape(int(cfg.get("expand", 2) * h), cfg.get("state_size", 16),
                        math.ceil(h / 16) if rank == "auto" else rank, cfg.get("conv_kernel", 4),
                        bool(cfg.get("use_conv_bias", True)), bool(cfg.get("use_bias", False)), norms=falcon,
                        norm_weights=False)
    hybrid = HybridShape(None, ((MAMBA1, ""),) * n, (), norms=1, mamba1=mamba)
    return {"hybrid": hybrid, "layers": n, "config": {"tie_word_embeddings": cfg.get("tie_word_embeddings", True)}}
