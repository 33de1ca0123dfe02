"""The planner's memory, timing, ranking and command line, each against hand arithmetic or a physical
expectation stated in the test."""

from __future__ import annotations

from dataclasses import replace

import pytest

from seqmesh.planner.hardware import GB, GiB, PRESETS, HardwareSpec, LinkLevel, make_cluster, parse_link
from seqmesh.planner.activations import attention_backward_bytes
from seqmesh.planner.memory import (end_of_backward_grads, layer_saved_bytes, loss_memory, memory_at, memory_per_gpu,
                                   parameter_memory)
from seqmesh.planner.memory import MemoryBreakdown
from seqmesh.planner.plan import Candidate
from seqmesh.planner.plan import evaluate, longest_sequence, plan
from seqmesh.planner.recommend import explain, pick
from seqmesh.planner.hardware import IDEAL_RING
from seqmesh.planner.network import concurrent_all_to_all_seconds
from seqmesh.planner.attention_layer import attention_pairs, ring_attention_seconds
from seqmesh.planner.timing import StepTime, step_time
from seqmesh.planner.traffic import attention_traffic
from seqmesh.rules.degrees import Degrees
from seqmesh.planner.workload import Workload
from seqmesh.model.presets import MODELS
from seqmesh.model.shapes import ModelShape

TINY = ModelShape(name="tiny", family="llama", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  vocab=256)
H100 = PRESETS["h100-nvlink"]


def _fast(hw: HardwareSpec) -> HardwareSpec:
    """Links, NICs and memory so fast that only FLOPs count; efficiencies 1, smaller ring blocks included."""
    return replace(hw, links=(LinkLevel("x", 0, 1e30, 0.0),), memory_bandwidth=1e30, fabric=None,
                   matmul_efficiency=1.0, attention_efficiency=1.0, ring_efficiency=IDEAL_RING)


# -- memory -------------------------------------------------------------------------------------------
LLAMA8B_LAYER = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336 + 2 * 4096  # q,k,v,o + gated MLP + 2 norms
LLAMA8B_EMBEDDING = 128256 * 4096  # untied: its own FSDP unit
LLAMA8B_ROOT = 128256 * 4096 + 4096  # LM head + final norm


