"""Expert parallelism in ``seqmesh plan``: each rank's share of the routed experts against the model transformers
builds, the all-to-all bytes against ``seqmesh.experts.traffic`` (the formula the runtime's counters are tested
against), the memory EP saves, the refusals, and the recommendation for DeepSeek-V3- and Qwen3.5-MoE-shaped
config.json files at 128K tokens on 64 H100s (docs/planner.md, "Expert parallelism")."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from seqmesh.rules.degrees import Degrees
from seqmesh.experts.traffic import expected_exchange_bytes
from seqmesh.model.presets import MODELS, model_shape
from seqmesh.planner.hardware import PRESETS, make_cluster
from seqmesh.planner.memory import memory_at, parameter_memory
from seqmesh.planner.plan import communication, evaluate, layouts, plan
from seqmesh.planner.workload import Workload
from seqmesh.tools.cli import main

H100 = PRESETS["h100-nvlink"]
# DeepSeek-V3 as published (transformers does not build its multi-token-prediction layer)
DEEPSEEK_V3 = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   vocab_size=129280, intermediate_size=18432, moe_intermediate_size=2048, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                   num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, n_shared_experts=1,
                   max_position_embeddings=163840)
# Qwen3.5-MoE's shape at its largest published size: Gated DeltaNet layers with full attention every 4th, all MoE
QWEN35_MOE = dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
                  vocab_size=248320, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
                  shared_expert_intermediate_size=1024, linear_num_key_heads=16, linear_num_value_heads=64,
                  linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    """The two shapes as config.json folders, written by transformers' own config classes."""
    import transformers as tf

    root = tmp_path_factory.mktemp("moe")
    tf.DeepseekV3Config(**DEEPSEEK_V3).save_pretrained(root / "deepseek-v3")
    tf.Qwen3_5MoeTextConfig(**QWEN35_MOE).save_pretrained(root / "qwen3.5-moe")
    return {"deepseek-v3": str(root / "deepseek-v3"), "qwen3.5-moe": str(root / "qwen3.5-moe")}


