"""transformers checkpoint folders: loaded shard by shard on every rank, checked before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pretrained_cases import build_error, loaded_weights, loading_memory
from seqmesh.tools.launch import spawn
from seqmesh.training.model import build_model


def _saved(folder, preset: str, **kwargs) -> str:
    """``preset`` saved with ``save_pretrained(**kwargs)``; ``"uneven"``: llama-tiny with a vocabulary and
    MLP width that 4 ranks do not divide (shards of 65, 65, 65 and 63 rows)."""
    if preset == "uneven":
        from seqmesh.training.model import hf_config
        from seqmesh.training.presets import MODELS

        config = hf_config(MODELS["llama-tiny"])
        config.update({"vocab_size": 258, "intermediate_size": 130})
        config.save_pretrained(str(folder) + "-config")
        preset = str(folder) + "-config"
    model = build_model(preset, seed=5)
    dtype = kwargs.pop("dtype", None)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(str(folder), **kwargs)
    return str(folder)


def _reference(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("preset, save, mesh", [
    ("llama-tiny", {"max_shard_size": "20KB"}, (2, 2, 1)),  # many files and an index; untied head
    ("qwen3-tiny", {"dtype": torch.bfloat16}, (2, 2, 1)),  # bf16 on disk into fp32; tied head absent from the file
    ("llama-tiny", {"dtype": torch.bfloat16, "max_shard_size": "50KB"}, (2, 1, 2)),  # HSDP (Replicate, Shard(0))
    ("uneven", {}, (2, 2, 1)),  # rows that 4 ranks do not divide evenly
])
def test_checkpoint_loads_shard_by_shard_as_from_pretrained(pools, tmp_path, preset, save, mesh):
    folder = _saved(tmp_path / "ckpt", preset, **save)
    if "max_shard_size" in save:
        assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    got = pools.run(4, loaded_weights, folder, *mesh)[0]
    want = _reference(folder)
    assert got["dtypes"] == ["torch.float32"]
    assert got["tied"] == (preset == "qwen3-tiny")
    params = dict(want.named_parameters())
    assert sorted(got["weights"]) == sorted(params)
    for name, p in params.items():
        assert torch.equal(got["weights"][name], p), name
    assert torch.equal(got["inv_freq"], want.model.rotary_emb.inv_freq)


def test_a_checkpoint_that_differs_from_its_config_is_refused_naming_the_difference(pools, tmp_path):
    folder = _saved(tmp_path / "ckpt", "llama-tiny")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config.pop("layer_types", None)  # one entry per layer: transformers itself refuses a count that differs
    config.update(intermediate_size=96, num_hidden_layers=3)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    errors = pools.run(4, build_error, folder)
    assert len(set(errors)) == 1, errors  # every rank raises the same error
    assert "missing model.layers.2." in errors[0], errors[0]
    assert "shapes differ: model.layers.0.mlp.down_proj.weight is [64, 128]" in errors[0], errors[0]
    config.update(intermediate_size=128, num_hidden_layers=1)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    error = pools.run(4, build_error, folder)[0]
    assert "unexpected model.layers.1." in error and "missing" not in error, error


def _memory_model(folder) -> str:
    """About 80 MB of fp32 weights, so a rank's quarter and the whole differ by far more than noise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder), max_shard_size="30MB")
    return str(folder)


def test_loading_holds_a_ranks_shard_not_the_whole_model(tmp_path):
    """4 fresh ranks load an 80 MB model shard by shard; then rank 0 loads it whole with from_pretrained."""
    folder = _memory_model(tmp_path / "ckpt")
    whole = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))
    ranks = spawn(loading_memory, 4, folder, threads=1)
    largest = 32000 * 256 * 4  # the embedding, the largest tensor: a rank reads a quarter of it at a time
    for rank in ranks:
        assert rank["read"] == rank["held"] <= whole / 4 + largest, rank  # each rank reads only its rows
        assert rank["sharded"] < whole / 4 + largest / 4 + 16 * 2**20, (rank, whole)
    assert ranks[0]["whole"] > whole * 0.9, (ranks[0], whole)
    per_rank = ", ".join(f"{r['sharded'] / 2**20:.1f}" for r in ranks)
    print(f"\nwhole model {whole / 2**20:.1f} MiB; host memory above the start while loading, per rank: "
          f"{per_rank} MiB sharded over 4 ranks, {ranks[0]['whole'] / 2**20:.1f} MiB whole with from_pretrained")
