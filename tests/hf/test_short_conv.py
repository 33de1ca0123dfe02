"""LFM2, LFM2-MoE and LFM3 (tiny, float64) through seqmesh.hf: their gated short convolutions run sequence-parallel
with the conv's halo (seqmesh.hf.short_conv), and logits, loss and every parameter's gradient equal the unmodified
transformers model on one process (packed documents one call each), within ROUNDING_MULTIPLE x the reference's own
rounding as test_hf_families measures it."""

from __future__ import annotations

import json
import math

import pytest

from short_conv_cases import halo_traffic, layer_refusals, parity_all, parity_with_a_short_halo
from test_hf_families import ROUNDING_MULTIPLE, _outside_rounding

# lfm2: conv width 3, no bias; lfm2-hybrid: width 5 with a bias, conv conv attention conv; lfm2_moe: experts after
# a dense conv layer; lfm3: width 7 (a halo of 6 tokens, a whole zigzag run on U2xR2), sliding and full attention
FAMILIES = ["lfm2", "lfm2-hybrid", "lfm2_moe", "lfm3"]
MESHES = [(2, 1), (1, 2), (2, 2)]
LAYOUTS = [("zigzag", False), ("zigzag", True), ("contiguous", True), ("per_document", True)]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_short_conv_families_exact(pools, ulysses, ring):
    """Every family, zigzag plain and packed, contiguous and per_document packed, in one pool call per mesh."""
    cases = [(f, ulysses, ring, layout, docs) for f in FAMILIES for layout, docs in LAYOUTS]
    worst = {}
    for results in pools.run(ulysses * ring, parity_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            seen = (r["logits"] / r["rounding"]["logits"], r["grad"] / r["rounding"]["grad"], r["logits"], r["grad"])
            worst[r["case"][0]] = tuple(max(a, b) for a, b in zip(worst.get(r["case"][0], (0.0,) * 4), seen))
    print(f"u{ulysses}xr{ring} worst error / reference rounding (logits, relative grad), worst error (same): "
          + ", ".join(f"{f} {' '.join(f'{v:.1e}' for v in w)}" for f, w in worst.items()))


@pytest.mark.parametrize("seq_len,documents", [(20, False), (31, True)], ids=["plain", "documents"])
def test_a_halo_wider_than_a_run(pools, seq_len, documents):
    """LFM3's halo of 6 tokens on ring 4, zigzag, 20 or 31 tokens (padded to 24 or 32: runs of 3 or 4 tokens): a run's
    halo spans earlier runs of two or more other ranks, and packed documents (cut at 1, 9, 10, 30) restart it inside."""
    for results in pools.run(4, parity_all, [("lfm3", 1, 4, "zigzag", documents)], seq_len=seq_len):
        for r in results:
            assert not _outside_rounding(r), r


def test_a_halo_one_token_short_is_seen(pools):
    """The conv's halo one token short (each run's first token misses its farthest tap): far outside the tolerance,
    for the narrowest conv (lfm2, width 3: a halo of 1 becomes none) and the widest (lfm3, 6 becomes 5). The tiny
    models' conv moves their logits little (weights of std 0.02), their gradients much."""
    cases = [("lfm2", 1, 2, "zigzag", False), ("lfm3", 2, 1, "zigzag", True)]
    for results in pools.run(2, parity_with_a_short_halo, cases):
        for r in results:
            assert {"logits", "grad"} <= set(_outside_rounding(r)), r
            tolerance = {k: ROUNDING_MULTIPLE * r["rounding"][k] for k in ("logits", "grad")}
            assert r["logits"] > 10 * tolerance["logits"] and r["grad"] > 1000 * tolerance["grad"], r  # not near misses
            print(f"{r['case']}: error / tolerance {r['logits'] / tolerance['logits']:.0f} (logits), "
                  f"{r['grad'] / tolerance['grad']:.0f} (grad)")


def test_halo_traffic_per_layer(pools):
    """One all-gather per conv layer and forward, of (P - 1) x max_tail x D rows: max_tail = K - 1 rows per run
    that does not start the sequence, padded to the busiest rank (zigzag: 2 runs a ring rank, contiguous: 1)."""
    cases = {("lfm2", "zigzag"): 2 * 2, ("lfm2", "contiguous"): 2, ("lfm3", "zigzag"): 2 * 6, ("lfm3", "contiguous"): 6}
    for (family, layout), tail in cases.items():
        for r in pools.run(4, halo_traffic, family, 1, 4, layout, False):
            assert r["calls"] == r["convs"] > 0 and r["max_tail"] == [tail], (family, layout, r)
            assert r["bytes_per_layer"] == 3 * tail * r["channels"] * 8, (family, layout, r)
        print(f"{family} ring 4 {layout}: halo {r['bytes_per_layer']} B per conv layer per rank (float64, D=32)")


def test_an_lfm2_config_json_verifies_and_trains_on_four_ranks(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a tiny LFM2-shaped config (conv, attention,
    conv, attention) over 2 x 2 Ulysses x ring: the single-process model's loss, then a finite, falling loss with the
    layers recomputed in backward (the halo's all-gather runs again in the recompute)."""
    import transformers as tf

    from seqmesh.training.config import TrainConfig
    from train_job_cases import run_train, run_verify

    config = tf.Lfm2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=64, intermediate_size=64, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                           layer_types=["conv", "full_attention"] * 2)
    path = tmp_path / "lfm2" / "config.json"
    path.parent.mkdir()
    path.write_text(config.to_json_string())
    base = dict(model=str(path), seq_len=77, ulysses=2, ring=2, dp=1, lr=1e-2, warmup=1, log_every=1, eval_every=0,
                symbols=16)
    good = pools.run(4, run_verify, TrainConfig(**base, steps=1, out=str(tmp_path / "verify")), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    pools.run(4, run_train, TrainConfig(**base, steps=6, checkpointing=True, out=str(tmp_path / "train")))
    with open(tmp_path / "train" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_a_short_conv_refuses_what_it_cannot_compute(pools):
    """A parallelized short-conv layer called without seqmesh's entry, with a cache or with a padding mask, and the
    model asked for a cache, each raise a ValueError naming the way out; tensor parallelism is refused by name
    before any change (it would cut in_proj's B | C | x)."""
    import types

    from family_cases import build, family_config
    from seqmesh.hf.short_conv import short_conv_layers

    said = pools.run(2, layer_refusals)[0]
    assert "shard_batch" in said["no entry"] and "unparallelize" in said["no entry"], said
    assert all("keeps no cache" in said[k] and "unparallelize" in said[k] for k in ("cache", "model cache")), said
    assert "padding mask" in said["padding mask"] and "position_ids" in said["padding mask"], said
    model = build(family_config("lfm2"))
    assert len(short_conv_layers(model, types.SimpleNamespace(tp=1))) == 1
    with pytest.raises(ValueError, match=r"model\.layers\.0\.conv \(Lfm2ShortConv\) .* tp=1"):
        short_conv_layers(model, types.SimpleNamespace(tp=2))


def test_compiled_lfm2_has_one_graph_and_equals_eager(pools):
    """torch.compile (fullgraph, aot_eager) of the parallelized LFM2 on ring 2 with packed documents: one graph, no
    break (the placement is index arithmetic on the layout, constants to dynamo), the eager model's logits, loss and
    gradients within the reference's rounding. Measured: compiled == eager exactly, both 2e-16 from the reference."""
    from compile_cases import compiled_cases

    for results in pools.run(2, compiled_cases, [(1, 2, True, "lfm2")]):
        for r in results:
            assert not _outside_rounding({**r["compiled"], "rounding": r["rounding"]}), r
            assert not _outside_rounding({**r["compiled_vs_eager"], "rounding": r["rounding"]}), r
