"""The planner's async Ulysses: the pipelining formula against a small event simulation of the pipeline, and
the step time it predicts against the synchronous one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from seqmesh.rules.degrees import Degrees
from seqmesh.model.presets import model_shape
from seqmesh.rules.overlap import pipelined_exposed
from seqmesh.planner.hardware import PRESETS
from seqmesh.planner.attention_layer import _ulysses_seconds, ulysses_exposed_seconds
from seqmesh.planner.timing import step_time
from seqmesh.planner.workload import Workload


def simulated_exposed(comm: float, compute: float, pieces: int) -> float:
    """Two resources, one piece at a time: piece i's communication starts when its compute is done and the
    communication of piece i-1 has finished; what the last communication ends after the compute is exposed."""
    compute_end = comm_end = 0.0
    for _ in range(pieces):
        compute_end += compute / pieces
        comm_end = max(comm_end, compute_end) + comm / pieces
    return max(0.0, comm_end - compute_end)


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("comm,compute", [(1.0, 0.0), (1.0, 0.5), (1.0, 1.0), (1.0, 3.0), (0.2, 7.0), (5.0, 1.0)])
def test_pipelined_exposed_is_the_simulated_pipeline(comm, compute, pieces):
    assert pipelined_exposed(comm, compute, pieces) == pytest.approx(simulated_exposed(comm, compute, pieces), abs=1e-12)


def test_one_piece_is_the_synchronous_path():
    assert pipelined_exposed(2.5, 10.0, 1) == 2.5
    with pytest.raises(ValueError, match="pieces=0"):
        pipelined_exposed(1.0, 1.0, 0)


H100 = PRESETS["h100-nvlink"]
LLAMA = Workload(model=model_shape("llama3-8b"), seq_len=131072)


@pytest.mark.parametrize("hw", ["h100-nvlink", "l20-pcie"])
@pytest.mark.parametrize("seq_len", [32768, 131072])
@pytest.mark.parametrize("ulysses,ring", [(8, 1), (4, 2), (2, 4)])
def test_async_hides_part_of_the_all_to_alls_and_nothing_else(hw, seq_len, ulysses, ring):
    """Async never predicts a slower step; what it saves per layer is at most the all-to-alls' time (forward,
    backward and the recompute); the serial communication and the compute are unchanged."""
    work, spec, layout = replace(LLAMA, seq_len=seq_len), PRESETS[hw], Degrees(ulysses, ring, 1)
    sync, overlapped = step_time(work, layout, spec), step_time(replace(work, async_ulysses=True), layout, spec)
    a2a = sum(_ulysses_seconds(work, layout, spec, phase) for phase in ("forward", "backward", "forward"))
    assert overlapped.total < sync.total
    assert sync.total - overlapped.total <= work.model.layers * a2a * (1 + 1e-9)
    assert overlapped.compute == sync.compute and overlapped.serial_comm == sync.serial_comm


def test_async_changes_nothing_without_ulysses_or_with_tensor_parallelism():
    """No Ulysses axis: nothing to overlap; TP: refused at run time, so predicted as the synchronous path."""
    on = replace(LLAMA, async_ulysses=True)
    for layout in (Degrees(1, 8, 1), Degrees(4, 1, 1, tp=2)):
        assert step_time(on, layout, H100) == step_time(LLAMA, layout, H100)


def test_exposed_all_to_all_from_the_shapes():
    """Llama-3-8B, 128K tokens on U8: per layer, each all-to-all beside its projection (forward: q/k/v then output;
    backward: output then q/k/v, twice the matmuls), pipelined in 4 pieces, recomputed from the formula."""
    layout, on = Degrees(8, 1, 1), replace(LLAMA, async_ulysses=True)
    m = LLAMA.model
    rate = H100.flops_for("bf16") * H100.matmul_efficiency
    tokens = 131072 // 8
    qkv = 2 * tokens * m.hidden * m.head_dim * (m.heads + 2 * m.kv_heads) / rate
    out = 2 * tokens * m.hidden * m.head_dim * m.heads / rate
    sync_fwd = _ulysses_seconds(LLAMA, layout, H100, "forward")
    share = (m.heads + 2 * m.kv_heads) / (2 * m.heads + 2 * m.kv_heads)  # the q/k/v all-to-all's share of the bytes
    c_in, c_out = share * sync_fwd, (1 - share) * sync_fwd
    assert c_in < qkv and c_out < out  # NVLink: each all-to-all is shorter than its projection, so 1/4 stays exposed
    assert ulysses_exposed_seconds(on, layout, H100, "forward") == pytest.approx((c_in + c_out) / 4, rel=1e-3)
