"""MiniMax-01's lightning attention (tiny ``minimax``, float64: a lightning layer, then full attention, MoE)
through seqmesh.hf: logits, loss and every parameter's gradient equal the single-process model's (packed
documents one call each) within a multiple of the reference's own rounding, on every mesh; a state not passed
between ranks, or not reset at a document start, is seen."""

from __future__ import annotations

import pytest

from family_cases import family_parity, share_references
from lightning_cases import mutated_parity, state_pass_traffic

# As test_hf_families. Measured (torch 2.13, transformers 5.24, CPU): the reference's rounding is 1.3e-7 on logits
# and 6.7e-7 (relative) on gradients (its RMSNorm computes in float32); seqmesh's error is 1.7e-16 and 6.5e-16, float64's
# own, on every mesh; a dropped state or a missed document reset moves the logits by 1.5e5..2.1e5 times the rounding.
ROUNDING_MULTIPLE = 4
MESHES = [(2, 1), (1, 2), (2, 2)]
CASES = [("zigzag", False), ("zigzag", True), ("contiguous", True)]


def _run_all(cases: list[tuple]) -> list[dict]:
    share_references(cases)
    return [{"case": c, **family_parity(*c)} for c in cases]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_minimax_exact(pools, ulysses, ring):
    cases = [("minimax", ulysses, ring, layout, docs) for layout, docs in CASES]
    worst, error, rounding = (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            worst = tuple(max(a, r[k] / r["rounding"][k]) for a, k in zip(worst, ("logits", "grad")))
            error = tuple(max(a, r[k]) for a, k in zip(error, ("logits", "grad")))
            rounding = tuple(max(a, r["rounding"][k]) for a, k in zip(rounding, ("logits", "grad")))
    print(f"minimax u{ulysses}xr{ring} (logits, relative grad): worst error / reference rounding {worst}, "
          f"worst error {error}, reference rounding {rounding}")


@pytest.mark.parametrize("mutation,ulysses,ring,documents", [("state_dropped", 1, 2, False),
                                                             ("state_dropped", 2, 2, False),
                                                             ("documents_ignored", 1, 2, True)])
def test_a_broken_recurrence_is_seen(pools, mutation, ulysses, ring, documents):
    """The parity above fails, by far, when a rank's runs start from zero instead of the state passed to them, or
    when the state runs on across a packed document's start."""
    for r in pools.run(ulysses * ring, mutated_parity, mutation, "minimax", ulysses, ring, "zigzag", documents):
        assert "logits" in _outside_rounding(r), r
        assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r
    print(f"{mutation} u{ulysses}xr{ring}: logits error / reference rounding {r['logits'] / r['rounding']['logits']:.3g}")


def test_a_call_it_cannot_run_exactly_is_refused():
    """The parallelized layer's forward (one process: it refuses before any communication) refuses a call without
    seqmesh's entry, with a cache, or with a padding mask, naming the way out; a design name it does not know is
    refused when the layers are looked up."""
    import types

    import torch

    from family_cases import build, family_config
    from seqmesh.hf.lightning import KIND

    mesh = types.SimpleNamespace(sp_size=2)
    model = build(family_config("minimax"))
    (path, layer), = KIND.find(model, mesh, "all_to_all")
    assert path == "model.layers.0.self_attn"
    forward = KIND.make_forward(layer, mesh, "auto")
    x = torch.zeros(1, 4, model.config.hidden_size, dtype=torch.float64)
    info = types.SimpleNamespace(layout="zigzag", seq_len=8, cu_seqlens=None)
    with pytest.raises(ValueError, match="without the 'seqmesh' entry"):
        forward(layer, x)
    with pytest.raises(ValueError, match="keeps no cache"):
        forward(layer, x, cache=object(), seqmesh=info)
    with pytest.raises(ValueError, match="padding mask"):
        forward(layer, x, attention_mask=torch.ones(1, 4), seqmesh=info)
    with pytest.raises(ValueError, match="unknown linear_attention design"):
        KIND.find(model, mesh, "heads")


# the runs a rank holds (zigzag over the ring: two chunks a rank, one run where they meet; Ulysses within a chunk)
TRAFFIC = [(2, 1, "zigzag", False, 1), (1, 2, "zigzag", False, 2), (1, 2, "zigzag", True, 2), (2, 2, "zigzag", False, 1)]


@pytest.mark.parametrize("ulysses,ring,layout,documents,runs", TRAFFIC)
def test_one_state_gather_per_layer(pools, ulysses, ring, layout, documents, runs):
    """A forward's lightning layer makes one all-gather, of every run's [S_0 | exp(sum g)] per head: a rank receives
    (P - 1) x runs x B x H x (Dk Dv + 1) values (float64 here), whatever the sequence's length."""
    heads, dim, p = 4, 8, ulysses * ring
    for calls in pools.run(p, state_pass_traffic, ulysses, ring, layout, documents):
        assert len(calls) == 1, calls
        assert calls[0]["sent"] == (1, runs, heads * (dim * dim + 1)), calls
        assert calls[0]["received"] == (p - 1) * runs * heads * (dim * dim + 1) * 8, calls
    print(f"u{ulysses}xr{ring} {layout} documents={documents}: {calls[0]['received']} bytes received per layer and rank")
