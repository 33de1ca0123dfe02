"""BLOOM, MPT, Falcon, GPT-Neo, OpenAI-GPT, XGLM, GPT-NeoX-Japanese, Doge, RemBERT and MegatronBERT (tiny, float64) through seqmesh.hf: their attention, outside transformers' interface, runs on
the sequence mesh (seqmesh.hf.own_attention: the layer's own projections, seqmesh.attention with the family's ALiBi
slopes or rotary), and logits, loss and
every parameter's gradient equal the unmodified transformers model on one process (packed documents one call each),
within ROUNDING_MULTIPLE x the reference's own rounding as test_hf_families measures it."""

from __future__ import annotations

import json
import math

import pytest

from own_attention_cases import (layer_refusals, parity_with_bias_dropped, parity_with_both_ways,
                                 parity_with_padding_counted_per_shard, parity_with_positions_off_by_one,
                                 parity_with_slopes_unmoved, parity_with_table_from_each_shard, parity_with_whole_rotary,
                                 parity_with_windows_dropped, xlm_refusals)
from short_conv_cases import parity_all
from test_hf_families import ROUNDING_MULTIPLE, _outside_rounding

# bloom: 6 heads (slopes past the power of two); mpt: 6 heads, MPT's reordered slopes, a q/k/v clip; falcon: rotary,
# multi-query; falcon-mha: every head its own key and value, biases, sequential; falcon-new: rotary, 2 kv heads
# interleaved with their query groups; gpt-neo: unscaled, a local layer; bloom-sliced: transformers' sliced product
# (pretraining_tp with slow_but_exact), which adds no bias: the first version added it, and its gradient was wrong
# openai-gpt: its class named Attention, blocks without **kwargs; xglm: the query scaled first; gpt-neox-japanese: a
# partial rotary; doge: a bias of each key folded into the keys; rembert, megatron-bert: BERT-style attention as a
# decoder (is_decoder), three levels of calls without **kwargs, a prediction head holding the projection; roformer:
# the same, rotated at its encoder's sinusoidal table (renumbered as the decoders' of encoder-decoder families)
def _newest(*families: str) -> list[str]:
    """``families`` where the installed transformers is the one seqmesh computes them for (own_attention.NEWEST_ONLY);
    none at the floor, where they are refused by name (test_the_newest_only_families_are_refused_on_older_releases)."""
    from seqmesh.hf.own_attention import _too_old

    return [] if _too_old("DogeAttention") else list(families)


FAMILIES = ["bloom", "bloom-sliced", "mpt", "falcon", "falcon-mha", "falcon-new", "gpt-neo", "openai-gpt", "xglm",
            "xlm", "xlm-both-ways", *_newest("gpt-neox-japanese", "doge", "rembert", "megatron-bert", "roformer")]
