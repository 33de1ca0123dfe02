"""``seqmesh train --compile``: every decoder layer compiled without a graph break, and the loss curve that of the eager run
within the spread rounding alone gives two eager runs (another layout: the same sums in another order)."""

from __future__ import annotations

import json
import os

from seqmesh.training.config import TrainConfig
from train_job_cases import compiled_layers, run_train, run_train_counting_breaks

ROUNDING_MULTIPLE = 4
FLOOR = 1e-6  # float32's rounding of a loss near 1 (2**-24 ~ 6e-8), times a few steps, should two layouts agree exactly


def _losses(folder) -> list[float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", seq_len=64, ulysses=1, ring=2, dp=1, steps=4, lr=1e-2, warmup=1, log_every=1,
                eval_every=0, export=False, out=str(out), symbols=16)
    return TrainConfig(**{**base, **kw})


def test_compile_flag_compiles_each_layer_and_follows_the_eager_curve(pools, tmp_path):
    assert all(pools.run(2, compiled_layers, _cfg(tmp_path / "probe", compile=True))[0])
    assert not any(pools.run(2, compiled_layers, _cfg(tmp_path / "probe_eager"))[0])
    runs = {name: _cfg(tmp_path / name, **kw) for name, kw in
            (("eager", {}), ("eager_contiguous", {"layout": "contiguous"}), ("compiled", {"compile": True}))}
    for name, cfg in runs.items():
        if name == "compiled":  # each decoder layer one graph: no break inside (per-layer compile, FSDP2 around)
            for r in pools.run(2, run_train_counting_breaks, cfg):
                assert r["graph_breaks"] == 0 and r["graphs"] >= 1, r
        else:
            pools.run(2, run_train, cfg)
    eager, other, compiled = (_losses(runs[n].out) for n in ("eager", "eager_contiguous", "compiled"))
    assert len(eager) == len(compiled) == 4
    spread = max(max(abs(a - b) for a, b in zip(eager, other)), FLOOR)
    apart = max(abs(a - b) for a, b in zip(eager, compiled))
    print(f"train --compile: loss curve apart from eager {apart:.2e}, two eager layouts {spread:.2e}")
    assert apart <= ROUNDING_MULTIPLE * spread, (eager, other, compiled)
