"""No code from data (issue 17): a checkpoint folder someone else wrote runs nothing when loaded.

DCP pickles a checkpoint's index (``.metadata``); a folder whose pickle calls ``os.system`` ran it on
every rank of ``seqmesh train --resume``, in ``seqmesh export`` and in the Trainer's resume, whatever
``seqmesh.json`` said (its writer writes the checksums too, and without ``"files"`` none were checked).
Each poisoned folder here would load cleanly, after running its command, without the checked reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import re
import shutil
import warnings

import pytest
import torch

from checkpoint_safety_cases import cli_exit, trainer_checkpoint, trainer_resume_error
from safety_cases import train_error
from seqmesh.tools.cli import main
from seqmesh.training import checkpoint as ckpt
from seqmesh.training.config import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one-process saves and loads

FLAGS = dict(model="llama-tiny", seq_len=64, ulysses=2, ring=1, dp=1, lr=1e-2, warmup=1, log_every=1, eval_every=0,
             symbols=16, export=False)


class RunsCode:
    """Pickles as a call of ``os.system`` that creates ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _poison(step, marker, how: str) -> None:
    """Rewrite ``step/.metadata`` so unpickling it runs a command (the checkpoint still loads: the call's
    result lands in ``storage_meta.modules``), or cut it short; then fix or drop the checksums."""
    meta = step / ".metadata"
    if how == "truncated":
        meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    else:
        with open(meta, "rb") as f:
            metadata = pickle.load(f)  # our own honest checkpoint
        metadata.storage_meta.modules = [RunsCode(marker)]
        meta.write_bytes(pickle.dumps(metadata))
    saved = json.loads((step / "seqmesh.json").read_text())
    if how == "checksums updated":
        saved["files"][".metadata"] = [meta.stat().st_size, hashlib.sha256(meta.read_bytes()).hexdigest()]
    else:
        del saved["files"]
    (step / "seqmesh.json").write_text(json.dumps(saved))


@pytest.fixture(scope="module")
def honest_run(pools, tmp_path_factory):
    """A run of 2 steps on 2 ranks with a checkpoint after each; tests take copies."""
    out = tmp_path_factory.mktemp("honest") / "run"
    assert pools.run(2, train_error, TrainConfig(**FLAGS, out=str(out), steps=2, save_every=1)) == ["", ""]
    return out


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _argv(out, steps: int = 3) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items() if k != "export"]
    return ["train", *flags, "--no-export", f"--steps={steps}", "--save-every=1", f"--out={out}", "--resume"]


@pytest.mark.parametrize("how, says", [("checksums updated", "asks to load posix.system"),
                                       ("files dropped", "asks to load posix.system"),
                                       ("truncated", "cannot be read as DCP metadata")])
def test_resume_refuses_a_poisoned_checkpoint_on_every_rank(pools, honest_run, tmp_path, how, says):
    out = _copy(honest_run, tmp_path)
    marker = tmp_path / "ran"
    for step in ckpt.steps_in(str(out / "checkpoints")):
        _poison(pathlib.Path(step), marker, how)
    results = pools.run(2, cli_exit, _argv(out))
    assert not marker.exists()
    assert [r["code"] for r in results] == [2, 2], results
    lines = [line for line in results[0]["stderr"].splitlines() if line.startswith("seqmesh: error:")]
    assert len(lines) == 1 and "--resume found no intact checkpoint" in lines[0] and says in lines[0], results[0]
    assert "step_0000002/.metadata" in lines[0] and "step_0000001/.metadata" in lines[0], lines[0]
    assert "seqmesh: error:" not in results[1]["stderr"]  # one message for the job: rank 0 prints it
    assert "Traceback" not in results[0]["stderr"] + results[1]["stderr"]


def test_resume_passes_over_a_poisoned_newest_checkpoint_to_an_honest_one(pools, honest_run, tmp_path):
    out = _copy(honest_run, tmp_path)
    marker = tmp_path / "ran"
    _poison(out / "checkpoints" / "step_0000002", marker, "files dropped")
    results = pools.run(2, cli_exit, _argv(out))
    assert not marker.exists()
    assert [r["code"] for r in results] == [0, 0], results
    assert "step_0000002 is damaged" in results[0]["stderr"] and "asks to load posix.system" in results[0]["stderr"]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000001", "step_0000002", "step_0000002.damaged",
                                                       "step_0000003"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]  # resumed at 1, redid 2


