"""Planner fidelity on real clusters: shared node uplinks and leaf-switch bisection, the ring's
split-and-merge efficiency by block size, and a fixed global batch. Every expected time is written out
by hand from the byte counts and bandwidths stated in the test."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from seqmesh.planner.workload import GlobalBatch, global_batch_from
from seqmesh.planner.hardware import GB, PRESETS, LinkLevel
from seqmesh.planner.plan import plan
from seqmesh.planner.hardware import make_cluster
from seqmesh.planner.hardware import DEFAULT_RING_EFFICIENCY, IDEAL_RING, RingEfficiency, from_merge_bench
from seqmesh.planner.network import (Fabric, concurrent_all_to_all_seconds, every_group,
                                     parse_fabric, ring_hop_seconds, ring_load)
from seqmesh.planner.attention_layer import _ulysses_seconds
from seqmesh.planner.timing import step_time
from seqmesh.rules.degrees import Degrees
from seqmesh.planner.workload import Workload
from seqmesh.tools.cli import main
from seqmesh.model.presets import MODELS
from seqmesh.model.shapes import ModelShape

MB = 10**6
H100 = PRESETS["h100-nvlink"]


def _two_level(per_node: int, nics: int, oversub: float = 1.0, per_switch: int = 0):
    """NVLink 100 GB/s inside a node, 40 GB/s per GPU to the network, no latencies; ``nics`` x 40 GB/s per node."""
    links = (LinkLevel("nv", per_node, 100 * GB, 0.0), LinkLevel("net", 0, 40 * GB, 0.0))
    return replace(H100, links=links, gpus_per_node=per_node, fabric=Fabric(nics, 40 * GB, oversub, per_switch))


# -- shared uplinks and bisection ----------------------------------------------------------------------
def test_all_to_all_over_two_nodes_shares_the_uplinks_over_one_node_does_not():
    """16 GPUs, 2 nodes of 8, 2 NICs (80 GB/s) per node; each rank sends n = 15 MB. Over all 16, a rank sends
    8/15 n off its node, and the node's 8 ranks 64/15 n = 64 MB through 80 GB/s: 0.8 ms, above a GPU's own
    8 MB / 40 GB/s = 0.2 ms and 7 MB / 100 GB/s over NVLink. Over 8 ranks of one node: n / 100 GB/s."""
    hw, n = _two_level(8, 2), 15 * MB
    assert concurrent_all_to_all_seconds(n, hw, [list(range(16))]) == pytest.approx(64 * MB / (80 * GB))
    assert concurrent_all_to_all_seconds(n, hw, [list(range(8))]) == pytest.approx(n / (100 * GB))
    # the two node-local groups of U8 x DP2 run at once and still leave no node
    local_groups = every_group(Degrees(8, 1, 2), "ulysses")
    assert concurrent_all_to_all_seconds(n, hw, local_groups) == pytest.approx(n / (100 * GB))
    # one NIC per GPU (8 x 40 GB/s, as a DGX H100): the node's share equals each GPU's, 8 MB / 40 GB/s
    one_nic_each = concurrent_all_to_all_seconds(n, _two_level(8, 8), [list(range(16))])
    assert one_nic_each == pytest.approx(8 * MB / (40 * GB))


def test_all_to_all_over_8_spanning_two_nodes_of_4():
    """16 GPUs in nodes of 4 with 1 NIC (40 GB/s): U8 x DP2 groups each span 2 nodes. A rank sends 4/7 of
    n = 7 MB off-node; a node's 4 ranks, all in one group, 16 MB through 40 GB/s: 0.4 ms."""
    hw, n = _two_level(4, 1), 7 * MB
    groups = every_group(Degrees(8, 1, 2), "ulysses")
    assert groups == (tuple(range(8)), tuple(range(8, 16)))
    assert concurrent_all_to_all_seconds(n, hw, groups) == pytest.approx(16 * MB / (40 * GB))


@pytest.mark.parametrize("oversub,want_mb", [(1.0, 192), (2.0, 2 * 128)])
def test_oversubscribed_leaf_switches_bound_by_bisection(oversub, want_mb):
    """32 GPUs, 4 nodes of 8 with 8 NICs (320 GB/s), 2 nodes per leaf switch; an all-to-all over 32 with
    n = 31 MB per rank. A rank sends 24/31 n = 24 MB off its node, 16/31 n = 16 MB off its leaf. Node: 8 x 24
    = 192 MB through 320 GB/s; through the spine: 8 x 16 = 128 MB at 320 / oversubscription GB/s."""
    hw, n = _two_level(8, 8, oversub, per_switch=2), 31 * MB
    assert concurrent_all_to_all_seconds(n, hw, [list(range(32))]) == pytest.approx(want_mb * MB / (320 * GB))


