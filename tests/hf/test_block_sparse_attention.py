"""MiniMax-M3's block-sparse attention (its ``minimax_m3_sparse`` layers) through seqmesh.hf: logits, loss and every
parameter's gradient against transformers' model on the whole sequence (packed documents: each document alone, its
blocks numbered from its first token), within the reference's own rounding, on Ulysses, ring and both; a selection
one block short, and blocks numbered from the row's start instead of the document's, are seen."""

from __future__ import annotations

import pytest

from family_cases import family_parity, share_references

FAMILY = "minimax-m3-sparse"  # blocks of 4 keys: each query the top 2 of up to 12, its own block always one of them
ROUNDING_MULTIPLE = 4


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    share_references(cases, 45)
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


def one_block_short(model) -> None:
    for module in model.modules():
        if hasattr(module, "topk_blocks"):
            module.topk_blocks -= 1


def _run_from_the_row_start(cases: list[tuple]) -> list[dict]:
    """The mutation: every query's blocks numbered from the row's first token, as one transformers call over the
    packed row would (each document's blocks must start at its own first token)."""
    from seqmesh.hf import block_sparse_attention

    documents = block_sparse_attention.document_places

    def from_row_start(mesh, info, device):
        start, within, _ = documents(mesh, info, device)
        return start * 0, start + within, info.seq_len

    block_sparse_attention.document_places = from_row_start
    try:
        return _run_all(cases)
    finally:
        block_sparse_attention.document_places = documents


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1), (2, 2)], ids=["u1xr2", "u2xr1", "u2xr2"])
def test_block_sparse_attention_exact(pools, ulysses, ring):
    cases = [(FAMILY, ulysses, ring, layout, docs) for layout, docs in (("zigzag", False), ("per_document", True))]
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            assert r["rounding"]["logits"] < 1e-4, r  # a bound that could not hide a wrong selection


def test_a_selection_one_block_short_is_seen(pools):
    for results in pools.run(2, _run_all, [(FAMILY, 1, 2, "zigzag", False)], alter=one_block_short):
        for r in results:
            assert "logits" in _outside_rounding(r), r


def test_blocks_numbered_from_the_row_start_are_seen(pools):
    for results in pools.run(2, _run_from_the_row_start, [(FAMILY, 1, 2, "per_document", True)]):
        for r in results:
            assert "logits" in _outside_rounding(r), r


def test_the_planner_sizes_it(tmp_path):
    """The planner sizes the sparse layers by their own kind, never as full attention (their parameters, traffic and
    plan: tests/planner/test_planner_block_sparse.py; generation runs them: tests/inference/test_generate.py)."""
    from family_cases import family_config
    from seqmesh.model.presets import model_shape

    family_config(FAMILY).save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    assert not shape.unplanned and shape.block_sparse_layers == 1 and shape.seqmesh_attention_layers == 1, shape


def test_a_config_json_verifies_and_trains_on_a_ring(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` from MiniMax-M3's config.json with a block-sparse layer, ring 2."""
    import math

    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config(FAMILY))
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
