"""Sliding windows, attention sinks and a value head dim unlike q's, on spawned gloo groups, against
float64 attention with an explicit mask on the whole sequence (forward and every gradient)."""

from __future__ import annotations

import itertools

import pytest

from dist_cases import Case, attention_cases, shifted_alibi_cases, shifted_chunk_cases, traffic_cases

# (ulysses, ring): a ring of 4 and Ulysses 4 reach every line that ring 2, Ulysses 2 and U2 x R2 reached here
# (docs/testing.md, the twins)
MESHES = [(1, 4), (4, 1)]


def _documents(seq_len: int) -> tuple[int, ...]:
    return (0, 1, 9, 10, seq_len - 5)


def _cases() -> list[Case]:
    """Windows of 1 token, shorter than a zigzag chunk (48 tokens on 4 ring ranks: chunks of 6),
    between a chunk and a shard, longer than a shard and longer than the sequence; lengths with and
    without padding (45 is not a multiple of 2P); packed documents; sinks; Dv != D; both layouts."""
    cases = [
        Case(seq_len, 4, 2, True, layout, _documents(seq_len) if docs else None, window=window)
        for layout, seq_len, docs, window in itertools.product(
            ("zigzag", "contiguous"), (48, 45), (False, True), (1, 5, 9, 20, 64)
        )
    ]
    cases += [Case(48, 4, 1, True, layout, None, window=7, sinks=True) for layout in ("zigzag", "contiguous")]
    cases += [Case(45, 4, 2, causal, "zigzag", _documents(45), sinks=True) for causal in (True, False)]
    cases += [Case(48, 4, 2, causal, "zigzag", None, v_dim=4) for causal in (True, False)]
    cases += [Case(45, 4, 4, True, "contiguous", _documents(45), v_dim=12, window=6, sinks=True)]
    cases += [Case(40, 4, 2, True, "zigzag", None, window=6, sinks=True, v_dim=4, dtype="float32", seed=2)]
    # images seen both ways by their tokens (Gemma 3): across shards and chunks, back to back at a document
    # boundary, under windows shorter than a chunk and none, in every layout
    images = ((2, 7), (9, 10), (10, 16), (20, 27), (33, 40))
    cases += [Case(45, 4, 2, True, layout, _documents(45), window=window, image_blocks=images)
              for layout, window in itertools.product(("zigzag", "contiguous", "per_document"), (None, 7))]
    # chunked attention (Llama 4): chunks of 1 token, shorter than a zigzag chunk, across shards, longer than the
    # sequence; with packed documents (chunks count from each document's start) and with a window
    cases += [Case(45, 4, 2, True, layout, _documents(45) if docs else None, chunk=chunk)
              for layout, docs, chunk in itertools.product(("zigzag", "contiguous", "per_document"), (False, True),
                                                           (1, 5, 16, 64))]
    cases += [Case(48, 4, 2, True, "zigzag", None, chunk=16, window=7, sinks=True)]
    # soft-capping (Gemma 2), a cap that bites (scores of about 1 against 0.7): with documents, windows, sinks
    cases += [Case(45, 4, 2, causal, layout, _documents(45), softcap=0.7, window=window, sinks=sinks)
              for causal, layout, window, sinks in ((True, "zigzag", None, False), (True, "per_document", 7, True),
                                                    (False, "contiguous", None, False))]
    # ALiBi (BLOOM, MPT): slopes that bite (a distance of 10 costs 5 at 0.5), grouped-query heads, every layout, with
    # and without documents and padding, in float32 too
    cases += [Case(seq_len, 4, 2, True, layout, _documents(seq_len) if docs else None, alibi=ALIBI)
              for layout, seq_len, docs in itertools.product(("zigzag", "contiguous", "per_document"), (48, 45),
                                                             (False, True)) if docs or layout != "per_document"]
    cases += [Case(45, 4, 4, True, "zigzag", _documents(45), alibi=ALIBI, dtype="float32", seed=3)]
    # the CPU flash op's row bands take the fp32 and fp64 cases above; the math kernel, by name, the same
    cases += [Case(48, 4, 2, True, "zigzag", _documents(48), alibi=ALIBI, backend="math")]
    return cases


ALIBI = (0.5, 0.25, 0.125, 2 ** -0.5)


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_window_sinks_value_dim_exact(pools, ulysses, ring):
    """Output, dq, dk, dv and d(sinks) (summed over the sequence group) equal the reference."""
    cases = _cases()
    per_rank = pools.run(ulysses * ring, attention_cases, ulysses, ring, 1, cases)
    worst: dict[str, dict[str, float]] = {"float64": {}, "float32": {}}
    for results in per_rank:
        for r in results:
            dtype = "float32" if "float32" in r["case"] else "float64"
            for name, err in r.items():
                if name != "case":
                    assert err < (1e-5 if dtype == "float32" else 1e-10), (r["case"], name, err)
                    worst[dtype][name] = max(worst[dtype].get(name, 0.0), err)
    assert len(per_rank[0]) == len(cases)
    print(f"u{ulysses}xr{ring} worst errors: {worst}")


