"""``seqmesh bench vision``: the sharded tower's traffic equals the planner's formula byte for byte, and a
rank holds about half of what the replicated tower holds on 2 ranks."""

from __future__ import annotations

import pytest

from seqmesh.bench.vision import VisionBench, bench_vision


@pytest.mark.parametrize("model", ["qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def test_tower_traffic_is_the_formula_and_memory_is_shared(model):
    """3 images of 24x40 patches on 2 ranks (one straddles the shards, so the ring has work), Ulysses and
    ring: every rank's all-to-all and ring bytes, forward and backward, equal
    ``vision_tower_traffic + vision_route_traffic``; the busiest rank's peak is under 0.6 of the replicated
    tower's (measured 0.46 with Ulysses, 0.51 with ring: the parameters and their gradients stay whole)."""
    rows = bench_vision(VisionBench(model=model, images=3, height=24, width=40, world=2))
    assert [r["mesh"] for r in rows] == ["2x1", "1x2"]
    for r in rows:
        assert r["exact"], r
        assert r["sharded_bytes"] < 0.6 * r["replicated_bytes"], r
    assert rows[1]["counted"]["p2p_forward"] > 0  # the straddling image made the ring send
