"""Expert parallelism and saved state: a checkpoint written with the experts split over ``ep=4`` resumes at ``ep=2``
and without expert parallelism (AdamW's moments resharded with the weights); the rows the losses of the resumed
runs take equal one uninterrupted process's within a multiple of its noise."""

from __future__ import annotations

import torch

from experts_checkpoint_cases import load_export_all, resume_at_other_ep, save_tiny

NOISE_MULTIPLE = 8


def test_checkpoint_resumes_at_another_ep(pools, tmp_path):
    """Qwen3-MoE on U2 x R2, FSDP2, AdamW, float64: 2 steps at ep=4, saved; loaded at ep=2 and at ep=1, 2 more
    steps each. Every step's loss against the uninterrupted one-process run, and the loaded exp_avg (gathered)
    against that run's after 2 steps."""
    for rank in pools.run(4, resume_at_other_ep, "qwen3_moe", str(tmp_path / "ckpt"), 2, 2, 1, 4, [2, 1]):
        for ep, r in rank.items():
            print(f"\nresumed at ep={ep}: loss {r['loss']:.2f} x noise, exp_avg relative error {r['exp_avg']:.1e}")
            assert r["loss"] <= NOISE_MULTIPLE and r["exp_avg"] <= 1e-12, (ep, r)


def test_load_transformers_folder_into_expert_groups_and_export(pools, tmp_path):
    """Qwen3-MoE and DeepSeek-V3 saved by save_pretrained (per-expert tensors) read shard by shard by seqmesh's
    loader on U2 x R2 at ep=2, ep=4 and ep=1 (FSDP2 over the fused tensors): each rank reads exactly the bytes of
    its own parts; every parameter equals from_pretrained's exactly; one step's loss within the noise; the model exported after that step loads with from_pretrained, its
    weights the parallel model's exactly and its logits the one-process model's after the same step."""
    cases = []
    for family in ("qwen3_moe", "deepseek_v3"):
        folder = tmp_path / family
        save_tiny(family, str(folder))
        cases += [(family, str(folder), str(tmp_path / f"{family}-out{ep}"), 2, 2, 1, ep) for ep in (2, 4, 1)]
    for rank in pools.run(4, load_export_all, cases):
        for r in rank:
            print(f"\n{r['case'][0]} ep={r['case'][-1]}: loaded {r['loaded']:.1e}, loss {r['loss']:.2f} x noise"
                  + (f", exported {r['exported']:.1e}, logits {r['logits']:.1e}" if "logits" in r else ""))
            assert r["loaded"] == 0.0 and r["loss"] <= NOISE_MULTIPLE and r["read"] == r["held"], r
            if "logits" in r:
                assert r["exported"] == 0.0 and r["names"] and r["logits"] <= 1e-12, r


def _meta(folder: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float64)


def test_header_checks_name_the_per_expert_tensors(tmp_path):
    """A folder missing one expert's tensor, or holding one of another shape, is refused before any read, naming
    the tensor as the file names it; Mixtral's w1/w3/w2 map to its fused experts; gpt-oss (fused on disk) maps one to one; a quantized config is refused."""
    import pytest
    from safetensors.torch import load_file, save_file

    from seqmesh.model.pretrained import check_pretrained

    folder = tmp_path / "qwen3_moe"
    save_tiny("qwen3_moe", str(folder))
    sources = check_pretrained(_meta(str(folder)), str(folder))
    assert len(sources["model.layers.0.mlp.experts.gate_up_proj"]) == 16  # 8 experts x (gate, up)
    file = str(folder / "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.1.mlp.experts.5.down_proj.weight"] = torch.zeros(32, 17, dtype=torch.float64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight \(of "
                                         r"model\.layers\.0\.mlp\.experts\.gate_up_proj\).*shapes differ: "
                                         r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight is \[32, 17\]"):
        check_pretrained(_meta(str(folder)), str(folder))
    mixtral = tmp_path / "mixtral"  # w1, w3 -> gate_up_proj; w2 -> down_proj, block_sparse_moe renamed mlp
    import transformers as tf

    tf.AutoModelForCausalLM.from_config(tf.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)).save_pretrained(str(mixtral))
    pieces = check_pretrained(_meta(str(mixtral)), str(mixtral))
    assert {p.key for p in pieces["model.layers.0.mlp.experts.gate_up_proj"]} == {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3")}
    oss = tmp_path / "gpt_oss"
    save_tiny("gpt_oss", str(oss))
    model = _meta(str(oss))
    assert all(len(pieces) == 1 for pieces in check_pretrained(model, str(oss)).values())
    model.config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="quantized checkpoint \\(mxfp4\\).*Dequantize"):
        check_pretrained(model, str(oss))
