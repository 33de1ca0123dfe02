"""``seqmesh plan`` on the command line: JSON schema, speed, errors; and ``--calibrate``'s measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from planner_cases import TrafficCase  # noqa: F401  (keeps the case module importable for spawned ranks)
from seqmesh.cli import main
from seqmesh.planner.calibrate import Calibration, apply_calibration, measure_compute, measure_links
from seqmesh.planner.hardware import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_KEYS = {"weights", "grads", "optimizer", "activations", "total"}
LAYOUT_KEYS = {"ulysses", "ring", "dp_shard", "tp"}


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seqmesh", "plan", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_json_has_the_issue_schema():
    done = _run("--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["candidates"]
    for c in out["candidates"]:
        assert set(c["layout"]) == LAYOUT_KEYS
        assert MEMORY_KEYS <= set(c["memory_bytes"])
        assert c["memory_bytes"]["total"] == sum(v for k, v in c["memory_bytes"].items() if k != "total")
        assert set(c["comm_bytes_per_layer"]) == {"forward", "backward"}
        for phase in c["comm_bytes_per_layer"].values():
            assert "total" in phase and all(isinstance(v, int) for v in phase.values())
        assert isinstance(c["step_time_s"], float) and c["step_time_s"] > 0
        assert isinstance(c["feasible"], bool)
        n = c["layout"]
        assert n["ulysses"] * n["ring"] * n["dp_shard"] * n["tp"] == 8
    rec = out["recommended"]
    assert set(rec["layout"]) == LAYOUT_KEYS and rec["reason"]
    assert out["candidates"][0]["layout"] == rec["layout"]  # the recommendation heads the list


def test_table_mode_is_fast_and_recommends(capsys):
    """The planning itself takes well under a second; the process mostly imports torch (seqmesh's
    package __init__ does)."""
    start = time.perf_counter()
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink"]) == 0
    assert time.perf_counter() - start < 3.0
    out = capsys.readouterr().out
    assert "recommended: U" in out and "memory per GPU" in out
    start = time.perf_counter()
    done = _run("--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink")
    assert done.returncode == 0 and "recommended:" in done.stdout
    assert time.perf_counter() - start < 20.0  # generous: a cold torch import on a loaded 2-core box


def test_max_seq_len_mode(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--max-seq-len", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lengths = {tuple(r["layout"].values()): r["max_seq_len"] for r in out["candidates"]}
    assert lengths[(8, 1, 1, 1)] > lengths[(1, 1, 8, 1)] > 0  # sharding the sequence 8 ways fits more
    assert out["recommended"]["max_seq_len"] == max(r["max_seq_len"] for r in out["candidates"] if r["layout"]["tp"] == 1)


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama-9b", "--seq-len", "8"], "not a preset (llama-tiny, qwen3-tiny, llama3.2-1b"),
    (["--model", "llama3-8b", "--seq-len", "8", "--hardware", "tpu"], "presets: h100-nvlink, h200-nvlink"),
    (["--model", "llama3-8b", "--seq-len", "8", "--gpus", "12"], "not a whole number of 8-GPU nodes"),
    (["--model", "llama3-8b", "--seq-len", "8", "--gpus", "12", "--nodes", "2"], "= 16; give --gpus 16"),
    (["--model", "llama3-8b", "--seq-len", "0"], "--seq-len 0"),
    (["--model", "llama3-8b"], "give --seq-len N"),
    (["--model", "llama3-8b", "--seq-len", "8", "--efficiency", "1.5"], "must be in (0, 1]"),
    (["--model", "llama3-8b", "--seq-len", "8", "--link", "pcie:4"], "NAME:GROUP:GBPS:MICROSECONDS"),
    (["--model", "llama3-8b", "--seq-len", "8", "--link", "a:8:10:1", "--link", "b:4:10:1", "--link", "c:all:1:1"],
     "must grow outward"),
])
def test_bad_input_exits_2_naming_the_fix(capsys, argv, needle):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqmesh plan: error:") and needle in err


def test_bad_input_exit_code_in_a_real_process():
    done = _run("--model", "llama3-8b", "--seq-len", "-5")
    assert done.returncode == 2 and "--seq-len -5" in done.stderr and not done.stdout


def test_custom_links_and_memory(capsys):
    assert main(["plan", "--model", "qwen3-0.6b", "--seq-len", "65536", "--gpus", "8", "--memory-gib", "24",
                 "--peak-tflops", "100", "--link", "pcie:4:20:10", "--link", "host:8:10:15", "--link", "net:all:5:20",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [lv["name"] for lv in out["hardware"]["links"]] == ["pcie", "host", "net"]
    assert out["hardware"]["memory_bytes"] == 24 * 2**30


# -- calibration ----------------------------------------------------------------------------------------
def test_link_measurement_counts_what_it_times(pools):
    """Each rank of 2 sends half of a (2*rows, 256) float32 all-to-all and one (rows, 256) ring message."""
    per_rank = pools.run(2, measure_links, 4096, 65536, 2)
    for r in per_rank:
        assert r["a2a_large_bytes"] == r["p2p_large_bytes"] == 65536
        assert r["a2a_small_bytes"] == r["p2p_small_bytes"] == 4096
        assert all(r[k] > 0 for k in r if k.endswith("_s"))


def test_compute_measurement_and_its_use():
    mm, attn, dtype = measure_compute("cpu", size=128, seq_len=128)
    assert mm > 0 and attn > 0 and dtype == "float32"
    cal = Calibration("cpu", dtype, 2e11, 1e11, 5e9, 1e-4, 6e9, 2e-4, 1.0)
    hw = apply_calibration(PRESETS["l20-pcie"], cal, "bf16")
    assert hw.peak_flops == 2e11 and hw.matmul_efficiency == 1.0 and hw.attention_efficiency == 0.5
    assert [(lv.bandwidth, lv.latency) for lv in hw.links[:2]] == [(5e9, 2e-4)] * 2  # inside the node
    assert hw.links[2] == PRESETS["l20-pcie"].links[2]  # between nodes: kept
