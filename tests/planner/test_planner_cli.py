"""``seqmesh plan`` on the command line: JSON schema, speed, errors; and ``--calibrate``'s measurements."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from planner_cases import in_process  # (also keeps the case module importable for spawned ranks)
from seqmesh.tools.cli import main
from seqmesh.planner.calibrate import Calibration, apply_calibration, measure_compute, measure_links
from seqmesh.planner.hardware import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SP_KEYS = {"ulysses_all_to_all", "ring_p2p", "fsdp_all_gather", "fsdp_reduce_scatter", "total"}
TP_KEYS = SP_KEYS | {"tp_all_gather", "tp_reduce_scatter"}
TYPES = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, float),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "null": lambda v: v is None,
}


def _run(*argv: str, process: bool = False) -> subprocess.CompletedProcess:
    """``seqmesh plan *argv``: in a fresh interpreter as a user runs it (``process``), else in this one (the same
    ``main``, without a second import of torch: seconds less)."""
    if process:
        return subprocess.run([sys.executable, "-m", "seqmesh", "plan", *argv], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
    return in_process(["plan", *argv])



def _schema() -> dict:
    """The JSON schema written in docs/planner.md (the block after the ``planner-json-schema`` marker)."""
    with open(os.path.join(ROOT, "docs", "planner.md")) as f:
        text = f.read()
    block = text.split("<!-- planner-json-schema -->", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    return json.loads(block)


def conform(value, spec, defs: dict, where: str = "$") -> None:
    """Assert that ``value`` matches ``spec`` in the notation docs/planner.md describes."""
    if isinstance(spec, str):
        for kind in spec.split(":", 1)[0].split("|"):
            kind = kind.strip()
            if kind.startswith("@"):
                try:
                    conform(value, defs[kind], defs, where)
                    return
                except AssertionError:
                    continue
            elif TYPES[kind](value):
                return
        raise AssertionError(f"{where}: {value!r} is not {spec!r}")
    if isinstance(spec, list):
        assert isinstance(value, list), f"{where}: {value!r} is not a list"
        for i, item in enumerate(value):
            conform(item, spec[0], defs, f"{where}[{i}]")
        return
    assert isinstance(value, dict), f"{where}: {value!r} is not an object"
    if set(spec) == {"*"}:
        for key, item in value.items():
            conform(item, spec["*"], defs, f"{where}.{key}")
        return
    assert set(value) == set(spec), f"{where}: keys {sorted(value)} differ from the schema's {sorted(spec)}"
    for key, item in spec.items():
        conform(value[key], item, defs, f"{where}.{key}")


def test_schema_checker_is_not_vacuous():
    schema = _schema()
    defs = {k: v for k, v in schema.items() if k.startswith("@")}
    layout = {"ulysses": 2, "ring": 1, "dp_shard": 4, "tp": 1}
    conform(layout, "@layout", defs)
    for bad in ({**layout, "tp": 1.0}, {**layout, "extra": 1}, {"ulysses": 2}):
        with pytest.raises(AssertionError):
            conform(bad, "@layout", defs)
    conform(None, "@recommendation|null", defs)
    with pytest.raises(AssertionError):
        conform({"layout": layout}, "@recommendation|null", defs)


def test_json_matches_the_documented_schema_and_its_arithmetic():
    """Every key and type as docs/planner.md writes them, and the sums the docs promise, checked from the
    model's shape: per step = layers x (forward + backward + recompute), plus, for FSDP, the two other
    units of an untied model, each reduce-scattered once: the embedding (vocab x hidden parameters, gathered
    for its forward and again for its backward) and the root (LM head + final norm, vocab x hidden + hidden,
    gathered once and kept for backward)."""
    done = _run("--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink", "--json",
                process=True)
    assert done.returncode == 0, done.stderr
    out, schema = json.loads(done.stdout), _schema()
    conform(out, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    m = out["model"]
    assert not m["tie_embeddings"]
    units = (m["vocab"] * m["hidden"], m["vocab"] * m["hidden"] + m["hidden"])  # embedding, root
    for c in out["candidates"]:
        n, mem = c["layout"], c["memory_bytes"]
        assert n["ulysses"] * n["ring"] * n["dp_shard"] * n["tp"] == 8
        assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
        assert c["feasible"] == (mem["total"] <= out["hardware"]["memory_bytes"])
        assert c["step_time_s"] == c["time_s"]["total"] > 0
        assert c["tokens_per_s"] == pytest.approx(n["dp_shard"] * 131072 / c["step_time_s"])
        layer, step = c["comm_bytes_per_layer"], c["comm_bytes_per_step"]
        keys = TP_KEYS if n["tp"] > 1 else SP_KEYS
        assert all(set(layer[p]) == keys for p in ("forward", "backward", "recompute"))
        assert set(step) == keys | {"input_check_all_gather", "loss_all_reduce"} | ({"tp_all_reduce"} if n["tp"] > 1 else set())
        for phase in (*layer.values(), step):
            assert phase["total"] == sum(v for k, v in phase.items() if k != "total")
        for k in keys - {"total", "fsdp_all_gather", "fsdp_reduce_scatter"}:
            outside = layer["forward"][k] if k.startswith("tp_") else 0  # the embedding's and the loss's: one each (a layer's forward has two)
            assert step[k] == 32 * (layer["forward"][k] + layer["backward"][k] + layer["recompute"][k]) + outside
            if k != "tp_reduce_scatter":  # the recompute stops before the MLP's reduce-scatter: half of it
                assert layer["recompute"][k] == layer["forward"][k]  # checkpointing is on
        group = n["dp_shard"] * n["ulysses"] * n["ring"]  # FSDP ranks; TP splits each unit first
        shards = [math.ceil((math.ceil((u - h) / n["tp"]) + h) / group) for u, h in zip(units, (0, m["hidden"]))]
        root_gathers = sum(g * (group - 1) * sh * 2 for g, sh in zip((2, 1), shards))  # bf16: embedding twice, root once
        root_reduce = sum((group - 1) * sh * 4 for sh in shards)  # fp32
        assert step["fsdp_all_gather"] == 32 * 2 * layer["forward"]["fsdp_all_gather"] + root_gathers
        assert step["fsdp_reduce_scatter"] == 32 * layer["backward"]["fsdp_reduce_scatter"] + root_reduce
    rec = out["recommended"]
    assert rec["reason"] == out["reason"] and out["candidates"][0]["layout"] == rec["layout"]


def test_reason_and_table_print_the_same_share():
    """The share of the step that waits on communication reads the same in the table and the reason."""
    done = _run("--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink")
    lines = done.stdout.splitlines()
    row = next(line for line in lines if line.strip().startswith("1  "))
    (exposed,) = [word for word in row.split() if word.endswith("%")]  # the 'exposed' column
    assert f"; {exposed} of the step waits on communication" in done.stdout


def test_table_mode_recommends_in_process_and_as_a_command(capsys):
    """The table mode recommends a layout and prints its memory, called in-process and as a command.
    (How long planning takes is not asserted here: speed belongs in benchmarks, not tests.)"""
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink"]) == 0
    out = capsys.readouterr().out
    assert "recommended: U" in out and "memory per GPU" in out
    done = _run("--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink")
    assert done.returncode == 0 and "recommended:" in done.stdout


def test_header_gives_parameters_in_a_unit_that_fits(capsys):
    for model, params in (("llama-tiny", "106.8K params"), ("qwen3-0.6b", "596.0M params"), ("llama3-8b", "8.0B params")):
        assert main(["plan", "--model", model, "--seq-len", "4096", "--gpus", "4"]) == 0
        assert capsys.readouterr().out.startswith(f"model {model}: {params}, ")


def test_the_header_says_row_1_is_the_recommendation(capsys):
    """The header said "ranked by predicted tokens/s" above a first row that is the recommendation, not the fastest."""
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "; row 1 is the recommendation (why: below), the others ranked by predicted tokens/s" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit() and " x " in line]
    fits = [next(i for i, word in enumerate(row) if word in ("yes", "NO")) for row in rows]
    label = " ".join(rows[0][1:fits[0]])
    assert f"recommended: {label} -- " in out, out
    speed = [int(row[i + 3].replace(",", "")) for row, i in zip(rows, fits)]  # tokens/s: after fits, GiB, step
    assert speed[0] < max(speed) and speed[1:] == sorted(speed[1:], reverse=True), out  # not the fastest: a tie
    assert main(["plan", "--model", "llama3-70b", "--seq-len", "1048576", "--gpus", "8"]) == 0  # nothing fits
    out = capsys.readouterr().out
    assert "no seqmesh layout fits" in out and "row 1 is" not in out and "; ranked by predicted tokens/s" in out


def test_max_seq_len_mode(capsys):
    schema = _schema()
    defs = {k: v for k, v in schema.items() if k.startswith("@")}
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--max-seq-len", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    conform(out, schema["max_seq_len"], defs)
    lengths = {tuple(r["layout"].values()): r["max_seq_len"] for r in out["candidates"]}
    assert lengths[(8, 1, 1, 1)] > lengths[(1, 1, 8, 1)] > 0  # sharding the sequence 8 ways fits more
    assert out["recommended"]["max_seq_len"] == max(r["max_seq_len"] for r in out["candidates"] if r["layout"]["tp"] == 1)
    assert out["recommended"]["reason"] == out["reason"] and f"{out['recommended']['max_seq_len']:,}" in out["reason"]
    # Llama-3-70B on 16 GPUs: 16 B per parameter / 16 and the fused AdamW step leave an H100 room for tokens, where
    # a foreach step would not (test_planner.test_llama70b_on_16_gpus_fits_with_the_fused_adamw_step_not_with_foreach)
    assert main(["plan", "--model", "llama3-70b", "--nodes", "2", "--max-seq-len", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    conform(out, schema["max_seq_len"], defs)
    assert out["recommended"]["max_seq_len"] > 131072
    # on 8 GPUs (16 B per parameter / 8 = 131 GiB) none holds one token; those rows have no step time
    assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--max-seq-len", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    conform(out, schema["max_seq_len"], defs)
    assert out["recommended"] is None and "use more GPUs" in out["reason"]
    for r in out["candidates"]:
        assert (r["step_time_s"] is None) == (r["max_seq_len"] == 0) == (not r["feasible"])


def test_peak_flops_per_dtype(capsys):
    """--peak-tflops is the bf16 peak; fp32 needs its own (no fixed ratio), and says which flag gives it."""
    argv = ["plan", "--model", "qwen3-0.6b", "--seq-len", "8192", "--gpus", "8", "--peak-tflops", "500"]
    assert main([*argv, "--dtype", "fp32"]) == 2
    assert "--peak-tflops-fp32" in capsys.readouterr().err
    assert main([*argv, "--dtype", "fp32", "--peak-tflops-fp32", "30", "--json"]) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert (hw["peak_flops"], hw["peak_flops_fp32"]) == (500e12, 30e12)
    assert main([*argv, "--json"]) == 0  # bf16 needs only the bf16 peak
    assert json.loads(capsys.readouterr().out)["hardware"]["peak_flops_fp32"] is None


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
    """Compute is measured in the dtype being planned and stored as that dtype's peak."""
    for dtype, torch_name in (("fp32", "float32"), ("bf16", "bfloat16")):
        mm, attn, measured = measure_compute("cpu", dtype, size=128, seq_len=128)
        assert mm > 0 and attn > 0 and measured == torch_name
    cal = Calibration("cpu", "bfloat16", 2e11, 1e11, 5e9, 1e-4, 6e9, 2e-4, 1.0)
    hw = apply_calibration(PRESETS["l20-pcie"], cal, "bf16")
    assert hw.peak_flops == 2e11 and hw.matmul_efficiency == 1.0 and hw.attention_efficiency == 0.5
    assert hw.peak_flops_fp32 == PRESETS["l20-pcie"].peak_flops_fp32  # fp32 was not measured
    assert [(lv.bandwidth, lv.latency) for lv in hw.links[:2]] == [(5e9, 2e-4)] * 2  # inside the node
    assert hw.links[2] == PRESETS["l20-pcie"].links[2]  # between nodes: kept
    fp32 = apply_calibration(PRESETS["h100-nvlink"], Calibration("cuda", "float32", 5e13, 4e13, 1, 0, 1, 0, 1), "fp32")
    assert fp32.flops_for("fp32") == 5e13 and fp32.peak_flops == PRESETS["h100-nvlink"].peak_flops
    with pytest.raises(ValueError, match="measured bfloat16 but the plan computes in fp32"):
        apply_calibration(PRESETS["l20-pcie"], cal, "fp32")


def test_nothing_fits_names_the_moment_and_what_fills_it(capsys):
    """Llama-3-70B on 8 GPUs holds no token: at the end of backward each GPU has AdamW's two fp32 moments
    (8 bytes per parameter), its fp32 shards (4) and their gradients (4, with the root's unsharded ones), all over
    8 GPUs. The reason must say so, not blame activations."""
    from seqmesh.model.presets import model_shape

    params = model_shape("llama3-70b").params
    assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--max-seq-len"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
    assert f"at the end of backward: optimizer {gib(8 * params / 8)}, grads " in out


def test_json_of_a_vision_language_plan_matches_the_schema():
    """A vision-language preset with images: the model entry is the decoder's, the tower's bytes and seconds
    are folded into each candidate; the JSON keeps the documented schema."""
    out = _run("--model", "qwen2.5-vl-7b", "--seq-len", "131072", "--gpus", "8", "--images", "64", "--json")
    assert out.returncode == 0, out.stderr
    schema = _schema()
    data = json.loads(out.stdout)
    conform(data, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    assert any(key.startswith("vision") for key in data["candidates"][0]["comm_bytes_per_step"]), data["candidates"][0]
