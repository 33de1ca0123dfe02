"""``seqmesh selftest``: on a machine without CUDA it says what it would run and exits 0; its rehearsal runs
every step of the GPU path on the CPU at toy sizes and writes the report the GPU run would."""

from __future__ import annotations

import json
import subprocess
import sys

from seqmesh.kernels import AUTO_ORDER
from seqmesh.tools.selftest import rehearsal_plan, run_selftest


def test_without_cuda_it_says_what_it_would_run_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "-m", "seqmesh", "selftest", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "would run" in done.stdout and "llama3-8b" in done.stdout and "no CUDA device here" in done.stdout
    assert not (tmp_path / "r.json").exists()  # nothing ran, nothing written


def test_the_rehearsal_runs_every_step_and_writes_the_report(tmp_path):
    plan = rehearsal_plan()
    report = run_selftest(plan, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["longest"]["model"] == plan.longest_model
    kernels = {r["kernel"]: r for r in report["kernels"]}
    assert set(kernels) == {"torch_sdpa", *AUTO_ORDER}
    assert "seconds" in kernels["cpu_flash"] and "seconds" in kernels["math"]
    assert all("skipped" in kernels[k] for k in ("cuda_flash", "cuda_efficient"))  # named, not silently absent
    # the planner's prediction beside each measured peak; on the CPU it is validated within 5% elsewhere
    assert [r["seq_len"] for r in report["memory"]] == plan.memory_seq_lens
    assert all(0.95 <= r["predicted_ratio"] <= 1.05 for r in report["memory"]), report["memory"]
    longest = report["longest"]
    trials = {int(n): t for n, t in longest["trials"].items()}
    assert longest["longest"] is not None and not longest["bounded"]
    assert trials[longest["longest"]]["peak_bytes"] <= plan.budget_bytes
    above = longest["longest"] + plan.longest_resolution
    assert above in trials and trials[above]["peak_bytes"] > plan.budget_bytes  # the search found the edge