def test_ring_messages_that_leave_a_node_at_once_share_its_uplinks():
    """16 GPUs on 2 nodes of 8 with 2 NICs (80 GB/s); a message of n = 10 MB. One ring of 16 (U1 x R16):
    sending to the next rank, 1 message leaves each node (7 -> 8, 15 -> 0); to the rank 8 places on, all 8
    do. seqmesh relays K/V blocks to the next rank (shift 1), so 10 MB per node through 80 GB/s, and the
    crossing GPU's own 40 GB/s link is the bound. U8 x R2: the 8 ring groups send between the nodes
    together, 80 MB through 80 GB/s; without the fabric each GPU's 10 MB at its own 40 GB/s."""
    hw, n = _two_level(8, 2), 10 * MB
    ring16 = every_group(Degrees(1, 16, 1), "ring")
    assert [ring_load(ring16, hw.fabric, 8, (t,)) for t in (1, 2, 8)] == [1, 2, 8]
    assert ring_hop_seconds(n, hw, Degrees(1, 16, 1)) == pytest.approx(n / (40 * GB))
    assert ring_hop_seconds(n, hw, Degrees(8, 2, 1)) == pytest.approx(8 * n / (80 * GB))
    assert ring_hop_seconds(n, replace(hw, fabric=None), Degrees(8, 2, 1)) == pytest.approx(n / (40 * GB))


def _messages_leaving(groups, fabric: Fabric, per_node: int, shifts) -> float:
    """Rank by rank: at each shift, every rank's message to the rank that many places on in its group;
    the busiest node's count off the node, or off its leaf switch times the oversubscription."""
    worst = 0.0
    for t in shifts:
        off_node, off_switch = Counter(), Counter()
        for g in groups:
            for i, a in enumerate(g):
                na, nb = a // per_node, g[(i + t) % len(g)] // per_node
                off_node[na] += na != nb
                per = fabric.nodes_per_switch
                off_switch[na] += bool(per) and na // per != nb // per
        worst = max(worst, max(off_node.values()), max(off_switch.values()) * fabric.oversubscription)
    return worst


