"""Mamba2 hybrids as the planner sizes them: Nemotron-H (each layer ONE block: Mamba2, attention, MLP or MoE),
Granite-4 hybrid / Bamba (each layer a mixer, Mamba2 or attention, and its feed-forward) and Falcon-H1 (attention and
Mamba2 side by side in every layer, then an MLP), read from a transformers ``config.json``.

A Mamba2 mixer (transformers' ``*Mamba2Mixer`` / ``*MambaLayer``) holds, with ``d_inner = H P`` and
``conv_dim = d_inner + 2 G N``::

    in_proj   hidden x (2 d_inner + 2 G N + H)      (bias with mamba_proj_bias)
    conv1d    conv_dim x K, depthwise               (bias with the conv bias)
    dt_bias, A_log, D    H each;  norm (gated RMSNorm)  d_inner;  out_proj  d_inner x hidden
"""

from __future__ import annotations

from .hybrid_shape import ATTENTION, CONV, MAMBA2, PARALLEL, FeedForward, HybridShape, Mamba2Shape
from .jamba import jamba_fields, mamba_fields
from .kimi import kimi_linear_fields
from .lfm import lfm2_fields, lfm3_fields
from .minimax import minimax_fields
from .recurrent_gemma import recurrent_gemma_fields
from .rwkv import rwkv_fields
from .xlstm import xlstm_fields
from .zaya import zaya_fields
from .zamba import zamba2_fields, zamba_fields

# the names config.json files give a layer's mixer (transformers 5 names, the original releases' names, pattern chars)
_MAMBA_NAMES = {"linear_attention", "mamba", "mamba2", "M"}
_ATTENTION_NAMES = {"full_attention", "attention", "*"}
_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _positive(cfg: dict, *names: str, default=None) -> int:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is None:
        raise ValueError(f"the config.json has no {' / '.join(names)}: the Mamba2 layers' sizes need it.")
    return default


# the recurrent mixers seqmesh trains but the planner does not size yet: model_type -> the mixer's name
_UNSIZED: dict[str, str] = {}
_SIZED = ("attention, Gated DeltaNet (Qwen3.5, Qwen3-Next), the Mamba2 hybrids Nemotron-H (nemotron_h), Granite-4 "
          "hybrid (granitemoehybrid), Bamba and Falcon-H1 (falcon_h1), LFM2's gated short convolutions (lfm2, "
          "lfm2_moe, lfm3), Kimi Linear's KDA (kimi_linear), MiniMax-01's lightning attention (minimax), "
          "RecurrentGemma's "
          "RG-LRU (recurrent_gemma), Mamba (jamba, mamba, falcon_mamba), RWKV-4's blocks (rwkv) and xLSTM's mLSTM "
          "(xlstm), ZAYA's CCA attention (zaya), Zamba's and Zamba2's shared blocks beside Mamba and Mamba2 (zamba, "
          "zamba2)")


def hybrid_fields(cfg: dict) -> dict:
    """The :class:`HybridShape` of a hybrid config.json (``hybrid``, with ``layers`` the blocks' number): a Mamba2
    hybrid's or an LFM2's (:mod:`.lfm`), or nothing for another model. A recurrent mixer the planner cannot size gets
    ``unplanned``, the reason the planner gives (training reads their shape all the same), never attention's plan."""
    family = cfg.get("model_type", "")
    if family in ("lfm2", "lfm2_moe"):
        return lfm2_fields(cfg)
    if family == "lfm3":
        return lfm3_fields(cfg)
    if family == "kimi_linear":
        return kimi_linear_fields(cfg)
    if family == "minimax":
        return minimax_fields(cfg)
    if family == "recurrent_gemma":
        return recurrent_gemma_fields(cfg)
    if family == "jamba":
        return jamba_fields(cfg)
    if family == "rwkv":
        return rwkv_fields(cfg)
    if family in ("mamba", "falcon_mamba"):
        return mamba_fields(cfg)
    if family == "xlstm":
        return xlstm_fields(cfg)
    if family == "zaya":
        return zaya_fields(cfg)
    if family == "zamba":
        return zamba_fields(cfg)
    if family == "zamba2":
        return zamba2_fields(cfg)
    if family in _UNSIZED or CONV in (cfg.get("layer_types") or ()):
        mixer = _UNSIZED.get(family, "gated short convolution")
        return {"unplanned": f"seqmesh plan does not size the {mixer} layers of {family or 'this model'} yet (it "
                             f"would plan them as attention, which they are not); it sizes {_SIZED}. seqmesh train "
                             "runs the model all the same."}
    if family == "falcon_h1":
        return _falcon_h1(cfg)
    if family == "mamba2":
        return _mamba2(cfg)
    if family == "nemotron_h":
        return _nemotron_h(cfg)
    if family in ("granitemoehybrid", "bamba"):
        return _granite_or_bamba(cfg, family)
    if any(k.startswith("mamba_") or k == "ssm_state_size" for k in cfg):
        return {"unplanned": f"seqmesh plan does not size the Mamba layers of {family or 'this model'}; it sizes "
                             f"{_SIZED}."}
    return {}


