"""The planner on Inkling (the shape: seqmesh.model.inkling; its layer: seqmesh.planner.relative_attention): its
parameter count against the model transformers builds, layer by layer, its row's and its short convolutions' gathers
against what seqmesh.hf.inkling really sends (``comm_stats``), ``seqmesh plan`` on its config.json, and what it
refuses by name. Its memory is held to its rehearsal in tests/rehearsal/test_rehearse.py."""

from __future__ import annotations

import json

import pytest

from planner_cases import assert_relative_plan, config_shape, measured_gathers
from seqmesh.model.inkling import FULL, SLIDING
from seqmesh.model.presets import model_shape
from seqmesh.planner.layers import layer_kinds
from seqmesh.planner.relative_attention import HALOS, ROWS, RelativeAttention
from seqmesh.planner.workload import Workload
from seqmesh.rules.degrees import Degrees

pytestmark = pytest.mark.skipif(
    "inkling_text" not in __import__("transformers").models.auto.configuration_auto.CONFIG_MAPPING,
    reason="Inkling is not in this transformers")

# the config class's sizes (975B: 66 layers, every sixth full, 256 experts); a small one with sliding layers of more
# heads than its full ones, two shared experts, a dense first layer, log scaling and its own layer pattern
CONFIGS = {
    "default": {},
    "small": dict(vocab_size=500, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=16,
                  sliding_window_size=64, rel_extent=128, d_rel=8, intermediate_size=256, moe_intermediate_size=64,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, dense_mlp_idx=1, conv_kernel_size=3,
                  local_layer_ids=[0, 1, 3, 4], log_scaling_n_floor=16),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The model's count and each layer's (its FSDP unit: its attention by its kind, its norms and four convolutions,
    its experts with the router's shared rows, or its dense MLP) equal the model transformers builds; the layers are
    planned by their kinds."""
    import torch
    import transformers as tf

    config, shape, built = config_shape("InklingTextConfig", CONFIGS[name], tmp_path)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    with torch.device("meta"):
        layers = tf.AutoModelForCausalLM.from_config(config).model.layers
    for kind, mlp, layer in zip(config.layer_types, config.mlp_layer_types, layers):
        assert shape.inkling_layer_params(kind, dense=mlp == "dense") == sum(p.numel() for p in layer.parameters())
    kinds = layer_kinds(Workload(shape, 4096), Degrees(2, 1, 1))
    assert [(type(k), k.kind, n) for k, n in kinds] == [
        (RelativeAttention, kind, config.layer_types.count(kind)) for kind in (SLIDING, FULL)]


def test_a_checkpoints_entries_are_read_as_transformers_reads_them(tmp_path):
    """A config.json as the released checkpoints write it: no layer_types (its local_layer_ids, or every sixth layer
    full), no mlp_layer_types (``dense_mlp_idx``), ``intermediate_size`` the experts' width beside a
    ``dense_intermediate_size``, the convolutions' ``sconv_kernel_size``: the planner's count equals the model
    transformers builds from the same file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    small = CONFIGS["small"]
    released = {k: v for k, v in small.items() if k not in ("intermediate_size", "moe_intermediate_size",
                                                            "conv_kernel_size")}
    released |= {"model_type": "inkling_text", "intermediate_size": 64, "dense_intermediate_size": 256,
                 "sconv_kernel_size": 3, "num_hidden_layers": 7}
    del released["local_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(released))
    shape = model_shape(str(tmp_path / "config.json"))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path), local_files_only=True))
    assert shape.params == sum(p.numel() for p in built.parameters())
    assert shape.inkling.kinds == (SLIDING,) * 5 + (FULL, SLIDING) and (shape.dense_layers, shape.intermediate) == (
        1, 64), shape


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step of the census's Inkling (a sliding layer, then a full one): the all-gathers of each layer's row of
    keys and values and of its four short convolutions' halos (forward; with checkpointing, again in the recompute)
    and their gradients' reduce-scatters (backward), per rank, calls and bytes, against the planner's figures of both
    kinds."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, "inkling", ulysses, ring, tmp_path):
        kinds = layer_kinds(work, layout)
        assert [n for _, n in kinds] == [1, 1]
        for rank in ranks:
            index = rank["ulysses_rank"] + ulysses * rank["ring_rank"]
            planned = [kind.ranks()[index] for kind, _ in kinds]
            for (kind, phase), repeats in ((("all_gather", "forward"), 2 if case.checkpointing else 1),
                                           (("reduce_scatter", "backward"), 1)):
                counted = rank["stats"][kind][phase]
                want = (repeats * sum(t.calls(kind, phase) for t in planned),
                        repeats * sum(t.sent(kind, phase) for t in planned))
                assert (counted["calls"], counted["bytes_sent"]) == want, (case, kind, counted, want)
        per_layer = kinds[0][0].traffic()
        assert per_layer["forward"][ROWS] > 0 and per_layer["forward"][HALOS] > 0


def test_seqmesh_plan_sizes_inkling(tmp_path, capsys):
    """``seqmesh plan`` names Inkling's layers and sends each layer's row and halo gathers on every sharded layout
    (the other rank's 65,536 tokens of the keys and values, bf16, on two ranks: the full layers' 2 kv heads of 32,
    the sliding layers' 4 of 16, the same), none on one GPU; it refuses ``--inference`` (seqmesh generate does not
    decode Inkling yet) and tensor parallelism (its experts', and its attention's, which the runtime refuses)."""
    assert_relative_plan("InklingTextConfig", CONFIGS["small"], tmp_path, capsys,
                         "4 sliding layers of 8 query / 4 kv heads x 16, window 64; 2 full, bias 128 keys back")
