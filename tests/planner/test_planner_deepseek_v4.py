"""The planner on DeepSeek-V4 (its compressed attention, seqmesh.hf.compressed_attention; the shape:
seqmesh.model.deepseek_v4): its parameter count against the model transformers builds, its halo's and entries'
bytes against what seqmesh.hf.compressed_attention really sends (``comm_stats``), and ``seqmesh plan`` on
transformers' default config.json (DeepSeek-V4-Flash's sizes)."""

from __future__ import annotations

import json

import pytest
import torch

from planner_cases import assert_gathers, config_shape, measured_gathers
from seqmesh.model.presets import model_shape
from seqmesh.planner.compressed import KEY, CompressedAttention
from seqmesh.planner.layers import layer_kinds
from seqmesh.planner.workload import Workload
from seqmesh.rules.degrees import Degrees
from seqmesh.tools.cli import main

# DeepSeek-V4's sizes: tiny with transformers' default kinds (HCA, then CSA and HCA in turn); with sliding layers, a
# tied head, two streams and other rates; transformers' defaults (V4-Flash: 284B)
CONFIGS = {
    "tiny": dict(vocab_size=512, hidden_size=256, num_hidden_layers=5, num_attention_heads=8, head_dim=64,
                 q_lora_rank=96, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, o_groups=2,
                 o_lora_rank=48, index_n_heads=4, index_head_dim=32, index_topk=16, sliding_window=16),
    "sliding": dict(vocab_size=300, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, head_dim=16,
                    q_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, o_groups=2,
                    o_lora_rank=8, hc_mult=2, index_n_heads=8, index_head_dim=8, index_topk=3,
                    partial_rotary_factor=0.5, tie_word_embeddings=True,
                    compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 16},
                    layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                                 "sliding_attention", "compressed_sparse_attention"],
                    mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"]),
    "flash": {},
}


