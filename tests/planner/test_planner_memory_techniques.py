"""The planner's model of the memory techniques: what each takes off the GPU, what it puts on the host,
and what it costs in time."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from seqmesh.memory.offload import ActivationOffload
from seqmesh.planner.hardware import PRESETS
from seqmesh.planner.activations import norm_backward_steps, norm_saved, outside_layers_bytes
from seqmesh.planner.memory import (host_memory, layer_saved_bytes, local_tokens, memory_at,
                                    memory_per_gpu, mlp_tile_tokens, parameter_memory)
from seqmesh.planner.plan import longest_sequence
from seqmesh.planner.timing import step_time
from seqmesh.rules.degrees import Degrees
from seqmesh.planner.workload import Workload
from seqmesh.model.presets import MODELS

LLAMA8B = MODELS["llama3-8b"]
LAYOUTS = [Degrees(1, 1, 1), Degrees(8, 1, 1), Degrees(2, 4, 1), Degrees(1, 8, 4)]


def test_tiled_mlp_keeps_only_the_mlp_input():
    work = Workload(LLAMA8B, 131072, checkpointing=False)
    for layout in LAYOUTS:
        tokens = local_tokens(work, layout)
        dropped = layer_saved_bytes(work, layout) - layer_saved_bytes(replace(work, tiled_mlp=True), layout)
        assert dropped == tokens * 4 * LLAMA8B.intermediate * work.act_bytes  # gate, SiLU(gate), up, product
        assert mlp_tile_tokens(work, layout) <= LLAMA8B.hidden


def test_efficient_norm_keeps_4_bytes_per_hidden_less_and_bounds_its_backward():
    work = Workload(LLAMA8B, 131072, checkpointing=False)
    lean = replace(work, efficient_norm=True)
    for layout in LAYOUTS:
        tokens = local_tokens(work, layout)
        dropped = layer_saved_bytes(work, layout) - layer_saved_bytes(lean, layout)
        assert dropped == 2 * tokens * 4 * LLAMA8B.hidden  # per norm: float32 copy + bf16 normalized - bf16 input
        steps = dict((op, allocated) for op, allocated, _ in norm_backward_steps(lean, layout))
        tile = 3 * LLAMA8B.hidden * LLAMA8B.hidden * 4  # three float32 (tile, hidden) tensors, tiles of <= hidden
        working = min(tile, 3 * tokens * LLAMA8B.hidden * 4)
        assert steps == {"norm tiled backward": tokens * LLAMA8B.hidden * 2 + working}  # + dx, compute dtype


def test_offload_leaves_the_prefetched_inputs_and_needs_checkpointing():
    work = Workload(LLAMA8B, 524288)
    moved = replace(work, offload_checkpoints=True)
    layout = Degrees(1, 1, 1)
    layer_input = local_tokens(work, layout) * LLAMA8B.hidden * work.act_bytes
    kept, offloaded = (memory_at(w, layout, "layer backward").activations for w in (work, moved))
    prefetch = inspect.signature(ActivationOffload).parameters["prefetch"].default  # what the offload fetches ahead
    assert moved.offload_prefetch == prefetch
    assert kept - offloaded == (LLAMA8B.layers - prefetch - 1) * layer_input
    # at the loss only the LM head's input stays (and the token ids, labels, RoPE tables)
    assert memory_at(moved, layout, "loss backward").activations == layer_input + outside_layers_bytes(work, layout)
    # the layers' inputs and the final norm's float32 input, float32 scale and bf16 normalized tensor
    tokens = local_tokens(work, layout)
    assert norm_saved(LLAMA8B, 2) == 4 * 4096 + 4 + 2 * 4096
    assert host_memory(moved, layout) == LLAMA8B.layers * layer_input + tokens * (6 * LLAMA8B.hidden + 4)
    with pytest.raises(ValueError, match="--checkpointing"):
        Workload(LLAMA8B, 1024, checkpointing=False, offload_checkpoints=True)


def test_fsdp_cpu_offload_moves_the_sharded_state_to_the_host():
    work = Workload(LLAMA8B, 65536)
    for layout in LAYOUTS:
        weights, grads, optimizer = parameter_memory(work, layout, "end of backward")
        offloaded = replace(work, fsdp_cpu_offload=True)
        off_weights, off_grads, off_optimizer = parameter_memory(offloaded, layout, "end of backward")
        shard = -(-LLAMA8B.params // layout.fsdp_group)
        assert off_optimizer == 0 and off_grads == grads - 4 * shard
        assert off_weights < weights
        assert host_memory(offloaded, layout) == 16 * shard


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.label)
def test_every_technique_lowers_the_peak_and_lengthens_the_longest(layout):
    base = Workload(LLAMA8B, 262144)
    budget = PRESETS["h100-nvlink"].memory_bytes
    previous_peak, previous_longest = memory_per_gpu(base, layout).total, longest_sequence(base, layout, budget)
    work = base
    for option in ("tiled_mlp", "offload_checkpoints", "fsdp_cpu_offload", "efficient_norm"):
        work = replace(work, **{option: True})
        peak, longest = memory_per_gpu(work, layout).total, longest_sequence(work, layout, budget)
        assert peak < previous_peak and longest >= previous_longest, option
        previous_peak, previous_longest = peak, longest


def test_one_h100_fits_a_long_llama8b_sequence_only_with_the_techniques():
    budget = PRESETS["h100-nvlink"].memory_bytes
    plain = Workload(LLAMA8B, 1)
    every = replace(plain, tiled_mlp=True, offload_checkpoints=True, fsdp_cpu_offload=True)
    assert longest_sequence(plain, Degrees(1, 1, 1), budget) == 0  # model state alone is 126.6 GiB
    assert longest_sequence(every, Degrees(1, 1, 1), budget) > 400_000


def test_tiled_mlp_recompute_and_offload_traffic_cost_time():
    hw = PRESETS["h100-nvlink"]
    work, layout = Workload(LLAMA8B, 131072), Degrees(8, 1, 1)
    plain = step_time(work, layout, hw)
    tiled = step_time(replace(work, tiled_mlp=True), layout, hw)
    assert tiled.compute > plain.compute  # one more MLP forward per layer
    slow_host = replace(hw, host_bandwidth=1e6)  # so slow that no layer hides the copy
    assert step_time(replace(work, offload_checkpoints=True), layout, slow_host).total > plain.total
    assert step_time(replace(work, offload_checkpoints=True), layout, hw).total == plain.total  # hidden by compute


@pytest.mark.parametrize("layout", [Degrees(8, 1, 1), Degrees(2, 4, 1)], ids=["U8", "U2xR4"])
def test_keep_attention_trades_the_attention_recompute_for_the_kept_outputs(layout):
    """``keep_attention``: each layer's attention runs forward once (its compute less one attention forward a layer,
    the recompute's ring hops gone), for its output (bf16) and float32 log-sum-exp over the rank's attention tokens
    and heads, kept by every layer below the one in backward."""
    from seqmesh.planner.attention_layer import Attention
    from seqmesh.planner.network import every_group

    hw = PRESETS["h100-nvlink"]
    work = Workload(LLAMA8B, 131072)
    keep = replace(work, keep_attention=True)
    plain_time, keep_time = step_time(work, layout, hw), step_time(keep, layout, hw)
    ranks = [r for group in every_group(layout, "sequence") for r in group]
    attention_forward = Attention(work, layout).seconds(hw, ranks)["attention_forward"]
    assert plain_time.compute - keep_time.compute == pytest.approx(LLAMA8B.layers * attention_forward, rel=1e-9)
    if layout.ring > 1:
        assert Attention(keep, layout).traffic()["recompute"]["ring_p2p"] == 0
        assert Attention(work, layout).traffic()["recompute"]["ring_p2p"] > 0
    # rank's attention tokens (the whole ring block) x its heads x (128 bf16 values + a float32 lse)
    tokens, heads = 131072 // layout.ring, LLAMA8B.heads // layout.ulysses
    kept = tokens * heads * (128 * 2 + 4)
    grown = {moment: memory_at(keep, layout, moment).activations - memory_at(work, layout, moment).activations
             for moment in ("loss forward", "layer backward", "first layer backward", "end of backward")}
    # every layer's at the loss; the layers' below the one in backward (its own is its backward's, as before)
    assert grown == {"loss forward": LLAMA8B.layers * kept, "layer backward": (LLAMA8B.layers - 1) * kept,
                     "first layer backward": 0, "end of backward": 0}


def test_the_plan_says_what_keeping_the_attention_would_give_its_recommendation():
    """``seqmesh plan`` without ``--keep-attention`` prints the recommended layout's tokens/s and memory with it (its
    own evaluation, as the flag would plan it); with the flag, or without checkpointing, it says nothing of it."""
    from seqmesh.planner.hardware import make_cluster
    from seqmesh.planner.plan import evaluate, plan
    from seqmesh.planner.recommend import gib
    from seqmesh.planner.report import format_plan

    cluster = make_cluster(PRESETS["h200-nvlink"], 8)
    work = Workload(LLAMA8B, 131072)
    p = plan(work, cluster)
    kept = evaluate(replace(work, keep_attention=True), p.recommended.layout, cluster)
    assert kept.tokens_per_s > p.recommended.tokens_per_s and kept.memory.total > p.recommended.memory.total
    lines = [line for line in format_plan(p, 5).splitlines() if line.startswith("with --keep-attention")]
    assert len(lines) == 1 and f"{gib(kept.memory.total)} GiB per GPU (fits)" in lines[0], lines
    assert f"({kept.tokens_per_s / p.recommended.tokens_per_s - 1:+.1%})" in lines[0]
    for other in (replace(work, keep_attention=True), replace(work, checkpointing=False)):
        assert "--keep-attention (the recompute" not in format_plan(plan(other, cluster), 5)
