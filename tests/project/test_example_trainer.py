"""examples/trainer.py runs at tiny size on 4 gloo ranks, checkpointed and keeping the attention outputs, and writes a
folder transformers loads."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("accelerate")

from trainer_cases import run_example  # noqa: E402


def test_trainer_example_runs(pools, tmp_path):
    from transformers import AutoModelForCausalLM

    logs = pools.run(4, run_example, str(tmp_path), "--ulysses", "2", "--ring", "2", "--steps", "2", "--seq-len", "32",
                     "--checkpointing", "--keep-attention", timeout=300)
    losses = [[h["loss"] for h in log if "loss" in h] for log in logs]
    assert len(losses[0]) == 2 and all(math.isfinite(x) for x in losses[0]), logs[0]
    assert all(rank == losses[0] for rank in losses[1:])  # every rank logs the same losses
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).config.num_hidden_layers == 2