def _mixer(kind: str, where: str) -> str:
    if kind in _MAMBA_NAMES:
        return MAMBA2
    if kind in _ATTENTION_NAMES:
        return ATTENTION
    raise ValueError(f"{where}: layer type {kind!r} is neither a Mamba2 layer ({', '.join(sorted(_MAMBA_NAMES))}) nor "
                     f"attention ({', '.join(sorted(_ATTENTION_NAMES))}); fix the config.json.")


def _nemotron_h(cfg: dict) -> dict:
    """Nemotron-H: ``layers_block_type`` / ``layer_types`` (or the original ``hybrid_override_pattern``), each layer
    one block behind one RMSNorm; a squared-ReLU MLP (up, down) and MoE experts of the same form, one shared expert,
    a float32 router (its correction bias is a buffer, not a parameter)."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types and cfg.get("hybrid_override_pattern"):
        types = [_NEMOTRON_PATTERN.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if not types:
        raise ValueError("a Nemotron-H config.json names its layers in layers_block_type (or hybrid_override_pattern).")
    blocks = []
    for kind in types:
        if kind in ("mlp", "moe", "-", "E"):
            blocks.append(("", {"-": "mlp", "E": "moe"}.get(kind, kind)))
        else:
            blocks.append((_mixer(kind, "layers_block_type"), ""))
    h = cfg["hidden_size"]
    bias = bool(cfg.get("mlp_bias"))
    ffns = {}
    if ("", "mlp") in blocks:
        i = cfg["intermediate_size"]
        ffns["mlp"] = FeedForward(2 * h * i + (i + h if bias else 0), 2 * h * i, h + 2 * i)
    if ("", "moe") in blocks:
        e, k = _positive(cfg, "n_routed_experts"), _positive(cfg, "num_experts_per_tok", default=1)
        i, shared = cfg["moe_intermediate_size"], cfg["moe_shared_expert_intermediate_size"]
        width = cfg.get("moe_latent_size") or h  # the experts' input (a latent projection of the hidden state)
        latent = 2 * h * width + (width + h if bias else 0) if cfg.get("moe_latent_size") else 0
        mlp_shared = 2 * h * shared + (shared + h if bias else 0)
        ffns["moe"] = FeedForward(e * 2 * i * width + mlp_shared + e * h + latent,
                                  k * 2 * i * width + 2 * h * shared + e * h + (2 * h * width if latent else 0),
                                  h + 2 * shared + k * (width + 2 * i))
    mamba = Mamba2Shape(_positive(cfg, "mamba_num_heads"), _positive(cfg, "mamba_head_dim"),
                        _positive(cfg, "ssm_state_size"), _positive(cfg, "n_groups", "mamba_n_groups", default=8),
                        _positive(cfg, "conv_kernel", "mamba_d_conv", default=4),
                        bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
                        bool(cfg.get("use_bias", False)))  # Nemotron-H biases in_proj and out_proj by use_bias
    return {"hybrid": HybridShape(mamba, tuple(blocks), tuple(ffns.items()), norms=1,
                                  attention_bias=bool(cfg.get("attention_bias"))), "layers": len(blocks)}


def _mamba_heads(cfg: dict, inner: int) -> tuple[int, int]:
    """(heads, head_dim) of Granite's, Bamba's and Falcon-H1's Mamba2 (``mamba_d_head`` "auto": inner / heads)."""
    heads = _positive(cfg, "mamba_n_heads", default=128)
    head_dim = cfg.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if heads * head_dim != inner:
        raise ValueError(f"mamba_n_heads {heads} x mamba_d_head {head_dim} must equal the Mamba2 width {inner} "
                         "(mamba_expand x hidden_size, or Falcon-H1's mamba_d_ssm; transformers checks the same); fix "
                         "the config.json.")
    return heads, head_dim


