"""The planner on Inkling 2 (the shape: seqmesh.model.inkling; its layer: seqmesh.planner.relative_attention): its
parameter count against the model transformers builds, layer by layer, its row's and its short convolutions' gathers
(static and dynamic) against what seqmesh.hf.inkling2 really sends (``comm_stats``), ``seqmesh plan`` on its
config.json, and what it refuses by name. Its memory is held to its rehearsal in tests/rehearsal/test_rehearse.py."""

from __future__ import annotations

import json

import pytest

from planner_cases import assert_relative_plan, config_shape, measured_gathers
from seqmesh.model.inkling import FULL, SLIDING
from seqmesh.planner.inkling2 import Inkling2Layer
from seqmesh.planner.layers import layer_kinds
from seqmesh.planner.relative_attention import HALOS, ROWS
from seqmesh.planner.workload import Workload
from seqmesh.rules.degrees import Degrees
from seqmesh.tools.cli import main

pytestmark = pytest.mark.skipif(
    "inkling2_text" not in __import__("transformers").models.auto.configuration_auto.CONFIG_MAPPING,
    reason="Inkling 2 is not in this transformers")

# the config class's sizes (594B: 48 layers, every sixth full, 384 experts); a small one with sliding layers of more
# heads than its full ones, blocks of three layers, a head of fewer rows than the embedding and its own layer pattern
CONFIGS = {
    "default": {},
    "small": dict(vocab_size=500, unpadded_vocab_size=490, hidden_size=128, num_hidden_layers=7,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, swa_num_attention_heads=8,
                  swa_num_key_value_heads=4, swa_head_dim=16, sliding_window_size=64, rel_extent=128, d_rel=8,
                  moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, conv_kernel_size=3,
                  n_layers_per_attn_res_block=3, eos_token_id=1,
                  layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid",
                               "hybrid_sliding"]),
}


# Inkling2-Loop: the config class's sizes (26.1B: 24 layers, 6 to 17 looped in 3 passes), and the small one with
# layers 3 to 5 looped in 4 passes through gates of rank 8
LOOPS = {"default": {}, "small": {**CONFIGS["small"], "n_layers_per_attn_res_block": 3, "loop_layer_index_start": 3,
                                  "loop_layer_index_end": 6, "loop_num_passes": 4, "loop_gate_rank": 8}}


@pytest.mark.parametrize("name", [*CONFIGS, *(f"loop-{n}" for n in LOOPS)])
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The model's count and each layer's (its FSDP unit: its attention by its kind, its depth attention's queries,
    fewer in the first layer, its norms and two convolutions, its experts and float32 router; an Inkling2-Loop
    looped layer's four message gates, and the model's message queries) equal the model transformers builds; the
    layers are planned by their kinds, an Inkling2-Loop looped layer's calls after the first pass as gated ones."""
    import torch
    import transformers as tf

    loop = name.startswith("loop-")
    config, shape, built = config_shape("Inkling2LoopTextConfig" if loop else "Inkling2TextConfig",
                                        LOOPS[name[5:]] if loop else CONFIGS[name], tmp_path)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    with torch.device("meta"):
        layers = tf.AutoModelForCausalLM.from_config(config).model.layers
    for i, (kind, layer) in enumerate(zip(config.layer_types, layers)):
        counted = shape.inkling_layer_params(kind, first=i == 0, looped=shape.inkling.looped(i))
        assert counted == sum(p.numel() for p in layer.parameters()), (i, kind)
    kinds = layer_kinds(Workload(shape, 4096), Degrees(2, 1, 1))
    looped = config.layer_types[config.loop_layer_index_start:config.loop_layer_index_end] if loop else []
    passes = config.loop_num_passes if loop else 1
    assert [(type(k), k.kind, k.gated, n) for k, n in kinds] == [
        (Inkling2Layer, kind, False, config.layer_types.count(kind)) for kind in (SLIDING, FULL)] + [
        (Inkling2Layer, kind, True, (passes - 1) * looped.count(kind)) for kind in (SLIDING, FULL)
        if looped.count(kind)]


