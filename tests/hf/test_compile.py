"""``torch.compile`` through seqmesh: a parallelized 2-layer Llama compiles with no graph break
(``fullgraph=True``, which raises on one, naming it) under Ulysses and ring with packed documents, a Gated
DeltaNet model (Qwen3.5) under Ulysses and ring, plain and packed, and a Mamba2 model under ring; the compiled
model's logits, loss and gradients equal the float64 single-process model's within the reference's own rounding,
as the eager seqmesh model's do."""

from __future__ import annotations

import pytest

from compile_cases import compiled_cases, compiles_over_packed_batches

# The bound is a multiple of how far float32 rounding moves the reference (family_cases.reference_rounding:
# the same Llama in float32 against float64; its RMSNorm computes in float32 whatever the dtype, so the
# float64 models round like float32 there). See tests/hf/test_hf_families.py for the same choice.
ROUNDING_MULTIPLE = 4
# Ulysses 2 and ring 2; U2 x R2 (Llama plain and packed) reached no line of seqmesh they do not (docs/testing.md)
MESHES = [(2, 1), (1, 2)]


def _outside(errors: dict, rounding: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not errors[key] <= ROUNDING_MULTIPLE * rounding[key]]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_compiled_model_has_no_graph_break_and_equals_eager(pools, ulysses, ring):
    # Llama packed (the varlen path, which holds the plain one's ops; Qwen3.5's attention layer runs plain)
    cases = [(ulysses, ring, True)]
    # Gated DeltaNet (Qwen3.5: a linear-attention layer, then full attention); plain, dynamo alone (no graph break,
    # eager's numbers): AOTAutograd traces the same autograd functions of its layers in the packed case
    cases += [(ulysses, ring, False, "qwen3_5", "eager"), (ulysses, ring, True, "qwen3_5")]
    if (ulysses, ring) == (1, 2):  # Mamba2 (no attention at all), packed documents
        cases += [(ulysses, ring, True, "mamba2")]
    # the bound is not loose: on the ring, one rank's positions one step off in one more call of the compiled Llama
    # (no recompile: a tensor's values) is caught, logits 100 times past it
    shifted = cases[0] if (ulysses, ring) == (1, 2) else None
    for results in pools.run(ulysses * ring, compiled_cases, cases, shifted=shifted):
        for r in results:
            if r["case"] == shifted:
                assert "logits" in _outside(r["shifted_vs_eager"], r["rounding"]), r
                assert r["shifted_vs_eager"]["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r
            if len(r["case"]) == 3:  # Llama: eager seqmesh itself within the reference's rounding (Gated DeltaNet's
                assert not _outside(r["eager"], r["rounding"]), r  # own bound is tests/linear_attention's)
            # compiled: eager's own distance from the reference, plus the rounding; and as near eager as rounding
            bound = {key: r["eager"][key] + ROUNDING_MULTIPLE * r["rounding"][key] for key in ("logits", "loss", "grad")}
            assert all(r["compiled"][key] <= bound[key] for key in bound), r
            assert not _outside(r["compiled_vs_eager"], r["rounding"]), r


def test_new_document_boundaries_do_not_recompile_every_batch(pools):
    """Packed batches bring new boundaries each step: dynamo recompiles once when their values change (they
    become symbolic) and once when their count does, then reuses the graph; every output equals eager's."""
    cuts = [[0, 9, 30, 48], [0, 5, 20, 48], [0, 11, 40, 48], [0, 3, 7, 30, 48], [0, 13, 17, 31, 48], [0, 2, 8, 44, 48]]
    for r in pools.run(2, compiles_over_packed_batches, 1, 2, cuts):
        assert r["frames"][-1] <= 3 and r["frames"][-1] == r["frames"][3], r
        assert r["logits_diff"] <= ROUNDING_MULTIPLE * r["rounding"], r