@pytest.mark.parametrize("how, says", [("checksums updated", "asks to load posix.system"),
                                       ("files dropped", "asks to load posix.system"),
                                       ("truncated", "is cut short or damaged")])
def test_export_refuses_a_poisoned_checkpoint(honest_run, tmp_path, capsys, how, says):
    out = _copy(honest_run, tmp_path)
    marker = tmp_path / "ran"
    step = out / "checkpoints" / "step_0000002"
    _poison(step, marker, how)
    code = main(["export", str(step), str(tmp_path / "model")])
    assert not marker.exists()
    assert code == 2 and not (tmp_path / "model").exists()
    err = capsys.readouterr().err
    assert f"seqmesh: error: the checkpoint {step} is damaged: {step}/.metadata" in err and says in err, err
    assert "re-save it with seqmesh" in err


def test_export_reads_an_honest_checkpoint(honest_run, tmp_path):
    step = honest_run / "checkpoints" / "step_0000002"
    assert main(["export", str(step), str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "model.safetensors").stat().st_size > 0


def test_trainer_resume_refuses_poisoned_optimizer_metadata(pools, tmp_path):
    pytest.importorskip("accelerate")
    pools.run(2, trainer_checkpoint, str(tmp_path), timeout=600)
    assert pools.run(2, trainer_resume_error, str(tmp_path), timeout=600) == ["", ""]  # the honest one resumes
    optimizer = tmp_path / "checkpoint-2" / "optimizer_dcp"
    with open(optimizer / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    marker = tmp_path / "ran"
    metadata.storage_meta.modules = [RunsCode(marker)]
    (optimizer / ".metadata").write_bytes(pickle.dumps(metadata))
    errors = pools.run(2, trainer_resume_error, str(tmp_path), timeout=600)
    assert not marker.exists()
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith(f"UnsafeCheckpoint: {optimizer}/.metadata asks to load posix.system"), errors
    assert "don't load a checkpoint folder you did not write" in errors[0]


@pytest.mark.parametrize("named", ["../elsewhere", "step_0000001/../../elsewhere", "ABSOLUTE"])
def test_latest_naming_a_folder_outside_is_refused_and_resume_ignores_it(tmp_path, named):
    folder = tmp_path / "checkpoints"
    model = torch.nn.Linear(8, 4)
    ckpt.save_checkpoint(str(folder), 1, model, torch.optim.AdamW(model.parameters()))
    shutil.copytree(folder / "step_0000001", tmp_path / "elsewhere")  # intact, but not this run's to read
    named = str(tmp_path / "elsewhere") if named == "ABSOLUTE" else named
    (folder / "latest").write_text(named)
    # the error quotes the file's first 80 characters (it is not seqmesh's to trust): a long temporary folder is cut
    with pytest.raises(ValueError, match=re.escape(f"latest holds {named[:80]!r}, not the name of a checkpoint folder beside it")):
        ckpt.latest_checkpoint(str(folder))
    with pytest.warns(UserWarning, match="ignoring .*latest"):
        path, skipped = ckpt.newest_intact_checkpoint(str(folder))
    assert (path, skipped) == (str(folder / "step_0000001"), [])


def test_non_tensor_items_are_read_as_plain_data_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    from seqmesh.model.checkpoint_reader import UnsafeCheckpoint, load_checked

    marker = tmp_path / "ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"lr": 0.5, "betas": (0.9, 0.99), "x": RunsCode(marker)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    plain = {"lr": 0.0, "betas": (0.0, 0.0)}
    load_checked(plain, str(tmp_path / "c"), no_dist=True, fix="")
    assert plain == {"lr": 0.5, "betas": (0.9, 0.99)}
    with pytest.raises(UnsafeCheckpoint, match="the non-tensor item 'x' is not plain data .*GLOBAL posix.system"):
        load_checked({"x": None}, str(tmp_path / "c"), no_dist=True, fix="")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "sub/file.distcp"])
def test_storage_files_outside_the_folder_are_refused(tmp_path, name):
    from seqmesh.model.checkpoint_reader import UnsafeCheckpoint, read_checked_metadata

    model = torch.nn.Linear(8, 4)
    ckpt.save_checkpoint(str(tmp_path), 1, model, torch.optim.AdamW(model.parameters()))
    meta = tmp_path / "step_0000001" / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)
    next(iter(metadata.storage_data.values())).relative_path = name
    meta.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match=f"names the file '{name}' for .* not a file inside the checkpoint"):
        read_checked_metadata(str(tmp_path / "step_0000001"))
