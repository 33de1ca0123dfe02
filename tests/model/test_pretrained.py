"""transformers checkpoint folders: loaded shard by shard on every rank, checked before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pretrained_cases import build_error, loaded_weights, loading_memory, train_command
from seqmesh.comm.launch import spawn
from seqmesh.model.lm import build_model


def _saved(folder, preset: str, **kwargs) -> str:
    """``preset`` saved with ``save_pretrained(**kwargs)``; ``"uneven"``: llama-tiny with a vocabulary and
    MLP width that 4 ranks do not divide (shards of 65, 65, 65 and 63 rows)."""
    if preset == "uneven":
        from seqmesh.model.lm import hf_config
        from seqmesh.model.presets import MODELS

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


def _damaged(tmp_path, damage: str) -> tuple[str, str, str]:
    """llama-tiny saved in several shards, then damaged as ``damage`` says: (folder, the file the error
    must name, a tensor it must name, or "")."""
    model = build_model("llama-tiny", seed=5)
    name = "model.layers.0.mlp.up_proj.weight"  # (128, 64): its last row is on rank 1 of 2 alone
    with torch.no_grad():
        if damage in ("huge", "nan"):
            dict(model.named_parameters())[name][-1, 7] = 2.4e36 if damage == "huge" else float("nan")
    folder = tmp_path / "ckpt"
    model.save_pretrained(str(folder), max_shard_size="20KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"][name]
    raw = shard.read_bytes()
    header = int.from_bytes(raw[:8], "little")
    if damage == "truncated header":
        shard.write_bytes(raw[:8 + header // 2])
    elif damage == "garbage header":
        shard.write_bytes(raw[:8] + b"\xff" * 32 + raw[40:])
    elif damage in ("wrong shard", "outside", "absolute"):
        other = next(f for f in index["weight_map"].values() if f != shard.name)
        index["weight_map"][name] = {"wrong shard": other, "outside": "../" + shard.name,
                                     "absolute": str(shard)}[damage]
        index_path.write_text(json.dumps(index))
        return str(folder), str(index_path), name
    if damage in ("huge", "nan"):  # named in the folder the error names
        return str(folder), shard.name, name
    return str(folder), str(shard), ""


DAMAGE = {  # what is wrong, and what the one error line must say besides the file and the tensor
    "truncated header": ("invalid header length", "truncated or damaged", "Download or save it again"),
    "garbage header": ("invalid UTF-8 in header", "truncated or damaged", "Download or save it again"),
    "wrong shard": ("maps tensors to files that do not hold them", "save the folder again"),
    "outside": ("names '../", "a file outside", "Correct the weight_map"),
    "absolute": ("a file outside", "Correct the weight_map"),
    "huge": ("(max |w| 2.4e+36)", "non-finite or absurdly large weights", "Download or save it again"),
    "nan": ("(max |w| nan)", "non-finite or absurdly large weights", "Download or save it again"),
}


@pytest.mark.parametrize("damage, fsdp", [(d, True) for d in DAMAGE] + [("nan", False), ("garbage header", False)])
def test_a_damaged_checkpoint_is_one_error_line_on_every_rank(pools, tmp_path, damage, fsdp):
    """``seqmesh train --model DIR`` on 2 ranks: exit 2 on both, the same error on both, one line on rank 0's
    stderr naming the file (and the tensor) and the fix, no traceback. The files' own damage is found before
    any model is built; the values (non-finite, absurd) as the shards are read, the tensor's bad row on rank
    1 alone (its shard) yet the error raised by both ranks."""
    folder, file, tensor = _damaged(tmp_path, damage)
    argv = ["--model", folder, "--seq-len", "64", "--ulysses", "2", "--ring", "1", "--dp", "1", "--steps", "1",
            "--eval-every", "0", "--no-export", "--out", str(tmp_path / "run")] + ([] if fsdp else ["--no-fsdp"])
    files_damaged = damage not in ("huge", "nan")
    ranks = pools.run(2, train_command, argv, files_damaged)
    error = ranks[0]["error"]
    assert [r["code"] for r in ranks] == [2, 2] and [r["error"] for r in ranks] == [error] * 2, ranks
    assert folder in error and file in error and tensor in error and all(words in error for words in DAMAGE[damage]), error
    assert [line for line in ranks[0]["stderr"].splitlines() if "seqmesh: error" in line] == [f"seqmesh: error: {error}"]
    assert "\n" not in error and "seqmesh: error" not in ranks[1]["stderr"]
    assert not any("Traceback" in r["stderr"] for r in ranks), ranks
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step
