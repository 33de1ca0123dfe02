"""dots.llm3's config.json (``dots3_note``, ``dots3_note_text``) as transformers reads it, for the planner: a file of an
older release writes no ``per_layer_config`` (its sliding layers' MLA sizes are ``swa_*`` entries, or transformers'
defaults), may name its indexed layers ``full_attention`` (``use_dsa``) or leave ``layer_types`` and
``mlp_layer_types`` to the config class, and gives its window as ``sliding_window_size``. :func:`dots3_entries` writes
them as ``Dots3NoteTextConfig.__post_init__`` builds them, so that one reader (``config_json._sliding_latent_fields``)
sizes every release.
"""

from __future__ import annotations

FAMILIES = ("dots3_note", "dots3_note_text")
# the sliding layers' MLA sizes an older release gives as swa_*, and Dots3NoteTextConfig's defaults for them
SWA_DEFAULTS = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 1024,
                "head_dim": 256, "qk_nope_head_dim": 192, "v_head_dim": 128}
_LEGACY_TYPES = {"deepseek_sparse_attention": "indexed_attention", "attention": "full_attention"}


def dots3_entries(cfg: dict) -> dict:
    """``cfg`` with dots.llm3's layer kinds, MLP kinds, window and sliding layers' sizes as transformers builds them;
    any other config as it is."""
    if cfg.get("model_type") not in FAMILIES:
        return cfg
    out = dict(cfg)
    n = cfg.get("num_hidden_layers") or 0
    if out.get("mlp_layer_types") is None:  # the class's first_k_dense_replace and moe_layer_freq (1 and 1)
        first, freq = cfg.get("first_k_dense_replace", 1), cfg.get("moe_layer_freq", 1)
        out["mlp_layer_types"] = ["sparse" if i >= first and (bool(freq[i]) if isinstance(freq, (list, tuple))
                                                                else i % freq == 0) else "dense" for i in range(n)]
    use_dsa = cfg.get("use_dsa", None if "per_layer_config" in cfg else True)
    if out.get("sliding_window") is None:
        out["sliding_window"] = cfg.get("sliding_window_size", 512)
    types = cfg.get("layer_types")
    if types is None:
        full = "full_attention" if use_dsa is False else "indexed_attention"
        sliding = cfg.get("use_sliding_window", True)
        types = [full if not sliding or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(n)]
    types = [_LEGACY_TYPES.get(t, t) for t in types]
    if use_dsa is not None:  # the older releases call their indexed layers full_attention
        old, new = ("full_attention", "indexed_attention") if use_dsa else ("indexed_attention", "full_attention")
        types = [new if t == old else t for t in types]
    out["layer_types"] = types
    if "per_layer_config" not in cfg:
        own = {k: cfg.get(f"swa_{k}", v) for k, v in SWA_DEFAULTS.items()}
        own["qk_rope_head_dim"] = cfg.get("swa_qk_rope_head_dim", own["head_dim"] - own["qk_nope_head_dim"])
        out["per_layer_config"] = {str(i): own for i, t in enumerate(types) if t == "sliding_attention"}
    return out
