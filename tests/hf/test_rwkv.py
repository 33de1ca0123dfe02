"""RWKV-4 (tiny, float64) through seqmesh.hf.rwkv: logits, loss and every parameter's gradient equal the unmodified
transformers model on one process (packed documents one call each), within a multiple of the reference's own
rounding (transformers keeps the recurrence's state in float32 whatever the model's dtype); a state not carried
across ranks, or a token shift without its halo, is caught."""

from __future__ import annotations

import pytest

from family_cases import during_calls, outside_rounding, parity_cases, parity_line

ROUNDING_MULTIPLE = 4
MESHES = [(2, 1), (1, 2)]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_rwkv_exact(pools, ulysses, ring):
    """Zigzag plain and packed, contiguous packed, on one mesh, in one pools.run call."""
    cases = [("rwkv", ulysses, ring, layout, docs) for layout, docs in
             (("zigzag", False), ("zigzag", True), ("contiguous", True))]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        print(parity_line(r))
        assert not outside_rounding(r, ROUNDING_MULTIPLE), r


def test_rwkv_exact_on_the_2d_mesh(pools):
    """Ulysses 2 x ring 2, packed documents: states chained across both axes' ranks."""
    r = pools.run(4, parity_cases, [("rwkv", 2, 2, "zigzag", True)])[0][0]
    print(parity_line(r))
    assert not outside_rounding(r, ROUNDING_MULTIPLE), r


def _during_calls(lm, name: str, value) -> None:
    from seqmesh.hf import rwkv

    during_calls(lm, lambda m: type(m).__name__ in (rwkv.TIME_MIX, rwkv.CHANNEL_MIX), rwkv, name, value)


def _state_not_carried(lm) -> None:
    """The mutation: every rank's runs keep their outputs from the empty state (earlier ranks' state dropped)."""
    _during_calls(lm, "rerun_states", lambda out, finals, place, empty, carry, rerun, keep=None: out)


def _shift_without_halo(lm) -> None:
    """The mutation: the token shift reads only this rank's tokens (zero before each run instead of the token held
    by another rank)."""
    import torch

    def local(hidden, place):
        out = torch.zeros_like(hidden)
        for run in place.chain.runs[place.rank]:
            out[:, run.offset + 1:run.offset + run.length] = hidden[:, run.offset:run.offset + run.length - 1]
        return out

    _during_calls(lm, "shifted", local)


@pytest.mark.parametrize("mutation", [_state_not_carried, _shift_without_halo], ids=["not-carried", "no-halo"])
def test_an_rwkv_mutation_is_caught(pools, mutation):
    r = pools.run(2, parity_cases, [("rwkv", 1, 2, "zigzag", False)], alter=mutation)[0][0]
    print(f"{mutation.__name__}: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_an_rwkv_config_json_verifies_and_trains(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on RWKV (no attention heads in its config.json) over
    a ring of 2, the blocks recomputed in backward: a finite, falling loss; the planner sizes it (its RWKV blocks:
    tests/planner/test_planner_mixers.py)."""
    import math

    from family_cases import family_config
    from seqmesh.model.presets import model_shape
    from train_job_cases import verify_then_train

    family_config("rwkv").save_pretrained(tmp_path / "plan")
    shape = model_shape(str(tmp_path / "plan"))
    assert not shape.unplanned and shape.hybrid.count(mixer="rwkv") == shape.layers
    good, losses = verify_then_train(pools, tmp_path, family_config("rwkv"), checkpointing=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
