"""MoE models with the router load-balancing loss on (``output_router_logits=True``, coefficient 0.5): seqmesh's
loss and every gradient equal the single-process transformers model's on the whole batch (Ulysses, ring, USP,
data-parallel replicas; right-padded rows and packed documents; three routers), within a multiple of the
reference's own rounding; without the term the same comparison fails by a wide margin. Families whose model adds no
such term get none; one seqmesh has not checked is refused."""

from __future__ import annotations

import pytest
import torch

from router_aux_cases import aux_parity_all, vision_aux_all
from seqmesh.model.router_aux import router_aux

# As tests/hf/test_hf_families.py: a multiple of how far rounding moves the reference (family_cases.reference_rounding,
# which counts transformers' float32 steps: the routers' softmax, the aux loss's float32 sums). Measured (torch 2.13,
# transformers 5.24, CPU): see test_router_aux_exact's printout, at most ~0.3 of the reference's rounding on the loss
# and ~0.6 on gradients. Without the term the loss is ~1.0 off (2e6 x its bound) and the gradients ~100% (1e5 x).
ROUNDING_MULTIPLE = 4
FAMILIES = ["qwen3_moe", "gpt-oss", "mixtral"]
KINDS = ["rows", "documents"]


def _outside(r: dict) -> list[str]:
    return [key for key in ("loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


def _check(world: int, pools, cases: list[tuple]) -> dict:
    worst: dict = {}
    results = pools.run(world, aux_parity_all, cases)
    for rank_results in results:
        for r in rank_results:
            assert not _outside(r), r
            assert r["own"] is None or r["own"] < 1e-5 * r["value"], r  # the reference is the model's own loss
            key = r["case"][:3] + r["case"][4:]
            ratios = (r["loss"] / r["rounding"]["loss"], r["grad"] / r["rounding"]["grad"])
            worst[key] = tuple(max(a, b) for a, b in zip(worst.get(key, (0.0, 0.0)), ratios))
    values = [r["value"] for r in results[0]]
    for other in results[1:]:  # every rank reports the same loss
        assert all(abs(a - r["value"]) <= 1e-12 * abs(a) for a, r in zip(values, other))
    print(f"worst error / reference rounding (loss, grad): {worst}")
    return worst


def test_router_aux_exact_on_two_ranks(pools):
    """Ulysses 2 and ring 2: three routers, padded rows and packed documents."""
    _check(2, pools, [(f, u, r, k) for u, r in ((2, 1), (1, 2)) for f in FAMILIES for k in KINDS])


def test_router_aux_with_recomputed_layers(pools):
    """Activation checkpointing recomputes the routers in backward: the term still counts each layer once,
    Ulysses 2 and ring 2."""
    cases = [("qwen3_moe", 2, 1, "rows"), ("gpt-oss", 1, 2, "documents")]
    for rank_results in pools.run(2, aux_parity_all, cases, plan={"checkpointing": True}):
        for r in rank_results:
            assert not _outside(r), r


def test_router_aux_exact_on_four_ranks(pools):
    """USP 2 x 2, and two data-parallel replicas each holding one of the two rows (sequence over 2 ranks), against
    one process on both rows."""
    _check(4, pools, [(f, 2, 2, k) for f in FAMILIES for k in KINDS]
           + [("qwen3_moe", 1, 2, "rows", 2), ("gpt-oss", 2, 1, "rows", 2)])


def test_dropping_the_term_fails_widely(pools):
    """The behaviour before seqmesh added the term (coefficient 0 on seqmesh's side only) is far outside the bound."""
    for r in pools.run(2, aux_parity_all, [("qwen3_moe", 1, 2, "rows"), ("gpt-oss", 2, 1, "documents")], drop_aux=True)[0]:
        assert r["loss"] > 1e5 * ROUNDING_MULTIPLE * r["rounding"]["loss"], r
        assert r["grad"] > 1e3 * ROUNDING_MULTIPLE * r["rounding"]["grad"], r


def test_vision_moe_router_aux(pools):
    """Qwen3-VL-MoE (ring 2): images across shards and packed documents; without the term it fails."""
    cases = [("mixed", "zigzag", False), ("documents", "per_document", False), ("mixed", "zigzag", True)]
    for results in pools.run(2, vision_aux_all, [(1, 2, *c) for c in cases]):
        for (*_, dropped), r in zip(cases, results):  # noqa: B007
            if dropped:
                assert r["loss"] > 1e3 * ROUNDING_MULTIPLE * r["rounding"]["loss"], r
            else:
                assert r["loss"] <= ROUNDING_MULTIPLE * r["rounding"]["loss"], r
                assert r["grad"] <= ROUNDING_MULTIPLE * r["rounding"]["grad"], r
    print(f"qwen3_vl_moe error / reference rounding (loss, grad): "
          f"{[(r['loss'] / r['rounding']['loss'], r['grad'] / r['rounding']['grad']) for r in results]}")


def _meta(config_class, **kwargs):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_class(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                                             vocab_size=64, **kwargs))


def test_families_without_the_term_and_unchecked_ones():
    """DeepSeek-V3's model adds no aux loss (its balance is a bias): none is added. A family seqmesh has not checked
    is refused, naming the way out; a coefficient of 0 or output_router_logits off add nothing."""
    import transformers as tf

    assert router_aux(_meta(tf.DeepseekV3Config, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            output_router_logits=True)) is None
    with pytest.raises(ValueError, match="output_router_logits=False"):
        router_aux(_meta(tf.GraniteMoeConfig, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    from seqmesh.model.lm import SequenceParallelLM

    with pytest.raises(ValueError, match="output_router_logits=False"):  # when the model is wrapped, before any batch
        SequenceParallelLM(_meta(tf.GraniteMoeConfig, num_local_experts=4, num_experts_per_tok=2,
                                 output_router_logits=True), None)
    assert router_aux(_meta(tf.GraniteMoeConfig, num_local_experts=4, output_router_logits=True,
                            router_aux_loss_coef=0.0)) is None
    assert router_aux(_meta(tf.Qwen3MoeConfig, num_experts=4, output_router_logits=False)) is None
