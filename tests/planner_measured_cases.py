"""Rank-side cases of test_planner_measured: the tracked peak of real training steps, measured as
``seqmesh bench memory`` measures it (the ``seqmesh train`` build, the second of two steps)."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from seqmesh.bench.memory import MemoryBench, measure_rank

# a wider Llama than llama-tiny: 3 layers, hidden 128, head dim 32, intermediate 352, vocab 512
WIDE_CONFIG = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
}


# a RecurrentGemma: two RG-LRU blocks and one local attention layer (a window of 256), tied embeddings
RECURRENT_GEMMA_CONFIG = {
    "model_type": "recurrent_gemma", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 512, "lru_width": 256,
    "attention_window_size": 256, "block_types": ["recurrent", "recurrent", "attention"],
}


# a Jamba: Mamba (v1) layers (inner 256, state 16) around one attention layer, a MoE layer of 4 experts (2 a token)
JAMBA_CONFIG = {
    "model_type": "jamba", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "attn_layer_period": 3,
    "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
    "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_dt_rank": 8, "mamba_expand": 2,
}


# a pure Mamba: three layers of a norm and a Mamba mixer (inner 256, state 16), tied embeddings
MAMBA_CONFIG = {
    "model_type": "mamba", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "vocab_size": 512,
    "state_size": 16, "expand": 2, "time_step_rank": 8, "conv_kernel": 4,
}


# a Nemotron-H: three Mamba2 layers (8 heads of 32, state 64, one group), one attention layer, one MLP layer
NEMOTRON_H_CONFIG = {
    "model_type": "nemotron_h", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention", "mlp"],
    "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 64, "n_groups": 1, "tie_word_embeddings": False,
}


def write_wide_config(folder: str, config: dict = WIDE_CONFIG) -> str:
    """A config.json of the wider model (or ``config``) in ``folder`` (a model argument of TrainConfig); its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def measured_peaks(cases: list[tuple[str, int, int, int, dict]]) -> list[int]:
    """On every rank: for each ``(model, seq_len, ulysses, ring, options)``, this rank's tracked peak bytes (``tp`` in
    the options is the bench's tensor-parallel degree, the rest TrainConfig's memory options)."""
    world = dist.get_world_size()
    peaks = []
    for model, seq_len, u, r, options in cases:
        rest = {k: v for k, v in options.items() if k != "tp"}
        bench = MemoryBench(model=model, world=world, ulysses=u, ring=r, tp=options.get("tp", 1))
        peaks.append(measure_rank(bench, seq_len, rest)["peak_bytes"])
    return peaks
