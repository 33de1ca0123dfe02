"""The planner's traffic figures against what seqmesh really sends, and against textbook arithmetic.

The planner derives every byte from shapes (``seqmesh.planner.traffic``, which does not import
seqmesh's attention code); the real attention's counters (``seqmesh.comm_stats``) measure them. They
must agree exactly, per rank, per collective kind and phase, calls included.
"""

from __future__ import annotations

import pytest

from planner_cases import TrafficCase, measured_traffic
from seqmesh.planner.traffic import HeadDeal, attention_traffic, padded_length, tensor_parallel_traffic
from seqmesh.presets import MODELS

CASES = [
    TrafficCase(32, 4, 4, "float64"),  # MHA
    TrafficCase(30, 8, 4, "float32", batch=2),  # GQA, padded length
    TrafficCase(32, 8, 2, "bfloat16"),  # GQA: kv replicated when ulysses = 4
    TrafficCase(28, 4, 1, "float64", layout="contiguous", causal=False),  # MQA, replicated
    TrafficCase(26, 6, 2, "float32"),  # uneven query heads over 4 (2,2,1,1), rank 1 needs both kv heads
    TrafficCase(32, 5, 5, "bfloat16", batch=2),  # uneven MHA heads
    TrafficCase(21, 5, 1, "float64", layout="contiguous"),  # uneven MQA, odd length
]


def _predicted(case: dict, ulysses: int, ring: int) -> list:
    return attention_traffic(case["q_heads"], case["kv_heads"], case["head_dim"], seq_len=case["seq_len"],
                             batch=case["batch"], ulysses=ulysses, ring=ring, dtype=case["dtype"],
                             layout=case["layout"])


def _as_counters(rank_traffic) -> dict:
    """Predicted traffic in the shape of ``CommStats.as_dict()`` (calls and bytes sent)."""
    out: dict = {}
    for c in rank_traffic.collectives:
        entry = out.setdefault(c.kind, {}).setdefault(c.phase, {"calls": 0, "bytes_sent": 0})
        entry["calls"] += c.calls
        entry["bytes_sent"] += c.bytes_sent
    return out


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4), (2, 1), (1, 2)])
def test_predicted_bytes_equal_measured(pools, ulysses, ring):
    per_rank = pools.run(ulysses * ring, measured_traffic, ulysses, ring, CASES)
    checked_uneven = False
    for rank_results in per_rank:
        for r in rank_results:
            case = r["case"]
            predicted = _predicted(case, ulysses, ring)
            mine = predicted[r["ring_rank"] * ulysses + r["ulysses_rank"]]
            assert (mine.ulysses_rank, mine.ring_rank) == (r["ulysses_rank"], r["ring_rank"])
            measured = {kind: {phase: {"calls": v["calls"], "bytes_sent": v["bytes_sent"]} for phase, v in phases.items()}
                        for kind, phases in r["stats"].items()}
            assert measured == _as_counters(mine), (case, r["ulysses_rank"], r["ring_rank"])
            if len({t.sent("all_to_all", "forward") for t in predicted}) > 1:
                checked_uneven = True
    if ulysses == 4:  # uneven heads really give ranks different byte counts, and each one matched
        assert checked_uneven


def test_uneven_heads_forward_and_backward_differ_per_rank():
    """6 query heads over 4 Ulysses ranks deal (2, 2, 1, 1) with 2 kv heads of 3 query heads each: rank 1
    holds query heads 2 and 3, which read both kv heads. Rows of B*L*D elements (here 1*8*8*4 bytes)."""
    deal = HeadDeal(6, 2, 4)
    assert [deal.q(u) for u in range(4)] == [2, 2, 1, 1]
    assert [deal.kv(u) for u in range(4)] == [1, 2, 1, 1]
    ranks = attention_traffic(6, 2, 8, seq_len=32, batch=1, ulysses=4, ring=1, dtype="float32")
    row = 1 * 8 * 8 * 4
    total = sum(deal.q(u) + 2 * deal.kv(u) for u in range(4))  # 4 + 6 + 3 + 3 = 16 heads sent in all
    for u, t in enumerate(ranks):
        q, kv = deal.q(u), deal.kv(u)
        assert t.sent("all_to_all", "forward") == (total - q - 2 * kv + 3 * q) * row
        assert t.sent("all_to_all", "backward") == (6 - q + 3 * (q + 2 * kv)) * row
    assert ranks[1].sent("all_to_all", "forward") != ranks[1].sent("all_to_all", "backward")


def test_padding_follows_the_layout():
    assert padded_length(30, 2, 2) == 32  # zigzag over a ring: multiple of ring * lcm(2, ulysses) = 4
    assert padded_length(30, 3, 2) == 36  # ring 2 x lcm(2, 3) = 12
    assert padded_length(30, 3, 2, "contiguous") == 30
    assert padded_length(30, 4, 1) == 32  # no ring: multiple of ulysses


def test_llama70b_ulysses_versus_tensor_parallel_at_1m_tokens():
    """Llama-3-70B (64 query heads, 8 kv heads, head dim 128, hidden 8192), 1M tokens, 8 GPUs, bf16.

    Ulysses, per layer forward, per rank: q, k, v go out and the output comes back, each rank keeping
    its own share: (Hq + 2*Hkv + Hq) * D * (S/P) * (P-1)/P * 2 bytes.
    Megatron TP + sequence parallelism, per layer forward, per rank: the (S, hidden) activation is
    all-gathered and reduce-scattered twice (attention and MLP): 4 * S * h * (P-1)/P * 2 bytes.
    Their ratio is 4*h*P / ((2*Hq + 2*Hkv) * D) = 14.2: TP's traffic does not shrink with P."""
    m = MODELS["llama3-70b"]
    s, p = 2**20, 8
    assert (m.heads, m.kv_heads, m.head_dim, m.hidden) == (64, 8, 128, 8192)
    ulysses_formula = (64 + 2 * 8 + 64) * 128 * (s // p) * (p - 1) // p * 2
    tp_formula = 4 * s * 8192 * (p - 1) // p * 2
    assert ulysses_formula == 4_227_858_432  # 3.94 GiB
    assert tp_formula == 60_129_542_144  # 56 GiB
    ranks = attention_traffic(64, 8, 128, seq_len=s, batch=1, ulysses=p, ring=1, dtype="bfloat16", validate=False)
    assert {t.sent("all_to_all", "forward") for t in ranks} == {ulysses_formula}
    tp = tensor_parallel_traffic(s, 8192, p, "bfloat16")
    assert tp["all_gather"] + tp["reduce_scatter"] == tp_formula
    assert tp_formula / ulysses_formula == pytest.approx(4 * 8192 * 8 / (144 * 128))
    assert tp_formula / ulysses_formula == pytest.approx(14.22, abs=0.01)


def test_ring_bytes_textbook():
    """Pure ring, Llama-3-8B shape (8 kv heads x 128), 128K tokens on 8 ranks, bf16: forward sends 7
    K/V blocks of 2 * (S/P) * Hkv * D * 2 bytes; backward 7 more and 8 float32 dK/dV partials."""
    s, p = 131072, 8
    block = 2 * (s // p) * 8 * 128
    (t,) = {(x.sent("p2p", "forward"), x.sent("p2p", "backward"))
            for x in attention_traffic(32, 8, 128, seq_len=s, batch=1, ulysses=1, ring=p, dtype="bfloat16")}
    assert t == (7 * block * 2, 7 * block * 2 + 8 * block * 4)
