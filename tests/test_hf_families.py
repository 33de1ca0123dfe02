"""Gemma 3, Mistral with a window, gpt-oss and DeepSeek-V3 (tiny, float64) through seqmesh.hf: logits
and every parameter gradient equal the single-process model on the whole sequence."""

from __future__ import annotations

import pytest

from family_cases import family_parity

FAMILIES = ["gemma3", "mistral", "gpt-oss", "deepseek-v3"]
MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]


def _cases(ulysses: int, ring: int) -> list[tuple]:
    return [(f, ulysses, ring, layout, docs) for f in FAMILIES for layout, docs in (("zigzag", False), ("contiguous", True))]


def _run_all(cases: list[tuple]) -> list[dict]:
    return [{"case": c, **family_parity(*c)} for c in cases]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_families_exact(pools, ulysses, ring):
    """Float64 models: logits and loss within 1e-12. Gradients within 1e-12 of each parameter's largest,
    except where the model itself computes in float32 whatever the dtype: Gemma 3's RMSNorm
    (``x.float()``) and DeepSeek-V3's router (``F.linear`` in float32) carry float32 rounding into their
    gradients (~2e-7 here), so those two families are held to 1e-5. A mask, window or sink error
    shows as 1e-2 or more."""
    worst = {}
    for results in pools.run(ulysses * ring, _run_all, _cases(ulysses, ring)):
        for r in results:
            assert r["logits"] < 1e-12 and r["loss"] < 1e-12, r
            assert r["grad"] < (1e-5 if r["case"][0] in ("gemma3", "deepseek-v3") else 1e-12), r
            family = r["case"][0]
            worst[family] = tuple(max(a, b) for a, b in zip(worst.get(family, (0.0, 0.0)), (r["logits"], r["grad"])))
    print(f"u{ulysses}xr{ring} worst (logits, relative grad): {worst}")
