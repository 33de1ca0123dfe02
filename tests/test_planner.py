"""The planner's memory, timing, ranking and command line, each against hand arithmetic or a physical
expectation stated in the test."""

from __future__ import annotations

from dataclasses import replace

import pytest

from seqmesh.planner.hardware import GB, GiB, PRESETS, HardwareSpec, LinkLevel, make_cluster, parse_link
from seqmesh.planner.memory import activation_memory, logits_memory, memory_per_gpu, parameter_memory
from seqmesh.planner.plan import longest_sequence, plan
from seqmesh.planner.timing import all_to_all_seconds, attention_pairs, ring_attention_seconds, step_time
from seqmesh.planner.traffic import attention_traffic
from seqmesh.planner.workload import Layout, Workload
from seqmesh.presets import MODELS, ModelShape

TINY = ModelShape("tiny", "llama", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
H100 = PRESETS["h100-nvlink"]


def _fast(hw: HardwareSpec) -> HardwareSpec:
    """Links and memory so fast that only FLOPs count; efficiencies 1."""
    return replace(hw, links=(LinkLevel("x", 0, 1e30, 0.0),), memory_bandwidth=1e30,
                   matmul_efficiency=1.0, attention_efficiency=1.0)


# -- memory -------------------------------------------------------------------------------------------
def test_parameter_memory_is_16_bytes_per_parameter_sharded_plus_two_unsharded_units():
    """FSDP over 8 ranks, bf16 compute: fp32 master + fp32 grad + 2 fp32 Adam moments = 16 bytes per
    parameter over 8, plus two bf16 copies of the largest unit (here Llama-3-8B's embedding,
    128256 x 4096) and that unit's bf16 gradient with its fp32 reduce copy."""
    m = MODELS["llama3-8b"]
    layer = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336 + 2 * 4096
    params = 32 * layer + 2 * 128256 * 4096 + 4096
    assert m.params == params == 8_030_261_248
    unit = 128256 * 4096
    weights, grads, optimizer = parameter_memory(Workload(m, 8192), Layout(8, 1, 1))
    shard = -(-params // 8)
    assert (weights, grads, optimizer) == (4 * shard + 2 * 2 * unit, 4 * shard + (2 + 4) * unit, 8 * shard)


def test_saved_activations_per_layer_by_hand():
    """Tiny model, one GPU, bf16, no checkpointing. Per token and layer: 2 norm inputs + q/k/v and gate/up
    inputs (4 x 64), gate, up, SiLU and down input (4 x 128), two fp32 norm scales, q, k, v, out in
    heads (16 x (4+2+2+4)) and an fp32 LSE per query head: 2*(256 + 512) + 8 + 2*16*12 + 4*4 = 1944
    bytes. Checkpointing keeps one 64-wide bf16 input per layer and one layer's worth."""
    s, lay = 64, Layout(1, 1, 1)
    per_layer = 1944 * s
    full = activation_memory(Workload(TINY, s, checkpointing=False), lay)
    deeper = activation_memory(Workload(replace(TINY, layers=5), s, checkpointing=False), lay)
    assert deeper - full == 2 * per_layer
    ck, ck_deeper = (activation_memory(Workload(t, s), lay) for t in (TINY, replace(TINY, layers=5)))
    assert ck_deeper - ck == 2 * s * 64 * 2
    assert full - ck == (TINY.layers - 1) * per_layer - TINY.layers * s * 64 * 2


def test_ring_divides_every_activation_by_its_degree():
    """Pure ring keeps every per-token tensor on the local tokens only: 1/P of one GPU's, exactly."""
    w = Workload(MODELS["llama3-8b"], 65536, checkpointing=False)
    one = activation_memory(w, Layout(1, 1, 8))
    assert activation_memory(w, Layout(1, 8, 1)) * 8 == one


def test_chunked_loss_bounds_the_logits():
    """bf16 logits + fp32 copy + fp32 gradient = 10 bytes per logit; chunking keeps 4096 tokens' worth."""
    m, lay = MODELS["llama3-8b"], Layout(4, 1, 1)
    assert logits_memory(Workload(m, 65536, chunked_loss=False), lay) == 16384 * 128256 * 10
    assert logits_memory(Workload(m, 65536), lay) == 4096 * 128256 * 10


def test_longest_sequence_is_the_memory_boundary():
    w, lay = Workload(MODELS["llama3-8b"], 1), Layout(8, 1, 1)
    n = longest_sequence(w, lay, H100.memory_bytes)
    assert n > 100_000
    assert memory_per_gpu(replace(w, seq_len=n), lay).total <= H100.memory_bytes
    assert memory_per_gpu(replace(w, seq_len=n + 1), lay).total > H100.memory_bytes


# -- timing -------------------------------------------------------------------------------------------
def test_compute_time_by_hand():
    """With free communication and peak FLOP/s: per layer 2 FLOPs per weight per token forward, 4
    backward, 2 again to recompute under checkpointing; attention 4*D*H FLOPs per visible pair with
    S(S+1)/2 causal pairs, x (1 + 2.5 + 1); the LM head 6 FLOPs per weight per token."""
    hw, s = _fast(H100), 1024
    t = step_time(Workload(TINY, s), Layout(1, 1, 1), hw)
    mm = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    attention = 4 * 16 * 4 * (s * (s + 1) // 2)
    flops = TINY.layers * (8 * s * mm + 4.5 * attention) + 6 * s * 256 * 64
    assert attention_pairs(s, True) == s * (s + 1) // 2
    assert t.compute == pytest.approx(flops / hw.peak_flops, rel=1e-9)
    assert t.total == pytest.approx(t.compute, rel=1e-9)


def test_ring_overlaps_transfers_with_block_compute():
    """Forward over R ring steps of compute c with hop time h takes (R-1) * max(c, h) + c: compute when
    the link is fast, hops when it is slow."""
    w, lay = Workload(MODELS["llama3-8b"], 131072), Layout(1, 4, 1)
    kv_bytes = 2 * (131072 // 4) * 8 * 128 * 2
    slow = replace(H100, links=(LinkLevel("slow", 0, 0.1 * GB, 0.0),))  # a hop: 1.34 s > a step: 0.25 s
    assert ring_attention_seconds(w, lay, _fast(H100), 1.0, "forward")[0] == pytest.approx(1.0)
    assert ring_attention_seconds(w, lay, slow, 1.0, "forward")[0] == pytest.approx(3 * kv_bytes / (0.1 * GB) + 0.25)


def test_all_to_all_across_two_levels_waits_for_the_slower_share():
    """16 ranks over 2 nodes of 8: each rank sends 7/15 of its bytes over NVLink and 8/15 over the network,
    in parallel; the call costs the network's latency plus the slower share."""
    hw, nbytes = H100, 15 * 2**20
    nv, ib = hw.links
    want = ib.latency + max(7 * 2**20 / nv.bandwidth, 8 * 2**20 / ib.bandwidth)
    assert all_to_all_seconds(nbytes, hw, list(range(16))) == pytest.approx(want)
    assert all_to_all_seconds(nbytes, hw, list(range(8))) == pytest.approx(nv.latency + nbytes / nv.bandwidth)


# -- hardware -----------------------------------------------------------------------------------------
def test_links_follow_rank_placement():
    """L20 box: 4 GPUs per PCIe switch, 8 per host. Ulysses-innermost ranks: U4 x R2 puts Ulysses
    groups {0..3}, {4..7} inside switches and ring pairs {0, 4} across the host bridge."""
    hw = make_cluster(PRESETS["l20-pcie"], nodes=2).hardware
    assert hw.link_for_group([0, 1, 2, 3]).name == "pcie-switch"
    assert hw.link_for_group([0, 4]).name == "pcie-host"
    assert hw.link_for_group([3, 8]).name == "ethernet"
    assert hw.peers_by_level(0, list(range(16))) == [3, 4, 8]
    four = PRESETS["l20-pcie"].with_gpus_per_node(4)
    assert [lv.group for lv in four.links] == [4, 0]


@pytest.mark.parametrize("kwargs,needle", [
    ({"gpus": 12}, "not a whole number of 8-GPU nodes"),
    ({"gpus": 12, "nodes": 2}, "--nodes 2 x --gpus-per-node 8 = 16"),
    ({"gpus": 0}, "at least one GPU"),
])
def test_cluster_errors_name_the_numbers(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        make_cluster(H100, **kwargs)


def test_parse_link():
    assert parse_link("pcie:4:24:10") == LinkLevel("pcie", 4, 24 * GB, 10e-6)
    assert parse_link("ib:all:40:15").group == 0
    with pytest.raises(ValueError, match="NAME:GROUP:GBPS:MICROSECONDS"):
        parse_link("pcie:4:fast")


# -- recommendations ----------------------------------------------------------------------------------
def test_two_nodes_keep_ulysses_inside_a_node():
    """Over InfiniBand the all-to-all would cross nodes unhedged; the pick keeps Ulysses on NVLink and puts
    the ring (or data parallelism) across nodes."""
    p = plan(Workload(MODELS["llama3-8b"], 2**20), make_cluster(H100, nodes=2))
    best = p.recommended
    assert best is not None and best.layout.ulysses <= 8
    assert best.comm_links["ulysses_all_to_all"] in ("nvlink4", "-")
    assert best.layout.ring > 1 or best.layout.dp_shard > 1
    assert "crosses nodes" in p.reason or "data-parallel" in p.reason


def test_one_nvlink_node_at_long_length_is_mostly_ulysses():
    p = plan(Workload(MODELS["llama3-8b"], 2**19), make_cluster(H100, gpus=8))
    assert p.recommended is not None
    assert p.recommended.layout.ulysses >= p.recommended.layout.ring
    assert p.recommended.layout.ulysses * p.recommended.layout.ring == 8  # 512K tokens need all 8 GPUs


def test_ulysses_beyond_kv_heads_works_by_replication():
    """Llama-3-8B has 8 kv heads; Ulysses 16 replicates each to two ranks and is still a valid plan whose
    traffic counts the copies."""
    p = plan(Workload(MODELS["llama3-8b"], 2**20), make_cluster(H100, nodes=2))
    (u16,) = [c for c in p.candidates if c.layout == Layout(16, 1, 1)]
    assert u16.feasible and any("kv replication" in n for n in u16.notes)
    sent = attention_traffic(32, 8, 128, seq_len=2**20, batch=1, ulysses=16, ring=1, dtype="bfloat16")
    row = (2**20 // 16) * 128 * 2
    assert {t.sent("all_to_all", "forward") for t in sent} == {(32 + 2 * 16 - 2 - 2) * row + 15 * 2 * row}


def test_a_sequence_that_cannot_fit_is_reported():
    """1M tokens of Llama-3-70B on 16 H100s: the 80 layer inputs alone are 80 x 65536 x 8192 x 2 bytes = 80 GiB
    per GPU, on top of 16 bytes per parameter / 16."""
    p = plan(Workload(MODELS["llama3-70b"], 2**20), make_cluster(H100, nodes=2))
    assert p.recommended is None
    assert not any(c.feasible for c in p.candidates if c.layout.runs_on_seqmesh)
    assert "needs" in p.reason and "GiB" in p.reason
    assert all(c.memory.activations > 80 * GiB for c in p.candidates if c.layout.dp_shard == 1 and c.layout.tp == 1)
