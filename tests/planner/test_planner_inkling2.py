"""The planner on Inkling 2 (the shape: seqmesh.model.inkling; its layer: seqmesh.planner.relative_attention): its
parameter count against the model transformers builds, layer by layer, its row's and its short convolutions' gathers
(static and dynamic) against what seqmesh.hf.inkling2 really sends (``comm_stats``), ``seqmesh plan`` on its
config.json, and what it refuses by name. Its memory is held to its rehearsal in tests/rehearsal/test_rehearse.py."""

from __future__ import annotations

import json

import pytest

from planner_cases import config_shape, measured_gathers
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


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The model's count and each layer's (its FSDP unit: its attention by its kind, its depth attention's queries,
    fewer in the first layer, its norms and two convolutions, its experts and float32 router) equal the model
    transformers builds; the layers are planned by their kinds."""
    import torch
    import transformers as tf

    config, shape, built = config_shape("Inkling2TextConfig", CONFIGS[name], tmp_path)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    with torch.device("meta"):
        layers = tf.AutoModelForCausalLM.from_config(config).model.layers
    for i, (kind, layer) in enumerate(zip(config.layer_types, layers)):
        assert shape.inkling_layer_params(kind, first=i == 0) == sum(p.numel() for p in layer.parameters()), (i, kind)
    kinds = layer_kinds(Workload(shape, 4096), Degrees(2, 1, 1))
    assert [(type(k), k.kind, n) for k, n in kinds] == [
        (Inkling2Layer, kind, config.layer_types.count(kind)) for kind in (SLIDING, FULL)]


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step of the census's Inkling 2 (a sliding layer, then a full one whose key and value convolutions are
    dynamic): the all-gathers of each layer's row of keys and values and of its four short convolutions' halos
    (forward; with checkpointing, again in the recompute) and their gradients' reduce-scatters (backward), per rank,
    calls and bytes, against the planner's figures of both kinds."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, "inkling2", ulysses, ring, tmp_path):
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
        per_layer = kinds[1][0].traffic()
        assert per_layer["forward"][ROWS] > 0 and per_layer["forward"][HALOS] > 0


def test_seqmesh_plan_sizes_inkling2(tmp_path, capsys):
    """``seqmesh plan`` names Inkling 2's layers and its blocks, and sends each layer's row and halo gathers on every
    sharded layout (the other rank's 65,536 tokens of the keys and values, bf16, on two ranks: the full layers' 2 kv
    heads of 32, the sliding layers' 4 of 16, the same), none on one GPU; it refuses ``--inference`` (seqmesh
    generate does not decode Inkling 2) and tensor parallelism; Inkling2-Loop's passes it names as not planned."""
    config_shape("Inkling2TextConfig", CONFIGS["small"], tmp_path, count=False)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "131072", "--gpus", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4 sliding layers of 8 query / 4 kv heads x 16, window 64; 3 full, bias 128 keys back" in out, out
    assert "block states of 3 layers" in out, out
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    plans = {c["label"]: c for c in result["candidates"]}
    assert plans["U2 x R1 x DP1"]["comm_bytes_per_layer"]["forward"][ROWS] == 65536 * 2 * 2 * 32 * 2
    assert plans["U1 x R1 x DP2"]["comm_bytes_per_layer"]["forward"].get(ROWS, 0) == 0
    assert [(x["layout"]["tp"], "tp 1 only" in x["reason"]) for x in result["excluded"]] == [(2, True)], result
    assert main([*argv, "--inference"]) != 0
    assert "is an Inkling model, whose decode" in capsys.readouterr().err
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                 "model_type": "inkling2_loop_text"}))
    assert main(["plan", "--model", str(loop / "config.json"), "--seq-len", "131072", "--gpus", "2"]) != 0
    assert "Inkling2-Loop's passes" in capsys.readouterr().err
