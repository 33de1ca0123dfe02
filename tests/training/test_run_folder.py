"""Nothing loses a run or hides a fault in its output folder (issue 17): one run per --out, metrics that
stay whole lines across resumes, data with nothing to train on refused, and --keep-checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from run_folder_cases import config_reads_in_a_run, data_unreadable_on_rank1
from safety_cases import train_error
from seqmesh.training import checkpoint as ckpt
from seqmesh.training.config import TrainConfig
from seqmesh.training.outlock import LOCK_NAME, OutputLock
from train_job_cases import entry_error

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", seq_len=64, ulysses=2, ring=1, dp=1, steps=3, lr=1e-2, warmup=1, log_every=1,
                eval_every=0, out=str(out), symbols=16, export=False)
    base.update(kw)
    return TrainConfig(**base)


def _same_on_every_rank(errors: list[str]) -> str:
    assert len(set(errors)) == 1, errors
    return errors[0]


def _snapshot(folder) -> dict[str, tuple[float, str]]:
    """``{relative path: (mtime, sha256)}`` of every file under ``folder`` but the lock file."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name != LOCK_NAME:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                found[os.path.relpath(path, folder)] = (os.path.getmtime(path), digest)
    return found


def _metric_lines(out) -> list[dict]:
    """Every line of metrics.jsonl parsed on its own (a torn or glued line fails here)."""
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.split("\n")[:-1]]


