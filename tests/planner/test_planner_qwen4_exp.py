"""The planner on Qwen4-Exp (the shape: seqmesh.model.qwen4_exp; its QSA layer: seqmesh.planner.qsa): its parameter
count against the model transformers builds, layer by layer, its QSA row's all-gathers and reduce-scatters against
what seqmesh.hf.qsa_attention really sends (``comm_stats``), ``seqmesh plan`` on its config.json, and what it refuses
by name. Its memory is held to its rehearsal in tests/rehearsal/test_rehearse.py."""

from __future__ import annotations

import json

import pytest

from planner_cases import assert_gathers, config_shape, measured_gathers
from seqmesh.model.presets import model_shape
from seqmesh.planner.layers import GatedDeltaNet, layer_kinds, linear_layer_params
from seqmesh.planner.qsa import KEY, QsaAttention
from seqmesh.planner.workload import Workload, layer_params
from seqmesh.rules.degrees import Degrees
from seqmesh.tools.cli import main

pytestmark = pytest.mark.skipif(
    "qwen4_exp_text" not in __import__("transformers").models.auto.configuration_auto.CONFIG_MAPPING,
    reason="Qwen4-Exp is not in this transformers")

_INDEXER = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=256,
                indexer_compress_ratio=4)
# the config class's sizes (2,048 wide, 40 layers, 512 experts of 512) with an indexer (its default has none, and
# builds no QSA layer) and a quarter of its 256-wide heads rotated (the rotary part must fit an indexer head), without
# and with three PLE layers (n-gram tables of 20M-row heads: 190B parameters); a small one with three streams, tied
# embeddings, a partial rotary, its layers named full_attention, as a file may write them, and two PLE layers of a
# 5-gram, heads of their own width and tables padded to 64 rows
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
CONFIGS = {
    "default": dict(_INDEXER, rope_parameters=_ROPE),
    "ple": dict(_INDEXER, rope_parameters=_ROPE, ple_layer_ids=[1, 2, 3], eos_token_id=1),
    "small": dict(_INDEXER, vocab_size=1000, hidden_size=128, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=24, moe_intermediate_size=48,
                  shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2, hc_count=3, hc_lowrank=12,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5},
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
                  ple_layer_ids=[4, 1], eos_token_id=3, ple_embed_dim=96, ngram_size=5, heads_per_ngram=3,
                  ngram_vocab_size_base=300, make_ngram_vocab_size_divisible_by=64, ple_conv_kernel_size=3),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The model's count and each layer's (its FSDP unit: a Gated DeltaNet or a QSA layer, with its experts and its
    two gated residuals, and a PLE layer's n-gram tables, projections, norms and conv) equal the model transformers
    builds; the layers are planned by their kinds."""
    import torch
    import transformers as tf

    config, shape, built = config_shape("Qwen4ExpTextConfig", CONFIGS[name], tmp_path)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    with torch.device("meta"):
        layers = tf.AutoModelForCausalLM.from_config(config).model.layers
    qsa = config.layer_types.count("indexed_attention")
    ple = shape.qwen_exp.ple
    for i, (layer, kind) in enumerate(zip(layers, config.layer_types)):
        mine = layer_params(shape) if kind == "indexed_attention" else linear_layer_params(shape)
        if ple is not None and i in ple.layers:  # its own tables' rows
            mine += ple.params(shape.hidden, shape.qwen_exp.streams, ple.tables[ple.layers.index(i)])
        assert mine == sum(p.numel() for p in layer.parameters()), (i, kind)
    kinds = layer_kinds(Workload(shape, 4096), Degrees(2, 1, 1))
    with_ple = len(ple.layers) if ple is not None else 0
    linear = [(GatedDeltaNet, False, config.num_hidden_layers - qsa - with_ple)]
    linear += [(GatedDeltaNet, True, with_ple)] if with_ple else []
    assert [(type(k), getattr(k, "ple", False), n) for k, n in kinds] == [*linear, (QsaAttention, False, qsa)]
    if name == "small":
        assert (shape.qwen_exp.streams, shape.qwen_exp.rotary, shape.tie_embeddings) == (3, 16, True)


def test_the_vision_language_model_counts_its_tower(tmp_path):
    """``qwen4_exp`` (its language model in text_config beside a Qwen-VL tower): the language model as above and the
    tower, together equal to the model transformers builds."""
    import torch
    import transformers as tf

    text = {k: v for k, v in CONFIGS["small"].items() if k != "tie_word_embeddings"}
    config = tf.Qwen4ExpConfig(text_config=text)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        built = sum(p.numel() for p in tf.Qwen4ExpForConditionalGeneration(config).parameters())
    shape = model_shape(str(tmp_path))
    assert shape.vision is not None and shape.qwen_exp.ple is not None and shape.params == built, (shape.params, built)


def test_sizes_transformers_refuses_are_refused_by_name(tmp_path):
    """A config.json without its indexer's sizes, with more than one indexer key head, or with a PLE layer on a QSA
    layer (transformers' config class refuses each) is refused naming the entry."""
    for entries, named in ((dict(_INDEXER, indexer_budget=None), "indexer_budget"),
                           (dict(_INDEXER, indexer_kv_heads=2), "indexer_kv_heads"),
                           (dict(_INDEXER, ple_layer_ids=[4], eos_token_id=1), "ple_layer_ids")):
        (tmp_path / named).mkdir()
        (tmp_path / named / "config.json").write_text(json.dumps(dict(model_type="qwen4_exp_text", **entries)))
        with pytest.raises(ValueError, match=named):
            model_shape(str(tmp_path / named))


@pytest.mark.parametrize("ulysses,ring,family", [(2, 1, "qwen4-exp"), (1, 2, "qwen4-exp-ple-linear")])
def test_predicted_row_bytes_equal_measured(pools, ulysses, ring, family, tmp_path):
    """One step of the census's Qwen4-Exp (a Gated DeltaNet layer, then a QSA layer; on the ring with a PLE layer
    before the first): the all-gathers of the QSA row's raw indexer keys, rotary tables, keys and values and of the
    PLE layer's two halos, its token ids and its conv's input (forward; with checkpointing, again in the recompute),
    the reduce-scatters of the keys', values' and conv input's gradients (backward), per rank, calls and bytes,
    against the planner's figures of every layer kind (the Gated DeltaNet layer's state passing gathers its states;
    its all-to-all none)."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, family, ulysses, ring, tmp_path):
        kinds = layer_kinds(work, layout)
        qsa = next(k for k, n in kinds if isinstance(k, QsaAttention) and n == 1)
        for rank in ranks:
            index = rank["ulysses_rank"] + ulysses * rank["ring_rank"]
            assert_gathers(rank, [kind.ranks()[index] for kind, _ in kinds], 2 if case.checkpointing else 1, case)
        per_layer = qsa.traffic()
        assert per_layer["forward"][KEY] == max(r.sent("all_gather", "forward") for r in qsa.ranks())
        assert (work.model.qwen_exp.ple is not None) == (family != "qwen4-exp")


def test_seqmesh_plan_sizes_qwen4_exp(tmp_path, capsys):
    """``seqmesh plan`` names the QSA and PLE layers and the streams, and sends the QSA row's gathers on every sharded
    layout (the other rank's 65,536 tokens of the raw indexer key, the rotary tables, the keys and values, bf16, on
    two ranks) and the PLE halos, none on one GPU; it refuses ``--inference`` (whose decode seqmesh does not run
    yet)."""
    config_shape("Qwen4ExpTextConfig", CONFIGS["small"], tmp_path, count=False)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "131072", "--gpus", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 Gated DeltaNet; PLE before 2 of them: n-gram tables of" in out and "3 residual streams" in out, out
    assert "2 QSA layers: top 64 blocks of 4 keys" in out, out
    assert main([*argv, "--json"]) == 0
    plans = {c["label"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert plans["U2 x R1 x DP1"]["comm_bytes_per_layer"]["forward"][KEY] == 65536 * (64 + 2 * 16 + 2 * 2 * 32) * 2
    assert plans["U1 x R1 x DP2"]["comm_bytes_per_layer"]["forward"].get(KEY, 0) == 0
    # each halo (ids in int64, the conv's 3 x 128 channels in bf16) is max((3 - 1) x 5, 5 - 1) = 10 rows a tail
    halo = plans["U2 x R1 x DP1"]["comm_bytes_per_layer"]["forward"]["ple_halo_gather"]
    assert halo > 0 and halo % (8 + 3 * 128 * 2) == 0, halo
    assert main([*argv, "--inference"]) != 0
    assert "QSA layers, whose decode seqmesh does not run yet" in capsys.readouterr().err