@pytest.mark.parametrize("family,ulysses,ring", [("inkling2", 2, 1), ("inkling2", 1, 2), ("inkling2-loop", 2, 1)])
def test_predicted_bytes_equal_measured(pools, family, ulysses, ring, tmp_path):
    """One step of the census's Inkling 2 (a sliding layer, then a full one whose key and value convolutions are
    dynamic; -loop: a sliding layer after them, the full one run in two passes): the all-gathers of each layer
    call's row of keys and values and of its four short convolutions' halos (forward; with checkpointing, again in
    the recompute) and their gradients' reduce-scatters (backward), per rank, calls and bytes, against the
    planner's figures of every kind, each as many times as the step calls it."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, family, ulysses, ring, tmp_path):
        kinds = layer_kinds(work, layout)
        assert [n for _, n in kinds] == ([1, 1] if family == "inkling2" else [2, 1, 1])
        for rank in ranks:
            index = rank["ulysses_rank"] + ulysses * rank["ring_rank"]
            planned = [(kind.ranks()[index], n) for kind, n in kinds]
            for (kind, phase), repeats in ((("all_gather", "forward"), 2 if case.checkpointing else 1),
                                           (("reduce_scatter", "backward"), 1)):
                counted = rank["stats"][kind][phase]
                want = (repeats * sum(n * t.calls(kind, phase) for t, n in planned),
                        repeats * sum(n * t.sent(kind, phase) for t, n in planned))
                assert (counted["calls"], counted["bytes_sent"]) == want, (case, kind, counted, want)
        per_layer = kinds[1][0].traffic()
        assert per_layer["forward"][ROWS] > 0 and per_layer["forward"][HALOS] > 0


def test_seqmesh_plan_sizes_inkling2(tmp_path, capsys):
    """``seqmesh plan`` names Inkling 2's layers and its blocks, and sends each layer's row and halo gathers on every
    sharded layout (the other rank's 65,536 tokens of the keys and values, bf16, on two ranks: the full layers' 2 kv
    heads of 32, the sliding layers' 4 of 16, the same), none on one GPU; it refuses ``--inference`` (seqmesh
    generate does not decode Inkling 2) and tensor parallelism; Inkling2-Loop's loop it names, and its step takes
    longer than Inkling 2's of the same layers by its passes."""
    plans = assert_relative_plan("Inkling2TextConfig", CONFIGS["small"], tmp_path, capsys,
                                 "3 full, bias 128 keys back; relative bias over the gathered row, four short "
                                 "convolutions of 3 a layer (the full layers' keys' and values' dynamic); block "
                                 "states of 3 layers")
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                 **LOOPS["small"], "model_type": "inkling2_loop_text"}))
    assert main(["plan", "--model", str(loop / "config.json"), "--seq-len", "131072", "--gpus", "2", "--json"]) == 0
    looped = {c["label"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert looped["U2 x R1 x DP1"]["step_time_s"] > plans["U2 x R1 x DP1"]["step_time_s"] * 1.5, (looped, plans)
    assert main(["plan", "--model", str(loop / "config.json"), "--seq-len", "131072", "--gpus", "2"]) == 0
    assert "layers 3-5 looped, 4 passes, message gates of rank 8" in capsys.readouterr().out


def test_a_loop_transformers_could_not_build_is_refused_naming_the_fix(tmp_path):
    """Inkling2-Loop's looped layers start and end at block boundaries (transformers' config checks it too); the
    planner names the entries and the fix. A loop past the last layer loops what it holds, as transformers runs it."""
    from seqmesh.model.presets import model_shape

    config_shape("Inkling2LoopTextConfig", LOOPS["small"], tmp_path, count=False)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "loop_layer_index_start": 2}))
    with pytest.raises(ValueError, match="multiples of n_layers_per_attn_res_block .3.; fix loop_layer_index_start"):
        model_shape(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({**written, "loop_layer_index_end": 9}))
    assert model_shape(str(tmp_path / "config.json")).inkling.extra_passes == 3 * 4  # layers 3 .. 6 of 7, 3 passes more
