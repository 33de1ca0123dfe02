"""The planner on ZAYA (its CCA attention projections, seqmesh.hf.cca; the shape: seqmesh.model.zaya): its parameter
count against the model transformers builds, its halo's bytes against what seqmesh.hf.cca really sends
(``comm_stats``), and ``seqmesh plan`` on ZAYA1's config.json."""

from __future__ import annotations

import json

import pytest

from planner_cases import assert_gathers, config_shape, measured_gathers
from seqmesh.planner.attention_layer import Attention
from seqmesh.planner.cca import cca_ranks
from seqmesh.planner.layers import layer_kinds
from seqmesh.rules.degrees import Degrees
from seqmesh.tools.cli import main

# ZAYA's sizes: tiny, all full; with windows, biases, an untied biased head and wider convs; ZAYA1's (the defaults)
CONFIGS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 vocab_size=1000, moe_intermediate_size=128, num_experts=4, router_hidden_size=64),
    "windows": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    vocab_size=500, moe_intermediate_size=64, num_experts=3, router_hidden_size=32, attention_bias=True,
                    lm_head_bias=True, tie_word_embeddings=False, cca_time0=3, cca_time1=4,
                    layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding"], sliding_window=16),
    "zaya1": {},
}


def _shape(sizes: dict, folder, count: bool = False):
    """(config, the planner's shape, with ``count`` transformers' parameter count) of ZayaConfig(**sizes) written to
    ``folder``."""
    return config_shape("ZayaConfig", sizes, folder, count)


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_are_what_transformers_builds(name, tmp_path):
    """The CCA projection (q, k, the two value halves, the convs, the key temperature), the residual scalings, the
    router (its MLP, the previous router states' scale from layer 1 on), the experts, the input scaling and the head,
    counted exactly; the windowed layers planned with their window, and nothing left unplanned."""
    config, shape, built = _shape(CONFIGS[name], tmp_path, count=True)
    assert shape.params == built and not shape.unplanned, (shape.params, built, shape.unplanned)
    windows = [t == "hybrid_sliding" for t in config.layer_types]
    assert shape.hybrid.count(mixer="sliding_attention") == sum(windows)
    assert shape.sliding_window == (config.sliding_window if any(windows) else None)


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_halo_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step's halo all-gathers (forward; with checkpointing, again in the recompute) and reduce-scatters
    (backward), per rank, calls and bytes, against the planner's per-layer figures times the layers."""
    layout = Degrees(ulysses, ring, 1)
    for case, work, ranks in measured_gathers(pools, "zaya", ulysses, ring, tmp_path):
        kinds = layer_kinds(work, layout)
        assert all(isinstance(k, Attention) and k.cca for k, _ in kinds) and sum(n for _, n in kinds) == 2
        for rank in ranks:  # two layers
            mine = cca_ranks(work, layout)[rank["ulysses_rank"] + ulysses * rank["ring_rank"]]
            assert_gathers(rank, [mine], 2 if case.checkpointing else 1, case, layers=2)
        for kind, _ in kinds:  # the layer's figures are the busiest rank's
            per_layer = kind.traffic()
            assert per_layer["forward"]["cca_halo_gather"] == max(r.sent("all_gather", "forward")
                                                                  for r in cca_ranks(work, layout))
            assert per_layer["backward"]["cca_halo_gather"] == per_layer["forward"]["cca_halo_gather"]


def test_seqmesh_plan_sizes_zaya1(tmp_path, capsys):
    """``seqmesh plan`` on ZAYA1's config.json (8.8B): its layers named, the halo's traffic in each sharded layout's
    layer (``(P - 1)`` runs' 2 earlier rows of q | k, 1,280 channels, and one row of the delayed value, 128 channels,
    in bf16 on Ulysses 8) and none where one GPU holds the sequence."""
    _shape({}, tmp_path)
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "131072", "--gpus", "8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "8.8B params" in text and "CCA projections, their q | k convs 2 and 2 taps" in text, text
    assert main([*argv, "--json"]) == 0
    plans = {c["label"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    u8 = plans["U8 x R1 x DP1"]["comm_bytes_per_layer"]["forward"]
    assert u8["cca_halo_gather"] == 7 * (2 * 1280 + 1 * 128) * 2, u8
    assert plans["U1 x R1 x DP8"]["comm_bytes_per_layer"]["forward"].get("cca_halo_gather", 0) == 0
