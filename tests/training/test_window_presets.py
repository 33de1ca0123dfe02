"""The new families' presets through the main job: ``seqmesh verify`` on Gemma 3 (a preset and a
config.json built from transformers' config class) and gpt-oss, and gpt-oss-tiny training on the
built-in copy task with FSDP2 over a 2 x 2 ring x Ulysses mesh."""

from __future__ import annotations

import json
import math

from seqmesh.training.config import TrainConfig
from seqmesh.model.presets import MODELS, model_shape
from train_job_cases import run_train, run_verify


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="gemma3-tiny", seq_len=77, ulysses=2, ring=2, dp=1, steps=4, lr=1e-2, warmup=1, log_every=1,
                eval_every=0, out=str(out), symbols=16)
    base.update(kw)
    return TrainConfig(**base)


def test_presets_have_windows_and_published_shapes():
    assert MODELS["gemma3-4b"].layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert MODELS["gpt-oss-20b"].layer_types[:2] == ("sliding_attention", "full_attention")
    assert MODELS["mistral-7b-window"].sliding_layers == 32
    assert round(MODELS["gpt-oss-20b"].params / 1e9, 1) == 20.9  # 21B total parameters as published
    assert round(MODELS["gemma3-27b"].params / 1e9) == 27


def test_verify_gemma3_preset_and_config_json(pools, tmp_path):
    from family_cases import family_config

    good = pools.run(4, run_verify, _cfg(tmp_path / "preset"), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    config = family_config("gemma3")
    path = tmp_path / "gemma3" / "config.json"
    path.parent.mkdir()
    path.write_text(config.to_json_string())
    shape = model_shape(str(path))
    assert shape.sliding_window == 5 and shape.full_every == 2
    good = pools.run(4, run_verify, _cfg(tmp_path / "json", model=str(path), ulysses=1, ring=4), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good


def test_gpt_oss_verifies_and_trains_on_the_copy_task(pools, tmp_path):
    good = pools.run(4, run_verify, _cfg(tmp_path / "verify", model="gpt-oss-tiny"), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    summary = pools.run(4, run_train, _cfg(tmp_path / "train", model="gpt-oss-tiny", steps=6, seq_len=64))[0]
    with open(tmp_path / "train" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert summary is not None


def test_planner_window_work_equals_the_ring_schedule():
    """The planner's visible pairs under a window (closed form) equal the pairs the ring schedule
    computes over all ranks, for both layouts; the planner's per-step ring bytes count sliding
    layers with the steps their window leaves."""
    import pytest

    from seqmesh.sequence.layout import SequenceLayout
    from seqmesh.planner.plan import communication
    from seqmesh.planner.hardware import PRESETS
    from seqmesh.planner.attention_layer import attention_pairs
    from seqmesh.planner.traffic import attention_traffic, worst_rank
    from seqmesh.rules.degrees import Degrees
    from seqmesh.planner.workload import Workload
    from seqmesh.sharded_attention.blocks import document_bounds
    from seqmesh.sharded_attention.schedule import RingSchedule

    for kind in ("zigzag", "contiguous"):
        for ring, s, w in [(4, 64, 5), (4, 64, 20), (8, 256, 3), (2, 48, 100), (4, 64, 1)]:
            schedule = RingSchedule(SequenceLayout(kind, ring, 1, s), document_bounds(s, s, None), True, w)
            assert sum(schedule.work(r) for r in range(ring)) == attention_pairs(s, True, w)
    model = MODELS["gemma3-4b"]
    work = Workload(model, 131072)
    layout = Degrees(1, 8, 1)
    _, _, step = communication(work, layout, PRESETS["h100-nvlink"])
    def ring_bytes(window):
        t = attention_traffic(model.heads, model.kv_heads, model.head_dim, seq_len=131072, batch=1, ulysses=1, ring=8,
                              dtype="bfloat16", window=window)
        return 2 * worst_rank(t, "p2p", "forward") + worst_rank(t, "p2p", "backward")  # + checkpoint recompute
    want = (model.layers - model.sliding_layers) * ring_bytes(None) + model.sliding_layers * ring_bytes(1024)
    # window 1024 over zigzag chunks of 8K: steps (0, 1, 7), direct: 2 K/V blocks out (counted twice for
    # the recompute), 2 back and 2 float32 partials = 4 + 2 + 4 bf16 blocks; the whole ring relays 7, 7
    # and 8 partials = 14 + 7 + 16
    assert step["ring_p2p"] == want and ring_bytes(1024) * 37 == ring_bytes(None) * 10
    from seqmesh.planner.attention_layer import ring_hop_count

    # 5 full layers make 7 hops each, 29 sliding layers 2 (steps 0, 1 and 7 of zigzag over 8)
    assert ring_hop_count(work, layout) == pytest.approx((5 * 7 + 29 * 2) / 34)


def test_bench_window_rows():
    """``seqmesh bench window``'s figures without timing: steps, work saved and balance per layout."""
    from seqmesh.bench.window import WindowBench, window_rows

    rows = window_rows(WindowBench(seq_len=1024, ring=4, windows=(None, 64), repeats=0))
    by = {(r["layout"], r["window"]): r for r in rows}
    assert by[("zigzag", None)]["balance"] == 1.0 and abs(by[("contiguous", None)]["balance"] - 1.75) < 0.01  # (2R-1)/R
    assert by[("zigzag", 64)]["steps"] == 3 and by[("contiguous", 64)]["steps"] == 2  # neighbours only
    # float32 blocks: window 2 K/V out, 2 back, 2 partials (direct); whole ring 3, 3 and 4 (relay)
    assert by[("zigzag", 64)]["bytes_per_rank"] * 5 == by[("zigzag", None)]["bytes_per_rank"] * 3
    assert by[("zigzag", 64)]["work_saved"] > 0.8