def _mamba2(cfg: dict) -> dict:
    """A pure Mamba2 model (``mamba2``: Mamba-Codestral's): every layer a Mamba2 mixer behind one RMSNorm, no MLP;
    ``num_heads`` of ``head_dim``, in_proj and out_proj biased by ``use_bias``; an untied head by default."""
    n, h = cfg.get("num_hidden_layers") or 64, cfg["hidden_size"]
    heads, head_dim = _positive(cfg, "num_heads", default=128), _positive(cfg, "head_dim", default=64)
    if heads * head_dim != int(cfg.get("expand", 2) * h):
        raise ValueError(f"Mamba2's num_heads {heads} x head_dim {head_dim} must equal expand x hidden_size "
                         f"({int(cfg.get('expand', 2) * h)}), the width its mixer projects to; fix the config.json.")
    mamba = Mamba2Shape(heads, head_dim, _positive(cfg, "state_size", default=128),
                        _positive(cfg, "n_groups", default=8), _positive(cfg, "conv_kernel", default=4),
                        bool(cfg.get("use_conv_bias", True)), bool(cfg.get("use_bias", False)))
    return {"hybrid": HybridShape(mamba, ((MAMBA2, ""),) * n, (), norms=1), "layers": n,
            "config": {"tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}}


def _falcon_h1(cfg: dict) -> dict:
    """Falcon-H1: in every layer attention and Mamba2 side by side on one normed input, then a gated MLP (two
    RMSNorms a layer); Mamba2's width ``mamba_d_ssm``, its gated norm only with ``mamba_rms_norm``, out_proj biased by
    ``projectors_bias``. Its muP multipliers are float32 buffers, not parameters: in_proj's output times them is float32
    whatever the activations' dtype, and so is all the mixer computes from it."""
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    i, bias = cfg["intermediate_size"], bool(cfg.get("mlp_bias"))
    inner = cfg.get("mamba_d_ssm") or int(_positive(cfg, "mamba_expand", default=2) * h)
    heads, head_dim = _mamba_heads(cfg, inner)
    mamba = Mamba2Shape(heads, head_dim, _positive(cfg, "mamba_d_state", default=256),
                        _positive(cfg, "mamba_n_groups", default=1), _positive(cfg, "mamba_d_conv", default=4),
                        bool(cfg.get("mamba_conv_bias", True)), bool(cfg.get("mamba_proj_bias", False)),
                        out_bias=bool(cfg.get("projectors_bias", False)), gated_norm=bool(cfg.get("mamba_rms_norm")),
                        float32_mixing=True)
    mlp = FeedForward(3 * h * i + (2 * i + h if bias else 0), 3 * h * i, h + 4 * i)
    return {"hybrid": HybridShape(mamba, ((PARALLEL, "mlp"),) * n, (("mlp", mlp),), norms=2,
                                  attention_bias=bool(cfg.get("attention_bias"))), "layers": n}


def _granite_or_bamba(cfg: dict, family: str) -> dict:
    """Granite-4 hybrid (``layer_types``; a gated shared MLP in every layer, beside the MoE experts when
    ``num_local_experts`` > 0) and Bamba (``attn_layer_indices``; a gated MLP): two RMSNorms a layer."""
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    if cfg.get("layer_types"):
        mixers = [_mixer(t, "layer_types") for t in cfg["layer_types"]]
    else:
        attention = set(cfg.get("attn_layer_indices") or [])
        mixers = [ATTENTION if i in attention else MAMBA2 for i in range(n)]
    if family == "bamba":
        i, bias = cfg["intermediate_size"], bool(cfg.get("mlp_bias"))
        ffn_name, ffn = "mlp", FeedForward(3 * h * i + (2 * i + h if bias else 0), 3 * h * i, h + 4 * i)
    else:
        si = cfg.get("shared_intermediate_size", 1024)
        e, k = cfg.get("num_local_experts") or 0, cfg.get("num_experts_per_tok") or 1
        i = cfg["intermediate_size"]
        ffn_name = "moe" if e else "mlp"
        ffn = FeedForward(3 * h * si + e * (3 * h * i + h), 3 * h * si + (k * 3 * h * i + e * h if e else 0),
                          h + 4 * si + (k * (h + 4 * i) if e else 0))
    heads, head_dim = _mamba_heads(cfg, int(_positive(cfg, "mamba_expand", default=2) * h))
    mamba = Mamba2Shape(heads, head_dim, _positive(cfg, "mamba_d_state", default=256),
                        _positive(cfg, "mamba_n_groups", default=1), _positive(cfg, "mamba_d_conv", default=4),
                        bool(cfg.get("mamba_conv_bias", True)), bool(cfg.get("mamba_proj_bias", False)))
    return {"hybrid": HybridShape(mamba, tuple((m, ffn_name) for m in mixers), ((ffn_name, ffn),), norms=2,
                                  attention_bias=bool(cfg.get("attention_bias"))), "layers": len(mixers)}