HOLDER = """
import sys, time
from seqmesh.training.outlock import OutputLock
lock = OutputLock(sys.argv[1])
assert lock.acquire() is None
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_names_its_holder_and_is_released(tmp_path):
    first, second = OutputLock(str(tmp_path)), OutputLock(str(tmp_path))
    assert first.acquire() is None
    refusal = second.acquire()  # another open file of the same process is refused too
    assert refusal and f"pid {os.getpid()} on host {socket.gethostname()} since " in refusal, refusal
    assert "choose another --out" in refusal and not second.held
    first.release()
    assert second.acquire() is None
    second.release()


def test_a_second_run_on_the_same_out_is_refused_until_the_holder_dies(pools, tmp_path):
    out = tmp_path / "run"
    assert pools.run(2, train_error, _cfg(out, steps=2, save_every=1)) == ["", ""]
    # a run refused after taking the lock (an old run is there, no flag) lets it go on every exit path
    assert "already holds a run" in _same_on_every_rank(pools.run(2, train_error, _cfg(out)))
    probe = OutputLock(str(out))
    assert probe.acquire() is None
    probe.release()

    before = _snapshot(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert holder.stdout.readline().strip() == b"held"
        # --overwrite would clear the holder's checkpoints and metrics: it does not get past the lock either
        for cfg in (_cfg(out, overwrite=True), _cfg(out, resume=True, steps=4)):
            error = _same_on_every_rank(pools.run(2, train_error, cfg))
            assert error.startswith(f"ValueError: {out} is already used by a seqmesh run: pid {holder.pid} on host "
                                    f"{socket.gethostname()} since "), error
            assert "choose another --out" in error
        assert _snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel dropped the dead holder's lock: nothing stale is left to clear by hand
    assert pools.run(2, train_error, _cfg(out, steps=2, overwrite=True)) == ["", ""]
    assert [r["step"] for r in _metric_lines(out) if r["kind"] == "train"] == [1, 2]


def test_a_torn_last_line_survives_two_resumes(pools, tmp_path):
    out = tmp_path / "run"
    assert pools.run(2, train_error, _cfg(out, steps=4, save_every=2)) == ["", ""]
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # a write cut by a power loss, no newline
    for steps in (6, 8):
        assert pools.run(2, train_error, _cfg(out, steps=steps, save_every=2, resume=True)) == ["", ""], steps
    records = _metric_lines(out)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))
    assert [r["step"] for r in records if r["kind"] == "config"] == [0, 4, 6]
    assert (out / "loss_curve.png").stat().st_size > 1000


def test_a_bad_metrics_line_is_refused_on_every_rank_before_any_model(pools, tmp_path):
    out = tmp_path / "run"
    assert pools.run(2, train_error, _cfg(out, steps=2, save_every=1)) == ["", ""]
    lines = (out / "metrics.jsonl").read_text().split("\n")
    (out / "metrics.jsonl").write_text("\n".join(lines[:2] + ["garbage"] + lines[2:]))
    errors = pools.run(2, entry_error, "train", _cfg(out, steps=3, resume=True))
    assert all("metrics.jsonl, line 3, is not a JSON record" in e for e in errors), errors


def test_data_with_no_target_tokens_is_refused_before_any_model(pools, tmp_path):
    singles = tmp_path / "letters.txt"
    singles.write_text("\n\n".join("abcdefghijklmnopqrstuvwxyz"))  # 26 documents of one byte token each
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text": a + b}) + "\n" for a, b in zip("abcdef", "ghijkl")))
    for entry in ("train", "verify"):
        errors = pools.run(2, entry_error, entry, _cfg(tmp_path / "a", data=[str(singles)]))
        want = f"{singles} has no target tokens at --seq-len 64"
        assert all(want in e and "single token" in e for e in errors), errors
        errors = pools.run(2, entry_error, entry, _cfg(tmp_path / "b", data=[str(pairs)], seq_len=1, ulysses=1, dp=2))
        assert all("no target tokens at --seq-len 1" in e and "Raise --seq-len" in e for e in errors), errors
    # two-token documents do leave a target: such a run trains (its loss is a real cross-entropy)
    assert pools.run(2, train_error, _cfg(tmp_path / "c", data=[str(pairs)], seq_len=8, steps=1)) == ["", ""]
    (loss,) = [r["loss"] for r in _metric_lines(tmp_path / "c") if r["kind"] == "train"]
    assert loss > 1.0, loss
    with pytest.raises(ValueError, match=r"copy_period must be in \[1, 62\]"):
        _cfg(tmp_path, copy_period=63)  # the copy task's first block and the token after it are never scored


def test_a_data_error_on_one_rank_is_raised_on_every_rank(pools, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on")
    errors = pools.run(2, data_unreadable_on_rank1, _cfg(tmp_path / "run", data=[str(corpus)]), timeout=120)
    assert errors == [f"[Errno 13] Permission denied: '{corpus}'"] * 2, errors


def test_the_job_reads_its_model_once(pools, tmp_path):
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 97}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    reads = pools.run(2, config_reads_in_a_run, _cfg(tmp_path / "run", model=str(path), steps=1), timeout=240)
    assert reads == [1, 1], reads


def _fake_checkpoint(folder, step: int, complete: bool = True) -> str:
    path = folder / f"step_{step:07d}"
    path.mkdir(parents=True)
    if complete:
        (path / "seqmesh.json").write_text(json.dumps({"step": step}))
    return str(path)


def test_pruning_keeps_the_newest_and_spares_what_a_run_relies_on(tmp_path):
    folder = tmp_path / "checkpoints"
    paths = {step: _fake_checkpoint(folder, step) for step in (1, 2, 3, 4, 5, 6)}
    _fake_checkpoint(folder, 7, complete=False)  # not a complete checkpoint: not counted, not touched
    (folder / "step_0000008.partial").mkdir()
    (folder / "step_0000002.damaged").mkdir()
    (folder / "latest").write_text("step_0000004")  # as if a save of 5 and 6 were still being named
    deleted = ckpt.prune_checkpoints(str(folder), 2, protect=paths[1])
    assert sorted(deleted) == [paths[2], paths[3]], deleted
    assert sorted(os.listdir(folder)) == ["latest", "step_0000001", "step_0000002.damaged", "step_0000004",
                                          "step_0000005", "step_0000006", "step_0000007", "step_0000008.partial"]
    with pytest.raises(ValueError, match="keep_checkpoints must be at least 1"):
        _cfg(tmp_path, keep_checkpoints=0)


def test_keep_checkpoints_in_a_run_and_its_resume(pools, tmp_path):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    assert pools.run(2, train_error, _cfg(out, steps=7, save_every=1, keep_checkpoints=2)) == ["", ""]
    assert [os.path.basename(p) for p in ckpt.steps_in(str(folder))] == ["step_0000007", "step_0000006"]
    # resumed from step 7 with one to keep: 7 stays (the run started there) beside the newest
    assert pools.run(2, train_error, _cfg(out, steps=10, save_every=1, keep_checkpoints=1, resume=True)) == ["", ""]
    kept = ckpt.steps_in(str(folder))
    assert [os.path.basename(p) for p in kept] == ["step_0000010", "step_0000007"], kept
    assert sorted(os.listdir(folder)) == ["latest", "step_0000007", "step_0000010"]
    assert all(ckpt.checkpoint_problem(p) is None for p in kept)
    assert ckpt.latest_checkpoint(str(folder)) == kept[0]
