"""Nothing lost, nothing silently wrong: damaged checkpoints, torn metrics, bad data files."""

from __future__ import annotations

import os

import pytest
import torch

import seqmesh.training.checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves and loads


def _save_two(folder: str) -> torch.nn.Module:
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(folder, 1, model, optimizer)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ckpt.save_checkpoint(folder, 2, model, optimizer)
    return model


def _flip(path: str, offset: int = 64, count: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(count))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _data_file(step_folder: str) -> str:
    return next(os.path.join(step_folder, n) for n in sorted(os.listdir(step_folder)) if n.endswith(".distcp"))


def test_flipped_bytes_are_refused_and_the_older_step_is_offered(tmp_path):
    folder = str(tmp_path / "checkpoints")
    _save_two(folder)
    newest = os.path.join(folder, "step_0000002")
    assert ckpt.checkpoint_problem(newest) is None
    _flip(_data_file(newest))
    problem = ckpt.checkpoint_problem(newest)
    assert problem is not None and "does not match the SHA-256" in problem and ".distcp" in problem
    fresh = torch.nn.Linear(64, 32)
    with pytest.raises(ValueError, match="step_0000002 is damaged"):
        ckpt.load_checkpoint(newest, fresh, torch.optim.AdamW(fresh.parameters()))
    assert not torch.equal(fresh.weight, torch.full((32, 64), 3.0))  # nothing was loaded
    path, skipped = ckpt.newest_intact_checkpoint(folder)
    assert path == os.path.join(folder, "step_0000001")
    assert [s for s, _ in skipped] == [newest]


