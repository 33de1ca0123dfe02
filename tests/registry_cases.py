"""A sample of transformers' causal-LM registry through seqmesh.hf: each family is exact or refused
with a ValueError that names what seqmesh cannot compute and what it supports."""

from __future__ import annotations

import inspect

import torch

import seqmesh
from dist_cases import get_mesh
from seqmesh.hf import parallelize

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=64, sliding_window=5, attention_dropout=0.0, n_embd=32, n_layer=2, n_head=4,
             moe_intermediate_size=16, num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             max_position_embeddings=256, n_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(family: str):
    """The family's config class with small sizes wherever its constructor names them."""
    from transformers import CONFIG_MAPPING

    if family == "deepseek_v3":  # MLA needs consistent rope/nope/v head dims
        from family_cases import family_config

        return family_config("deepseek-v3")
    cls = CONFIG_MAPPING[family]
    if family == "lfm2":  # one short-convolution layer and one attention layer
        return cls(**{k: v for k, v in SIZES.items() if k in set(vars(cls()))}, layer_types=["conv", "full_attention"])
    if family == "jamba":  # a Mamba layer and an attention layer (its default puts attention at layer 4 of 8)
        return cls(**{k: v for k, v in SIZES.items() if k in set(vars(cls()))}, attn_layer_period=2, attn_layer_offset=1)
    names = set(inspect.signature(cls.__init__).parameters)
    defaults = cls()
    keys = names | set(vars(defaults))
    return cls(**{k: v for k, v in SIZES.items() if k in keys})


def family_outcome(family: str, seq_len: int = 24) -> dict:
    """``{"outcome": "exact", "err": ...}`` or ``{"outcome": "refused", "message": ...}`` or ``{"outcome":
    "error", ...}`` for anything else (a crash inside, or a refusal that is not a ValueError)."""
    from transformers import AutoModelForCausalLM

    mesh = get_mesh(1, 2)
    config = tiny_config(family)
    build = dict(attn_implementation="eager", dtype=torch.float32, experts_implementation="eager")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, **build)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), **build)
    ids = torch.randint(0, 64, (1, seq_len), generator=torch.Generator().manual_seed(1))
    try:
        parallelize(model, mesh)
        batch = seqmesh.shard_batch({"input_ids": ids}, mesh)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], seqmesh=batch["seqmesh"],
                           use_cache=False).logits
            want = reference(input_ids=ids, use_cache=False).logits
        whole = seqmesh.gather_sequence(logits, mesh, length=seq_len)
        return {"family": family, "outcome": "exact", "err": float((whole - want).abs().max())}
    except ValueError as err:
        return {"family": family, "outcome": "refused", "message": str(err)}
    except Exception as err:  # noqa: BLE001  reported to the test, which fails on it
        return {"family": family, "outcome": "error", "message": f"{type(err).__name__}: {err}"}


def registry_sample(families: list[str]) -> list[dict]:
    return [family_outcome(f) for f in families]
