"""Mamba2 hybrids (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1) and the pure Mamba2 model through seqmesh.hf: the halo conv and the
state pass across ranks give the logits, the loss and every parameter's gradient of the unmodified model on one
process (each packed document alone), within the reference's own rounding (test_hf_families's bound)."""

from __future__ import annotations

import dataclasses

import pytest

from family_cases import family_parity
from test_hf_families import ROUNDING_MULTIPLE, _outside_rounding

FAMILIES = ["nemotron-h", "granite-4-hybrid", "bamba", "falcon-h1", "mamba2"]  # mamba2: no attention at all
MESHES = [(2, 1), (1, 2), (2, 2)]


def _run(cases: list[tuple], **kwargs) -> list[dict]:
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_mamba2_families_exact(pools, ulysses, ring):
    """Zigzag without documents and per-document packing with documents shorter than the conv's halo (1 and 9 tokens
    at the row's start) and documents crossing rank boundaries."""
    cases = [(f, ulysses, ring, layout, docs) for f in FAMILIES for layout, docs in (("zigzag", False), ("zigzag", True))]
    worst = {}
    for results in pools.run(ulysses * ring, _run, cases, timeout=900):
        for r in results:
            assert not _outside_rounding(r), r
            ratios = tuple(r[k] / r["rounding"][k] for k in ("logits", "loss", "grad"))
            worst[r["case"][0]] = tuple(max(a, b) for a, b in zip(worst.get(r["case"][0], (0.0,) * 3), ratios))
    print(f"u{ulysses}xr{ring} worst error / reference rounding (logits, loss, grad): {worst}  (bound {ROUNDING_MULTIPLE})")


def _mutant(what: str):
    """A change to the parallelized model only: ``state``: each rank's runs start from zero (no state passed);
    ``halo``: every conv halo one token short (the placement built for a conv of width K - 1)."""
    from unittest import mock

    import seqmesh.hf.mamba2 as mamba2
    from seqmesh.linear_attention.decay_scan import chunk_decay_scan
    from seqmesh.linear_attention.halo import halo_causal_conv, placement

    def alter(model):
        if what == "state":
            mock.patch.object(mamba2, "pass_decay_states", lambda q, k, v, g, place: chunk_decay_scan(
                q, k, v, g, place.mine.segment_bounds)[0]).start()
        else:
            short = lambda mesh, n, kernel, **kw: placement(mesh, n, kernel=kernel - 1, **kw)  # noqa: E731
            mock.patch.object(mamba2, "placement", short).start()
            mock.patch.object(mamba2, "halo_causal_conv", lambda x, w, b, place, act: halo_causal_conv(
                x, w, b, dataclasses.replace(place, kernel=w.shape[-1]), act)).start()

    return alter


def _run_mutants(cases: list[tuple]) -> list[dict]:
    from unittest import mock

    out = []
    for what, case in cases:
        try:
            out.append({"case": (what, *case), **family_parity(*case, alter=_mutant(what))})
        finally:
            mock.patch.stopall()
    return out


def test_mutants_are_seen(pools):
    """The bound sees a state not passed between ranks and a conv halo one token short (Nemotron-H, ring 2, zigzag:
    every rank's runs continue another rank's)."""
    cases = [(what, ("nemotron-h", 1, 2, "zigzag", False)) for what in ("state", "halo")]
    for r in pools.run(2, _run_mutants, cases, timeout=900)[0]:
        ratios = {k: r[k] / r["rounding"][k] for k in ("logits", "grad")}
        assert max(ratios.values()) > 100 * ROUNDING_MULTIPLE, r  # not a near miss
        print(f"{r['case'][0]} mutant: error / reference rounding {ratios} (logits {r['logits']:.1e}, "
              f"relative grad {r['grad']:.1e})")


def test_a_nemotron_h_config_json_verifies_and_trains_on_four_ranks(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` on a tiny Nemotron-H config.json (Mamba2, MoE, attention and MLP
    layers) over 2 x 2 Ulysses x ring with FSDP2, packed documents: the loss of the single-process model, then
    training."""
    import json
    import math

    from family_cases import family_config
    from seqmesh.training.config import TrainConfig
    from train_job_cases import run_train, run_verify

    path = tmp_path / "nemotron_h" / "config.json"
    path.parent.mkdir()
    path.write_text(family_config("nemotron-h").to_json_string())
    base = dict(model=str(path), seq_len=77, ulysses=2, ring=2, dp=1, lr=1e-2, warmup=1, log_every=1, eval_every=0,
                symbols=16)
    good = pools.run(4, run_verify, TrainConfig(**base, steps=1, out=str(tmp_path / "verify")), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    pools.run(4, run_train, TrainConfig(**base, steps=6, out=str(tmp_path / "train")))
    with open(tmp_path / "train" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
