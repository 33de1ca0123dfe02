"""Model shapes: tiny ones for CPU tests and demos, and the real shapes of public models.

Shapes come from the models' published configurations; weights are never downloaded (training
presets start from random initialisation). ``model_shape`` also reads a transformers
``config.json`` (a file or a directory holding one: :mod:`.config_json`).
"""

from __future__ import annotations

import os

from .config_json import shape_from_config
from .shapes import ModelShape, VisionShape


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-tiny", "llama", 64, 2, 4, 2, 16, 128, 256, rope_theta=10000.0),
        ModelShape("qwen3-tiny", "qwen3", 64, 2, 4, 2, 16, 128, 256, tie_embeddings=True, rope_theta=1e6),
        ModelShape("llama3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
        ModelShape("llama3-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
        ModelShape("llama3-70b", "llama", 8192, 80, 64, 8, 128, 28672, 128256, False, 500000.0),
        ModelShape("qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6),
        ModelShape("qwen3-4b", "qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1e6),
        ModelShape("qwen3-32b", "qwen3", 5120, 64, 64, 8, 128, 25600, 151936, False, 1e6),
        ModelShape("mistral-7b", "mistral", 4096, 32, 32, 8, 128, 14336, 32768, False, 1e6),
        # hybrid: Gated DeltaNet layers with full attention every 4th layer
        ModelShape("qwen3.5-tiny", "qwen3_5_text", 64, 4, 4, 2, 16, 128, 256, True, 1e6, full_attention_interval=4,
                   linear_key_heads=2, linear_value_heads=4, linear_key_dim=16, linear_value_dim=16),
        # transformers' Qwen3_5TextConfig defaults, its "Qwen3.5-9B style configuration"
        ModelShape("qwen3.5-9b", "qwen3_5_text", 4096, 32, 16, 4, 256, 12288, 248320, False, 1e7,
                   full_attention_interval=4, linear_key_heads=16, linear_value_heads=32, linear_key_dim=128,
                   linear_value_dim=128),
        # sliding windows and sinks (published configs: Mistral-7B-v0.1, Gemma 3 4B/27B, gpt-oss 20b/120b)
        ModelShape("mistral-window-tiny", "mistral", 64, 2, 4, 2, 16, 128, 256, sliding_window=8),
        ModelShape("mistral-7b-window", "mistral", 4096, 32, 32, 8, 128, 14336, 32000, False, 10000.0,
                   sliding_window=4096),
        ModelShape("gemma3-tiny", "gemma3_text", 64, 2, 4, 2, 16, 128, 256, True, 1e6, sliding_window=8, full_every=2,
                   extra=(("query_pre_attn_scalar", 16),)),
        ModelShape("gemma3-4b", "gemma3_text", 2560, 34, 8, 4, 256, 10240, 262208, True, 1e6, sliding_window=1024,
                   full_every=6, extra=(("query_pre_attn_scalar", 256),)),
        ModelShape("gemma3-27b", "gemma3_text", 5376, 62, 32, 16, 128, 21504, 262208, True, 1e6, sliding_window=1024,
                   full_every=6, extra=(("query_pre_attn_scalar", 168),)),
        ModelShape("gpt-oss-tiny", "gpt_oss", 64, 2, 4, 2, 16, 64, 256, False, 150000.0, sliding_window=8,
                   full_every=2, experts=4, experts_per_token=2),
        ModelShape("gpt-oss-20b", "gpt_oss", 2880, 24, 64, 8, 64, 2880, 201088, False, 150000.0, sliding_window=128,
                   full_every=2, experts=32, experts_per_token=4),
        ModelShape("gpt-oss-120b", "gpt_oss", 2880, 36, 64, 8, 64, 2880, 201088, False, 150000.0, sliding_window=128,
                   full_every=2, experts=128, experts_per_token=4),
        # vision-language: a tower of 2x2-pixel patches before a tiny decoder; published Qwen2.5-VL-7B, Qwen3-VL-8B
        ModelShape("qwen2.5-vl-tiny", "qwen2_5_vl", 64, 2, 4, 2, 16, 128, 256, False, 10000.0,
                   vision=VisionShape(3, 32, 4, 48, 64, patch=2, window=8, full_blocks=(1,))),
        ModelShape("qwen3-vl-tiny", "qwen3_vl", 64, 2, 4, 2, 16, 128, 256, False, 10000.0,
                   vision=VisionShape(3, 32, 4, 48, 64, patch=2, deepstack=(0, 2), position_table=16, gated=False)),
        ModelShape("qwen2.5-vl-7b", "qwen2_5_vl", 3584, 28, 28, 4, 128, 18944, 152064, False, 1e6,
                   vision=VisionShape(32, 1280, 16, 3420, 3584, window=112, full_blocks=(7, 15, 23, 31))),
        ModelShape("qwen3-vl-8b", "qwen3_vl", 4096, 36, 32, 8, 128, 12288, 151936, False, 5e6,
                   vision=VisionShape(27, 1152, 16, 4304, 4096, patch=16, deepstack=(8, 16, 24), position_table=2304,
                                      gated=False)),
    )
}


def model_shape(name_or_path: str) -> ModelShape:
    """A preset by name, or the shape in a transformers ``config.json`` (file or directory)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(MODELS)}) and no config.json at {path!r}."
        )
    return shape_from_config(path)
