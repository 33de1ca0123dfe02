"""Gated DeltaNet by state passing (``seqmesh.linear_attention.state_passing``) against one process."""

from __future__ import annotations

import itertools

import pytest
import torch

from linear_cases import LayerCase, ModelCase, layer_cases, model_cases
from seqmesh.linear_attention.choice import state_passing_bytes

MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]  # (ulysses, ring)
# documents of length 1 and 2 (shorter than the conv's tail of 3), documents crossing rank boundaries
DOCS = {24: (0, 1, 2, 9, 10, 20, 24), 23: (0, 1, 7, 8, 22, 23), 48: (0, 2, 3, 30, 31, 46, 48)}
# (key heads, value heads): grouped; fewer value heads than ranks, which the all-to-all design refuses
HEADS = [(2, 4), (1, 2)]
# float64 throughout, except the decay g, which seqmesh computes in float32 from A_log as transformers does:
# A_log's gradient is a float32 sum over the tokens, in another order once they are split over ranks.
# Measured: <= 4e-9 relative (the all-to-all design keeps each head's tokens together and is exact); a state
# that skips a rank boundary or a conv that misses a tail is off by more than 1e-2.
FLOAT64_ATOL = 1e-12
A_LOG_RTOL = 64 * torch.finfo(torch.float32).eps


def _cases(p: int) -> list[LayerCase]:
    cases = [LayerCase(s, hk, hv, layout, DOCS[s] if docs else None, design="state_passing")
             for layout, s, docs, (hk, hv) in itertools.product(("zigzag", "contiguous", "per_document"), (24, 48),
                                                                (False, True), HEADS)
             if (docs or layout != "per_document") and s % p == 0]
    # a longer conv (its tail reaches across two short documents and several ranks); a length that pads
    cases += [LayerCase(24, 2, 4, "per_document", DOCS[24], kernel=6, design="state_passing"),
              LayerCase(23, 2, 4, "zigzag", DOCS[23], design="state_passing")]
    return cases


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_state_passing_exact_float64(pools, ulysses, ring):
    """Output, the input's and every parameter's gradient equal the whole-sequence computation (float64);
    every rank sends the bytes of the closed form (two all-gathers forward, their reduce-scatters backward)."""
    p = ulysses * ring
    cases = _cases(p)
    per_rank = pools.run(p, layer_cases, ulysses, ring, cases, timeout=600)
    for rank, results in enumerate(per_rank):
        for case, r in zip(cases, results):
            errors = dict(r["errors"])
            a_log = errors.pop("A_log")
            assert max(errors.values()) <= FLOAT64_ATOL, (rank, r["case"], errors)
            assert a_log <= A_LOG_RTOL * r["A_log_scale"], (rank, r["case"], a_log, r["A_log_scale"])
            assert r["a2a_calls"] == 0 and r["gather_calls"] == (2, 2), (rank, r["case"], r)
            if case.documents is None:  # the runs of zigzag and contiguous follow from the mesh alone
                want = state_passing_bytes(case.key_heads, case.value_heads, case.key_dim, case.value_dim,
                                           batch=case.batch, ulysses=ulysses, ring=ring, layout=case.layout,
                                           kernel=case.kernel, dtype_bytes=8, state_bytes=8)
                assert max(r["gather_bytes"]["forward"] for r in (x[cases.index(case)] for x in per_rank)) == want, \
                    (r["case"], want)
                assert r["gather_bytes"]["backward"] == r["gather_bytes"]["forward"], r
