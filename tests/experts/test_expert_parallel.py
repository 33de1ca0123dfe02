"""Expert parallelism (``ParallelPlan(ep=...)``): a model whose experts are split over expert groups trains as one
process does. Qwen3-MoE (softmax top-k), DeepSeek-V3 (sigmoid scores with a routing bias, group-limited top-k, a
shared expert, MLA, a dense first layer) and gpt-oss (router and expert biases, clamped interleaved gate) on Ulysses,
USP and ring x data-parallel meshes, FSDP2, float64: every step's loss and the first step's gradients, against the
transformers model on the whole batch in one process, within a multiple of the reference's own noise (the same
batch with its rows in the other order). A rank whose tokens choose none of its experts, experts no token chooses,
recomputation in backward, the bytes each exchange sends, and a mutation that sends tokens to the wrong rank."""

from __future__ import annotations

import pytest

from experts_cases import ep_all, ep_bytes, ep_gradient_norm, replicas_all
from seqmesh.experts.layers import EXPERT_PARALLEL_FAMILIES
from seqmesh.experts.rules import check_expert_parallel

# Measured (torch 2.13, transformers 5.24, CPU): at most ~1.9 x the reference's noise (gpt-oss's sinks); the mutation
# that sends each pair to the next rank's expert moves the loss 2.5e5 x (DeepSeek-V3 at transformers 5.15, whose
# noise includes its float32 router's) to 1.9e6 x and the gradients 5e6 x to 1.6e15 x that noise.
NOISE_MULTIPLE = 8
MUTATION_SEEN = 1e4  # over a thousand times the bound
FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss"]


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["loss"] <= NOISE_MULTIPLE and r["grad"] <= NOISE_MULTIPLE, r


def test_two_ranks_ulysses(pools):
    """--ep 2 on U2; the experts past the first two unchosen (rank 1 receives nothing); the mutation fails."""
    cases = [(f, 2, 1, 1, 2) for f in FAMILIES] + [("qwen3_moe", 2, 1, 1, 2, 2)]
    for rank in pools.run(2, ep_all, cases):
        _check(rank)
    for rank in pools.run(2, ep_all, [("qwen3_moe", 2, 1, 1, 2), ("deepseek_v3", 2, 1, 1, 2)], wrong_rank=True):
        for r in rank:
            assert r["loss"] > MUTATION_SEEN and r["grad"] > MUTATION_SEEN, r


def test_four_ranks(pools):
    """--ep 4 on U2 x R2 and --ep 2 on R2 x DP2, every family; with ep 4 and two experts chosen, three of the four
    ranks receive nothing; DeepSeek-V3 with activation checkpointing (the exchanges run again in backward), and on
    R2 x two HSDP replicas (the experts sharded over both)."""
    cases = ([(f, 2, 2, 1, 4) for f in FAMILIES] + [(f, 1, 2, 2, 2) for f in FAMILIES]
             + [("qwen3_moe", 2, 2, 1, 4, 2)])
    for rank in pools.run(4, ep_all, cases):
        _check(rank)
    for rank in pools.run(4, ep_all, [("deepseek_v3", 2, 2, 1, 4)], checkpointing=True):
        _check(rank)
    for rank in pools.run(4, ep_all, [("deepseek_v3", 1, 2, 1, 2)], replicate=2):  # HSDP: R2 x 2 replicas
        _check(rank)


def test_every_family_with_and_without_ep(pools):
    """Every other family seqmesh splits (census tiny configs, 4 experts) trains on U2 with ep 2 as on the same ranks
    without it (whose exactness against one process the census and family tests establish)."""
    from census_configs import census_names

    here = set(census_names())  # the families this transformers has
    others = [f for f in EXPERT_PARALLEL_FAMILIES if f not in FAMILIES and f in here]
    for rank in pools.run(2, replicas_all, [(f, 2, 1, 1, 2) for f in others]):
        for r in rank:
            if "refused" in r:  # DeepSeek Sparse Attention as transformers 5.15 lays it out: refused without EP too
                assert "upgrade transformers" in r["refused"], r
                continue
            assert r["loss"] <= NOISE_MULTIPLE and r["grad"] <= NOISE_MULTIPLE, r


@pytest.mark.parametrize("family", ["qwen3_vl_moe"])
def test_vision_language_moe(pools, family):
    """A vision-language MoE (its tower sharded, images in one replica's batch, text only in the other's) with the
    language model's experts split over groups of 2 and of 4 ranks (R2 x DP2), against one process on both batches,
    within the bound of tests/vision (a multiple of the float32-vs-float64 spread of the reference)."""
    from vision_cases import fsdp_data_parallel_parity

    for ep in (2, 4):
        for r in pools.run(4, fsdp_data_parallel_parity, family, ep=ep):
            assert r["loss"] <= 4 * r["rounding"]["loss"] and r["grad"] <= 4 * r["rounding"]["grad"], (family, ep, r)


@pytest.mark.parametrize("ring,dp,ep", [(2, 1, 2), (2, 2, 2), (2, 2, 4)])
def test_counted_bytes_equal_formula(pools, ring, dp, ep):
    """What the exchanges count equals seqmesh.experts.traffic's formula of the routes taken (forward: counts,
    dispatch, combine; backward: the two exchanges reversed)."""
    for rank in pools.run(ring * dp, ep_bytes, "qwen3_moe", ring, dp, ep):
        assert rank["layers"] == 2 and rank["counted"] == rank["formula"], rank
        assert rank["formula"]["forward"] > 0


def test_refusals_name_the_value_and_fix():
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 routed experts.*Use one of \\[1, 2, 4\\]"):
        check_expert_parallel(3, experts=8, token_ranks=12)
    with pytest.raises(ValueError, match="ep=4 does not divide the 6 ranks"):
        check_expert_parallel(4, experts=8, token_ranks=6)
    with pytest.raises(ValueError, match="no routed experts"):
        check_expert_parallel(2, experts=None, token_ranks=4)
    with pytest.raises(ValueError, match="tp=2"):
        check_expert_parallel(2, experts=8, token_ranks=4, tp=2)
    with pytest.raises(ValueError, match="without FSDP2"):
        check_expert_parallel(2, experts=8, token_ranks=4, fsdp=False)
    with pytest.raises(ValueError, match="compile"):
        check_expert_parallel(2, experts=8, token_ranks=4, compile=True)
    check_expert_parallel(1, experts=None, token_ranks=3)
    check_expert_parallel(4, experts=8, token_ranks=8)


@pytest.mark.parametrize("ulysses,ring,ep", [(2, 2, 2), (2, 2, 1)])
def test_gradient_norm_over_both_meshes(pools, ulysses, ring, ep):
    """gradient_norm with the experts' gradients on their own 2-D mesh (and, ep=1, on the FSDP mesh alone) equals
    the one-process model's gradient norm, and clipping scales every gradient of both meshes by torch's
    coefficient."""
    for rank in pools.run(ulysses * ring, ep_gradient_norm, "qwen3_moe", ulysses, ring, 1, ep):
        assert rank["meshes"] == (2 if ep > 1 else 1), rank
        # measured (torch 2.13, float64): 1.2e-16 relative (one ulp of the norm 0.919; the reference's own spread with
        # its rows reversed is 0, hence the floor of 1e-15), clipped gradients 7.4e-16, at ep 2 and ep 1 alike
        assert rank["norm"] <= NOISE_MULTIPLE * max(rank["spread"], 1e-15), rank
        assert rank["again"] and rank["clipped"] <= 1e-12, rank
