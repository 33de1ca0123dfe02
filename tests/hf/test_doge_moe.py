"""Doge's cross-domain experts (is_moe=True) through seqmesh.hf.doge_moe: transformers routes each token by two other
tokens' halves of router logits (its (2, N, K) view of the call's (N, 2K) logits), across rows and the whole call.
On Ulysses 2 and ring 2, three rows plain and two rows of packed documents, the logits and every parameter's gradient
equal transformers' float64 model on one process within ROUNDING_MULTIPLE x how far that reference moves in float32
(and with the layout's padding on ring 2);
routing by the shard's own logits (what seqmesh did before it refused the layer) and reading the gathered logits in
shard order are each seen far outside that."""

from __future__ import annotations

import pytest

from doge_moe_cases import parity, refusals
from test_hf_families import ROUNDING_MULTIPLE

pytestmark = pytest.mark.skipif(
    __import__("seqmesh.hf.own_attention", fromlist=["_too_old"])._too_old("DogeAttention"),
    reason="this transformers' Doge is refused whole (seqmesh.hf.own_attention.NEWEST_ONLY)")

# (ulysses, ring, layout, packed documents[, tokens]): 41 tokens leave the layout's padding on ring 2, whose tokens
# route by their own logits and score nothing. (transformers' norm_topk_prob=True divides the softmax's output in place,
# which its own backward refuses: no reference to train against.)
CASES = [(2, 1, "zigzag", False), (2, 1, "contiguous", True), (1, 2, "zigzag", False), (1, 2, "per_document", True),
         (1, 2, "zigzag", False, 41)]


def test_exact_over_rows_and_documents(pools):
    for results in pools.run(2, parity, CASES):
        for r in results:
            assert r["logits"] <= ROUNDING_MULTIPLE * r["rounding"]["logits"], r
            assert r["grad"] <= ROUNDING_MULTIPLE * r["rounding"]["grad"], r


@pytest.mark.parametrize("mutation,cases", [("own shard", CASES[:1] + CASES[3:4]), ("shard order", CASES[2:4])])
def test_each_mutation_is_seen(pools, mutation, cases):
    """Routing by the shard's own logits (U2 and R2); the gathered logits read in shard order (ring 2, whose zigzag
    and per-document layouts reorder the sequence; Ulysses 2 alone keeps it in order)."""
    for results in pools.run(2, parity, cases, mutation):
        for r in results:
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r
            assert r["grad"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["grad"], r


def test_padded_rows_are_refused_by_name(pools):
    """Rows right-padded inside the batch (transformers routes real tokens by the padding's logits) raise a ValueError
    on every rank naming what to do instead, as does a prefill onto a kept cache (its routing depends on where the
    row's calls are cut); rows whose mask pads nothing run, and generation's check passes (it generates as
    transformers does: tests/inference/test_generate.py)."""
    for said in pools.run(2, refusals):
        assert said["whole rows"] == "", said  # an attention_mask of ones pads nothing
        assert "rows' padding" in said["padded rows"] and "[20, 15]" in said["padded rows"], said
        assert "pack the documents" in said["padded rows"], said
        assert said["generate"] == "", said
        assert "Doge's cross-domain experts" in said["extension"] and "at once" in said["extension"], said