def test_untied_units_root_gathered_all_step_embedding_only_at_the_ends():
    """seqmesh's FSDP units (seqmesh.model.fsdp.apply_fsdp) for an untied model: one per decoder layer, the input
    embedding on its own, and the root with the final norm and LM head. Llama-3-8B, bf16, FSDP over 8
    ranks; per GPU:

    - sharded: fp32 master 4 B + Adam 8 B per parameter / 8 at every moment, the fp32 gradient shard 4 B
      only from the reduce-scatters on (the step after zero_grad(set_to_none=True) starts without it);
    - gathered in bf16: the root from the loss to the end of backward; in the loss's backward also the last
      layer (FSDP2's root prefetches it as backward starts; measured by seqmesh rehearse at 131K and 1M tokens);
      inside a layer's backward that layer and the next one (its all-gather prefetched); at the step nothing;
    - unsharded gradients: inside a layer's backward the root's and the layer's (bf16); at the end the
      larger of the embedding's reduce-scatter (its bf16 gradient + fp32 copy, the root's bf16 gradient
      still alive) and the root's (bf16 + fp32 copy); at the loss none yet (the loss's fp32 accumulator
      of the head's gradient is counted with the loss);
    - the step: AdamW's fused kernel (seqmesh train's) adds nothing; its foreach path one fp32 temporary per
      parameter."""
    m = MODELS["llama3-8b"]
    params = 32 * LLAMA8B_LAYER + LLAMA8B_EMBEDDING + LLAMA8B_ROOT
    assert LLAMA8B_LAYER == 218_112_000 and m.params == params == 8_030_261_248
    shard = -(-params // 8)
    w, lay = Workload(m, 8192), Degrees(8, 1, 1)
    at_embedding_rs = 2 * LLAMA8B_ROOT + (2 + 4) * LLAMA8B_EMBEDDING
    at_root_rs = (2 + 4) * LLAMA8B_ROOT
    assert at_embedding_rs - at_root_rs == 2 * 128256 * 4096 - 4 * 4096 > 0  # the embedding's moment is larger
    assert end_of_backward_grads(w, lay) == {"embedding": at_embedding_rs, "root": at_root_rs}
    want = {
        "layer backward": (4 * shard + 2 * (LLAMA8B_ROOT + 2 * LLAMA8B_LAYER), 2 * (LLAMA8B_ROOT + LLAMA8B_LAYER),
                           8 * shard),
        "loss backward": (4 * shard + 2 * (LLAMA8B_ROOT + LLAMA8B_LAYER), 0, 8 * shard),
        "end of backward": (4 * shard + 2 * LLAMA8B_ROOT, 4 * shard + at_embedding_rs, 8 * shard),
        "optimizer step": (4 * shard, 4 * shard, 8 * shard),
    }
    for moment, expected in want.items():
        assert parameter_memory(w, lay, moment) == expected, moment
    assert parameter_memory(replace(w, optimizer="foreach"), lay, "optimizer step") == (4 * shard, 4 * shard,
                                                                                        12 * shard)
    # fp32 (no reduce copy): the embedding's moment holds both fp32 gradients
    w32 = Workload(m, 8192, bf16=False)
    assert end_of_backward_grads(w32, lay) == {"embedding": 4 * (LLAMA8B_ROOT + LLAMA8B_EMBEDDING),
                                              "root": 4 * LLAMA8B_ROOT}


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3.2-1b"])
def test_tied_head_is_one_root_weight_and_no_embedding_unit(name):
    """Qwen3-0.6B and Llama-3.2-1B tie the head to the embedding: no embedding unit (a tied weight stays in
    one unit); the root is vocab x hidden + the final norm, once; the end of backward is the root's
    reduce-scatter alone (its bf16 gradient + fp32 copy)."""
    m = MODELS[name]
    per_layer = {"qwen3-0.6b": 1024 * 128 * (2 * 16 + 2 * 8) + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128,  # + q/k norms
                 "llama3.2-1b": 2048 * 64 * (2 * 32 + 2 * 8) + 3 * 2048 * 8192 + 2 * 2048}[name]
    root = {"qwen3-0.6b": 151936 * 1024 + 1024, "llama3.2-1b": 128256 * 2048 + 2048}[name]
    assert m.tie_embeddings and m.params == m.layers * per_layer + root
    shard = -(-m.params // 4)
    w, lay = Workload(m, 4096), Degrees(4, 1, 1)
    assert end_of_backward_grads(w, lay) == {"root": 6 * root}
    want = {
        "layer backward": (4 * shard + 2 * (root + 2 * per_layer), 2 * (root + per_layer)),
        "loss backward": (4 * shard + 2 * (root + per_layer), 0),  # the last layer prefetched as backward starts
        "end of backward": (4 * shard + 2 * root, 4 * shard + 6 * root),
    }
    for moment, (weights, grads) in want.items():
        assert parameter_memory(w, lay, moment)[:2] == (weights, grads), moment


def test_llama70b_on_16_gpus_fits_with_the_fused_adamw_step_not_with_foreach():
    """Llama-3-70B on 16 H100s, one token. End of backward: 12 B per parameter / 16 (fp32 master, Adam) +
    the fp32 gradient shard 4 B / 16 + the root (head + norm) gathered in bf16 + its bf16 gradient + the
    embedding's bf16 gradient and fp32 reduce copy + 2 GiB reserve = 77.5 GiB, under the 79.6 GiB of an H100:
    the fused step (16 B, in place) is below it, so lengths fit. AdamW's foreach step would add one fp32 copy of
    the parameters (4 B / 16 each, 16.4 GiB) to the 16 B: 84.1 GiB, and no length fits; the per-tensor step
    needs only its largest tensor twice."""
    m = MODELS["llama3-70b"]
    layer = 8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672 + 2 * 8192
    emb, root = 128256 * 8192, 128256 * 8192 + 8192
    assert m.params == 80 * layer + emb + root
    shard = -(-m.params // 16)
    one_token = Workload(m, 1)
    end = memory_at(one_token, Degrees(1, 16, 1), "end of backward")
    want = 16 * shard + 2 * root + 2 * root + (2 + 4) * emb + 2 * GiB
    assert want / GiB == pytest.approx(77.49, abs=0.01)
    assert end.total - end.activations == want and end.logits == end.attention == 0
    # zigzag over 16 ring ranks pads 1 token to 32: 2 local tokens' ids, positions, labels, the loss's copy
    # (int64) and RoPE's cos and sin (bf16)
    assert end.activations == 2 * (4 * 8 + 2 * 128 * 2)
    step = memory_at(one_token, Degrees(1, 16, 1), "optimizer step")
    assert step.optimizer == 8 * shard and step.total - step.activations == 16 * shard + 2 * GiB
    assert 0 < longest_sequence(one_token, Degrees(1, 16, 1), H100.memory_bytes)
    foreach = replace(one_token, optimizer="foreach")
    step = memory_per_gpu(foreach, Degrees(1, 16, 1))
    assert step.moment == "optimizer step" and step.optimizer == 12 * shard
    assert step.total - step.activations == 20 * shard + 2 * GiB > H100.memory_bytes
    assert longest_sequence(foreach, Degrees(1, 16, 1), H100.memory_bytes) == 0
    per_tensor = replace(one_token, optimizer="per_tensor")
    assert 0 < longest_sequence(per_tensor, Degrees(1, 16, 1), H100.memory_bytes) < 262144
    with pytest.raises(ValueError, match="optimizer='adam8bit': choose one of fused, foreach, per_tensor"):
        replace(one_token, optimizer="adam8bit")


def test_attention_backward_buffers_by_hand():
    """Tiny model (4 query / 2 kv heads x 16), bf16. One GPU: the kernel's dq, dk, dv (64 tokens x 8 heads x
    16 x 2 B = 16384) are the gradients returned, nothing more. Ring 4 (16 local tokens, every head): the
    kernel's gradients of one block 16 x 8 x 16 x 2 = 4096; fp32 dQ 16 x 4 x 16 x 4 = 4096; four fp32
    dK/dV blocks (home, this step's partial, the one sent on a step earlier, the one arriving) 4 x 16 x 4 x
    16 x 4 = 16384; three bf16 K/V blocks (home, held, arriving) 3 x 16 x 4 x 16 x 2 = 6144: 30720.
    A ring of two has no middle step: three fp32 dK/dV blocks and two K/V blocks."""
    assert attention_backward_bytes(Workload(TINY, 64), Degrees(1, 1, 1)) == 16384
    assert attention_backward_bytes(Workload(TINY, 64), Degrees(1, 4, 1)) == 4096 + 4096 + 16384 + 6144
    # ring 2: 32 local tokens; kernel 32x8x16x2 = 8192, dQ 32x4x16x4 = 8192, three fp32 dK/dV (home, in
    # flight, this step's) 3x(32x4x16x4) = 24576, two bf16 K/V 2x(32x4x16x2) = 8192
    assert attention_backward_bytes(Workload(TINY, 64), Degrees(1, 2, 1)) == 8192 + 8192 + 24576 + 8192
    # Ulysses 2: 64 tokens x (2 + 1 + 1) heads of this rank; the inner kernel's gradients 64x4x16x2 = 8192,
    # then packed (8192) beside the 32 local tokens' gradients of every head 32x8x16x2 = 8192
    assert attention_backward_bytes(Workload(TINY, 64), Degrees(2, 1, 1)) == max(8192, 2 * 8192 + 8192)


def test_saved_activations_per_layer_by_hand():
    """Tiny model, one GPU, no checkpointing. Per token and layer, what transformers' Llama layer with
    seqmesh attention saves (listed with saved_tensors_hooks on a real llama-tiny step in fp32: 4,376 B):
    two RMSNorms, each its float32 input, float32 scale, normalized tensor and output (the projections'
    input); q, k, v, attention output (16 x (4 + 2 + 2 + 4)) and a float32 LSE per query head; gate, up,
    SiLU(gate) and their product (4 x 128)."""
    s, lay = 64, Degrees(1, 1, 1)
    fp32 = 2 * (4 * 64 + 4 + 4 * 64 + 4 * 64) + 4 * 16 * 12 + 4 * 4 + 4 * 4 * 128
    bf16 = 2 * (4 * 64 + 4 + 2 * 64 + 2 * 64) + 2 * 16 * 12 + 4 * 4 + 2 * 4 * 128  # the norms' fp32 copies stay
    assert (fp32, bf16) == (4376, 2456)
    assert layer_saved_bytes(Workload(TINY, s, bf16=False, checkpointing=False), lay) == fp32 * s
    assert layer_saved_bytes(Workload(TINY, s, checkpointing=False), lay) == bf16 * s
    # Ulysses 2: the attention tensors on 64 tokens x this rank's 2 + 1 + 1 + 2 heads, and the output
    # projection's own input (every head, 32 local tokens)
    uly = 32 * 2 * (4 * 64 + 4 + 2 * 64 + 2 * 64) + 64 * (2 * 16 * 6 + 4 * 2) + 32 * 2 * 64 + 32 * 2 * 4 * 128
    assert layer_saved_bytes(Workload(TINY, s, checkpointing=False), Degrees(2, 1, 1)) == uly


def test_ring_divides_saved_activations_by_its_degree():
    """Pure ring keeps every saved tensor on the local tokens only: 1/P of one GPU's, exactly."""
    w = Workload(MODELS["llama3-8b"], 65536, checkpointing=False)
    assert layer_saved_bytes(w, Degrees(1, 8, 1)) * 8 == layer_saved_bytes(w, Degrees(1, 1, 8))


def test_chunked_loss_by_hand():
    """Llama-3-8B, bf16, 16,384 local tokens, chunks of 4,096. The forward makes the gradients: the hidden states'
    bf16 gradient, the head's float32 gradient accumulator (128256 x 4096 x 4), and the larger of one chunk's bf16
    logits next to their float32 copy (6 B per logit) and the logit gradient's bf16 copy next to the head-gradient
    matmul in bf16 and its float32 cast (128256 x 4096 x 6). Backward scales the two gradients into new bf16
    tensors beside the saved ones."""
    m, lay = MODELS["llama3-8b"], Degrees(4, 1, 1)
    t, n, v, h = 16384, 4096, 128256, 4096
    w = Workload(m, 65536)
    gradients = 2 * t * h + 4 * v * h
    assert loss_memory(w, lay, "loss forward") == gradients + max(6 * n * v, 2 * n * v + 6 * v * h)
    assert loss_memory(w, lay, "loss backward") == gradients + 2 * t * h + 2 * v * h
    unchunked = Workload(m, 65536, chunked_loss=False)
    assert loss_memory(unchunked, lay, "loss forward") == gradients + max(6 * t * v, 2 * t * v + 6 * v * h)


def test_longest_sequence_is_the_memory_boundary():
    w, lay = Workload(MODELS["llama3-8b"], 1), Degrees(8, 1, 1)
    n = longest_sequence(w, lay, H100.memory_bytes)
    assert n > 100_000
    assert memory_per_gpu(replace(w, seq_len=n), lay).total <= H100.memory_bytes
    assert memory_per_gpu(replace(w, seq_len=n + 1), lay).total > H100.memory_bytes


# -- timing -------------------------------------------------------------------------------------------
def test_compute_time_by_hand():
    """With free communication and peak FLOP/s: per layer 2 FLOPs per weight per token forward, 4
    backward, 2 again to recompute under checkpointing; attention 4*D*H FLOPs per visible pair with
    S(S+1)/2 causal pairs, x (1 + 2.5 + 1); the LM head 2 forward + 4 backward FLOPs per weight per token, with
    full logits and with the chunked loss alike (seqmesh.model.loss makes its gradients in its forward)."""
    hw, s = _fast(H100), 1024
    mm = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    attention = 4 * 16 * 4 * (s * (s + 1) // 2)
    assert attention_pairs(s, True) == s * (s + 1) // 2
    for chunked in (True, False):
        t = step_time(Workload(TINY, s, chunked_loss=chunked), Degrees(1, 1, 1), hw)
        flops = TINY.layers * (8 * s * mm + 4.5 * attention) + 6 * s * 256 * 64
        assert t.compute == pytest.approx(flops / hw.peak_flops, rel=1e-9)
        assert t.total == pytest.approx(t.compute, rel=1e-9)


@pytest.mark.parametrize("ulysses,ring", [(4, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_flops_per_rank_divide_by_the_sequence_degree(ulysses, ring, causal):
    """Over P = ulysses x ring ranks each rank does 1/P of the attention: Ulysses gives it Hq/U of the heads
    over all S queries, the (zigzag-balanced) ring 1/R of the visible pairs. Causal keeps S(S+1)/2 of the
    S^2 pairs. Matmuls run on the S/P local tokens. Free links and memory, peak FLOP/s, 4 ranks."""
    hw, s, d, hq = _fast(H100), 4096, 16, 4
    w = Workload(TINY, s, causal=causal)
    pairs = s * (s + 1) // 2 if causal else s * s
    attention = 4 * d * (hq // ulysses) * pairs // ring  # one rank, forward, FLOPs
    mm = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    flops = TINY.layers * (8 * (s // 4) * mm + 4.5 * attention) + 6 * (s // 4) * 256 * 64
    assert step_time(w, Degrees(ulysses, ring, 1), hw).compute == pytest.approx(flops / hw.peak_flops, rel=1e-9)
    one = step_time(w, Degrees(1, 1, 1), hw).compute
    assert one == pytest.approx((TINY.layers * (8 * s * mm + 4.5 * 4 * d * hq * pairs) + 6 * s * 256 * 64)
                                / hw.peak_flops, rel=1e-9)


def test_ring_overlaps_transfers_with_block_compute():
    """Forward over R ring steps of compute c with hop time h takes (R-1) * max(c, h) + c: compute when
    the link is fast, hops when it is slow."""
    w, lay = Workload(MODELS["llama3-8b"], 131072), Degrees(1, 4, 1)
    kv_bytes = 2 * (131072 // 4) * 8 * 128 * 2
    slow = replace(H100, links=(LinkLevel("slow", 0, 0.1 * GB, 0.0),))  # a hop: 1.34 s > a step: 0.25 s
    assert ring_attention_seconds(w, lay, _fast(H100), 1.0, "forward")[0] == pytest.approx(1.0)
    assert ring_attention_seconds(w, lay, slow, 1.0, "forward")[0] == pytest.approx(3 * kv_bytes / (0.1 * GB) + 0.25)


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_units_timing_with_free_compute(tied):
    """Tiny model over 4 data-parallel ranks, compute free, one 1 GB/s link without latency, so every
    collective costs its bytes / 1e9. A rank sends 3 of 4 shards: all-gathers in bf16 (2 B), reduce-scatters
    in fp32 (4 B). Units: 3 layers of 36,992 parameters (9,248 per rank); untied, the embedding (256 x 64 =
    16,384; 4,096 per rank) and the root (head + final norm, 16,448; 4,112 per rank); tied, only the root
    (embedding = head + norm, 16,448). Every collective end to end: per layer 2 gathers + 1 reduce-scatter,
    the root's 1 + 1 (kept gathered for backward), the embedding's 2 + 1. With nothing to hide behind, a layer's forward is its gather
    and its backward the prefetched gather + its reduce-scatter; the first layer's backward prefetches the
    untied embedding in place of a layer, so the step is every collective but one layer gather."""
    m = replace(TINY, tie_embeddings=tied)
    hw = replace(_fast(H100), links=(LinkLevel("slow", 0, 1 * GB, 0.0),), peak_flops=1e30)
    layer, emb, root = 64 * 16 * 12 + 3 * 64 * 128 + 128, 256 * 64, 256 * 64 + 64
    assert (layer, emb, root) == (36_992, 16_384, 16_448) and m.params == 3 * layer + (0 if tied else emb) + root

    def unit(n: int, gathers: int = 2) -> float:  # all-gathers and one reduce-scatter of one unit, seconds
        return (gathers * 3 * (n // 4) * 2 + 3 * (n // 4) * 4) / GB

    serial = 3 * unit(layer) + unit(root, gathers=1) + (0 if tied else unit(emb))
    t = step_time(Workload(m, 64), Degrees(1, 1, 4), hw)
    assert t.serial_comm == pytest.approx(serial, rel=1e-9)
    assert t.total == pytest.approx(serial - (0 if tied else 3 * (layer // 4) * 2 / GB), rel=1e-6)


def test_all_to_all_across_two_levels_waits_for_the_slower_share():
    """16 ranks over 2 nodes of 8: each rank sends 7/15 of its bytes over NVLink and 8/15 over the network,
    in parallel; the call costs the network's latency plus the slower share."""
    hw, nbytes = H100, 15 * 2**20
    nv, ib = hw.links
    want = ib.latency + max(7 * 2**20 / nv.bandwidth, 8 * 2**20 / ib.bandwidth)
    assert concurrent_all_to_all_seconds(nbytes, hw, [list(range(16))]) == pytest.approx(want)
    alone = concurrent_all_to_all_seconds(nbytes, hw, [list(range(8))])
    assert alone == pytest.approx(nv.latency + nbytes / nv.bandwidth)


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
    (u16,) = [c for c in p.candidates if c.layout == Degrees(16, 1, 1)]
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


def _candidate(label: tuple[int, int, int], tokens_per_s: float, gib: float, serial: float) -> Candidate:
    """A made-up evaluated layout: ``gib`` of memory, ``serial`` of the (1 s) step in communication end to end."""
    mem = MemoryBreakdown(int(gib * GiB), 0, 0, 0, 0, 0, 0)
    t = StepTime(1.0, 1.0, 0.0, 0.0, 0.0, serial)
    return Candidate(Degrees(*label), mem, {}, {}, {}, t, tokens_per_s, True)


def test_a_tie_goes_to_clear_memory_headroom_then_to_less_exposed_communication():
    """On an 80 GiB GPU: A is the fastest prediction at 64 GiB; B is 0.5% slower (a tie: under 1%) at 36 GiB,
    more than 10% of the GPU (8 GiB) below A, so A drops out; C is 0.8% slower at 40 GiB, within 8 GiB of B,
    with less communication end to end, so C beats B; D at 20 GiB is 2% slower, no tie."""
    a = _candidate((1, 2, 4), 1000.0, 64.0, 0.001)
    b = _candidate((8, 1, 1), 995.0, 36.0, 0.030)
    c = _candidate((4, 2, 1), 992.0, 40.0, 0.020)
    d = _candidate((1, 8, 1), 980.0, 20.0, 0.000)
    assert pick([a, b, c, d], 80 * GiB) is c
    assert pick([a, b, d], 80 * GiB) is b
    assert pick([a, _candidate((8, 1, 1), 995.0, 60.0, 0.030)], 80 * GiB) is a  # 4 GiB apart: a tie on memory too


def test_h100_128k_picks_headroom_and_says_so():
    """Llama-3-8B at 128K on 8 H100s: layouts with data parallelism are predicted within 1% of the fastest
    but need far more memory; the pick leaves headroom and the reason names both footprints."""
    p = plan(Workload(MODELS["llama3-8b"], 131072), make_cluster(H100, gpus=8))
    fits = [c for c in p.candidates if c.feasible and c.layout.runs_on_seqmesh]
    best, fastest = p.recommended, max(fits, key=lambda c: c.tokens_per_s)
    assert best is not None and best is not fastest
    assert best.tokens_per_s >= 0.99 * fastest.tokens_per_s
    assert fastest.memory.total - best.memory.total > 0.1 * H100.memory_bytes
    assert f"{best.memory.total / GiB:.1f} GiB" in p.reason and f"{fastest.memory.total / GiB:.1f} GiB" in p.reason
    assert "memory headroom" in p.reason


def test_ring_reason_says_exposed_when_a_hop_outlasts_block_compute():
    """Ring 8 over Llama-3-8B at 128K: a forward hop carries 2 x 16384 x 8 x 128 x 2 B = 64 MiB. Over a
    1 GB/s link that is 67 ms against ~30 ms of block compute per step: exposed. Over NVLink: hidden."""
    w, lay = Workload(MODELS["llama3-8b"], 131072), Degrees(1, 8, 1)
    hop_bytes = 2 * 16384 * 8 * 128 * 2
    slow = replace(H100, links=(LinkLevel("slow", 0, 1 * GB, 0.0),))
    for hw, state in ((slow, "its P2P exposed"), (H100, "its P2P hidden behind block compute")):
        cluster = make_cluster(hw, gpus=8)
        c = evaluate(w, lay, cluster)
        assert state in explain(c, [c], cluster)
    c = evaluate(w, lay, make_cluster(slow, gpus=8))
    assert c.time.ring_hop_forward == pytest.approx(hop_bytes / GB)
    assert c.time.ring_hop_forward > c.time.ring_block_forward
    assert f"a hop {hop_bytes / GB * 1e3:.3g} ms forward" in explain(c, [c], make_cluster(slow, gpus=8))


def test_fp32_needs_its_own_peak():
    """H100 SXM: 989 TFLOP/s bf16 but 67 fp32 (not half); a GPU described only by its bf16 peak has no fp32
    figure, and fp32 planning says which flag gives it."""
    assert H100.flops_for("fp32") == 67e12 and H100.flops_for("bf16") == 989.4e12
    with pytest.raises(ValueError, match="--peak-tflops-fp32"):
        replace(H100, peak_flops_fp32=None).flops_for("fp32")
