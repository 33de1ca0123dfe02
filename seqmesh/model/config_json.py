"""A transformers ``config.json`` read into a :class:`~.shapes.ModelShape`: its decoder's sizes, windows, latent
attention, experts, linear-attention and hybrid layers (:mod:`.hybrid`), and a vision tower (Qwen-VL's, or a
fixed-size one: LLaVA's CLIP, Gemma 3's SigLIP, InternVL's InternViT). Every size is checked before it is used.
"""

from __future__ import annotations

import json
import os

from ..rules.model_sizes import check_model_sizes
from ..rules.own_attention import TWO_MATRIX_MLP
from ..rules.families import config_reason
from ..rules.positions import position_rows
from .deepseek_v4 import deepseek_v4_fields
from .doge import doge_fields
from .dots3 import FAMILIES as DOTS3, dots3_entries
from .minimax_m3 import SPARSE, canonical_entries, minimax_m3_fields
from .qwen4_exp import FAMILIES as QWEN4_EXP, qwen4_exp_fields
from .inkling import FAMILIES as INKLING, SECOND as INKLING2, inkling_entries, inkling_fields
from .hybrid import hybrid_fields
from .shapes import LatentShape, ModelShape, VisionShape


def read_config_json(path: str) -> dict:
    """The object in a ``config.json``; a file that is not JSON is named with the line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); a transformers config.json "
                         "is a UTF-8 JSON file.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}, column {err.colno}, is not valid JSON ({err.msg}). Fix the file, "
                         "or give a preset name or another config.json.") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, not an object of config fields.")
    return cfg


def _window_fields(cfg: dict) -> dict:
    """sliding_window and full_every from a config.json: its layer_types (one full layer in each period of
    ``layers / full layers``, wherever in the period it lies: GPT-Neo's global layer comes first, Gemma 3's last;
    else the first full layer gives the period), or one window for every layer (Mistral)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or []
    if not window or cfg.get("use_sliding_window") is False or (types and "sliding_attention" not in types):
        return {}
    full = [i for i, t in enumerate(types) if t in ("full_attention", "indexed_attention")]  # dots.llm3's unwindowed
    every = len(types) // len(full) if full and len(types) % len(full) == 0 else (full[0] + 1 if full else 0)
    return {"sliding_window": int(window), "full_every": every}


