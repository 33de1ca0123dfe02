"""``seqmesh selftest``: on a machine without CUDA it says what it would run and exits 0; its rehearsal runs
every step of the GPU path on the CPU at toy sizes and writes the report the GPU run would."""

from __future__ import annotations

import json
import subprocess
import sys

from seqmesh.kernels import AUTO_ORDER
import pytest
import torch

import seqmesh.comm.launch
from seqmesh.kernels import KERNELS
from seqmesh.tools.selftest import (host_memory_bytes, longest_model, longest_sequence, rehearsal_plan, run_selftest,
                                    time_kernels)


def test_without_cuda_it_says_what_it_would_run_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "-m", "seqmesh", "selftest", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    model, why = longest_model(host_memory_bytes())  # Llama-3.1-8B's shape where the host holds its offloaded state
    assert "would run" in done.stdout and model in done.stdout and why in done.stdout, done.stdout
    assert "no CUDA device here" in done.stdout
    assert not (tmp_path / "r.json").exists()  # nothing ran, nothing written


def test_the_rehearsal_runs_every_step_and_writes_the_report(tmp_path, rehearsal_server):
    plan = rehearsal_plan()
    report = run_selftest(plan, str(tmp_path / "r.json"), launch=rehearsal_server)
    assert json.loads((tmp_path / "r.json").read_text())["longest"]["model"] == plan.longest_model
    kernels = {r["kernel"]: r for r in report["kernels"]}
    assert set(kernels) == {"torch_sdpa", *AUTO_ORDER, "triton+alibi"}
    assert "seconds" in kernels["cpu_flash"] and "seconds" in kernels["math"]
    # named, not silently absent
    assert all("skipped" in kernels[k] for k in ("cuda_flash", "cuda_efficient", "triton_flash", "triton+alibi"))
    # the planner's prediction beside each measured peak; on the CPU it is validated within 5% elsewhere
    assert [r["seq_len"] for r in report["memory"]] == plan.memory_seq_lens
    assert all(0.95 <= r["predicted_ratio"] <= 1.05 for r in report["memory"]), report["memory"]
    # the real step (seqmesh train's, tracked) beside its rehearsal on fake tensors: the same storages, but for the
    # unsharded batch, which the real step's data pipeline touches on the host (its device, on the CPU)
    [row] = report["rehearsal"]
    assert row["seq_len"] == plan.memory_seq_lens[-1] and row["kernels"] == ["cpu_flash"], row
    whole_batch = 2 * 8 * row["seq_len"]  # input ids and labels, int64
    assert abs(row["tracked_peak_bytes"] - row["rehearsed_peak_bytes"]) <= whole_batch, row
    for part in ("parameters", "gradients", "optimizer", "activations"):
        assert row["tracked_by_category"][part] == row["rehearsed_by_category"][part], row
    longest = report["longest"]
    trials = {int(n): t for n, t in longest["trials"].items()}
    assert longest["longest"] is not None and not longest["bounded"]
    assert trials[longest["longest"]]["peak_bytes"] <= plan.budget_bytes
    above = longest["longest"] + plan.longest_resolution
    assert above in trials and trials[above]["peak_bytes"] > plan.budget_bytes  # the search found the edge


def test_a_kernel_out_of_memory_is_recorded_and_the_others_still_run(monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(KERNELS["cpu_flash"], "forward", no_memory)
    rows = {r["kernel"]: r for r in time_kernels(rehearsal_plan())}
    assert "out of memory" in rows["cpu_flash"]["skipped"] and "seconds" in rows["math"], rows


def test_a_failed_trial_ends_the_search_with_what_it_found(monkeypatch):
    """A trial that dies without a CUDA out-of-memory error (its time ran out, the host killed it) is recorded,
    and the search reports what it has, marked bounded, instead of dying."""
    class DyingPool:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, *args, **kwargs):
            raise RuntimeError("_trial failed on rank(s) [0]: killed")

    monkeypatch.setattr(seqmesh.comm.launch, "WorkerPool", DyingPool)
    result = longest_sequence(rehearsal_plan())
    assert result["bounded"] and result["longest"] is None
    assert "killed" in result["trials"]["256"]["failed"]
