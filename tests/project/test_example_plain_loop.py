"""examples/plain_loop.py: a user's own loop on 4 spawned ranks gives one process's loss at step 1 and trains."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location("plain_loop", os.path.join(ROOT, "examples", "plain_loop.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(steps: int, seq_len: int) -> list[float]:
    return _example().run(steps, seq_len)


def test_plain_loop_example_matches_one_process_and_trains(pools):
    results = pools.run(4, run_example, 6, 256)
    reference, *losses = results[0]
    assert all(r == results[0] for r in results)  # the pooled loss is the same on every rank
    assert abs(losses[0] - reference) < 1e-5, (reference, losses[0])  # fp32 rounding of the pooled mean
    assert losses[-1] < losses[0] - 0.5, losses