# Ulysses 2 (the slopes dealt with their heads) and ring 2 (each block's distance) reach every line U2 x R2 did
# (docs/testing.md, the twins)
MESHES = [(2, 1), (1, 2)]
LAYOUTS = [("zigzag", False), ("zigzag", True), ("contiguous", True), ("per_document", True)]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_own_attention_families_exact(pools, ulysses, ring):
    """Every family, zigzag plain and packed, contiguous and per_document packed, in one pool call per mesh."""
    cases = [(f, ulysses, ring, layout, docs) for f in FAMILIES for layout, docs in LAYOUTS]
    worst = {}
    for results in pools.run(ulysses * ring, parity_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            seen = (r["logits"] / r["rounding"]["logits"], r["grad"] / r["rounding"]["grad"])
            worst[r["case"][0]] = tuple(max(a, b) for a, b in zip(worst.get(r["case"][0], (0.0,) * 2), seen))
    print(f"u{ulysses}xr{ring} worst error / reference rounding (logits, relative grad): "
          + ", ".join(f"{f} {' '.join(f'{v:.1e}' for v in w)}" for f, w in worst.items()))


# Each mutation of a path seqmesh.hf.own_attention adds, on the cases that reach it: far outside the tolerance
MUTATIONS = {
    # each Ulysses rank's heads biased by the first heads' slopes (U2: rank 1 gets heads 3-5, the slopes of 0-2)
    "slopes not dealt with their heads": (parity_with_slopes_unmoved, [("bloom", 2, 1, "zigzag", False),
                                                                       ("mpt", 2, 1, "zigzag", True)]),
    # rank 1's position ids one too far in Falcon's rotary (ring 2, multi-query; U2, grouped kv heads, documents):
    # the tolerance is the float32 rotary tables' rounding, the reference's own
    "Falcon's positions off by one": (parity_with_positions_off_by_one, [("falcon", 1, 2, "zigzag", False),
                                                                        ("falcon-new", 2, 1, "zigzag", True)]),
    # GPT-Neo's local layer run as a global one (ring 2, zigzag, documents)
    "GPT-Neo's window dropped": (parity_with_windows_dropped, [("gpt-neo", 1, 2, "zigzag", True)]),
    # XLM's padding counted by each rank over its shard (ring 2, plain: rank 0 keeps a token the row zeroes; U2,
    # documents)
    "XLM's padding counted on each shard": (parity_with_padding_counted_per_shard, [("xlm", 1, 2, "zigzag", False),
                                                                                    ("xlm", 2, 1, "zigzag", True)]),
}
if _newest("doge"):
    # GPT-NeoX-Japanese's rotary over the whole head instead of its leading half (ring 2)
    MUTATIONS["GPT-NeoX-Japanese's rotary over the whole head"] = (parity_with_whole_rotary,
                                                                   [("gpt-neox-japanese", 1, 2, "zigzag", False)])
    # Doge's bias of each key left out (U2: the bias dealt with its kv heads)
    MUTATIONS["Doge's key bias dropped"] = (parity_with_bias_dropped, [("doge", 2, 1, "zigzag", True)])
    # RemBERT's decoder attending both ways (ring 2: each rank's queries see the other's later keys)
    MUTATIONS["RemBERT attending both ways"] = (parity_with_both_ways, [("rembert", 1, 2, "zigzag", False)])
    # RoFormer's rotary table made from each shard's first token (ring 2: rank 1's tokens rotated as the first)
    MUTATIONS["RoFormer's table from each shard"] = (parity_with_table_from_each_shard,
                                                     [("roformer", 1, 2, "zigzag", False)])


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_mutation_is_seen(pools, mutation):
    run, cases = MUTATIONS[mutation]
    for results in pools.run(2, run, cases):
        for r in results:
            tolerance = ROUNDING_MULTIPLE * r["rounding"]["logits"]
            assert r["logits"] > 100 * tolerance, r
            print(f"{mutation}, {r['case']}: logits error / tolerance {r['logits'] / tolerance:.0f}")


def test_an_own_attention_layer_refuses_what_it_cannot_compute(pools):
    """A parallelized BLOOM layer called without seqmesh's entry, with a padding mask or asked for its weights, and
    the model asked for a cache, each raise a ValueError naming the way out; tensor parallelism, too many Ulysses
    ranks, attention dropout, Falcon's bfloat16 ALiBi and a kernel without ALiBi are refused by name before any
    change."""
    import types

    from family_cases import build, family_config
    from seqmesh.hf import own_attention

    said = pools.run(2, layer_refusals)[0]
    assert "shard_batch" in said["no entry"] and "unparallelize" in said["no entry"], said
    assert "padding mask" in said["padding mask"] and "position_ids" in said["padding mask"], said
    assert "output_attentions=False" in said["weights"], said
    assert "keeps no cache" in said["model cache"] and "unparallelize" in said["model cache"], said
    model = build(family_config("mpt"))
    mesh = types.SimpleNamespace(tp=1, ulysses=2, sp_size=2)
    assert len(own_attention.own_attention_layers(model, mesh)) == 2
    with pytest.raises(ValueError, match=r"transformer\.blocks\.0\.attn \(MptAttention\): .*tp=1"):
        own_attention.own_attention_layers(model, types.SimpleNamespace(tp=2, ulysses=1, sp_size=1))
    with pytest.raises(ValueError, match=r"MptAttention has 6 heads, too few for ulysses=8.*ulysses=2 x ring=4"):
        own_attention.own_attention_layers(model, types.SimpleNamespace(tp=1, ulysses=8, sp_size=8))
    model.transformer.blocks[1].attn.attn_dropout_p = 0.1
    with pytest.raises(ValueError, match=r"blocks\.1\.attn \(MptAttention\) has attention dropout 0\.1"):
        own_attention.own_attention_layers(model, mesh)
    with pytest.raises(ValueError, match=r"backend='cuda_flash' cannot compute ALiBi.*backend='auto'"):
        own_attention.check_backend(own_attention.own_attention_layers(build(family_config("bloom")), mesh), "cuda_flash")
    falcon = build(family_config("falcon"))
    own_attention.check_backend(own_attention.own_attention_layers(falcon, mesh), "cpu_flash")  # rotary: any kernel
    falcon.config.alibi = True
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.self_attention \(FalconAttention\).*alibi=True.*bfloat16"):
        own_attention.own_attention_layers(falcon, mesh)


def test_xlm_refuses_what_it_cannot_compute_on_every_rank(pools):
    """XLM attending both ways over a row that holds its padding id (on one rank's shard) is refused on both ranks,
    naming causal=True; lengths, langs and a cache are refused by name."""
    for said in pools.run(2, xlm_refusals):
        assert "causal=True" in said["both ways, padded"] and "pad_index=2" in said["both ways, padded"], said
        assert all("does not shard" in said[n] and n in said[n] for n in ("lengths", "langs")), said
        assert "without one" in said["cache"], said


def test_a_bloom_config_json_verifies_and_trains_on_four_ranks(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a tiny BLOOM config over 2 x 2 Ulysses x ring:
    the single-process model's loss, then a finite, falling loss with the blocks recomputed in backward (the
    recompute finds seqmesh's entry though neither BLOOM's model nor its blocks pass their **kwargs on)."""
    import transformers as tf

    from seqmesh.training.config import TrainConfig
    from train_job_cases import run_train, run_verify

    config = tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64)
    path = tmp_path / "bloom" / "config.json"
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


@pytest.mark.parametrize("family", ["openai-gpt", "xglm", "gpt-neox-japanese", "doge"])
def test_the_planner_plans_the_newer_own_attention_families(tmp_path, family, capsys):
    """seqmesh plan reads each one's config.json (the layers' sizes: tests/planner/test_planner_own_attention.py) and
    plans it."""
    from family_cases import family_config
    from seqmesh.model.presets import model_shape
    from seqmesh.tools.cli import main

    family_config(family).save_pretrained(tmp_path)
    assert model_shape(str(tmp_path)).unplanned == ""
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "64", "--gpus", "2", "--json"]) == 0  # Doge: within its window
    assert json.loads(capsys.readouterr().out)["recommended"] is not None


@pytest.mark.parametrize("family", ["openai-gpt", "xglm", "xlm", *_newest("gpt-neox-japanese", "doge", "doge-moe", "rembert")])
def test_the_newer_families_verify_and_train_from_config_json(pools, tmp_path, family):
    """``seqmesh verify`` and ``seqmesh train`` from each one's config.json on a ring of 2."""
    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config(family))
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def _doge_too_long() -> str:
    import torch

    import seqmesh
    from dist_cases import get_mesh
    from family_cases import build, family_config
    from seqmesh.hf import parallelize

    mesh = get_mesh(1, 2)
    model = parallelize(build(family_config("doge")), mesh)
    try:
        model(**seqmesh.shard_batch({"input_ids": torch.randint(0, 64, (1, 100))}, mesh))
    except ValueError as err:
        return str(err)
    return ""


