"""seqmesh.attention on spawned gloo groups against float64 attention on the whole sequence."""

from __future__ import annotations

import itertools

import pytest

from dist_cases import Case, attention_cases, sharding_checks

# (ulysses, ring, dp_shard): world size is their product. One rank, USP 2 x 2 and a ring of 4 reach every line that
# ring 2, Ulysses 2, Ulysses 4 and the data-parallel meshes (R2 x DP2, U2 x DP2) reached here (docs/testing.md)
MESHES = [(1, 1, 1), (2, 2, 1), (1, 4, 1)]
# (query heads, kv heads): MHA, GQA with kv replication when ulysses > 2, MQA, uneven grouping, odd heads
HEADS = [(4, 4), (8, 2), (4, 1), (6, 3), (5, 5)]


def _documents(seq_len: int) -> tuple[int, ...]:
    """Packed documents with length-1 documents, a long one crossing shard boundaries, and padding
    after the last document."""
    return (0, 1, 2, 7, 8, seq_len - 6, seq_len - 1)


def _cases(ulysses: int, ring: int) -> list[Case]:
    cases = []
    for causal, layout, (hq, hk), seq_len, docs in itertools.product(
        (True, False), ("zigzag", "contiguous"), HEADS, (24, 23), (False, True)
    ):
        if hq < ulysses:
            continue
        cases.append(Case(seq_len, hq, hk, causal, layout, _documents(seq_len) if docs else None))
    return cases


@pytest.mark.parametrize("ulysses,ring,dp_shard", MESHES, ids=[f"u{u}xr{r}xdp{d}" for u, r, d in MESHES])
def test_exact_float64(pools, ulysses, ring, dp_shard):
    """Output and dq/dk/dv equal single-device float64 attention for every case, on every rank."""
    cases = _cases(ulysses, ring)
    per_rank = pools.run(ulysses * ring * dp_shard, attention_cases, ulysses, ring, dp_shard, cases)
    bad = [
        (rank, r["case"], {k: v for k, v in r.items() if k != "case" and v > 1e-10})
        for rank, results in enumerate(per_rank)
        for r in results
        if any(v > 1e-10 for k, v in r.items() if k != "case")
    ]
    assert not bad, f"{len(bad)} case(s) off by more than 1e-10: {bad[:5]}"
    assert len(per_rank[0]) == len(cases) >= 60


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (1, 4), (4, 1)])
def test_exact_float32(pools, ulysses, ring):
    """float32 inputs through the CPU flash kernel stay within 1e-5 of float64 attention."""
    cases = [
        Case(seq_len, hq, hk, causal, layout, docs, dtype="float32", seed=3)
        for causal, layout, (hq, hk), seq_len, docs in itertools.product(
            (True, False), ("zigzag",), [(4, 4), (8, 2)], (64, 61), (None, (0, 1, 20, 21, 45, 60))
        )
    ]
    per_rank = pools.run(ulysses * ring, attention_cases, ulysses, ring, 1, cases)
    worst = max(v for results in per_rank for r in results for k, v in r.items() if k != "case")
    assert worst < 1e-5, per_rank


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
def test_named_backends(pools, backend):
    """Each CPU kernel, named explicitly, gives the exact result through USP 2x2."""
    cases = [Case(23, 8, 2, causal, "zigzag", docs, backend=backend)
             for causal in (True, False) for docs in (None, (0, 1, 9, 20))]
    per_rank = pools.run(4, attention_cases, 2, 2, 1, cases)
    worst = max(v for results in per_rank for r in results for k, v in r.items() if k != "case")
    assert worst < 1e-10


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (1, 4), (4, 1), (1, 2)])
def test_placement_positions_and_shard_gather_gradients(pools, ulysses, ring):
    """Ulysses is innermost; positions follow the USP zigzag written out by hand; a mesh wrapped from
    the user's DeviceMesh places ranks the same; gather(shard(x)) == x, and its backward (reduce-
    scatter, then all-gather) gives every rank the summed gradient of all ranks' losses."""
    for rank, r in enumerate(pools.run(ulysses * ring, sharding_checks, ulysses, ring)):
        assert r["placement"] and r["wrapped_same_rank"], (rank, r)
        assert all(r["positions"].values()), (rank, r["positions"])
        assert all(r["roundtrip"].values()), (rank, r["roundtrip"])
        assert max(r["grad_err"].values()) < 1e-12, (rank, r["grad_err"])
