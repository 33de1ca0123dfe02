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
                 "big_bird": "BigBirdSelfAttention", "xlm": "xlm.MultiHeadAttention"}
# the families whose MLP is two matrices (up, activation, down), not a gated three
TWO_MATRIX_MLP = ("bloom", "mpt", "falcon", "gpt_neo", "openai-gpt", "xglm", "gpt_neox_japanese", "rembert",
                  "megatron-bert", "big_bird", "xlm", "trocr")


# families whose transformers model checkpoints no layer (XLM's layers are halves in lists of their own, its model
# supports_gradient_checkpointing=False): seqmesh train and plan run them without activation checkpointing
NOT_CHECKPOINTED = ("xlm",)


def checkpointing_refusal(name: str) -> str:
    """Why ``name`` (a model class or family) trains without activation checkpointing: the runtime's and the
    planner's words."""
    return (f"{name} does not support activation checkpointing in transformers (its layers are not checkpointable "
            "modules); train and plan it without checkpointing (--no-checkpointing, or checkpointing=False)")


DOGE_WINDOW = 2048  # DogeConfig's keep_window_size


def doge_window_problem(seq_len: int, keep_window_size: int) -> str | None:
    """Why Doge cannot run ``seq_len`` tokens (the runtime's and the planner's words), or None: past
    ``keep_window_size`` keys its dynamic mask keeps only each query's keys of largest bias."""
    if seq_len <= keep_window_size:
        return None
    return (f"a sequence of {seq_len} tokens is longer than keep_window_size={keep_window_size}, past which Doge's "
            "dynamic mask keeps only each query's keep_window_size keys of largest bias, which seqmesh does not "
            "compute; train with --seq-len at most keep_window_size, or raise keep_window_size")


def tensor_parallel_refusal(family: str) -> str | None:
    """Why seqmesh runs ``family`` (a model_type) without tensor parallelism, or None."""
    if family not in LAYER_CLASSES:
        return None
    return (f"seqmesh runs {family}'s attention layers ({LAYER_CLASSES[family]}) itself, through their own fused "
            "projections, which its tensor parallelism does not split (tp 1 only)")
