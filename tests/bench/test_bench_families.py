"""``seqmesh bench families`` at toy size: every family's step runs the model its config describes, beside its
reference, in one run; bad sizes are refused before any process."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from seqmesh.bench.families import FAMILIES, REFERENCE, FamiliesBench, bench_families, family_config
from seqmesh.tools.cli import main

TOY = dict(width=128, seq_len=128, layers=2, vocab=256, dsa_topk=16, warmup=0, repeats=1)


def test_every_family_is_timed_beside_its_reference_on_the_model_its_config_builds():
    bench = FamiliesBench(**TOY)
    rows = bench_families(bench)
    assert [r["family"] for r in rows] == list(FAMILIES)  # each reference runs before what it is compared with
    by = {r["family"]: r for r in rows}
    for name, r in by.items():
        # the bench trained the model transformers builds from the family's config (seqmesh adds no parameter)
        expected = sum(p.numel() for p in AutoModelForCausalLM.from_config(family_config(name, bench)).parameters())
        assert r["parameters"] == expected, (name, r["parameters"], expected)
        assert r["step_seconds"] > 0 and r["peak_bytes"] > 0, r
        assert r["tokens_per_second"] == pytest.approx(TOY["seq_len"] / r["step_seconds"]), r
        if REFERENCE[name] is None:
            assert "over_reference" not in r
        else:
            assert r["over_reference"] == pytest.approx(r["step_seconds"] / by[REFERENCE[name]]["step_seconds"]), r
    assert family_config("dsa", bench).index_topk == TOY["dsa_topk"]
    assert family_config("nemotron_h", bench).layer_types.count("linear_attention") == 3


def test_one_family_brings_its_reference_and_the_cli_prints_json(capsys):
    """``--keep-attention`` measures each family again keeping its attention outputs, against itself."""
    argv = ["bench", "families", "--family", "dsa", "--json", "--keep-attention"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in TOY.items()]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["family"], r["reference"]) for r in out["rows"]] == [
        ("llama", None), ("llama+keep", "llama"), ("mla", "llama"), ("mla+keep", "mla"), ("dsa", "mla"),
        ("dsa+keep", "dsa")]
    by = {r["family"]: r for r in out["rows"]}
    for name in ("llama", "mla", "dsa"):
        kept = by[f"{name}+keep"]
        assert kept["parameters"] == by[name]["parameters"]
        assert kept["over_reference"] == pytest.approx(kept["step_seconds"] / by[name]["step_seconds"])


def test_a_family_past_its_time_is_reported_and_the_next_runs_in_a_fresh_process(tmp_path, capsys):
    out = tmp_path / "rows.json"
    out.write_text("a user's file")
    argv = ["bench", "families", "--family", "mla", "--family-timeout", "0.001", "--out", str(out)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in TOY.items()]
    with pytest.raises(SystemExit, match="exists; pass --overwrite"):
        main(argv)
    assert out.read_text() == "a user's file"
    assert main(argv + ["--overwrite"]) == 1  # a family without figures fails the command
    rows = json.loads(out.read_text())["rows"]
    # llama's pool was closed at its limit: mla ran in a fresh one (a closed pool would say so) and hit its own
    assert [(r["family"], r["error"]) for r in rows] == [("llama", "did not finish in 0.001 s"),
                                                         ("mla", "did not finish in 0.001 s")]
    assert all("step_seconds" not in r for r in rows)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2:] == ["llama             did not finish in 0.001 s", "mla               did not finish in 0.001 s"]


def test_profile_writes_each_familys_tables_and_counts_its_operators(tmp_path, capsys):
    folder = tmp_path / "profiles"
    argv = ["bench", "families", "--family", "transformers", "--profile", str(folder), "--json"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in TOY.items()]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["family"] for r in rows] == ["llama", "transformers"]
    for r in rows:
        p = r["profiled"]
        assert p["operators"] > 100 and p["launches"] == 0 and p["device_seconds"] is None and p["seconds"] > 0, r
        text = (folder / f"{r['family']}.txt").read_text()
        assert "aten::mm" in text and "# of Calls" in text
    # seqmesh's step and plain transformers' are different programs: their tables differ
    assert (folder / "llama.txt").read_text() != (folder / "transformers.txt").read_text()
    with pytest.raises(SystemExit, match="already holds llama.txt, transformers.txt; pass --overwrite"):
        main(argv)


@pytest.mark.parametrize("changes, words", [
    ({"width": 100}, "width=100 must be a positive multiple of 128"),
    ({"families": ("gpt9",)}, "unknown families ['gpt9']"),
    ({"repeats": 0}, "repeats must be at least 1"),
    ({"family_timeout": 0}, "family_timeout must be positive"),
])
def test_bad_sizes_are_refused_by_name(changes, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        FamiliesBench(**{**TOY, **changes})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_device_is_refused():
    with pytest.raises(SystemExit, match="no CUDA device here; use --device cpu"):
        main(["bench", "families", "--device", "cuda"])
