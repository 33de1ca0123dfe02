"""The planner on Doge with its cross-domain experts (is_moe=True; the shape: seqmesh.model.doge, the layer:
seqmesh.planner.cross_domain): its parameter count against the model transformers builds, its router logits'
all-gather against what seqmesh.hf.doge_moe really sends (``comm_stats``), what its MLP keeps for backward against
the tensors autograd saves, and ``seqmesh plan`` on its config.json."""

from __future__ import annotations

import json

import pytest

from doge_moe_cases import mlp_saved_bytes
from planner_cases import assert_gathers, config_shape, measured_gathers
from seqmesh.model.presets import model_shape
from seqmesh.planner.activations import mlp_saved_bytes as planned_mlp_saved_bytes
from seqmesh.planner.attention_layer import Attention
from seqmesh.planner.cross_domain import KEY, router_ranks
from seqmesh.planner.layers import layer_kinds
from seqmesh.planner.workload import Workload
from seqmesh.rules.degrees import Degrees
from seqmesh.tools.cli import main

pytestmark = pytest.mark.skipif(
    __import__("seqmesh.hf.own_attention", fromlist=["_too_old"])._too_old("DogeAttention"),
    reason="this transformers' Doge is refused whole (seqmesh.hf.own_attention.NEWEST_ONLY)")

# Doge's defaults with its experts (1,024 wide, 16,384 experts, 64 a token); a small one with normalised weights and
# a count of experts that is not a square (its router's keys are floor(sqrt(1000)) = 31 a half)
CONFIGS = {
    "defaults": dict(is_moe=True),
    "small": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=500, num_experts=1000, num_experts_per_tok=8, norm_topk_prob=True,
                  tie_word_embeddings=False, is_moe=True),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The two embeddings, the router and the dense MLP beside them, counted exactly with the rest of the model."""
    config, shape, built = config_shape("DogeConfig", CONFIGS[name], tmp_path)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    assert shape.cross_domain.keys == (128 if name == "defaults" else 31)


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_router_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step's router all-gathers (forward; with checkpointing, again in the recompute) and reduce-scatters
    (backward), per rank, calls and bytes, against the planner's per-layer figures times the layers."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, "doge-moe", ulysses, ring, tmp_path):
        kinds = layer_kinds(work, layout)
        assert all(isinstance(k, Attention) for k, _ in kinds) and sum(n for _, n in kinds) == 2
        for rank in ranks:  # two layers
            mine = router_ranks(work, layout)[rank["ulysses_rank"] + ulysses * rank["ring_rank"]]
            assert_gathers(rank, [mine], 2 if case.checkpointing else 1, case, layers=2)
        for kind, _ in kinds:  # the layer's figures are the busiest rank's
            per_layer = kind.traffic()
            assert per_layer["forward"][KEY] == max(r.sent("all_gather", "forward") for r in router_ranks(work, layout))
            assert per_layer["backward"][KEY] == per_layer["forward"][KEY]


@pytest.mark.parametrize("norm_topk", [False, True])
def test_what_the_mlp_keeps_is_what_autograd_saves(pools, tmp_path, norm_topk):
    """In bfloat16 on Ulysses 2 (48 tokens a rank, none of the weights' sizes), the tensors the first layer's MLP
    saves (the dense MLP's four, the experts' rows, activations, routing weights, picks and sorted keys; with
    norm_topk_prob the normalised weights and their sum) are the planner's bytes for its tokens."""
    measured = pools.run(2, mlp_saved_bytes, 96, norm_topk)[0]
    (tmp_path / "config.json").write_text(json.dumps(measured["config"]))
    work = Workload(model_shape(str(tmp_path / "config.json")), 96, bf16=True)
    assert measured["tokens"] == 48
    assert planned_mlp_saved_bytes(work, Degrees(2, 1, 1)) == measured["saved"], measured


def test_seqmesh_plan_sizes_doge_with_its_experts(tmp_path, capsys):
    """``seqmesh plan`` on Doge's defaults with is_moe at its window of 2,048 tokens: the router logits' all-gather in
    each sharded layout's layer (the other rank's 1,024 tokens of 2 x 128 bf16 logits on two ranks) and none where
    one GPU holds the sequence; the tiled MLP refused in the runtime's words; ``--inference`` plans its generation
    (seqmesh generate runs it: tests/inference/test_generate.py)."""
    config_shape("DogeConfig", CONFIGS["defaults"], tmp_path, count=False)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "2048", "--gpus", "2"]
    assert main([*argv, "--json"]) == 0
    plans = {c["label"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert plans["U2 x R1 x DP1"]["comm_bytes_per_layer"]["forward"][KEY] == 1024 * 2 * 128 * 2
    assert plans["U1 x R1 x DP2"]["comm_bytes_per_layer"]["forward"].get(KEY, 0) == 0
    with pytest.raises(ValueError, match="route each token by other tokens' router logits.*without tiled_mlp"):
        Workload(model_shape(str(tmp_path / "config.json")), 2048, tiled_mlp=True)
    assert main([*argv, "--inference"]) == 0
    assert "recommended: " in capsys.readouterr().out
