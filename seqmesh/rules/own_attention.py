"""The decoder families whose attention layers compute their attention themselves, outside transformers'
``AttentionInterface``, which seqmesh runs through the layers' own projections (:mod:`seqmesh.hf.own_attention`):
one table, read by the runtime (by the layer's class) and by the planner (by config.json's ``model_type``).
Torch-free: ``seqmesh plan`` reads it."""

from __future__ import annotations

# config.json's model_type -> the class of its attention layers
LAYER_CLASSES = {"bloom": "BloomAttention", "mpt": "MptAttention", "falcon": "FalconAttention",
                 "gpt_neo": "GPTNeoAttention", "openai-gpt": "openai.Attention", "xglm": "XGLMAttention",
                 "gpt_neox_japanese": "GPTNeoXJapaneseAttention", "doge": "DogeAttention",
                 "rembert": "RemBertSelfAttention", "megatron-bert": "MegatronBertSelfAttention",
                 "trocr": "TrOCRAttention", "mvp": "MvpAttention", "roformer": "RoFormerSelfAttention",
                 "big_bird": "BigBirdSelfAttention"}
# of those, the families seqmesh plan does not size yet (their config.json's names and layer layouts)
UNPLANNED = ("openai-gpt", "xglm", "gpt_neox_japanese", "doge")
# the families whose bias by distance (ALiBi) only the math kernel (and, on the CPU, torch's flash op) adds
ALIBI = ("bloom", "mpt")
# the families whose MLP is two matrices (up, activation, down), not a gated three
TWO_MATRIX_MLP = ("bloom", "mpt", "falcon", "gpt_neo", "openai-gpt", "xglm", "gpt_neox_japanese", "rembert",
                  "megatron-bert", "big_bird")


def tensor_parallel_refusal(family: str) -> str | None:
    """Why seqmesh runs ``family`` (a model_type) without tensor parallelism, or None."""
    if family not in LAYER_CLASSES:
        return None
    return (f"seqmesh runs {family}'s attention layers ({LAYER_CLASSES[family]}) itself, through their own fused "
            "projections, which its tensor parallelism does not split (tp 1 only)")
