"""The planner on MiniMax-M3's block-sparse layers (seqmesh.hf.block_sparse_attention; the shape:
seqmesh.model.minimax_m3, the layer: seqmesh.planner.block_sparse): its parameter count against the model transformers
builds, its row's all-gathers and reduce-scatters against what the runtime really sends (``comm_stats``), and
``seqmesh plan`` on its config.json. Its memory is held to its rehearsal in tests/rehearsal/test_rehearse.py."""

from __future__ import annotations

import json

import pytest

from planner_cases import assert_gathers, config_shape, measured_gathers
from seqmesh.model.presets import model_shape
from seqmesh.planner.block_sparse import KEY, BlockSparseAttention
from seqmesh.planner.attention_layer import Attention
from seqmesh.planner.layers import layer_kinds
from seqmesh.planner.workload import Workload
from seqmesh.rules.degrees import Degrees
from seqmesh.tools.cli import main

pytestmark = pytest.mark.skipif(
    "minimax_m3_vl_text" not in __import__("transformers").models.auto.configuration_auto.CONFIG_MAPPING,
    reason="MiniMax-M3 is not in this transformers")

_SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              num_local_experts=4, vocab_size=1000, intermediate_size=128, dense_intermediate_size=512,
              shared_intermediate_size=128, index_n_heads=2, index_head_dim=32, index_block_size=16,
              index_topk_blocks=4, bos_token_id=1, eos_token_id=2)
# MiniMax-M3's sizes with every other layer block-sparse (its default config has none); a small one with a dense
# first MLP layer of its own width (dense_intermediate_size) and sparse layers that are not every other one
CONFIGS = {
    "m3": dict(layer_types=["minimax_m3_sparse", "full_attention"] * 30),
    "small": dict(_SMALL, layer_types=["minimax_m3_sparse", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The indexer of each block-sparse layer, every layer's q and k norms, the dense layers' own width: the planner's
    count equals the model's, and the layers are planned by their kinds."""
    config, shape, built = config_shape("MiniMaxM3VLTextConfig", CONFIGS[name], tmp_path)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    sparse = config.layer_types.count("minimax_m3_sparse")
    kinds = layer_kinds(Workload(shape, 4096), Degrees(2, 1, 1))
    assert [(type(k), n) for k, n in kinds] == [(Attention, config.num_hidden_layers - sparse),
                                                (BlockSparseAttention, sparse)], kinds
    if name == "small":
        assert (shape.dense_layers, shape.dense_intermediate) == (1, 512)


def test_the_released_entries_are_read_as_transformers_reads_them(tmp_path):
    """A config.json as MiniMax's checkpoints write it: each layer sparse or full in sparse_attention_config's
    sparse_attention_freq, the indexer's sizes under its names there, each MLP layer experts or dense in
    moe_layer_freq. Its parameters equal the model transformers builds from the same file, and its sparse layers,
    indexer and dense layer are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    released = {k: v for k, v in _SMALL.items() if not k.startswith("index_")}
    released |= {"model_type": "minimax_m3_vl_text", "moe_layer_freq": [0, 1, 1, 1],
                 "sparse_attention_config": {"sparse_attention_freq": [1, 0, 1, 0], "sparse_num_index_heads": 4,
                                             "sparse_index_dim": 16, "sparse_block_size": 8, "sparse_topk_blocks": 3,
                                             "sparse_local_block": 1}}
    (tmp_path / "config.json").write_text(json.dumps(released))
    shape = model_shape(str(tmp_path / "config.json"))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path), local_files_only=True))
    assert shape.params == sum(p.numel() for p in built.parameters())
    sparse = shape.block_sparse
    assert (sparse.layers, sparse.index_heads, sparse.index_head_dim, sparse.block_size, sparse.topk_blocks) == (
        2, 4, 16, 8, 3) and (shape.dense_layers, shape.dense_intermediate) == (1, 512), shape


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_row_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step's all-gathers of the row's indexer keys, keys and values (forward; with checkpointing, again in the
    recompute) and the reduce-scatters of the keys' and values' gradients (backward), per rank, calls and bytes,
    against the planner's per-layer figures: the one block-sparse layer's beside the full one's (which sends none)."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, "minimax-m3-sparse", ulysses, ring, tmp_path):
        sparse = next(k for k, n in layer_kinds(work, layout) if isinstance(k, BlockSparseAttention) and n == 1)
        mine = sparse.ranks()
        for rank in ranks:
            assert_gathers(rank, [mine[rank["ulysses_rank"] + ulysses * rank["ring_rank"]]],
                           2 if case.checkpointing else 1, case)
        per_layer = sparse.traffic()
        assert per_layer["forward"][KEY] == max(r.sent("all_gather", "forward") for r in mine)
        assert per_layer["recompute"][KEY] == (per_layer["forward"][KEY] if case.checkpointing else 0)


def test_seqmesh_plan_sizes_the_block_sparse_layers(tmp_path, capsys):
    """``seqmesh plan`` names the block-sparse layers and sends their row's gathers on every sharded layout (the
    other rank's 65,536 tokens of the indexer key and the keys and values, bf16, on two ranks), none on one GPU; it
    refuses ``--inference`` (whose cache and decode it does not size yet) and a bf16 peak without the fp32 one (the
    indexer scores in float32)."""
    config_shape("MiniMaxM3VLTextConfig", CONFIGS["small"], tmp_path, count=False)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "131072", "--gpus", "2"]
    assert main(argv) == 0
    assert "block-sparse attention on 3 layers: top 4 blocks of 16 keys a query" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    plans = {c["label"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert plans["U2 x R1 x DP1"]["comm_bytes_per_layer"]["forward"][KEY] == 65536 * (32 + 2 * 2 * 32) * 2
    assert plans["U1 x R1 x DP2"]["comm_bytes_per_layer"]["forward"].get(KEY, 0) == 0
    assert main([*argv, "--inference"]) != 0
    assert "block-sparse layers, whose decode" in capsys.readouterr().err
    assert main([*argv, "--peak-tflops", "900"]) != 0
    assert "block-sparse indexer scores in float32" in capsys.readouterr().err
