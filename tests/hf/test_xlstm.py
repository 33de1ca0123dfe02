"""xLSTM (tiny, float64; its mLSTM layers' chunkwise kernel over chunks of 8, the recurrent one for the rest) through
seqmesh.hf.xlstm: logits, loss and every parameter's gradient equal the unmodified transformers model on one process
(packed documents one call each), within a multiple of the reference's own rounding (transformers keeps the
memory in float32 where its recurrent kernel runs); a memory not carried across ranks is caught."""

from __future__ import annotations

import math

import pytest

from family_cases import during_calls, outside_rounding, parity_cases, parity_line

ROUNDING_MULTIPLE = 4


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (2, 2)], ids=["u2xr1", "u1xr2", "u2xr2"])
def test_xlstm_exact(pools, ulysses, ring):
    """Zigzag plain and packed, contiguous packed, on one mesh, in one pools.run call."""
    cases = [("xlstm", ulysses, ring, layout, docs) for layout, docs in
             (("zigzag", False), ("zigzag", True), ("contiguous", True))]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        print(parity_line(r))
        assert not outside_rounding(r, ROUNDING_MULTIPLE), r


def _memory_not_carried(lm) -> None:
    """The mutation: every rank's runs keep their outputs from transformers' zero state (earlier ranks' dropped),
    during each call of the model's mLSTM layers."""
    from seqmesh.hf import xlstm

    during_calls(lm, xlstm.is_mlstm_layer, xlstm, "rerun_states",
                 lambda out, finals, place, empty, carry, rerun, keep=None: out)


def test_a_memory_not_carried_is_caught(pools):
    r = pools.run(2, parity_cases, [("xlstm", 1, 2, "zigzag", False)], alter=_memory_not_carried)[0][0]
    print(f"not carried: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_an_xlstm_config_json_verifies_and_trains(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a ring of 2, the blocks recomputed in
    backward: a finite, falling loss."""
    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config("xlstm"), checkpointing=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
