"""Counted communication equals the formulas of DESIGN.md, and zigzag balances causal work."""

from __future__ import annotations

import pytest
import torch

from dist_cases import Case, saved_for_backward, traffic_cases
from reference import document_ids
from seqmesh.sharded_attention.schedule import RingSchedule
from seqmesh.sharded_attention.blocks import document_bounds
from seqmesh.sequence.layout import SequenceLayout

F64 = 8


def _expected(case: dict, ulysses: int, ring: int, kv_needed: int) -> dict:
    """Bytes each rank sends, from first principles (float64 inputs, float64 gradient partials).

    ``kv_needed``: kv heads one Ulysses rank needs (Hk/U when U divides Hk, else 1 per rank here)."""
    b, s, d, hq = case["batch"], case["seq_len"], case["head_dim"], case["q_heads"]
    p = ulysses * ring
    assert s % (2 * p) == 0, "choose lengths that need no padding"
    local = s // p
    # to each other Ulysses rank: its q, k, v heads of my tokens; then my output heads of its tokens
    a2a = (ulysses - 1) * b * local * d * F64 * (hq // ulysses + 2 * kv_needed + hq // ulysses)
    block = 2 * b * local * ulysses * kv_needed * d * F64  # one K/V ring block after the all-to-all
    return {
        "a2a_forward": a2a,
        "p2p_forward": (ring - 1) * block,
        # K/V blocks relayed on, and each dK/dV partial travelling with its block, one more hop home
        "p2p_backward": ((ring - 1) + ring) * block if ring > 1 else 0,
    }


def _sent(stats: dict, kind: str, phase: str) -> int:
    return stats.get(kind, {}).get(phase, {}).get("bytes_sent", 0)


def _calls(stats: dict, kind: str, phase: str) -> int:
    return stats.get(kind, {}).get(phase, {}).get("calls", 0)


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4)])
def test_bytes_and_calls_match_formulas(pools, ulysses, ring):
    cases = [
        Case(32, 8, 8, True, "zigzag"),  # MHA
        Case(32, 8, 4, True, "zigzag"),  # GQA, kv heads divisible by ulysses
        Case(32, 8, 2, False, "zigzag"),  # GQA, kv replicated when ulysses = 4
        Case(32, 4, 1, True, "contiguous"),  # MQA, replicated
    ]
    per_rank = pools.run(ulysses * ring, traffic_cases, ulysses, ring, cases)
    for rank_results in per_rank:
        for r in rank_results:
            case, stats = r["case"], r["stats"]
            hk = case["kv_heads"]
            kv_needed = hk // ulysses if hk % ulysses == 0 else 1
            want = _expected(case, ulysses, ring, kv_needed)
            got_a2a = _sent(stats, "all_to_all", "forward")
            assert got_a2a == want["a2a_forward"], (case, got_a2a, want)
            assert _sent(stats, "all_to_all", "backward") == want["a2a_forward"]  # the adjoint moves the same
            assert _sent(stats, "p2p", "forward") == want["p2p_forward"], (case, stats)
            assert _sent(stats, "p2p", "backward") == want["p2p_backward"], (case, stats)
            # the number of collectives: one packed q/k/v all-to-all and one for the output, each way;
            # ring-1 K/V blocks forward; ring-1 K/V blocks and ring gradient partials backward
            assert _calls(stats, "all_to_all", "forward") == (2 if ulysses > 1 else 0)
            assert _calls(stats, "all_to_all", "backward") == (2 if ulysses > 1 else 0)
            assert _calls(stats, "p2p", "forward") == ring - 1
            assert _calls(stats, "p2p", "backward") == (2 * ring - 1 if ring > 1 else 0)


def test_kv_replication_sends_only_needed_heads(pools):
    """With 8 query heads, 2 kv heads and ulysses=4, each rank needs one kv head: the all-to-all carries
    it to the two ranks that use it, less than expanding kv to 8 heads before the all-to-all would."""
    case = Case(32, 8, 2, True, "zigzag", batch=1)
    per_rank = pools.run(4, traffic_cases, 4, 1, [case])
    local, d = 8, 8
    expanded = 3 * local * d * F64 * (2 + 2 * 2 + 2)  # kv repeated to 8 heads: 2 of each per rank
    for results in per_rank:
        sent = _sent(results[0]["stats"], "all_to_all", "forward")
        assert sent == 3 * local * d * F64 * (2 + 2 * 1 + 2)
        assert sent < expanded


def _visible_pairs(positions: torch.Tensor, seq_len: int, cu: list[int] | None, causal: bool) -> int:
    """(query, key) pairs the given query positions see on one device (independent of the schedule)."""
    docs = document_ids(seq_len, cu)
    keys = torch.arange(seq_len)
    total = 0
    for p in positions.tolist():
        visible = docs == docs[p]
        if causal:
            visible &= keys <= p
        total += int(visible.sum())
    return total


@pytest.mark.parametrize("ring", [2, 4, 8])
@pytest.mark.parametrize("cu", [None, [0, 3, 4, 40, 41, 64]])
def test_schedule_computes_exactly_the_visible_pairs(ring, cu):
    """The ring's kernel calls cover each visible (query, key) pair once and nothing else, so
    zigzag balances causal work exactly while contiguous is off by (2P-1)/P: ring rank r computes r
    full blocks and half of its diagonal block, so max/mean = (P - 1/2) / (P/2)."""
    seq_len = 64
    balance = {}
    for kind in ("zigzag", "contiguous"):
        layout = SequenceLayout(kind, ring, 1, seq_len)
        schedule = RingSchedule(layout, document_bounds(seq_len, seq_len, cu), causal=True)
        works = []
        for r in range(ring):
            positions = torch.cat([torch.arange(run.start, run.stop) for run in layout.ring_runs(r)])
            assert schedule.work(r) == _visible_pairs(positions, seq_len, cu, causal=True)
            works.append(schedule.work(r))
        balance[kind] = max(works) * ring / sum(works)
    if cu is None:
        assert balance["zigzag"] == pytest.approx(1.0, abs=0.02)
        assert balance["contiguous"] == pytest.approx((2 * ring - 1) / ring, rel=0.02)


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4)])
def test_memory_saved_for_backward_is_one_pth_of_one_device(pools, ulysses, ring):
    """Each rank keeps exactly 1/P of what one device's flash attention keeps for backward: q, k, v and
    the output in the input dtype, and a float32 log-sum-exp per query and head."""
    cases = [Case(64, 8, 8, True, "zigzag", dtype="float32"), Case(64, 8, 4, False, "contiguous", dtype="bfloat16")]
    p = ulysses * ring
    for per_rank in pools.run(p, saved_for_backward, ulysses, ring, cases):
        for case, got in zip(cases, per_rank):
            item = torch.finfo(getattr(torch, case.dtype)).bits // 8
            one_device = (case.batch * case.seq_len * case.head_dim * item * (2 * case.q_heads + 2 * case.kv_heads)
                          + case.batch * case.q_heads * case.seq_len * 4)
            assert got * p == one_device, (case.name, got, one_device / p)