def test_a_chunk_boundary_off_by_one_is_seen(pools):
    """Chunk boundaries one position late in seqmesh's plan (ring 2): the output leaves the float64 bound by far."""
    cases = [Case(45, 4, 2, True, layout, None, chunk=16) for layout in ("zigzag", "per_document")]
    for results in pools.run(2, shifted_chunk_cases, 1, 2, cases):
        for r in results:
            assert r["out"] > 1e-3, r


def test_an_alibi_distance_off_by_one_is_seen(pools):
    """ALiBi's distance one short on every call between disjoint runs (ring 2, U1 x R2: each block's bias is still
    a bias by distance, off by one slope against the diagonal's): the output leaves the float64 bound by far."""
    cases = [Case(48, 4, 2, True, layout, None, alibi=(0.5, 0.25, 0.125, 0.0625)) for layout in ("zigzag", "contiguous")]
    for results in pools.run(2, shifted_alibi_cases, 1, 2, cases):
        for r in results:
            assert r["out"] > 1e-3, r
        print("ALiBi distance one short: output errors", ", ".join(f"{r['out']:.1e}" for r in results))


@pytest.mark.parametrize("ulysses,ring", [(1, 4), (2, 2)], ids=["u1xr4", "u2xr2"])
def test_window_traffic_equals_planner_formula(pools, ulysses, ring):
    """Per-rank P2P and all-to-all bytes counted by comm_stats equal the planner's first-principles
    formula, including the ring steps (and K/V transfers) a short window skips."""
    from seqmesh.planner.traffic import attention_traffic, ring_steps

    cases = [Case(64, 4, 2, True, layout, None, window=w) for layout in ("zigzag", "contiguous") for w in (1, 5, 9, 20, None)]
    per_rank = pools.run(ulysses * ring, traffic_cases, ulysses, ring, cases)
    for rank_results in per_rank:
        for r in rank_results:
            case, stats = r["case"], r["stats"]
            sp_rank = r["ring_rank"] * ulysses + r["ulysses_rank"]
            want = attention_traffic(4, 2, 8, seq_len=64, batch=case["batch"], ulysses=ulysses, ring=ring,
                                     dtype="float64", layout=case["layout"], window=case["window"])[sp_rank]
            for kind in ("p2p", "all_to_all"):
                for phase in ("forward", "backward"):
                    got = stats.get(kind, {}).get(phase, {})
                    assert got.get("bytes_sent", 0) == want.sent(kind, phase), (case, kind, phase, got)
                    assert got.get("calls", 0) == want.calls(kind, phase), (case, kind, phase, got)
    # what the window saves: with a window shorter than a zigzag chunk only the two neighbours' blocks
    # travel (steps 0, 1 and ring-1); contiguous needs only the previous rank's block
    assert ring_steps(4, 64, "zigzag", 5) == 3 and ring_steps(4, 64, "contiguous", 5) == 2
    assert ring_steps(4, 64, "zigzag", 1) == 1 and ring_steps(4, 64, "zigzag", None) == 4


def test_ring_messages_go_to_neighbours(pools):
    """On a ring of 4 (S=64: zigzag chunks of 8, contiguous shards of 16), the peers of every message
    each rank posts, as offsets from its ring rank. Whole ring (steps 0..3): blocks relay to r+1
    (forward 3; backward 3 K/V and 4 dK/dV partials, the last hop home being r - 3 = r+1). Contiguous,
    window 20 (steps 0, 1, 2): relay, then one partial jumps home 2 ranks back. Zigzag, window 5
    (steps 0, 1, 3): direct sends, shifts 1 and 3 = -1, neighbours anyway."""
    from dist_cases import ring_peers

    cases = [Case(64, 2, 1, True, "zigzag", batch=1), Case(64, 2, 1, True, "contiguous", window=20, batch=1),
             Case(64, 2, 1, True, "zigzag", window=5, batch=1)]
    want = [
        {"forward": {"send": {1: 3}, "recv": {3: 3}}, "backward": {"send": {1: 7}, "recv": {3: 7}}},
        {"forward": {"send": {1: 2}, "recv": {3: 2}}, "backward": {"send": {1: 4, 2: 1}, "recv": {3: 4, 2: 1}}},
        {"forward": {"send": {1: 1, 3: 1}, "recv": {3: 1, 1: 1}},
         "backward": {"send": {1: 2, 3: 2}, "recv": {3: 2, 1: 2}}},
    ]
    for rank_results in pools.run(4, ring_peers, 1, 4, cases):
        assert [{k: r[k] for k in ("forward", "backward")} for r in rank_results] == want