def test_ring_load_counts_stretches_as_a_rank_by_rank_count_would():
    """ring_load counts whole stretches of a group on one node and only the shifts where a count can peak;
    a rank-by-rank count over every shift must agree, on random layouts, fabrics and scrambled groups."""
    rng = random.Random(7)
    for _ in range(150):
        per_node, nodes = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4, 6])
        n = per_node * nodes
        sp = rng.choice([d for d in range(1, n + 1) if n % d == 0])
        u = rng.choice([d for d in range(1, sp + 1) if sp % d == 0])
        fabric = Fabric(2, 1e9, rng.choice([1.0, 2.0]), rng.choice([0, 1, 2]))
        groups = every_group(Degrees(u, sp // u, n // sp), "ring")
        for shifts in (range(1, max(2, sp // u)), (1,)):
            assert ring_load(groups, fabric, per_node, shifts) == _messages_leaving(groups, fabric, per_node, shifts)
        scrambled = rng.sample(range(n), n)
        assert ring_load([scrambled], fabric, per_node, range(1, n)) == _messages_leaving(
            [scrambled], fabric, per_node, range(1, n))


def test_ulysses_time_in_the_step_model_uses_the_uplinks():
    """16 query and 16 kv heads of 16 dims, 4096 bf16 tokens, U16 over 2 nodes of 8 with 2 NICs (80 GB/s).
    A rank holds 256 tokens; one head of them is 256 x 16 x 2 = 8192 B. Forward: q/k/v all-to-all sends
    the 45 heads of the other 15 ranks (3 each), the output all-to-all 15 heads; backward the same 15 and
    45. Each call: the node sends 8 x 8/15 of every rank's bytes through 80 GB/s; without the fabric each
    GPU's 8/15 at 40 GB/s."""
    m = ModelShape(name="mha16", family="llama", hidden=256, layers=2, heads=16, kv_heads=16, head_dim=16,
                   intermediate=512, vocab=256)
    hw, work, lay = _two_level(8, 2), Workload(m, 4096), Degrees(16, 1, 1)
    want = 8 * 8 / 15 * (45 + 15) * 8192 / (80 * GB)
    assert _ulysses_seconds(work, lay, hw, "forward") == pytest.approx(want)
    assert _ulysses_seconds(work, lay, hw, "backward") == pytest.approx(want)
    unshared = _ulysses_seconds(work, lay, replace(hw, fabric=None), "forward")
    assert unshared == pytest.approx(max(7 / 15 / (100 * GB), 8 / 15 / (40 * GB)) * 60 * 8192)
    # every collective end to end: 2 layers x (forward, its checkpoint recompute, backward)
    shared, alone = (step_time(work, lay, h).serial_comm for h in (hw, replace(hw, fabric=None)))
    assert shared - alone == pytest.approx(2 * 3 * (want - unshared))


def test_fewer_gpus_per_node_keep_the_nics_per_gpu():
    """A DGX H100 has one NIC per GPU; described as 4-GPU nodes it has 4, as 1-GPU nodes 1."""
    assert make_cluster(H100, gpus=16, gpus_per_node=4).hardware.fabric.nics_per_node == 4
    assert H100.with_gpus_per_node(1).fabric.nics_per_node == 1


def test_parse_fabric_and_its_errors():
    assert parse_fabric("8:40") == Fabric(8, 40 * GB, source="--fabric 8:40")
    f = parse_fabric("8:50:2:16")
    assert (f.nics_per_node, f.nic_bandwidth, f.oversubscription, f.nodes_per_switch) == (8, 50 * GB, 2.0, 16)
    for bad, needle in (("8", "NICS:GBS"), ("8:x", "NICS:GBS"), ("0:40", "at least 1 NIC"), ("8:40:0.5", ">= 1")):
        with pytest.raises(ValueError, match=needle):
            parse_fabric(bad)


# -- ring split-and-merge efficiency ---------------------------------------------------------------------
MERGE_TABLE = [  # as `seqmesh bench merge --json` prints it (seq_len 8192)
    {"ring": 2, "seq_len": 8192, "block_tokens": 4096, "one_call_s": 1.0, "split_merge_s": 1.0 / 0.96, "efficiency": 0.96},
    {"ring": 4, "seq_len": 8192, "block_tokens": 2048, "one_call_s": 1.0, "split_merge_s": 1.0 / 0.9, "efficiency": 0.9},
    {"ring": 8, "seq_len": 8192, "block_tokens": 1024, "one_call_s": 1.0, "split_merge_s": 1.0 / 0.8, "efficiency": 0.8},
]


def test_calibration_from_a_merge_table_reproduces_its_ratios():
    curve = from_merge_bench(MERGE_TABLE)
    for row in MERGE_TABLE:
        assert curve.at(row["block_tokens"]) == pytest.approx(row["efficiency"])
    assert curve.at(math.sqrt(1024 * 2048)) == pytest.approx((0.8 + 0.9) / 2)  # linear in log2(block tokens)
    assert curve.at(256) == 0.8 and curve.at(1 << 20) == 0.96  # held flat beyond the measured blocks
    with pytest.raises(ValueError, match="block_tokens"):
        from_merge_bench([{"ring": 2, "efficiency": 0.9}])


def test_step_time_divides_ring_attention_by_the_curve():
    """Free links, peak FLOP/s: a rank of U1 x R4 over 8192 tokens does 1/4 of the causal pairs' attention,
    4 x D x H FLOPs per pair forward, 3.5 x that forward + backward, + 1 x recompute; at 2048-token blocks
    the table's 0.9 stretches exactly that part."""
    m = ModelShape(name="tiny", family="llama", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                   vocab=256)
    base = replace(H100, links=(LinkLevel("x", 0, 1e30, 0.0),), memory_bandwidth=1e30, fabric=None,
                   matmul_efficiency=1.0, attention_efficiency=1.0, ring_efficiency=IDEAL_RING)
    s, lay, w = 8192, Degrees(1, 4, 1), Workload(m, 8192)
    attention = 4.5 * 4 * 16 * 4 * (s * (s + 1) // 2) / 4 / base.peak_flops  # one rank, one layer
    ideal = step_time(w, lay, base).compute
    measured = step_time(w, lay, replace(base, ring_efficiency=from_merge_bench(MERGE_TABLE))).compute
    assert measured - ideal == pytest.approx(m.layers * attention * (1 / 0.9 - 1), rel=1e-9)


def test_default_curve_is_the_published_point():
    """ring-flash-attention: 90.2% at 8K tokens per GPU; b / (b + t0) rises toward 1 with the block."""
    assert DEFAULT_RING_EFFICIENCY.at(8192) == pytest.approx(0.902)
    assert DEFAULT_RING_EFFICIENCY.at(4096) < 0.902 < DEFAULT_RING_EFFICIENCY.at(65536) < 1
    with pytest.raises(ValueError, match="ascending"):
        RingEfficiency(points=((2048, 0.9), (1024, 0.8)))


def test_bench_merge_rows_carry_their_block_size():
    """A 256-token bench over rings 2 and 4: blocks of 128 and 64 tokens, read back as the curve's points."""
    from seqmesh.bench.merge import MergeBench, bench_merge

    rows = bench_merge(MergeBench(seq_len=256, q_heads=2, kv_heads=1, head_dim=8, rings=(2, 4), repeats=1))
    assert [r["block_tokens"] for r in rows] == [128, 64]
    curve = from_merge_bench(rows)
    assert [curve.at(b) for b in (64, 128)] == pytest.approx([rows[1]["efficiency"], rows[0]["efficiency"]])


def test_plan_reads_the_curve_from_a_file(tmp_path, capsys):
    path = tmp_path / "merge.json"
    path.write_text(json.dumps(MERGE_TABLE))
    argv = ["plan", "--model", "qwen3-0.6b", "--seq-len", "8192", "--gpus", "8", "--json"]
    assert main([*argv, "--ring-efficiency", str(path)]) == 0
    curve = json.loads(capsys.readouterr().out)["hardware"]["ring_efficiency"]
    assert curve["points"] == [[1024, 0.8], [2048, 0.9], [4096, 0.96]]
    assert main([*argv, "--ring-efficiency", str(tmp_path / "missing.json")]) == 2
    assert "--ring-efficiency" in capsys.readouterr().err


# -- global batch ----------------------------------------------------------------------------------------
def test_global_batch_counts_accumulation_steps():
    """64 sequences per optimizer step, micro-batch 2: DP8 runs 16 per micro-step, 4 micro-steps; DP64 would
    run 128 > 64; DP32 exactly 1."""
    gb = GlobalBatch(64)
    assert gb.accumulation(Degrees(8, 1, 8), 2) == 4 and gb.why_not(Degrees(8, 1, 8), 2) is None
    assert gb.accumulation(Degrees(1, 2, 32), 2) == 1
    assert "not a whole number" in gb.why_not(Degrees(1, 1, 64), 2)
    assert "--one-group" in GlobalBatch(one_group=True).why_not(Degrees(8, 1, 8), 1)


def test_plan_keeps_only_layouts_that_give_the_global_batch():
    work, cluster = Workload(MODELS["llama3-8b"], 65536), make_cluster(H100, nodes=2)
    p = plan(work, cluster, GlobalBatch(4))
    assert p.candidates and all(c.layout.dp_shard * c.accumulation == 4 for c in p.candidates)
    assert all(c.optimizer_step_s == pytest.approx(c.accumulation * c.time.total) for c in p.candidates)
    assert any(lay.dp_shard == 8 and "global batch 4" in why for lay, why in p.excluded)
    one = plan(work, cluster, GlobalBatch(one_group=True))
    assert one.candidates and all(c.layout.sp == 16 and c.layout.dp_shard == 1 for c in one.candidates)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(sequences=None, tokens=100_000, seq_len=65536, micro_batch=1), "use 65,536 or 131,072"),
    (dict(sequences=8, tokens=524288, seq_len=65536, micro_batch=1), "not both"),
    (dict(sequences=6, tokens=None, seq_len=65536, micro_batch=4), "multiple of the micro-batch --batch 4"),
    (dict(sequences=None, tokens=131072, seq_len=None, micro_batch=1), "needs --seq-len"),
    (dict(sequences=0, tokens=None, seq_len=65536, micro_batch=1), "at least 1 sequence"),
])
def test_impossible_global_batches_name_the_value_and_the_fix(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        global_batch_from(**kwargs)


def test_cli_global_batch_in_tokens(capsys):
    argv = ["plan", "--model", "qwen3-0.6b", "--seq-len", "16384", "--gpus", "8"]
    assert main([*argv, "--global-batch-tokens", "65536", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch_seqs"] == 4
    assert all(c["layout"]["dp_shard"] * c["grad_accumulation"] == 4 for c in out["candidates"])
    assert main([*argv, "--global-batch-tokens", "65536"]) == 0
    assert "optimizer step (global batch 4 sequences = 65,536 tokens)" in capsys.readouterr().out
    assert main([*argv, "--global-batch-tokens", "50000"]) == 2
    assert "--global-batch-tokens 50000 is not a whole number of 16384-token sequences" in capsys.readouterr().err


def test_cli_fabric_flags_and_one_group_longest(capsys):
    """--link describes another machine, so the preset's NICs go; --fabric sets them; --one-group with
    --max-seq-len tries only layouts whose one sequence group spans all 8 GPUs."""
    argv = ["plan", "--model", "qwen3-0.6b", "--seq-len", "8192", "--gpus", "8", "--json"]
    assert main([*argv, "--link", "pcie:4:20:10", "--link", "net:all:5:20"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["fabric"] is None
    assert main([*argv, "--fabric", "2:25:2:4"]) == 0
    fabric = json.loads(capsys.readouterr().out)["hardware"]["fabric"]
    assert (fabric["nics_per_node"], fabric["nic_bandwidth"], fabric["oversubscription"]) == (2, 25 * GB, 2.0)
    assert main([*argv, "--fabric", "2:fast"]) == 2
    assert "NICS:GBS" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3-0.6b", "--gpus", "8", "--max-seq-len", "--one-group", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert rows and all(r["layout"]["dp_shard"] == 1 for r in rows)
