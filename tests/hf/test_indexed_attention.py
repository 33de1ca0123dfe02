"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5 with a shared-selection layer) through seqmesh.hf: logits, loss
and every parameter's gradient against transformers' model on the whole sequence, within the reference's own
rounding, on Ulysses, ring and both, plain and with packed documents; a selection one key short is seen."""

from __future__ import annotations

import pytest

from family_cases import family_parity

FAMILIES = ["deepseek-v3.2", "glm-5"]
MESHES = [(1, 2), (2, 1), (2, 2)]
# as tests/hf/test_hf_families.py: a multiple of how far the reference's own float32 rounding moves it
ROUNDING_MULTIPLE = 4


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


def one_key_short(model) -> None:
    """The mutation: every indexer of the parallelized model keeps one key fewer than the model's top-k."""
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk -= 1


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_indexed_attention_exact(pools, ulysses, ring):
    """Each query's top-k keys chosen from its document's earlier keys of the whole row, and MLA over them, as
    transformers computes on one process: zigzag without documents, per_document with packed documents."""
    cases = [(f, ulysses, ring, layout, docs) for f in FAMILIES
             for layout, docs in (("zigzag", False), ("per_document", True))]
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            assert r["rounding"]["logits"] < 1e-4, r  # a bound that could not hide a wrong selection (~1e-2)


def test_a_selection_one_key_short_is_seen(pools):
    for results in pools.run(2, _run_all, [("deepseek-v3.2", 1, 2, "zigzag", False)], alter=one_key_short):
        for r in results:
            assert "logits" in _outside_rounding(r), r
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r