@pytest.mark.parametrize("damage", ["truncated metadata", "missing shard", "unreadable seqmesh.json"])
def test_other_damage_is_named(tmp_path, damage):
    folder = str(tmp_path / "checkpoints")
    _save_two(folder)
    newest = os.path.join(folder, "step_0000002")
    if damage == "truncated metadata":
        meta = os.path.join(newest, ".metadata")
        os.truncate(meta, os.path.getsize(meta) // 2)
        want = ".metadata has"
    elif damage == "missing shard":
        os.remove(_data_file(newest))
        want = "is missing"
    else:
        with open(os.path.join(newest, "seqmesh.json"), "w") as f:
            f.write('{"step": 2, "fi')
        want = "cannot be read"
    assert want in (ckpt.checkpoint_problem(newest) or "")
    assert ckpt.newest_intact_checkpoint(folder)[0] == os.path.join(folder, "step_0000001")


def _verdicts_agree(folder: str) -> str | None:
    return ckpt.checkpoint_problem(folder)


def test_every_rank_gets_the_same_verdict(pools, tmp_path):
    """Files are checked round-robin over the ranks; a file only rank 1 hashes still fails rank 0."""
    folder = str(tmp_path / "checkpoints")
    _save_two(folder)
    newest = os.path.join(folder, "step_0000002")
    names = sorted(n for n in os.listdir(newest) if n != "seqmesh.json")
    _flip(os.path.join(newest, names[1]), offset=8, count=8)  # dealt to rank 1 of 2
    verdicts = pools.run(2, _verdicts_agree, newest)
    assert verdicts[0] == verdicts[1] and names[1] in verdicts[0]


def test_metrics_log_survives_a_torn_last_line(tmp_path):
    from seqmesh.training.metrics import MetricsLog

    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    for step in (1, 2, 3):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "step": 4, "lo')  # the write a power cut interrupted
    with pytest.warns(UserWarning, match="line 4 is cut short"):
        assert [r["step"] for r in log.read()] == [1, 2, 3]
    with pytest.warns(UserWarning):
        assert log.keep_until(2) == 1  # the resume path rewrites the file without the torn line
    assert [r["step"] for r in log.read()] == [1, 2]
    with open(log.path, "a") as f:
        f.write("not json\n")
        f.write('{"kind": "train", "step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3, is not a JSON record"):
        log.read()


@pytest.mark.parametrize("content,message", [
    ('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n', r"data.jsonl:2 is not valid JSON"),
    ('{"text": "a"}\n\n{"text": 12345}\n', r"data.jsonl:3: the 'text' field is 12345 \(int\), not a string"),
    ('{"text": null}\n', r"data.jsonl:1: the 'text' field is None"),
    ('["text"]\n', r"data.jsonl:1 is a JSON list"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"data.jsonl:2 is not UTF-8 \(byte 28"),
])
def test_bad_data_files_are_named_by_line(tmp_path, content, message):
    from seqmesh.training.datasets import PackedText

    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        PackedText([str(path)], 64)


def test_non_utf8_text_file_is_named(tmp_path):
    from seqmesh.training.datasets import PackedText

    path = tmp_path / "notes.txt"
    path.write_bytes(b"first document\n\nsecond\nwith \xff in it\n")
    with pytest.raises(ValueError, match=r"notes.txt:4 is not UTF-8"):
        PackedText([str(path)], 64)


def test_unwritable_output_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: a file where the folder should be instead
            locked.chmod(0o700)
            target = tmp_path / "a-file"
            target.write_text("x")
            out = str(target / "run")
        else:
            out = str(locked / "run")
        with pytest.raises(ValueError, match="cannot be written"):
            ckpt.check_output_dir(out)
    finally:
        locked.chmod(0o700)
    ckpt.check_output_dir(str(tmp_path / "fine"))


def test_a_failed_save_names_the_disk_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    folder = str(tmp_path / "checkpoints")
    model = _save_two(folder)

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file: unexpected pos")

    monkeypatch.setattr(ckpt.dcp, "save", full_disk)
    with pytest.raises(RuntimeError, match=r"GiB free; a full disk is the usual cause.*step_0000002\) is untouched"):
        ckpt.save_checkpoint(folder, 3, model, torch.optim.AdamW(model.parameters()))
    assert ckpt.latest_checkpoint(folder).endswith("step_0000002")


def test_a_checkpoint_of_the_per_tensor_adamw_resumes_on_the_fused_one(tmp_path):
    """Runs from before seqmesh train's AdamW took torch's fused kernel saved the default AdamW (on the CPU its
    per-tensor path, step counts on the host) with ``fused`` unset in its groups. Such a checkpoint resumes on
    ``make_optimizer``'s AdamW, which stays fused (torch's loading alone puts the saved groups back whole: the
    per-tensor path from then on), keeps this run's weight decay, and steps as the per-tensor path would: with the
    step count lost, a first step's bias corrections would move the weights by about lr (1e-2)."""
    from seqmesh.training.step import make_optimizer

    torch.manual_seed(0)
    x = torch.randn(16, 64, dtype=torch.float64)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    saved = torch.nn.Linear(64, 32).double()
    per_tensor = torch.optim.AdamW(saved.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        step(saved, per_tensor)
    assert per_tensor.param_groups[0]["fused"] is None
    folder = str(tmp_path / "checkpoints")
    ckpt.save_checkpoint(folder, 3, saved, per_tensor)
    newest = os.path.join(folder, "step_0000003")
    resumed = torch.nn.Linear(64, 32).double()
    fused = make_optimizer(resumed, lr=1e-2, weight_decay=0.1)
    ckpt.load_checkpoint(newest, resumed, fused)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), saved.parameters()))
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is None
    assert fused.state[resumed.weight]["step"].dtype == torch.float32
    before = saved.weight.detach().clone()
    step(saved, per_tensor)
    step(resumed, fused)
    assert float(fused.state[resumed.weight]["step"]) == 4.0
    with torch.no_grad():
        moved = float((saved.weight - before).abs().max())
        bound = 16 * torch.finfo(torch.float64).eps * float(saved.weight.abs().max())  # a few ulps of the weights
        assert moved > 1e-3 > 1e6 * bound
        assert float((resumed.weight - saved.weight).abs().max()) <= bound
        assert float((resumed.bias - saved.bias).abs().max()) <= bound
    # --allow-config-change --weight-decay: the run's decay, not the checkpoint's
    other = torch.nn.Linear(64, 32).double()
    changed = make_optimizer(other, lr=1e-2, weight_decay=0.05)
    ckpt.load_checkpoint(newest, other, changed)
    assert changed.param_groups[0]["weight_decay"] == 0.05 and changed.param_groups[0]["fused"] is True