def test_doge_past_its_keep_window_is_refused_by_name(pools):
    """Past keep_window_size keys Doge keeps only each query's keys of largest bias, which seqmesh does not compute:
    100 tokens against a keep_window_size of 96, refused with both numbers and the fix."""
    if not _newest("doge"):
        pytest.skip("this transformers' Doge is refused whole (test_the_newest_only_families_are_refused_on_older_...)")
    for message in pools.run(2, _doge_too_long):
        assert "100 tokens" in message and "keep_window_size=96" in message and "--seq-len" in message, message


def _refusal_of(family: str) -> str:
    from dist_cases import get_mesh
    from family_cases import build, family_config
    from seqmesh.hf import parallelize

    try:
        parallelize(build(family_config(family)), get_mesh(1, 1))
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("family", ["gpt-neox-japanese", "doge", "rembert", "roformer"])
def test_the_newest_only_families_are_refused_on_older_releases(pools, family):
    """At a transformers older than the one seqmesh computes them for, GPT-NeoX-Japanese, Doge, RemBERT and RoFormer are
    refused by name with the fix (upgrade), not computed from another release's layout."""
    from seqmesh.hf.own_attention import _too_old

    said = pools.run(1, _refusal_of, family)[0]
    if _too_old("DogeAttention"):
        assert "upgrade transformers to 5.24" in said, said
    else:
        assert said == "", said


def _after_a_stale_mask_function(family: str) -> dict:
    """``family_parity`` with a mask function registered first under the name parallelize gives the model, as a
    collected MPT or XGLM model of the same id leaves it when dropped without unparallelize (ids are reused; the census
    met it: one rank refused Dory's "own attention mask (1, 1, 1, 1)", the other hung in the next collective)."""
    import family_cases
    from transformers import AttentionMaskInterface

    from family_cases import family_parity
    from seqmesh.hf import own_attention

    real = family_cases.parallelize

    def after_a_stale_one(model, mesh, **kwargs):
        AttentionMaskInterface.register(f"seqmesh_{id(model):x}", own_attention.token_mask)
        return real(model, mesh, **kwargs)

    family_cases.parallelize = after_a_stale_one
    try:
        return family_parity(family, 1, 2)
    finally:
        family_cases.parallelize = real


def test_a_mask_function_left_under_the_models_name_is_not_used(pools):
    for r in pools.run(2, _after_a_stale_mask_function, "llama"):
        assert not _outside_rounding(r), r
