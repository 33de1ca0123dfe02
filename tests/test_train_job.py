"""seqmesh train / verify: curves that resume exactly, checkpoints that survive interruption, errors
before any work."""

from __future__ import annotations

import json
import os

import pytest

from seqmesh.checkpoint import latest_checkpoint
from seqmesh.config import TrainConfig
from seqmesh.train import resolve_degrees
from train_job_cases import build_error, run_train, run_verify, run_verify_with_a_bug


def _losses(folder: str) -> dict[int, float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", seq_len=96, ulysses=2, ring=2, dp=1, steps=6, lr=1e-2, warmup=2, log_every=1,
                eval_every=3, out=str(out), symbols=16)
    base.update(kw)
    return TrainConfig(**base)


def test_resume_continues_the_same_loss_curve(pools, tmp_path):
    straight = _cfg(tmp_path / "straight", save_every=3)
    pools.run(4, run_train, straight)
    first = _cfg(tmp_path / "split", steps=3)
    pools.run(4, run_train, first)  # ends with a checkpoint at step 3
    # an interrupted save must not be picked up: leave a half-written later checkpoint behind
    os.makedirs(tmp_path / "split" / "checkpoints" / "step_0000004.partial")
    resumed = _cfg(tmp_path / "split", resume=True)
    summary = pools.run(4, run_train, resumed)[0]
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # the resumed run appended to the same curve
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    assert latest_checkpoint(str(tmp_path / "split" / "checkpoints")).endswith("step_0000006")
    assert summary["loss_curve"] and os.path.getsize(summary["loss_curve"]) > 1000


def test_verify_passes_and_fails_loudly(pools, tmp_path):
    cfg = _cfg(tmp_path, seq_len=77, ulysses=2, ring=1, dp=2)
    good = pools.run(4, run_verify, cfg, None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5 and good["worst"][0][1] < 1e-4, good
    bug = pools.run(4, run_verify_with_a_bug, cfg)[0]
    assert not bug["ok"] and bug["worst"][0][1] > 0.1, bug  # an off-by-one in the labels is caught


@pytest.mark.parametrize("change,message", [
    (dict(ulysses=4, ring=1, dp=1, model="qwen3-tiny", seq_len=3), "seq_len=3 is smaller than the sequence degree 4"),
    (dict(ulysses=3, ring="auto", dp=1), "ulysses=3 x ring=1 = 3 but the sequence group has 4 ranks"),
    (dict(data=["/nonexistent/corpus.jsonl"]), "data file '/nonexistent/corpus.jsonl' does not exist"),
    (dict(tokenizer="/nonexistent/tok"), "tokenizer directory '/nonexistent/tok' does not exist"),
    (dict(model="gpt-9"), "unknown model 'gpt-9': not a preset"),
])
def test_bad_configuration_fails_before_any_work(pools, tmp_path, change, message):
    errors = pools.run(4, build_error, _cfg(tmp_path, **change))
    assert all(message in e for e in errors), errors


def test_degrees_auto_and_errors():
    cfg = TrainConfig(ulysses="auto", ring="auto", dp="auto")
    assert resolve_degrees(cfg, 16, 32, 8) == (8, 2, 1)  # Ulysses fills a node, the ring crosses nodes
    assert resolve_degrees(cfg, 16, 4, 8) == (4, 4, 1)  # no more Ulysses ranks than query heads
    assert resolve_degrees(TrainConfig(ulysses=2, ring=2), 8, 4, 8) == (2, 2, 2)  # dp takes the rest
    with pytest.raises(ValueError, match="too few for ulysses=8; with 8 sequence ranks use one of: ulysses=1 ring=8, ulysses=2 ring=4, ulysses=4 ring=2"):
        resolve_degrees(TrainConfig(ulysses=8, ring=1), 8, 4, 8)
    with pytest.raises(ValueError, match="packed text data takes one sequence"):
        TrainConfig(data=["x.txt"], batch=2)