def _expert_numel(config) -> tuple[int, int]:
    """(routed expert parameters, all parameters) of the model transformers builds from ``config``, on meta."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    named = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    return routed, sum(p.numel() for p in named.values())


def test_each_rank_holds_its_share_of_the_experts_transformers_builds(tmp_path):
    """A small DeepSeek-V3 (one dense layer, two MoE layers of 8 experts): the fp32 master shard per rank with EP is
    the built model's routed expert parameters / ep / (ranks / ep) plus the rest / ranks, for every ep."""
    import transformers as tf

    config = tf.DeepseekV3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                 vocab_size=256, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=16,
                                 kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                 n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                 first_k_dense_replace=1, n_shared_experts=1)
    config.save_pretrained(tmp_path)
    routed, total = _expert_numel(config)
    assert routed == 2 * 8 * 3 * 64 * 32  # two MoE layers of 8 experts of (gate, up, down) 64 x 32
    work = Workload(model_shape(str(tmp_path)), seq_len=64)
    assert work.model.params == total
    layout = Degrees(2, 1, 4)  # 8 ranks holding different tokens
    for ep in (1, 2, 4, 8):
        master = parameter_memory(work, replace(layout, ep=ep), "optimizer step")[0]
        expected = routed // ep // (8 // ep) + -(-(total - routed) // 8)
        assert master == 4 * expected if ep > 1 else 4 * -(-total // 8), ep


def test_deepseek_v3_expert_params_per_rank_by_hand(configs):
    """DeepSeek-V3 on 64 GPUs at EP8: 58 MoE layers x 256 experts x 3 x 7168 x 2048, each rank 32 experts of each
    over 8 ranks: 1/64 of them, as without EP; the gathered layer holds 32 experts, not 256."""
    work = Workload(model_shape(configs["deepseek-v3"]), seq_len=131072)
    routed = 58 * 256 * 3 * 7168 * 2048
    rest = work.model.params - routed
    one, eight = Degrees(8, 1, 8), Degrees(8, 1, 8, ep=8)
    optimizer = {lay.ep: memory_at(work, lay, "optimizer step").optimizer for lay in (one, eight)}
    assert optimizer[1] == optimizer[8] == 8 * (-(-rest // 64) + routed // 64)  # AdamW's moments (fused: no temporary)
    gathered = {lay.ep: memory_at(work, lay, "first layer backward").weights for lay in (one, eight)}
    expert = 256 * 3 * 7168 * 2048
    assert gathered[1] - gathered[8] == 2 * (expert - expert // 8)  # bf16 copies of 224 experts fewer


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3.5-moe"])
@pytest.mark.parametrize("ep", [1, 2, 8, 16])
def test_all_to_all_bytes_are_the_shared_formula_times_the_moe_layers(configs, name, ep):
    """Per MoE layer and per step, the planner's ep_all_to_all is ``expected_exchange_bytes`` of the rank's tokens
    (one phase each; forward again in the recompute) times the MoE layers counted from the config (DeepSeek-V3:
    61 less 3 dense; Qwen3.5-MoE: all 60); nothing at ep 1."""
    work = Workload(model_shape(configs[name]), seq_len=131072)
    layout = Degrees(4, 2, 8, ep=ep)
    per_layer, links, per_step = communication(work, layout, H100)
    if ep == 1:
        assert "ep_all_to_all" not in per_step and "ep_all_to_all" not in per_layer["forward"]
        return
    config = DEEPSEEK_V3 if name == "deepseek-v3" else QWEN35_MOE
    tokens = 131072 // (4 * 2)
    experts = config.get("n_routed_experts") or config["num_experts"]
    sent = expected_exchange_bytes(tokens, config["num_experts_per_tok"], ep, config["hidden_size"], 2, experts // ep)
    assert sent.dispatch == tokens * config["num_experts_per_tok"] * (ep - 1) // ep * config["hidden_size"] * 2
    assert [per_layer[ph]["ep_all_to_all"] for ph in ("forward", "backward", "recompute")] == [
        sent.forward, sent.backward, sent.forward]
    moe = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)
    assert per_step["ep_all_to_all"] == moe * (2 * sent.forward + sent.backward)
    assert links["ep_all_to_all"] == ("nvlink4" if ep <= 8 else "infiniband-ndr")


def test_memory_with_ep_is_lower_by_the_gathered_experts(configs):
    """In a layer's backward (the layer and the next one's prefetch gathered, the layer's unsharded gradients), EP
    gathers ``(ep - 1) / ep`` fewer routed experts in bf16 for each; the sharded state is the same, and so are the
    activations (the dispatched rows are not kept: the experts keep their own gathered copy, as without EP)."""
    work = Workload(model_shape(configs["deepseek-v3"]), seq_len=131072)
    for ep in (2, 4, 8, 16, 64):
        base, split = Degrees(8, 1, 8), Degrees(8, 1, 8, ep=ep)
        before, after = memory_at(work, base, "layer backward"), memory_at(work, split, "layer backward")
        fewer = 256 // ep * (ep - 1) * 3 * 7168 * 2048  # experts a rank no longer gathers
        assert before.weights - after.weights == 2 * 2 * fewer  # this layer and the prefetched next, bf16
        assert before.grads - after.grads == 2 * fewer  # this layer's unsharded gradients
        assert before.optimizer == after.optimizer
        assert before.activations + before.attention == after.activations + after.attention
        assert before.total - after.total == 6 * fewer


def test_refusals_name_the_number_and_the_fix(configs, capsys):
    deepseek = model_shape(configs["deepseek-v3"])
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 256 routed experts.*\[1, 2, 4, 8, 16, 32, 64, 128, 256\]"):
        Workload(deepseek, seq_len=4096, ep=3)
    with pytest.raises(ValueError, match="has no routed experts"):
        Workload(MODELS["llama3-8b"], seq_len=4096, ep=2)
    work = Workload(deepseek, seq_len=4096, ep="auto")
    cluster = make_cluster(H100, 16, None, None)
    with pytest.raises(ValueError, match=r"ep=32 does not divide the 16 ranks that hold different tokens"):
        evaluate(work, Degrees(4, 1, 4, ep=32), cluster)
    with pytest.raises(ValueError, match="ep=2 with tp=2"):
        evaluate(work, Degrees(4, 1, 2, tp=2, ep=2), cluster)
    ok, excluded = layouts(replace(work, ep=32), cluster)
    assert not ok and all("does not divide the 16 ranks" in why or "with tp=" in why or "tensor parallelism" in why
                      for _, why in excluded), excluded
    with pytest.raises(SystemExit) as refused:  # the flag's type (the run settings' ep: a number or auto)
        main(["plan", "--model", configs["deepseek-v3"], "--seq-len", "4096", "--gpus", "16", "--ep", "six"])
    assert refused.value.code == 2 and "--ep: expected an integer or auto, got 'six'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "4096", "--gpus", "8", "--ep", "2"]) == 2
    assert main(["plan", "--model", configs["deepseek-v3"], "--seq-len", "4096", "--gpus", "8", "--ep", "16"]) == 2
    err = capsys.readouterr().err
    assert "--ep 16 does not divide the 8 GPUs" in err and "experts: 1, 2, 4, 8; or --ep auto" in err


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3.5-moe"])
def test_recommends_expert_parallelism_at_128k_on_64_h100s(configs, name, capsys):
    """Both shapes at 131,072 tokens on 8 nodes of 8 H100s, FSDP2's state in host memory (on 64 GPUs neither model's
    fp32 weights, gradients and AdamW moments fit: 671B or 395B x 16 bytes / 64 > 80 GB): the recommendation splits
    the experts, fits, and gathers and sends less than the same layout without EP."""
    work = Workload(model_shape(configs[name]), seq_len=131072, fsdp_cpu_offload=True, ep="auto")
    cluster = make_cluster(H100, 64, None, None)
    best = plan(work, cluster).recommended
    assert best is not None and best.feasible and best.layout.ep > 1
    base = evaluate(work, replace(best.layout, ep=1), cluster)
    assert best.memory.total < base.memory.total and best.time.total < base.time.total
    assert best.comm_per_layer["forward"]["fsdp_all_gather"] < base.comm_per_layer["forward"]["fsdp_all_gather"]
    assert main(["plan", "--model", configs[name], "--seq-len", "131072", "--gpus", "64", "--fsdp-cpu-offload",
                 "--ep", "auto", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"recommended: {best.layout.label()}" in out and f"without EP ({base.layout.label()})" in out


def test_json_with_expert_parallelism_matches_the_documented_schema(configs, capsys):
    """``--ep auto --json``: layouts with ``ep`` and the ``ep_all_to_all`` key read as docs/planner.md writes them."""
    import json

    from test_planner_cli import _schema, conform

    assert main(["plan", "--model", configs["deepseek-v3"], "--seq-len", "8192", "--gpus", "8", "--ep", "auto",
                 "--fsdp-cpu-offload", "--json"]) == 0
    out, schema = json.loads(capsys.readouterr().out), _schema()
    conform(out, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    split = [c for c in out["candidates"] if c["layout"].get("ep", 1) > 1]
    assert split and all(c["comm_bytes_per_step"]["ep_all_to_all"] > 0 for c in split)
    assert all("ep" not in c["layout"] for c in out["candidates"] if c not in split)


@pytest.mark.parametrize("name", ["granitemoeshared", "mixtral", "deepseek_v3"])
def test_moe_parameters_are_what_transformers_builds(name, tmp_path):
    """A shared expert of its own width (Granite-MoE-shared's shared_intermediate_size), none (Mixtral), or of an
    expert's (DeepSeek-V3's n_shared_experts): the planner's count equals the model transformers builds."""
    from transformers import AutoModelForCausalLM

    from census_configs import census_config

    config = census_config(name)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert model_shape(str(tmp_path)).params == built


def test_qwen_moe_dense_layers_are_read_from_mlp_only_layers(tmp_path):
    """Qwen-MoE's convention: the layers of mlp_only_layers, and those decoder_sparse_step skips, have a dense MLP;
    whether the first is one of them (the planner plans the first layer's backward as its)."""
    import json

    base = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2)
    cases = (({}, 0, True), ({"mlp_only_layers": [0, 1]}, 2, True), ({"decoder_sparse_step": 2}, 3, True),
             ({"mlp_only_layers": [1], "decoder_sparse_step": 2}, 4, True), ({"mlp_only_layers": [2, 3]}, 2, False))
    for extra, dense, first in cases:
        path = tmp_path / f"{dense}{first}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**base, **extra}))
        shape = model_shape(str(path))
        assert (shape.dense_layers, shape.dense_first) == (dense, first), extra


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_what_an_moe_layer_keeps_is_what_autograd_saves(pools, tmp_path, family):
    """In bfloat16 on Ulysses 2, the tensors an MoE layer saves are the planner's count (each routed row's gathered
    input, down output and SwiGLU tensors: four of the expert's width, gpt-oss's clamped and offset SwiGLU seven), plus
    no more than its router's small ones, which the planner leaves out: each token's float32 probabilities over the
    experts and int64 picks, each routed row's int64 places and weight (a mis-counted SwiGLU tensor is 192 bytes a
    token here, against that bound's 108)."""
    import json

    from planner_cases import moe_mlp_saved_bytes
    from seqmesh.planner.activations import mlp_saved_bytes

    measured = pools.run(2, moe_mlp_saved_bytes, family)[0]
    (tmp_path / "config.json").write_text(json.dumps(measured["config"]))
    shape = model_shape(str(tmp_path / "config.json"))
    planned = mlp_saved_bytes(Workload(shape, 96, bf16=True), Degrees(2, 1, 1))
    k, router = shape.experts_per_token, 4 * shape.experts + 8 * shape.experts_per_token
    bound = measured["tokens"] * (router + k * (3 * 8 + 2) + 8)
    assert planned <= measured["saved"] <= planned + bound, (planned, measured["saved"], bound)



def test_a_family_whose_experts_the_runtime_does_not_split_gets_no_ep_layout(configs):
    """The planner reads the runtime's family rule (seqmesh.experts.layers.family_refusal): a JetMoE-shaped model
    (its experts take tokens already sorted by expert) gets no ep > 1 layout, with the runtime's reason; the same
    shape as DeepSeek-V3, and as Inkling 2 (whose experts seqmesh now splits, their float32 sum kept), gets them."""
    from seqmesh.planner.experts import expert_parallel_refusal

    shape = model_shape(configs["deepseek-v3"] + "/config.json")
    layout = Degrees(1, 1, 4, ep=2)
    assert expert_parallel_refusal(shape, layout) is None
    assert expert_parallel_refusal(replace(shape, family="inkling2_text"), layout) is None
    refusal = expert_parallel_refusal(replace(shape, family="jetmoe"), layout)
    assert refusal is not None and "jetmoe is not among them (JetMoE's experts take tokens already sorted" in refusal
    assert expert_parallel_refusal(replace(shape, family="jetmoe"), Degrees(1, 1, 4)) is None


def test_a_dbrx_config_json_is_read_and_planned_without_ep(tmp_path, capsys):
    """DBRX's config.json (d_model, n_heads, n_layers; its kv heads in attn_config, its experts in ffn_config) reads
    into a shape whose count equals transformers' model within its norms' share; seqmesh plan sizes it, and gives no
    ep > 1 layout, with the runtime's reason (each expert weight one (experts x width, hidden) matrix). Before, plan,
    train and verify refused the file ("no hidden_size entry")."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model_type="dbrx", d_model=256, n_heads=8, n_layers=2, vocab_size=512, max_seq_len=4096,
               attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"moe_num_experts": 8, "moe_top_k": 2,
                                                         "ffn_hidden_size": 384})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True))
    shape = model_shape(str(tmp_path / "config.json"))
    total = sum(p.numel() for p in model.parameters())
    assert (shape.experts, shape.experts_per_token, shape.kv_heads, shape.intermediate) == (8, 2, 2, 384), shape
    assert abs(shape.params - total) < 0.005 * total, (shape.params, total)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "65536", "--gpus", "8"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] is not None
    main([*argv, "--ep", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert not report["candidates"] and report["recommended"] is None, report["candidates"][:1]
    assert "DBRX keeps its experts' weights as one" in json.dumps(report["excluded"])
