"""The job never trains on, saves or splices something silently wrong, and never replaces a user's
files without a flag (issue 10: non-finite steps, resumes with another configuration, overwrites,
stalls, unreadable configs, one error message per job, and the ring's point-to-point issue order)."""

from __future__ import annotations

import datetime
import json
import os
import shutil

import pytest
import torch.distributed as dist

from safety_cases import overwrite_with_a_late_rank, p2p_issue_order, train_error
from trainer_cases import TORCHRUN_VARIABLES
from seqmesh.training import checkpoint as ckpt
from seqmesh.training.config import TrainConfig


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", seq_len=64, ulysses=2, ring=1, dp=1, steps=3, lr=1e-2, warmup=1, log_every=1,
                eval_every=0, out=str(out), symbols=16)
    base.update(kw)
    return TrainConfig(**base)


def _same_on_every_rank(errors: list[str]) -> str:
    assert len(set(errors)) == 1, errors
    return errors[0]


def _records(out, kind: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.mark.parametrize("field, value", [("lr", float("inf")), ("lr", float("nan")), ("grad_clip", float("nan")),
                                          ("weight_decay", float("inf")), ("min_lr_ratio", 1.5), ("timeout", 0.0),
                                          ("on_nonfinite", "ignore")])
def test_nonsense_numbers_are_refused_before_any_work(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_a_nonfinite_step_stops_the_run_naming_it_and_nothing_nonfinite_is_saved(pools, tmp_path):
    # lr 1e30 keeps step 1 finite (warm-up makes its lr 1e30 as well, but its gradients are finite) and
    # sends the weights to ~1e30, so step 2's logits overflow
    cfg = _cfg(tmp_path / "stop", lr=1e30, warmup=0, grad_clip=0.0, save_every=1, steps=4)
    error = _same_on_every_rank(pools.run(2, train_error, cfg))
    assert error.startswith("FloatingPointError: step 2:"), error
    assert "--on-nonfinite skip" in error
    saved = [os.path.basename(p) for p in ckpt.steps_in(str(tmp_path / "stop" / "checkpoints"))]
    assert saved == ["step_0000001"], saved  # nothing after the last finite step


def test_skipping_nonfinite_steps_is_recorded(pools, tmp_path):
    cfg = _cfg(tmp_path / "skip", lr=1e30, warmup=0, grad_clip=0.0, steps=3, on_nonfinite="skip")
    assert pools.run(2, train_error, cfg) == ["", ""]
    skipped = _records(tmp_path / "skip", "skipped")
    assert [r["step"] for r in skipped] == [2, 3], skipped


def test_resuming_with_another_configuration_needs_a_flag_and_is_recorded(pools, tmp_path):
    out = tmp_path / "run"
    assert pools.run(2, train_error, _cfg(out, steps=2, save_every=1)) == ["", ""]
    for change in ({"lr": 5e-3}, {"seq_len": 32}, {"seed": 1}):
        error = _same_on_every_rank(pools.run(2, train_error, _cfg(out, steps=4, resume=True, **change)))
        name = next(iter(change))
        assert error.startswith("ValueError: --resume would continue") and f"{name} " in error, error
        assert "--allow-config-change" in error
    # the mesh and the length of the run may change: seqmesh is exact under any mesh
    assert pools.run(2, train_error, _cfg(out, steps=3, resume=True, ulysses=1, ring=2)) == ["", ""]
    assert pools.run(2, train_error, _cfg(out, steps=4, resume=True, lr=5e-3, allow_config_change=True)) == ["", ""]
    (change,) = _records(out, "config_change")
    assert change["step"] == 3 and change["changes"] == {"lr": [1e-2, 5e-3]}, change
    # which checkpoint each resumed run started from is recorded (and printed: test_a_resumed_run_says_where_from)
    folder = os.path.join(out, "checkpoints")
    assert [r["resumed_from"] for r in _records(out, "config")] == [
        None, os.path.join(folder, "step_0000002"), os.path.join(folder, "step_0000003")]
    # another model's weights are named as such ("it is probably damaged", of a sound checkpoint, before)
    error = _same_on_every_rank(pools.run(2, train_error, _cfg(out, steps=5, resume=True, lr=5e-3, model="qwen3-tiny",
                                                               allow_config_change=True)))
    assert error.startswith(f"ValueError: the checkpoint {os.path.join(folder, 'step_0000004')} holds another model's "
                            "weights than this run builds (it was saved by a run of --model llama-tiny): "
                            "model.layers.0.self_attn.k_norm.weight is missing from it;"), error
    assert "resume with --model llama-tiny, or start a new run in another --out" in error and "damaged" not in error


def test_a_resumed_run_says_where_from():
    from seqmesh.training.resume import StartPoint

    assert StartPoint().describe() is None
    point = StartPoint("runs/x/checkpoints/step_0000040", {"step": 40}, {"lr": [0.01, 0.005]})
    assert point.describe() == ("resuming from runs/x/checkpoints/step_0000040 (step 40), with --allow-config-change: "
                                "lr 0.01 -> 0.005")


def test_existing_runs_are_never_overwritten_without_a_flag(pools, tmp_path):
    out = tmp_path / "run"
    assert pools.run(2, train_error, _cfg(out, steps=3, save_every=1)) == ["", ""]
    folder = out / "checkpoints"
    before = {p: os.path.getmtime(p) for p in ckpt.steps_in(str(folder))}
    metrics = (out / "metrics.jsonl").read_text()
    error = _same_on_every_rank(pools.run(2, train_error, _cfg(out, steps=3)))
    assert "already holds a run" in error and "--overwrite" in error and "--resume" in error, error
    assert {p: os.path.getmtime(p) for p in ckpt.steps_in(str(folder))} == before
    assert (out / "metrics.jsonl").read_text() == metrics

    # the issue's case: a damaged newest checkpoint, and the user resumes
    newest = folder / "step_0000003"
    shard = next(p for p in sorted(newest.iterdir()) if p.name.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(64)
    shard.write_bytes(data)
    assert pools.run(2, train_error, _cfg(out, steps=4, resume=True, save_every=1)) == ["", ""]
    names = sorted(os.listdir(folder))
    assert "step_0000003.damaged" in names and "step_0000001" in names and "step_0000004" in names, names
    assert [r["step"] for r in _records(out, "train")] == [1, 2, 3, 4]  # resumed at 2, redid 3, then 4

    assert pools.run(2, train_error, _cfg(out, steps=2, overwrite=True)) == ["", ""]
    assert [r["step"] for r in _records(out, "train")] == [1, 2]
    assert not (folder / "step_0000003.damaged").exists()


def test_stall_warning():
    import io

    from seqmesh.training.watch import StallWatch

    stream = io.StringIO()
    watch = StallWatch(after=60.0, timeout=300.0, stream=stream)
    watch.beat(1)
    watch.last = 1000.0
    watch.slowest = 2.0
    assert watch.check(now=1030.0) is None  # within max(60, 10 x 2) seconds
    message = watch.check(now=1061.0)
    assert message and "no step has finished for 61 s" in message and "--timeout" in message
    assert watch.check(now=1100.0) is None  # once per stall
    watch.beat(2)
    assert watch.limit() >= 60.0

    fast = StallWatch(after=0.05, timeout=1.0, stream=stream, poll=0.01)
    with fast:
        import time

        time.sleep(0.3)
    assert "warning: no step has finished" in stream.getvalue()


def test_compiling_the_first_step_is_not_a_stall():
    """--compile: rank 0 warned "a rank may be stuck" while the first step compiled, and that step, 10 times over,
    set the limit for every later one."""
    import io

    from seqmesh.training.watch import StallWatch

    watch = StallWatch(after=60.0, timeout=300.0, stream=io.StringIO(), compiling=True)
    watch.last = 1000.0
    assert watch.check(now=1250.0) is None  # 250 s compiling: no warning
    watch.beat(1)  # the compiled first step ends
    assert watch.slowest == 0.0 and watch.limit() == 60.0  # its time counts for no step
    watch.last = 2000.0
    assert "no step has finished for 61 s" in watch.check(now=2061.0)  # later steps are watched as ever


def test_timeout_reaches_the_process_group(monkeypatch):
    from seqmesh.tools import cli

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: seen.update(timeout=timeout))
    for name in TORCHRUN_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded as absent before, so what _init_distributed writes is undone after
        monkeypatch.delenv(name)
    cli._init_distributed(42.0)
    assert seen["timeout"] == datetime.timedelta(seconds=42)


def test_a_config_json_that_is_not_json_is_named(tmp_path):
    from seqmesh.model.presets import model_shape

    bad = tmp_path / "config.json"
    bad.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')
    with pytest.raises(ValueError, match=r"config.json, line 3, column 21, is not valid JSON"):
        model_shape(str(bad))


@pytest.mark.parametrize("rank, printed", [("0", True), ("3", False)])
def test_one_readable_error_per_job(monkeypatch, capsys, rank, printed):
    from seqmesh.tools.cli import USER_ERROR_EXIT, main

    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--lr", "nan"]) == USER_ERROR_EXIT
    err = capsys.readouterr().err
    assert ("seqmesh: error: lr must be a finite number" in err) is printed, err
    assert "Traceback" not in err


def unmatched_p2p(issued: list[list]) -> str | None:
    """Under NCCL a rank's sends to a peer pair with that peer's receives from it in issue order (tags are
    ignored). The first pair whose sequences differ in count, shape or dtype, or None."""
    for a, log in enumerate(issued):
        for b in range(len(issued)):
            sends = [op[2:] for op in log if op[0] == "send" and op[1] == b]
            recvs = [op[2:] for op in issued[b] if op[0] == "recv" and op[1] == a]
            if sends != recvs:
                return f"rank {a} -> {b}: sends {sends} but receives {recvs}"
    return None


def test_the_ring_issues_its_sends_in_the_order_every_peer_receives_them(pools):
    seen = 0
    # the whole ring and a contiguous window relay (the window's last partial jumps two ranks home);
    # a zigzag window shorter than a chunk sends direct
    for ulysses, ring, causal, docs, layout, window in (
        (1, 4, True, None, "zigzag", None), (2, 2, True, (0, 10, 40, 50), "zigzag", None), (1, 4, False, None, "zigzag", None),
        (1, 2, True, (0, 7, 50), "zigzag", None), (1, 4, True, None, "contiguous", 20), (1, 4, True, None, "zigzag", 5),
    ):
        issued = pools.run(4, p2p_issue_order, ulysses, ring, 50, causal, docs, layout, window)
        assert unmatched_p2p(issued) is None, (ulysses, ring, causal, docs, layout, window)
        seen += sum(len(log) for log in issued)
        # the check fails if a rank skips a send (its entries, kind, peer, shape and dtype, cannot show a swap
        # of two same-shaped messages to one peer: every K/V and dK/dV message here has the same shape)
        skipped = [list(log) for log in issued]
        del skipped[1][next(i for i, op in enumerate(skipped[1]) if op[0] == "send")]
        assert unmatched_p2p(skipped) is not None
    assert seen > 0


def test_attention_casts_like_sdpa_under_autocast_and_runs_without_it(pools):
    from safety_cases import attention_under_autocast

    for ulysses, ring in ((2, 1), (1, 2)):
        for r in pools.run(2, attention_under_autocast, ulysses, ring):
            assert r["seen"] == [("backward", False, "torch.bfloat16"), ("forward", False, "torch.bfloat16")], r
            assert r["out_dtype"] == "torch.bfloat16" and r["grad_dtype"] == "torch.float32", (ulysses, ring, r)
            assert r["identical"], (ulysses, ring, r)


def test_resume_with_overwrite_and_no_checkpoint_starts_clean(tmp_path):
    """--resume --overwrite where no checkpoint exists: a fresh start, not records appended to the old run's."""
    from seqmesh.training.resume import choose_start

    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 7, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="--overwrite"):
        choose_start(_cfg(out, resume=True))
    assert choose_start(_cfg(out, resume=True, overwrite=True)).step == 0
    assert not (out / "metrics.jsonl").exists() and not (out / "model").exists()


def test_overwrite_clears_the_old_run_on_every_rank_even_when_one_looks_late(pools, tmp_path):
    """Rank 0 clears an old run under --overwrite; a rank that looked for it afterwards used to find
    nothing, skip the clearing's barrier and leave the ranks' collectives unpaired (the demo hung)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_0000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    results = pools.run(2, overwrite_with_a_late_rank, _cfg(out, steps=2, overwrite=True), timeout=60)
    assert results == [{"step": 0, "ranks": [0, 1]}] * 2
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints" / "step_0000002").exists()
