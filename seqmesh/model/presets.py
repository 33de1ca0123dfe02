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
        ModelShape(name="llama-tiny", family="llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, rope_theta=10000.0),
        ModelShape(name="qwen3-tiny", family="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, tie_embeddings=True, rope_theta=1e6),
        ModelShape(name="llama3.2-1b", family="llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                   intermediate=8192, vocab=128256, tie_embeddings=True, rope_theta=500000.0),
        ModelShape(name="llama3-8b", family="llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                   intermediate=14336, vocab=128256, tie_embeddings=False, rope_theta=500000.0),
        ModelShape(name="llama3-70b", family="llama", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                   intermediate=28672, vocab=128256, tie_embeddings=False, rope_theta=500000.0),
        ModelShape(name="qwen3-0.6b", family="qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                   intermediate=3072, vocab=151936, tie_embeddings=True, rope_theta=1e6),
        ModelShape(name="qwen3-4b", family="qwen3", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                   intermediate=9728, vocab=151936, tie_embeddings=True, rope_theta=1e6),
        ModelShape(name="qwen3-32b", family="qwen3", hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128,
                   intermediate=25600, vocab=151936, tie_embeddings=False, rope_theta=1e6),
        ModelShape(name="mistral-7b", family="mistral", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                   intermediate=14336, vocab=32768, tie_embeddings=False, rope_theta=1e6),
        # hybrid: Gated DeltaNet layers with full attention every 4th layer
        ModelShape(name="qwen3.5-tiny", family="qwen3_5_text", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, tie_embeddings=True, rope_theta=1e6, full_attention_interval=4,
                   linear_key_heads=2, linear_value_heads=4, linear_key_dim=16, linear_value_dim=16),
        # transformers' Qwen3_5TextConfig defaults, its "Qwen3.5-9B style configuration"
        ModelShape(name="qwen3.5-9b", family="qwen3_5_text", hidden=4096, layers=32, heads=16, kv_heads=4, head_dim=256,
                   intermediate=12288, vocab=248320, tie_embeddings=False, rope_theta=1e7, full_attention_interval=4,
                   linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128),
        # sliding windows and sinks (published configs: Mistral-7B-v0.1, Gemma 3 4B/27B, gpt-oss 20b/120b)
        ModelShape(name="mistral-window-tiny", family="mistral", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, sliding_window=8),
        ModelShape(name="mistral-7b-window", family="mistral", hidden=4096, layers=32, heads=32, kv_heads=8,
                   head_dim=128, intermediate=14336, vocab=32000, tie_embeddings=False, rope_theta=10000.0,
                   sliding_window=4096),
        ModelShape(name="gemma3-tiny", family="gemma3_text", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, tie_embeddings=True, rope_theta=1e6, sliding_window=8, full_every=2,
                   extra=(("query_pre_attn_scalar", 16),)),
        ModelShape(name="gemma3-4b", family="gemma3_text", hidden=2560, layers=34, heads=8, kv_heads=4, head_dim=256,
                   intermediate=10240, vocab=262208, tie_embeddings=True, rope_theta=1e6, sliding_window=1024,
                   full_every=6, extra=(("query_pre_attn_scalar", 256),)),
        ModelShape(name="gemma3-27b", family="gemma3_text", hidden=5376, layers=62, heads=32, kv_heads=16, head_dim=128,
                   intermediate=21504, vocab=262208, tie_embeddings=True, rope_theta=1e6, sliding_window=1024,
                   full_every=6, extra=(("query_pre_attn_scalar", 168),)),
        ModelShape(name="gpt-oss-tiny", family="gpt_oss", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=64, vocab=256, tie_embeddings=False, rope_theta=150000.0, sliding_window=8,
                   full_every=2, experts=4, experts_per_token=2),
        ModelShape(name="gpt-oss-20b", family="gpt_oss", hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64,
                   intermediate=2880, vocab=201088, tie_embeddings=False, rope_theta=150000.0, sliding_window=128,
                   full_every=2, experts=32, experts_per_token=4),
        ModelShape(name="gpt-oss-120b", family="gpt_oss", hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64,
                   intermediate=2880, vocab=201088, tie_embeddings=False, rope_theta=150000.0, sliding_window=128,
                   full_every=2, experts=128, experts_per_token=4),
        # vision-language: a tower of 2x2-pixel patches before a tiny decoder; published Qwen2.5-VL-7B, Qwen3-VL-8B
        ModelShape(name="qwen2.5-vl-tiny", family="qwen2_5_vl", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, tie_embeddings=False, rope_theta=10000.0,
                   vision=VisionShape(depth=3, hidden=32, heads=4, intermediate=48, out_hidden=64, patch=2, window=8,
                                      full_blocks=(1,))),
        ModelShape(name="qwen3-vl-tiny", family="qwen3_vl", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   intermediate=128, vocab=256, tie_embeddings=False, rope_theta=10000.0,
                   vision=VisionShape(depth=3, hidden=32, heads=4, intermediate=48, out_hidden=64, patch=2,
                                      deepstack=(0, 2), position_table=16, gated=False)),
        ModelShape(name="qwen2.5-vl-7b", family="qwen2_5_vl", hidden=3584, layers=28, heads=28, kv_heads=4,
                   head_dim=128, intermediate=18944, vocab=152064, tie_embeddings=False, rope_theta=1e6,
                   vision=VisionShape(depth=32, hidden=1280, heads=16, intermediate=3420, out_hidden=3584, window=112,
                                      full_blocks=(7, 15, 23, 31))),
        ModelShape(name="qwen3-vl-8b", family="qwen3_vl", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                   intermediate=12288, vocab=151936, tie_embeddings=False, rope_theta=5e6,
                   vision=VisionShape(depth=27, hidden=1152, heads=16, intermediate=4304, out_hidden=4096, patch=16,
                                      deepstack=(8, 16, 24), position_table=2304, gated=False)),
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