def shape_from_config(path: str) -> ModelShape:
    """The shape in the transformers ``config.json`` at ``path`` (a file)."""
    cfg = read_config_json(path)
    refused = config_reason(cfg)  # a family refused whatever its sizes: said before its names would be missed
    if refused is not None:
        raise ValueError(f"{path}: seqmesh cannot run {cfg.get('model_type')} exactly: {refused}.")
    if cfg.get("is_encoder_decoder"):
        raise ValueError(f"{path} describes an encoder-decoder model ({cfg.get('model_type', 'is_encoder_decoder')}); "
                         "seqmesh trains and plans decoder-only causal language models (Llama, Qwen, Mistral, ...). "
                         "Give a preset or a decoder's config.json.")
    vision = _vision_fields(cfg, path)
    where = path
    text = cfg.get("text_config")
    if vision is None and isinstance(text, dict) and "hidden_size" not in _standard_names(cfg) \
            and "hidden_size" in _standard_names(text):
        raise ValueError(f"{path} describes a {cfg.get('model_type')} model whose decoder's sizes are in its "
                         "text_config, beside towers seqmesh does not route (it routes the vision-language families "
                         "Qwen-VL, LLaVA, Gemma 3 and InternVL). To train its language model, write its text_config "
                         f"as a config.json of its own (model_type {text.get('model_type')!r}).")
    if vision is not None and isinstance(cfg.get("text_config"), dict):  # the decoder's sizes in text_config
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type"),
               "tie_word_embeddings": cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings"))}
        where = f"{path} (text_config)"
    # otherwise (the original Qwen2.5-VL releases) they are at the top level, beside vision_config
    # MiniMax-M3's released entries as transformers reads them; dots.llm3's older releases as its config class builds
    # them; Inkling's checkpoints' MLP entries
    cfg = inkling_entries(dots3_entries(_with_layer_count(_standard_names(canonical_entries(cfg)))))
    hybrid = hybrid_fields(cfg)  # a hybrid's layers are its list's (transformers ignores a differing count)
    cfg = {**cfg, **hybrid.pop("config", {})}  # entries a family's reader renames (LFM2's tie_embedding, ...)
    if "layers" in hybrid:
        cfg = {**cfg, "num_hidden_layers": hybrid.pop("layers")}
    family = cfg.get("model_type", "")
    if family in _WITHOUT_ATTENTION:  # a nominal attention shape beside its layers' (the planner says "no attention")
        width = _WITHOUT_ATTENTION[family]
        hidden = cfg.get("hidden_size", 0)
        feed_forward = cfg.get(width) or (round(hidden * cfg["ffn_proj_factor"]) if cfg.get("ffn_proj_factor")
                                          else 4 * hidden)  # xLSTM's by its factor, RWKV's 4 x hidden by default
        cfg = {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": hidden, **cfg,
               "intermediate_size": feed_forward}
    check_model_sizes(cfg, where)  # before any size is used: each named with its value and the fix
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        fields = _merged({"head_dim": cfg.get("head_dim") or hidden // heads} | _latent_fields(cfg), _mlp_fields(cfg),
                         _linear_fields(cfg), _window_fields(cfg), _own_attention_fields(cfg), hybrid)
        return ModelShape(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            family=cfg.get("model_type", "llama"),
            hidden=hidden,
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=fields.pop("kv_heads", None) or cfg.get("num_key_value_heads") or heads,  # a reader's first
            vocab=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            **fields,
            vision=vision,
        )
    except KeyError as missing:
        raise ValueError(f"{path} has no {missing} entry; seqmesh needs a decoder-only transformer config.") from None


# families whose every layer is a recurrent mixer (no attention, no heads) that seqmesh train builds from a config.json,
# each sized by its own reader (seqmesh.model.rwkv, .xlstm, .jamba): the config.json entry of their feed-forward width
# (pure Mamba's: its mixer's, as it has none)
_WITHOUT_ATTENTION = {"rwkv": "intermediate_size", "xlstm": "intermediate_size", "mamba": "intermediate_size",
                      "falcon_mamba": "intermediate_size", "mamba2": "intermediate_size"}


# The config.json names of families older than transformers' standard ones (their config classes' attribute_map,
# written here so that reading a config.json needs no transformers)
_GPT2_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_inner": "intermediate_size"}
_OLD_NAMES = {"bloom": {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads"},
              # GPT-2's names, shared by GPT-BigCode (StarCoder), GPT-J and CodeGen; CTRL's MLP width is dff; OPT's
              # ffn_dim
              "gpt2": _GPT2_NAMES, "gpt_bigcode": _GPT2_NAMES, "gptj": _GPT2_NAMES, "codegen": _GPT2_NAMES,
              "ctrl": {**_GPT2_NAMES, "dff": "intermediate_size"}, "opt": {"ffn_dim": "intermediate_size"},
              "dbrx": {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers"},
              "trocr": {"d_model": "hidden_size", "decoder_layers": "num_hidden_layers",
                        "decoder_attention_heads": "num_attention_heads", "decoder_ffn_dim": "intermediate_size"},
              "longcat_flash": {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
                                "expert_ffn_hidden_size": "moe_intermediate_size", "moe_topk": "num_experts_per_tok"},
              "mpt": {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers"},
              "gpt_neo": {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"},
              "openai-gpt": {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads"},
              "xglm": {"d_model": "hidden_size", "num_layers": "num_hidden_layers", "attention_heads": "num_attention_heads",
                       "ffn_dim": "intermediate_size"},
              "xlm": {"emb_dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                      "n_words": "vocab_size"}}


def _falcon_kv_heads(cfg: dict) -> int | None:
    """Falcon's kv heads: ``num_kv_heads`` in its new layout (40B, 180B), else one (multi_query, 7B) or every head."""
    if cfg.get("new_decoder_architecture"):
        return cfg.get("num_kv_heads")
    return 1 if cfg.get("multi_query", True) else cfg.get("num_attention_heads")


def _standard_names(cfg: dict) -> dict:
    """``cfg`` with the standard names of an older family's sizes (BLOOM's ``n_layer``, MPT's ``d_model``, GPT-Neo's
    ``num_layers``), Falcon's kv heads, the MLP width these files leave to their config class (four times the width
    but MPT's ``expansion_ratio`` and Falcon's ``ffn_hidden_size``), their tied embeddings (their config classes'
    default where the file does not say) and GPT-Neo's local layers as sliding ones."""
    family = cfg.get("model_type")
    out = {std: cfg[old] for old, std in _OLD_NAMES.get(family, {}).items() if old in cfg} | cfg
    if family == "falcon" and "num_key_value_heads" not in out:
        out["num_key_value_heads"] = _falcon_kv_heads(cfg)
    if family == "gpt_neo" and isinstance(cfg.get("attention_layers"), list):
        kinds = cfg["attention_layers"]
        out["layer_types"] = ["sliding_attention" if kind == "local" else "full_attention" for kind in kinds]
        out["sliding_window"] = cfg.get("window_size", 256)
    if family in TWO_MATRIX_MLP and out.get("tie_word_embeddings") is None:  # their config classes tie by default
        out["tie_word_embeddings"] = True
    if family == "gpt_neox_japanese" and out.get("intermediate_size") is None and isinstance(out.get("hidden_size"), int):
        out["intermediate_size"] = cfg.get("intermediate_multiple_size", 4) * out["hidden_size"]
    if family in PLAIN_MLP + TWO_MATRIX_MLP and out.get("intermediate_size") is None \
            and isinstance(out.get("hidden_size"), int):
        ratio = cfg.get("expansion_ratio", 4) if family == "mpt" else 4
        out["intermediate_size"] = cfg.get("ffn_hidden_size") or ratio * out["hidden_size"]
    if family in PLAIN_MLP and out.get("tie_word_embeddings") is None:  # their config classes' defaults
        out["tie_word_embeddings"] = family not in ("gptj", "codegen")
    if family == "dbrx":  # its attention's and experts' sizes in attn_config and ffn_config (their classes' defaults)
        attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
        out = {"num_key_value_heads": attn.get("kv_n_heads", 1), "num_local_experts": ffn.get("moe_num_experts", 4),
               "num_experts_per_tok": ffn.get("moe_top_k", 1),
               "moe_intermediate_size": ffn.get("ffn_hidden_size", 3584)} | out
    if family == "gemma3n_text" and isinstance(out.get("intermediate_size"), list):  # a width per layer: read for
        out["intermediate_size"] = max(out["intermediate_size"] or [0])  # train and verify (plan refuses: UNSIZED)
    if family == "moshi":  # its text decoder's gated MLP: fc1 makes gate and up, ffn_dim / 2 each; full causal
        # attention (its sliding_window reaches no mask of that decoder)
        out["intermediate_size"] = cfg.get("ffn_dim", 22528) // 2
        out.pop("sliding_window", None)
    if family == "gpt_bigcode" and "num_key_value_heads" not in out:  # multi-query by default (StarCoder)
        out["num_key_value_heads"] = 1 if cfg.get("multi_query", True) else out.get("num_attention_heads")
    return out


# the families seqmesh runs through transformers' attention whose MLP is two matrices, up and down (GPT-2 and
# GPT-BigCode's c_fc and c_proj, GPT-J's and CodeGen's fc_in and fc_out, CTRL's, OPT's fc1 and fc2)
PLAIN_MLP = ("gpt2", "gpt_bigcode", "gptj", "codegen", "ctrl", "opt")
# families whose config.json is read (seqmesh train and verify need its sizes) but whose layers the planner does not
# size: why, as seqmesh plan says it
UNSIZED = {
    "longcat_flash": "LongCat-Flash's layers (two attention sublayers and two MLPs a layer beside a shortcut MoE with "
                     "zero-compute experts, MLA)",
    "gemma3n_text": "Gemma 3n's layers (a width per layer, AltUp's streams, LAuReL, per-layer inputs, shared caches)",
}


def trocr_cross_attention_params(cfg: dict) -> int:
    """A TrOCR decoder layer's cross-attention to its image encoder, which ``TrOCRForCausalLM`` builds (it makes its
    config a decoder) and a text step never calls: q and out over the width, k and v from
    ``cross_attention_hidden_size`` (the width where None), each with its bias, and its LayerNorm."""
    width = cfg.get("d_model") or cfg.get("hidden_size")
    source = cfg.get("cross_attention_hidden_size") or width
    return 2 * width * width + 2 * source * width + 4 * width + 2 * width


def _own_attention_fields(cfg: dict) -> dict:
    """A family whose attention layers seqmesh runs itself (``seqmesh.rules.own_attention``; MiniMax-M3's block-sparse
    layers, ``seqmesh.hf.block_sparse_attention``): a two-matrix MLP, and for a family the planner does not size
    its reason (``seqmesh train`` runs it all the same). BLOOM's and MPT's ALiBi is planned as attention: on CUDA it
    runs on seqmesh's Triton flash kernel (``seqmesh.kernels.flash_triton``), no score block held."""
    family = cfg.get("model_type")
    fields = {"gated_mlp": False} if family in TWO_MATRIX_MLP + PLAIN_MLP else {}
    if position_rows(cfg):  # a learned table of positions (CTRL's of sinusoids, no parameters): the longest sequence
        fields["position_rows"] = position_rows(cfg)
    width = cfg.get("word_embed_proj_dim") if family == "opt" else None
    if isinstance(width, int) and width != cfg.get("hidden_size"):  # OPT-350m's narrower embeddings
        fields["embed_width"] = width
    if SPARSE in (cfg.get("layer_types") or ()):
        fields |= minimax_m3_fields(cfg, cfg.get("num_attention_heads", 1))
    if family == "deepseek_v4":
        fields |= deepseek_v4_fields(cfg)
    if family in INKLING + INKLING2:
        fields |= inkling_fields(cfg)
    if family in QWEN4_EXP:
        fields |= qwen4_exp_fields(cfg)
    if family == "doge":  # its window, which the planner checks the length against; its experts with is_moe
        fields |= doge_fields(cfg)
    if family == "trocr":
        fields["idle_params"] = trocr_cross_attention_params(cfg)
    if family in UNSIZED:
        fields["unplanned"] = f"seqmesh plan does not size {UNSIZED[family]} yet; seqmesh train runs it all the same"
    return fields


def _with_layer_count(cfg: dict) -> dict:
    """``cfg`` with ``num_hidden_layers`` counted from its list of layer kinds where it names the kinds only (Nemotron-H
    as transformers 5.24 writes it: ``layers_block_type``; its older releases: ``hybrid_override_pattern``)."""
    if cfg.get("num_hidden_layers") is not None:
        return cfg
    for key in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        kinds = cfg.get(key)
        if isinstance(kinds, (list, str)) and kinds:
            return {**cfg, "num_hidden_layers": len(kinds)}
    return cfg


def _vision_fields(cfg: dict, path: str) -> VisionShape | None:
    """The tower of a vision-language config.json (its ``vision_config``), or None for a text model: a Qwen-VL
    tower, or a fixed-size one (LLaVA's CLIP, Gemma 3's SigLIP, InternVL's InternViT: :func:`_fixed_size_tower`).
    ``seqmesh train`` builds Qwen-VL towers only; the others train through ``parallelize_model`` in your loop."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        return None
    if v.get("model_type") in FIXED_SIZE_TOWERS:
        return _fixed_size_tower(cfg, v)
    if "depth" not in v:
        raise ValueError(f"{path} describes a {cfg.get('model_type')} model with a {v.get('model_type')} tower; seqmesh "
                         "plan sizes Qwen-VL towers (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5) and the fixed-size towers of "
                         "LLaVA (clip_vision_model), Gemma 3 (siglip_vision_model) and InternVL (internvl_vision).")
    try:
        if "embed_dim" in v:  # Qwen2-VL: the tower's width is embed_dim, hidden_size the merger's output
            widths = dict(hidden=v["embed_dim"], intermediate=int(v["embed_dim"] * v.get("mlp_ratio", 4)),
                          out_hidden=v["hidden_size"])
        else:
            widths = dict(hidden=v["hidden_size"], intermediate=v["intermediate_size"], out_hidden=v["out_hidden_size"])
        table = v.get("num_position_embeddings") or 0
        return VisionShape(depth=v["depth"], heads=v["num_heads"], **widths,
                           patch=v.get("patch_size", 14), merge=v.get("spatial_merge_size", 2),
                           temporal=v.get("temporal_patch_size", 2), window=v.get("window_size") or 0,
                           full_blocks=tuple(v.get("fullatt_block_indexes") or ()),
                           deepstack=tuple(v.get("deepstack_visual_indexes") or ()),
                           position_table=table, in_channels=v.get("in_channels", 3),
                           gated=not table and "embed_dim" not in v)  # Qwen2.5-VL's blocks only
    except KeyError as missing:
        raise ValueError(f"its vision_config has no {missing} entry; seqmesh reads Qwen-VL style towers.") from None


FIXED_SIZE_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip", "internvl_vision": "internvit"}


def _side(value) -> int:
    """A square size given as one number or a pair (InternVL's image_size, patch_size)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"size {value}: seqmesh plans square images of square patches.")
        return int(value[0])
    return int(value)


def _fixed_size_tower(cfg: dict, v: dict) -> VisionShape:
    """A LLaVA, Gemma 3 or InternVL tower from its config.json, with transformers' defaults for what a saved
    config leaves out; ``merge`` is the side of the window each placeholder token takes (LLaVA: 1, a patch)."""
    tower = FIXED_SIZE_TOWERS[v["model_type"]]
    text = cfg.get("text_config") or {}
    default_size, default_patch = {"clip": (224, 32), "siglip": (224, 16), "internvit": (448, 14)}[tower]
    size, patch = _side(v.get("image_size", default_size)), _side(v.get("patch_size", default_patch))
    side = size // patch
    depth = v.get("num_hidden_layers", 12)
    extra: dict = {}
    if tower == "siglip":
        pooled = round(cfg.get("mm_tokens_per_image", 256) ** 0.5)
        if pooled < 1 or side % pooled:
            raise ValueError(f"mm_tokens_per_image={cfg.get('mm_tokens_per_image', 256)} must be a square whose side "
                             f"divides the {side} patches of an image side, so each token pools whole patches.")
        extra = dict(merge=side // pooled, head=bool(v.get("vision_use_head", True)))
    else:  # both read one layer's hidden states (InternVL: -1, LLaVA: -2 by default); LLaVA may read several
        layers = cfg.get("vision_feature_layer", -1 if tower == "internvit" else -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        read = max(x % (depth + 1) for x in layers)  # index into the hidden states: 0 the embeddings
        extra = dict(read_blocks=read, feature_layers=len(layers))
        if tower == "clip":
            extra.update(merge=1, routes_class=cfg.get("vision_feature_select_strategy", "default") == "full")
        else:
            ratio = cfg.get("downsample_ratio", 0.5)
            extra.update(merge=max(round(1 / ratio), 1), qkv_bias=bool(v.get("attention_bias", False)),
                         qk_norm=bool(v.get("use_qk_norm", False)), final_norm=not v.get("use_mean_pooling", True),
                         mask_token=bool(v.get("use_mask_token", False)))
    return VisionShape(depth=depth, hidden=v.get("hidden_size", 768), heads=v.get("num_attention_heads", 12),
                       intermediate=v.get("intermediate_size", 3072), out_hidden=text.get("hidden_size", 4096),
                       patch=patch, temporal=1, in_channels=v.get("num_channels", 3), gated=False, tower=tower,
                       image_size=size, **extra)


def _mlp_fields(cfg: dict) -> dict:
    """The MLP of a config.json: its experts (each of ``moe_intermediate_size`` where the config names one, as
    Qwen3.5-MoE, whose config has no dense ``intermediate_size``; gpt-oss's are ``intermediate_size``), or one
    dense MLP. DeepSeek's and GLM's ``n_shared_experts`` (each an expert's size, or ``shared_expert_intermediate_size``
    wide where the config names one: then one, Qwen's gated) and dense layers (``mlp_layer_types`` "dense"; Qwen-MoE's
    ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips; or the first ``first_k_dense_replace``; of
    ``intermediate_size`` or their own width, :func:`_dense_width`) are counted."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return dict(intermediate=cfg["intermediate_size"])
    kinds, layers = cfg.get("mlp_layer_types"), cfg["num_hidden_layers"]
    if kinds:
        dense, first = kinds.count("dense"), kinds[0] == "dense"
    elif cfg.get("mlp_only_layers") is not None or (cfg.get("decoder_sparse_step") or 1) > 1:  # Qwen-MoE's convention
        step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        is_dense = [i in only or (i + 1) % step != 0 for i in range(layers)]
        dense, first = sum(is_dense), is_dense[0]
    else:
        dense, first = min(cfg.get("first_k_dense_replace") or 0, layers), True
    shared_width = next((cfg[k] for k in _SHARED_WIDTHS if cfg.get(k)), 0)
    shared = cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or (1 if shared_width else 0)
    return dict(intermediate=cfg.get("moe_intermediate_size") or cfg["intermediate_size"], experts=experts,
                experts_per_token=cfg.get("num_experts_per_tok") or 1, shared_experts=shared,
                shared_intermediate=shared_width, shared_gate=cfg.get("model_type") in _SHARED_GATED,
                dense_layers=dense, dense_intermediate=_dense_width(cfg) if dense else 0,
                dense_first=first or not dense)


def _dense_width(cfg: dict) -> int:
    """A dense layer's MLP width: ``intermediate_size``, unless the config names one of its own (MiniMax-M3's
    ``dense_intermediate_size``, Command A's MoE ``prefix_dense_intermediate_size``)."""
    return next((cfg[k] for k in ("dense_intermediate_size", "prefix_dense_intermediate_size") if cfg.get(k)),
                cfg.get("intermediate_size") or 0)


# the width of a family's shared expert where it is not a routed expert's (Qwen2-MoE, Qwen3-Next, Granite-MoE-shared,
# MiniMax-M3, ...), and the families that gate it by a (hidden -> 1) projection of the token
_SHARED_WIDTHS = ("shared_expert_intermediate_size", "shared_intermediate_size")
_SHARED_GATED = ("qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", *QWEN4_EXP)


def _latent_fields(cfg: dict) -> dict:
    """MLA's sizes (DeepSeek-V3, V3.2, GLM-5) and the head dim its attention runs at (the query/key head's, no-RoPE
    and RoPE parts; config.json's ``head_dim`` is the RoPE part only), with DeepSeek Sparse Attention's indexer where
    ``layer_types`` names ``indexed_attention`` layers (GLM-5's ``indexer_types`` "shared": no indexer of their own)."""
    if not cfg.get("kv_lora_rank"):
        return {}
    types = cfg.get("layer_types") or []
    indexed = types.count("indexed_attention")
    if indexed and not cfg.get("index_topk"):
        raise ValueError(f"{indexed} indexed_attention layers but no index_topk: DeepSeek Sparse Attention needs the "
                         "keys each query attends to (index_topk), index_head_dim and index_n_heads.")
    shared = [k for t, k in zip(types, cfg.get("indexer_types") or ["full"] * len(types)) if t == "indexed_attention"]
    latent = LatentShape(cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                         cfg["qk_rope_head_dim"], cfg["v_head_dim"], gate=_LATENT_GATES.get(cfg.get("model_type"), ""),
                         **(dict(index_topk=cfg["index_topk"], index_head_dim=cfg["index_head_dim"],
                                 index_n_heads=cfg["index_n_heads"], indexed_layers=indexed,
                                 shared_layers=shared.count("shared"),
                                 shared_runs=sum(a != "shared" and b == "shared" for a, b in zip(shared, shared[1:])))
                            if indexed else {}))
    return dict(latent=latent, head_dim=latent.qk_head_dim, **_indexed_layout_fields(cfg))


# the DeepSeek Sparse Attention layouts whose output gate the planner counts (seqmesh.hf.indexed_layouts)
_LATENT_GATES = {"axk2": "fused", "dots3_note": "head", "dots3_note_text": "head", "hy_v4": "value"}


def _merged(*parts: dict) -> dict:
    """The readers' fields in one dict; where more than one gives a reason the planner cannot size the model, all of
    them, joined."""
    out, reasons = {}, []
    for part in parts:
        reasons += [part["unplanned"]] if part.get("unplanned") else []
        out |= {k: v for k, v in part.items() if k != "unplanned"}
    return out | ({"unplanned": "; ".join(reasons)} if reasons else {})


def _indexed_layout_fields(cfg: dict) -> dict:
    """What MLA's other layouts add: the output gate (A.X-K2's, dots.llm3's), A.X-K2's gated norms, HY-V4's
    hyper-connections (``hc_mult`` streams), dots.llm3's sliding layers at their own sizes
    (:func:`_sliding_latent_fields`)."""
    family = cfg.get("model_type", "")
    streams = _sliding_latent_fields(cfg)
    if "unplanned" in streams:
        return streams
    streams |= {"hc_mult": int(cfg["hc_mult"])} if cfg.get("hc_mult") else {}  # its mixing weights even with one stream
    return streams | ({"norm_gate_rank": cfg.get("gated_norm_rank") or 0} if family == "axk2" else {})


# the MLA sizes a dots.llm3 per_layer_config entry may set, and the config.json entries they stand for
_LAYER_SIZES = ("num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "head_dim",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _sliding_latent_fields(cfg: dict) -> dict:
    """dots.llm3's layers (:func:`.dots3.dots3_entries` has read an older release as its class does): its
    ``layer_types`` as given (they follow no period), and its sliding layers' own MLA sizes from ``per_layer_config``
    (each entry a layer's, by index; an entry, or a size of one, equal to the file's own is no difference: transformers
    may write every layer's); or why the planner does not size the model: a layer other than a sliding one with sizes
    of its own, sliding layers of different sizes, an entry setting anything but these sizes, or full attention layers
    beside them (dots.llm3 without DeepSeek Sparse Attention)."""
    family = cfg.get("model_type", "")
    types = list(cfg.get("layer_types") or [])
    if family not in DOTS3 or not types:
        return {}
    given = {"given_layer_types": tuple(types)}
    file = {k: cfg.get(k) for k in _LAYER_SIZES}
    sizes, other = {}, set()
    for key, entry in (cfg.get("per_layer_config") or {}).items():
        i = int(key)
        size = {k: entry.get(k, file[k]) for k in _LAYER_SIZES}
        if "qk_rope_head_dim" not in entry:  # an entry without its rotary part: the rest of its head (transformers')
            size["qk_rope_head_dim"] = size["head_dim"] - size["qk_nope_head_dim"]
        other |= {k for k, v in entry.items() if k not in _LAYER_SIZES and v != cfg.get(k)}
        if size != file:
            sizes[i] = size
    if not sizes and not other:
        return given
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    kinds = {tuple(sorted(sizes.get(i, file).items())) for i in sliding}
    if other or set(sizes) - set(sliding) or len(kinds) > 1 or "full_attention" in types:
        why = (f"it sets {', '.join(sorted(other))} per layer" if other else
               "its other layers have sizes of their own, its sliding layers different ones, or it has full attention "
               "layers (use_dsa false)")
        return {"unplanned": f"seqmesh plan sizes {family}'s sliding layers at MLA sizes of their own "
                             f"(per_layer_config), one size for them all beside indexed layers, but {why}; seqmesh "
                             "train runs it all the same"}
    size = sizes[sliding[0]]  # every sliding layer's, all alike
    if size["num_key_value_heads"] != size["num_attention_heads"]:
        raise ValueError(f"per_layer_config: num_key_value_heads = {size['num_key_value_heads']} must equal "
                         f"num_attention_heads = {size['num_attention_heads']} in {family}'s MLA layers; fix the "
                         "config.json.")
    latent = LatentShape(size["q_lora_rank"] or 0, size["kv_lora_rank"], size["qk_nope_head_dim"],
                         size["qk_rope_head_dim"], size["v_head_dim"], gate=_LATENT_GATES.get(family, ""))
    return given | {"sliding_latent": latent, "sliding_heads": size["num_attention_heads"]}


def _linear_fields(cfg: dict) -> dict:
    """The Gated DeltaNet shape of a hybrid config.json (Qwen3.5, Qwen3-Next), or nothing."""
    if not cfg.get("linear_num_value_heads"):
        return {}
    types = cfg.get("layer_types") or []
    interval = cfg.get("full_attention_interval") or (types.index("full_attention") + 1 if "full_attention" in types else 4)
    return dict(full_attention_interval=interval, linear_key_heads=cfg["linear_num_key_heads"],
                linear_value_heads=cfg["linear_num_value_heads"], linear_key_dim=cfg["linear_key_head_dim"],
                linear_value_dim=cfg["linear_value_head_dim"], linear_conv=cfg.get("linear_conv_kernel_dim", 4))
