"""Tiny configs of every causal-LM family of the installed transformers, for the census (census_cases.py).

A family's tiny config starts from its config class's defaults: the size fields it takes (by name, or an alias of
``attribute_map`` either way round) made small (TINY), one layer of each kind its per-layer kind lists name,
its sub-configs made tiny alike, its special token ids inside the small vocabulary; a short table (PER_FAMILY)
for families that generic shrinking does not make runnable, and common variants (VARIANTS) beside every
family's default. Nothing is loaded from the hub.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

NOISE = 0.02  # standard deviation of the seeded noise added to every weight

# The sizes a tiny model takes, by the name a config uses for them (or an ``attribute_map`` alias of it). Only
# fields the family's config takes in its constructor are set, and only where its default is an int (a field a
# family leaves None, q_lora_rank, stays None), except the NULLABLE ones, which families leave None to derive
# or to be set by every checkpoint. The first name that reaches a field wins.
TINY = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512, "num_layers": 2, "rotary_dim": 8,
    # a window shorter than a shard (128 tokens on 2 ranks, zigzag chunks of 32), so sliding layers are not full
    "sliding_window": 24,
    # feed-forward sizes by other names
    "ffn_dim": 128, "dff": 128, "dim_ff": 128, "d_inner": 128, "feed_forward_size": 128, "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128, "dense_intermediate_size": 128, "output_embedding_size": 64, "prompt_mid_dim": 32,
    # decoders of encoder-decoder families (their ForCausalLM is the decoder alone), and their encoders
    "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128, "num_decoder_layers": 2,
    "num_decoder_attention_heads": 4, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
    "num_encoder_layers": 2, "num_encoder_attention_heads": 4,
    # mixtures of experts: two of four experts a token, one shared, the first layer dense
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "shared_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "zero_expert_num": 2,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "o_lora_rank": 16, "index_topk": 16,
    # linear attention and state-space layers
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_heads": 4, "linear_head_dim": 8,  # Kimi Linear's KDA (its default, 32 heads of 128, was a quarter of the census)
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_head_dim": 16,
    "time_step_rank": 8, "mamba_d_ssm": 64,
    # per-layer embeddings (Gemma 3n, Gemma 4), BLT's global transformer
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16, "hidden_size_global": 64,
    # other vocabularies: RoCBert's pronunciation and shape, BLT's hashed byte groups, Inkling's unpadded one
    "pronunciation_vocab_size": 32, "shape_vocab_size": 32, "pronunciation_embed_dim": 16, "shape_embed_dim": 16,
    "encoder_hash_byte_group_vocab": 512, "unpadded_vocab_size": 256,
    # vision and audio towers (built, never run: the batches are text)
    "depth": 2, "num_heads": 4, "embed_dim": 64, "out_hidden_size": 64, "projection_dim": 64, "mlp_dim": 128,
    "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64, "adapter_in_dim": 64,
    "adapter_input_size": 64, "adapter_out_dim": 64, "nemo_conv_channels": 64, "ext_pw_out_channel": 64,
    "depthwise_separable_out_channel": 64,
}
NULLABLE = ("head_dim", "num_key_value_heads")
# list fields with one kind per layer: a tiny model keeps one layer of each kind its family's default has
KIND_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "indexer_types")
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                  "cls_token_id", "mask_token_id", "unk_token_id")
# families the generic shrinking does not make tiny and runnable (a dict for a sub-config is merged into it)
PER_FAMILY: dict[str, dict] = {
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # what its attention reads
             "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2}},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"],  # rotary per kind; none on full
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                      "mrope_section": [4, 2, 2]},
                                                "full_attention": None}},
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default, which its router cannot take
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},  # dense without experts set
    "dots3_note_text": {"num_key_value_heads": 4, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                        "swa_q_lora_rank": 32,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # a tower whose pooled image tokens (mm_tokens_per_image) are whole squares of patches, which seqmesh routes
    "gemma3": {"vision_config": {"image_size": 64, "patch_size": 4}, "mm_tokens_per_image": 16},
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,  # the last two reuse the first two's keys
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "use_mamba_kernels": False},
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # its default is attention only; its checkpoints are not
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # its default 2 left no MoE layer
    "mamba2": {"head_dim": 32, "n_groups": 1},  # hidden_size * expand = num_heads * head_dim; groups divide heads
    "musicgen": {"decoder": {"num_codebooks": 1}},  # one row of codes a token: the batch is (1, S) like any text's
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                       "indexer_compress_ratio": 4, "hc_lowrank": 16},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "axial_pos_shape": [8, 16],
                 "axial_pos_embds_dim": [32, 32]},
    "xmod": {"default_language": "en_XX"},  # its adapters need a language
    "zaya": {"num_experts_per_tok": 1},
    # its hybrid layers share one tied transformer block, which needs two of them to tie
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
}
PER_FAMILY["qwen4_exp"] = {"text_config": PER_FAMILY["qwen4_exp_text"]}
PER_FAMILY["dots3_note"] = {"text_config": PER_FAMILY["dots3_note_text"]}

# Common variants beside every family's default: name -> (model type, constructor arguments over the tiny ones).
# Rotary scalings that follow the sequence (longrope's factors by the largest position, dynamic NTK's base by the
# length) set to change within the 128 tokens; those that do not (YaRN, Llama 3) beside them. ``rope_parameters``
# is given as ``rope_scaling`` to a config class that takes that instead.
_THETA = {"rope_theta": 10000.0}
_LONGROPE = {**_THETA, "rope_type": "longrope", "original_max_position_embeddings": 64,
             "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)]}
VARIANTS: dict[str, tuple[str, dict]] = {
    # Phi-3/3.5/4-mini 128K: short factors up to original_max_position_embeddings, long ones past it (8 = head_dim / 2);
    # Phi-3's config has the limit at its top level too, which wins over the rotary parameters'
    "phi3+longrope": ("phi3", {"max_position_embeddings": 512, "original_max_position_embeddings": 64,
                               "rope_parameters": _LONGROPE}),
    "llama+dynamic": ("llama", {"max_position_embeddings": 64,
                                "rope_parameters": {**_THETA, "rope_type": "dynamic", "factor": 2.0}}),
    "llama+yarn": ("llama", {"rope_parameters": {**_THETA, "rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64}}),
    "llama+llama3": ("llama", {"rope_parameters": {**_THETA, "rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    # what seqmesh's refusal of chunked attention tells a Llama 4 user to set; layer 1 without RoPE, whose attention
    # temperature grows every floor_scale positions
    "llama4_text+unchunked": ("llama4_text", {"attention_chunk_size": None, "floor_scale": 16, "no_rope_layers": [1, 0],
                                              "layer_types": ["full_attention", "full_attention"]}),
    "qwen2+sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1,
                                "layer_types": ["full_attention", "sliding_attention"]}),
    # MiniMax-M3 with its block-sparse layers (the default config has none): one sparse layer, then a full one
    "minimax_m3_vl_text+sparse": ("minimax_m3_vl_text", {"layer_types": ["minimax_m3_sparse", "full_attention"],
                                                         "index_block_size": 16, "index_topk_blocks": 2}),
    # RoBERTa as a causal LM: positions numbered from padding_idx + 1, skipping padding (id 1, among the random ids)
    "roberta+decoder": ("roberta", {"is_decoder": True}),
    # Doge with its cross-domain experts (the default config has a dense MLP): 16 experts, 4 a token
    "doge+moe": ("doge", {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 4}),
    # dots.llm3 whose sliding layers have heads of their own (2 beside the indexed layers' 4: transformers'
    # per-layer config, which refuses a global num_attention_heads)
    "dots3_note_text+own_heads": ("dots3_note_text", {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 2}),
    # BigBird as a causal LM with full attention (its block-sparse default attends both ways, and is refused)
    "big_bird+original_full": ("big_bird", {"is_decoder": True, "attention_type": "original_full"}),
    # XLM as a causal LM (its default attends both ways): its padding id (2, among the random ids) counted over the row
    "xlm+causal": ("xlm", {"causal": True}),
}

_MISSING = object()


def _read(config, field: str):
    """``config.field``; where reading it raises (a per-layer attribute of a heterogeneous config: Gemma 4's
    head_dim, dots3's heads), the class's default for it; _MISSING where it has neither."""
    try:
        return getattr(config, field)
    except Exception:  # noqa: BLE001 - any refusal to read: the declared default, if any
        fields = dataclasses.fields(type(config)) if dataclasses.is_dataclass(config) else ()
        declared = {f.name: f.default for f in fields}
        return declared.get(field, _MISSING)


@functools.lru_cache(maxsize=None)
def _constructor_fields(config_cls: type) -> frozenset[str]:
    """What ``config_cls``'s constructor takes: its dataclass fields and ``__init__``'s parameters. Cached per class:
    the census asks of every field name and alias of each of some 200 classes, and ``inspect.signature`` is slow (4%
    of the census's time while it ran once a field)."""
    fields = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set()
    return frozenset(fields | set(inspect.signature(config_cls.__init__).parameters))


def _takes(config_cls: type, field: str) -> bool:
    """Whether ``config_cls``'s constructor takes ``field`` (a property, Falcon's head_dim, is derived)."""
    if isinstance(getattr(config_cls, field, None), property):
        return False
    return field in _constructor_fields(config_cls)


def _fields_for(config_cls: type, name: str) -> list[str]:
    """The constructor fields of ``config_cls`` that ``name`` means: itself, or its alias either way round in
    ``attribute_map`` (some families map the field to the alias, Kolibri's num_experts -> num_local_experts)."""
    amap = config_cls.attribute_map
    names = [amap.get(name, name), name] + [alias for alias, field in amap.items() if field == name]
    return [f for f in dict.fromkeys(names) if _takes(config_cls, f)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kinds(values) -> list[str] | None:
    """The distinct kinds of a per-layer list, in order of first appearance; None for anything else."""
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return list(dict.fromkeys(values))


def tiny_kwargs(config_cls: type, default, extra: dict | None = None) -> dict:
    """Constructor arguments that make ``config_cls`` tiny, from its default instance ``default``: the TINY
    sizes of the fields it takes; one layer per kind of each per-layer kind list (at least TINY's layers);
    its sub-configs made tiny the same way; its special token ids within the small vocabulary; ``extra``
    (PER_FAMILY's or a variant's arguments) last."""
    from transformers import PretrainedConfig

    extra = dict(extra or {})
    kwargs: dict = {}
    for name, size in TINY.items():
        for field in _fields_for(config_cls, name):
            value = _read(default, field)
            settable = _is_int(value) or (isinstance(value, list) and value and all(_is_int(v) for v in value))
            if field not in kwargs and (settable or (value is None and name in NULLABLE)):
                kwargs[field] = size
    layers_field = config_cls.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    kinds = {f: k for f in KIND_LISTS if _takes(config_cls, f) and (k := _kinds(_read(default, f))) is not None}
    if kinds and layers_field in kwargs:
        layers = max([kwargs[layers_field]] + [len(k) for k in kinds.values()])
        kwargs[layers_field] = layers
        for field, k in kinds.items():  # each kind once, the last repeated to fill the layers
            kwargs[field] = (k + k[-1:] * layers)[:layers]
    for name, sub in vars(default).items():
        if isinstance(sub, PretrainedConfig):
            kwargs[name] = type(sub)(**tiny_kwargs(type(sub), sub, extra.pop(name, None)))
    _keep_ties(config_cls, default, kwargs)
    vocab = kwargs.get(config_cls.attribute_map.get("vocab_size", "vocab_size"))
    for i, name in enumerate(SPECIAL_TOKENS):
        token = _read(default, name)
        tokens = token if isinstance(token, list) else [token]
        if vocab is not None and any(_is_int(t) and t >= vocab for t in tokens):
            kwargs[name] = vocab - 1 - i
    return {**kwargs, **extra}


def _keep_ties(config_cls: type, default, kwargs: dict) -> None:
    """Sizes multi-head latent attention ties together, kept tied: a key/value head per query head (its keys
    come from the latent per head), and a head_dim that is the rotary part's where the default has them equal."""
    def field(name: str) -> str | None:
        return next((f for f in _fields_for(config_cls, name) if f in kwargs), None)

    heads, kv_heads, lora = field("num_attention_heads"), field("num_key_value_heads"), field("kv_lora_rank")
    if lora and heads and kv_heads:
        kwargs[kv_heads] = kwargs[heads]
    head_dim, rope_dim = field("head_dim"), field("qk_rope_head_dim")
    if head_dim and rope_dim and head_dim != rope_dim and _read(default, head_dim) == _read(default, rope_dim):
        kwargs[head_dim] = kwargs[rope_dim]


def census_names() -> list[str]:
    """Every causal-LM model type of the installed transformers, then the variants whose family it has."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return families + [v for v, (family, _) in VARIANTS.items() if family in CONFIG_MAPPING]


def census_config(name: str):
    """The tiny config of a model type or variant."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family, extra = VARIANTS.get(name, (name, {}))
    config_cls = CONFIG_MAPPING[family]
    extra = {**PER_FAMILY.get(family, {}), **extra}
    if "rope_parameters" in extra and not _takes(config_cls, "rope_parameters"):
        extra["rope_scaling"] = extra.pop("rope_parameters")
    try:
        default = config_cls()
    except Exception:  # noqa: BLE001 - a default its own validation refuses (Gemma 4's assistant): with the extras
        default = config_cls(**extra)
    config = config_cls(**tiny_kwargs(config_cls, default, extra))
    from transformers import PretrainedConfig

    unshrunk = [k for k, v in vars(config).items()
                if isinstance(v, PretrainedConfig) and not isinstance(getattr(default, k, None), PretrainedConfig)]
    if unshrunk:  # a sub-config the default left None (Gemma 4's assistant before 5.24): made tiny from the built one
        config = config_cls(**tiny_kwargs(config_cls, config, extra))
    return config


def build(config, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The model of ``config`` in eval mode (float64 unless asked), with transformers' own attention (SDPA, or
    eager where the family has none), every weight moved by seeded noise of NOISE's size."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model_cls = AutoModelForCausalLM._model_mapping[type(config)]
    attention = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    options = dict(attn_implementation=attention, dtype=dtype, experts_implementation="eager")
    part = next((sub for sub in vars(config).values() if type(sub) is model_cls.config_class), None)
    if part is not None:  # the causal LM is one part of a composite config (MusicGen's decoder)
        model = model_cls._from_config(part, **options).eval()
    else:
        model = AutoModelForCausalLM.from_config(config, **options).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model
