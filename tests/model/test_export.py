"""transformers folders out: at the end of ``seqmesh train`` and from any seqmesh checkpoint, loaded
back by ``from_pretrained`` with the trained weights and logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pretrained_cases import export_loaded, trained_weights
from seqmesh.tools.cli import main
from seqmesh.training.config import TrainConfig
from seqmesh.model.lm import build_model


def _from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _tokenizer(folder) -> str:
    """A small word-level tokenizer saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(["<unk>", "<eos>", *"abcdefghijklmnopqrstuvwxyz"])}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
def test_checkpoint_folder_trains_and_comes_back_as_a_transformers_folder(pools, tmp_path, preset):
    folder = tmp_path / "start"
    build_model(preset, seed=2).save_pretrained(str(folder))
    tokenizer = _tokenizer(tmp_path / "tokenizer")
    cfg = TrainConfig(model=str(folder), seq_len=64, ulysses=2, ring=2, dp=1, steps=3, lr=1e-2, warmup=1,
                      log_every=1, eval_every=0, symbols=8, out=str(tmp_path / "run"), tokenizer=tokenizer)
    trained = pools.run(4, trained_weights, cfg)[0]["weights"]
    out = tmp_path / "run" / "model"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(out)), os.listdir(out)
    exported = _from_pretrained(out)
    reference = _from_pretrained(folder)  # the starting weights, replaced by the trained ones
    start = dict(reference.named_parameters())
    assert not torch.equal(trained["model.norm.weight"], start["model.norm.weight"])  # it did train
    missing, unexpected = reference.load_state_dict(trained, strict=False)  # a tied head is saved once
    assert not unexpected and all(name in trained for name, _ in reference.named_parameters()), (missing, unexpected)
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) == (preset == "qwen3-tiny")
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = exported(tokens).logits, reference(tokens).logits
    difference = float((got - want).abs().max())
    print(f"\n{preset}: largest logit difference, exported vs trained: {difference:.2e}")
    assert difference == 0.0, difference  # the same weights through the same ops: measured 0.0

    # the same from the run's checkpoint, through the command line; an existing folder needs --overwrite
    step = tmp_path / "run" / "checkpoints" / "step_0000003"
    again = tmp_path / "again"
    assert main(["export", str(step), str(again), "--max-shard-gb", str(20e3 / 2**30)]) == 0
    assert os.path.isfile(again / "model.safetensors.index.json") and os.path.isfile(again / "tokenizer.json")
    reloaded = dict(_from_pretrained(again).named_parameters())
    assert all(torch.equal(reloaded[n], p) for n, p in exported.named_parameters())
    assert main(["export", str(step), str(again)]) == 2  # refused: it exists
    assert main(["export", str(step), str(again), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert json.loads((again / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("fsdp", [True, False])
def test_export_pretrained_writes_sharded_files_from_fsdp_shards_or_whole(pools, tmp_path, fsdp):
    folder = str(tmp_path / "start")
    build_model("llama-tiny", seed=4).save_pretrained(folder)
    out = str(tmp_path / "out")
    pools.run(4, export_loaded, folder, out, 30_000, torch.bfloat16, fsdp)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    got, want = dict(_from_pretrained(out).named_parameters()), dict(_from_pretrained(folder).named_parameters())
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], p.to(torch.bfloat16).float()) for n, p in want.items())
    assert not os.path.exists(out + ".partial")


def test_deepseek_with_experts_split_comes_back_with_its_routing_bias(pools, tmp_path):
    """DeepSeek-V3 (its routing bias is a persistent buffer, not a weight) trained with --ep 2 from a transformers
    folder, then exported from its checkpoint: the folder holds the trained weights and the bias it started with
    (before, the export dropped the bias, and from_pretrained filled in zeros: another router)."""
    from transformers import AutoModelForCausalLM

    from experts_cases import ep_config

    folder = tmp_path / "start"
    start = AutoModelForCausalLM.from_config(ep_config("deepseek_v3", experts=4), dtype=torch.float32)
    bias = {n: b for n, b in start.named_buffers() if n.endswith("e_score_correction_bias")}
    assert bias
    with torch.no_grad():
        for b in bias.values():
            b.copy_(torch.linspace(-0.3, 0.3, b.numel()))
    start.save_pretrained(str(folder))
    cfg = TrainConfig(model=str(folder), seq_len=48, ulysses=2, ring=1, dp=1, ep=2, steps=2, lr=1e-2, warmup=1,
                      log_every=1, eval_every=0, symbols=8, out=str(tmp_path / "run"), export=False)
    trained = pools.run(2, trained_weights, cfg)[0]["weights"]
    again = tmp_path / "again"
    assert main(["export", str(tmp_path / "run" / "checkpoints" / "step_0000002"), str(again)]) == 0
    reloaded = _from_pretrained(again)
    buffers = dict(reloaded.named_buffers())
    for name, b in bias.items():
        assert torch.equal(buffers[name], b), name
    assert all(torch.equal(p, trained[n]) for n, p in reloaded.named_parameters())
