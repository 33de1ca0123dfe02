"""Inkling (tiny, float64: a sliding layer of window 6, a full layer whose relative bias reaches 8 keys back and
whose queries are log-scaled by their index in the document) through seqmesh.hf.inkling: logits, loss and every
parameter's gradient equal the unmodified transformers model on one process (packed documents one call each), within
a multiple of the reference's own rounding, on Ulysses, ring and both; a bias one key off, a short convolution
without its halo, and the log scale counted from the row's start are seen."""

from __future__ import annotations

import pytest

from family_cases import during_calls, outside_rounding, parity_cases, parity_line

FAMILY = "inkling"
ROUNDING_MULTIPLE = 4


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (2, 2)], ids=["u2xr1", "u1xr2", "u2xr2"])
def test_inkling_exact(pools, ulysses, ring):
    cases = [(FAMILY, ulysses, ring, layout, docs) for layout, docs in
             (("zigzag", False), ("zigzag", True), ("contiguous", True))]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        print(parity_line(r))
        assert not outside_rounding(r, ROUNDING_MULTIPLE), r


def _during_calls(lm, name: str, value) -> None:
    """``seqmesh.hf.inkling.<name>`` replaced by ``value(original)`` during each call of the model's attention."""
    from seqmesh.hf import inkling

    during_calls(lm, inkling.is_relative_attention, inkling, name, value(getattr(inkling, name)))


def _bias_one_key_off(lm) -> None:
    """Each query's bias read one distance further (its profile shifted by one key)."""
    import torch

    def shifted(attend):
        return lambda module, query, rel, *rest: attend(module, query, torch.roll(rel, 1, dims=-1), *rest)

    _during_calls(lm, "_attend", shifted)


def _conv_without_halo(lm) -> None:
    """The short convolutions read this rank's rows only (zeros where another rank's rows would be)."""
    from family_cases import conv_without_halo
    from seqmesh.hf import inkling

    def own_rows_only(module, x, place):
        conv, wide = conv_without_halo(module, x, place)
        return (conv + wide).to(x.dtype)

    during_calls(lm, inkling.is_short_convolution, inkling, "short_convolution", own_rows_only)


def _scale_from_the_row_start(lm) -> None:
    """The full layer's log scale from each query's index in the row, not in its document."""
    def from_row(places):
        def document_places(mesh, info, device):
            starts, within, longest = places(mesh, info, device)
            return starts * 0, starts + within, longest

        return document_places

    _during_calls(lm, "document_places", from_row)


@pytest.mark.parametrize("mutation,case", [
    (_bias_one_key_off, (FAMILY, 1, 2, "zigzag", False)),
    (_conv_without_halo, (FAMILY, 1, 2, "zigzag", False)),
    (_scale_from_the_row_start, (FAMILY, 2, 1, "contiguous", True)),
], ids=["bias", "conv-halo", "scale"])
def test_an_inkling_mutation_is_seen(pools, mutation, case):
    r = pools.run(2, parity_cases, [case], alter=mutation)[0][0]
    print(f"{mutation.__name__}: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_an_inkling_config_json_verifies_and_trains(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a ring of 2: a finite, falling loss (the
    planner sizes the same file: tests/planner/test_planner_inkling.py)."""
    import math

    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config(FAMILY))
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