def _shape(sizes: dict, folder, count: bool = False):
    """(config, the planner's shape, with ``count`` transformers' parameter count) of DeepseekV4Config(**sizes) written to
    ``folder``."""
    return config_shape("DeepseekV4Config", sizes, folder, count)


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The low-rank query, the shared key, the grouped output, the sinks, each kind's compressor (CSA's with its
    indexer), the hyper-connections (the layers' and the head's), the experts (hash-routed ones alike), counted
    exactly; the layers planned by kind, nothing left unplanned."""
    config, shape, built = _shape(CONFIGS[name], tmp_path, count=True)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    work = Workload(shape, 4096)
    kinds = {getattr(k, "kind", "sliding_attention"): n for k, n in layer_kinds(work, Degrees(1, 2, 1))}
    assert kinds == {t: config.layer_types.count(t) for t in set(config.layer_types)}, kinds


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_collective_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step's all-gathers (forward; with checkpointing, again in the recompute) and reduce-scatters (backward),
    per rank, calls and bytes, against the planner's per-layer figures of its HCA and its CSA layer."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, "deepseek-v4", ulysses, ring, tmp_path):
        kinds = [k for k, _ in layer_kinds(work, layout)]
        assert sorted(k.kind for k in kinds if isinstance(k, CompressedAttention)) == sorted(
            ["heavily_compressed_attention", "compressed_sparse_attention"]) and len(kinds) == 2, kinds
        for rank in ranks:
            where = rank["ulysses_rank"] + ulysses * rank["ring_rank"]
            assert_gathers(rank, [k.ranks()[where] for k in kinds], 2 if case.checkpointing else 1, case)
        for kind in kinds:  # the layer's figures are the busiest rank's
            per_layer = kind.traffic()
            assert per_layer["forward"][KEY] == max(r.sent("all_gather", "forward") for r in kind.ranks())
            assert per_layer["backward"][KEY] == max(r.sent("reduce_scatter", "backward") for r in kind.ranks())


def test_seqmesh_plan_sizes_deepseek_v4_flash(tmp_path, capsys):
    """``seqmesh plan`` on transformers' default DeepSeek-V4 config.json (V4-Flash's sizes, 284B): its layers named,
    the compressed layers' collectives in each sharded layout's layer and none where one GPU holds the sequence, and
    the same time whatever the split of the sequence group into Ulysses and ring (one flat group); ``--inference``
    refused as generation refuses it, and a bf16 peak given without the fp32 one that its hyper-connections' mixes
    and CSA's indexer need."""
    _shape({}, tmp_path)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "131072", "--gpus", "8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "284.3B params" in text and "23 HCA (entries of 128 tokens), 20 CSA (entries of 4 tokens, top 512" in text
    assert "kv replication" not in text, text
    assert main([*argv, "--json"]) == 0
    plans = {c["label"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    u8, u4r2 = plans["U8 x R1 x DP1"], plans["U4 x R2 x DP1"]
    assert u8["comm_bytes_per_layer"]["forward"][KEY] > 0 and u8["step_time_s"] == u4r2["step_time_s"]
    assert plans["U1 x R1 x DP8"]["comm_bytes_per_layer"]["forward"].get(KEY, 0) == 0
    assert main([*argv, "--inference"]) == 2  # as seqmesh generate refuses it
    assert "compressed attention layers, whose decode seqmesh does not run yet" in capsys.readouterr().err
    assert main([*argv, "--peak-tflops", "900"]) == 2  # the float32 mixes and scores need the fp32 peak
    assert "hyper-connections mix (and its CSA indexer scores) in float32" in capsys.readouterr().err


def test_layer_kinds_that_do_not_match_the_layer_count_are_refused(tmp_path):
    sizes = dict(model_type="deepseek_v4", num_hidden_layers=3, hidden_size=64, num_attention_heads=4, head_dim=16,
                 vocab_size=100, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                 layer_types=["heavily_compressed_attention"] * 2)
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    with pytest.raises(ValueError, match="layer_types names 2 layers but num_hidden_layers is 3"):
        model_shape(str(tmp_path / "config.json"))


def test_sliding_layers_are_timed_with_their_window(tmp_path):
    """A sliding layer of DeepSeek-V4 is seqmesh attention over its window: its compressed layers are not full
    attention layers to average its pairs with (they were: a sliding layer of the 5 was planned as 3/5 full)."""
    from seqmesh.planner.attention_layer import Attention, attention_average, attention_pairs

    config, shape, _ = _shape(CONFIGS["sliding"], tmp_path)
    work = Workload(shape, 8192)
    window = attention_pairs(8192, True, config.sliding_window)
    assert attention_average(work, Degrees(1, 2, 1), Attention.pairs) == window < attention_pairs(8192, True)


def test_a_row_without_entries_selects_none(tmp_path):
    """CSA's selection over a row whose documents are all shorter than an entry's window: no entry, no pick (the
    runtime divided by the row's zero entries when it sized its passes)."""
    from transformers import AutoModelForCausalLM

    from seqmesh.hf.compressed_attention import _indexer_picks

    config, _, _ = _shape(CONFIGS["tiny"], tmp_path)
    layers = AutoModelForCausalLM.from_config(config).model.layers
    indexer = layers[config.layer_types.index("compressed_sparse_attention")].self_attn.compressor.indexer
    q = torch.randn(1, 3, indexer.num_heads, indexer.head_dim)
    picks = _indexer_picks(indexer, q, torch.randn(1, 3, config.hidden_size), torch.zeros(1, 0, indexer.head_dim),
                           torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert picks.shape == (1, 3, 0), picks.shape


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_the_kernels_slots_are_the_planned_ones(pools, ulysses, ring, tmp_path):
    """The (query, key) slots the planner times (``attended_pairs``: each query's window, and its block's entries, or
    CSA's top k) are the busiest rank's the layer hands the kernel, blocks of a few queries included."""
    from planner_cases import compressed_slots
    from seqmesh.planner.compressed import attended_pairs

    block_elements = 4 * 16 * 5  # 4 heads x 16 wide: 5 queries a block
    per_rank = pools.run(ulysses * ring, compressed_slots, ulysses, ring, 45, block_elements)
    (tmp_path / "config.json").write_text(json.dumps(per_rank[0]["config"]))
    shape = model_shape(str(tmp_path / "config.json"))
    c = shape.compressed
    import seqmesh.hf.indexed_attention as indexed_attention

    saved, indexed_attention.BLOCK_ELEMENTS = indexed_attention.BLOCK_ELEMENTS, block_elements
    attended_pairs.cache_clear()  # its figures are cached per layout, not per block budget
    try:
        for kind in ("heavily_compressed_attention", "compressed_sparse_attention"):
            planned = attended_pairs("zigzag", ulysses, ring, 45, 1, shape.heads, shape.head_dim, c.window,
                                     c.rate(kind), c.index_topk if kind == "compressed_sparse_attention" else 0)
            assert planned == max(r["slots"][kind] for r in per_rank) > 0, (kind, planned, per_rank)
    finally:
        indexed_attention.BLOCK_ELEMENTS = saved
        attended_pairs.cache_clear()
