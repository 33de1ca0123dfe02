"""Qwen4-Exp's QSA attention (its ``indexed_attention`` layers, beside Gated DeltaNet) through seqmesh.hf: logits,
loss and every parameter's gradient against transformers' model on the whole sequence (packed documents: each
document alone, its blocks counted from its first token), within the reference's own rounding, on Ulysses, ring and
both; a tail left out, blocks counted from the row's start, and a budget one block short are seen."""

from __future__ import annotations

import pytest

from family_cases import during_calls, outside_rounding, parity_cases

FAMILY = "qwen4-exp"  # blocks of 4 tokens: each query the top 4 of up to 11, and its tail of up to 3
ROUNDING_MULTIPLE = 4


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    return parity_cases(cases, **kwargs)


def _outside_rounding(r: dict) -> list[str]:
    return outside_rounding(r, ROUNDING_MULTIPLE)


def one_block_short(model) -> None:
    for module in model.modules():
        if hasattr(module, "compress_ratio"):
            module.block_topk -= 1


def _mutated(cases: list[tuple], name: str, value) -> list[dict]:
    """The cases with ``seqmesh.hf.qsa_attention.<name>`` replaced by ``value`` (restored after)."""
    from seqmesh.hf import qsa_attention

    kept = getattr(qsa_attention, name)
    setattr(qsa_attention, name, value(kept))
    try:
        return _run_all(cases)
    finally:
        setattr(qsa_attention, name, kept)


def _blocks_from_the_row_start(blocks):
    """Every document's blocks counted from the row's first token, as one transformers call over the packed row would
    count them (each document's must start at its own first token)."""
    import dataclasses

    def from_row_start(info, ratio, device):
        starts, firsts = blocks(dataclasses.replace(info, cu_seqlens=None), ratio, device)
        return starts, firsts.new_zeros(len(info.cu_seqlens or (0, 0)) - 1)  # every document from the row's first

    return from_row_start


def _without_the_tail(attend):
    """Each query attends its selected blocks only: the tokens after its last complete block (itself among them)
    left out (a query with no complete block then keeps the row's first token)."""
    import torch

    def attend_blocks(module, query, row_k, row_v, chosen, block_starts, start, within):
        return attend(module, query, row_k, row_v, chosen, block_starts, start,
                      torch.where((within + 1) // module.indexer.compress_ratio > 0,
                                  (within + 1) // module.indexer.compress_ratio * module.indexer.compress_ratio - 1,
                                  within))

    return attend_blocks


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1), (2, 2)], ids=["u1xr2", "u2xr1", "u2xr2"])
def test_qsa_attention_exact(pools, ulysses, ring):
    cases = [(FAMILY, ulysses, ring, layout, docs) for layout, docs in (("zigzag", False), ("per_document", True),
                                                                         ("contiguous", True))]
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            assert r["rounding"]["logits"] < 1e-4, r  # a bound that could not hide a wrong selection


def test_a_budget_one_block_short_is_seen(pools):
    for results in pools.run(2, _run_all, [(FAMILY, 1, 2, "zigzag", False)], alter=one_block_short):
        for r in results:
            assert "logits" in _outside_rounding(r), r


@pytest.mark.parametrize("name,mutation,case", [
    ("_blocks", _blocks_from_the_row_start, (FAMILY, 1, 2, "per_document", True)),
    ("_attend", _without_the_tail, (FAMILY, 2, 1, "zigzag", False)),
], ids=["row-start", "no-tail"])
def test_a_mutation_is_seen(pools, name, mutation, case):
    for results in pools.run(2, _mutated, [case], name, mutation):
        for r in results:
            assert "logits" in _outside_rounding(r), r


def _generate_refusal() -> str:
    from dist_cases import get_mesh
    from family_cases import build, family_config
    from seqmesh.hf import parallelize
    from seqmesh.inference.generate import check_generate

    mesh = get_mesh(1, 2)
    try:
        check_generate(parallelize(build(family_config(FAMILY)), mesh), mesh)
    except ValueError as err:
        return str(err)
    return ""


def test_generation_and_the_planners_inference_refuse_it_by_name(pools, tmp_path):
    """Generation does not decode QSA: it says so before the prompt is read, and ``seqmesh plan --inference`` (which
    plans its training: tests/planner/test_planner_qwen4_exp.py) the same."""
    from family_cases import family_config
    from planner_cases import in_process

    family_config(FAMILY).save_pretrained(tmp_path)
    done = in_process(["plan", "--model", str(tmp_path), "--seq-len", "4096", "--gpus", "2", "--inference"])
    assert done.returncode != 0 and "QSA layers, whose decode seqmesh does not run yet" in done.stderr, done.stderr
    for message in pools.run(2, _generate_refusal):
        assert "QSA layers, whose decode seqmesh does not run yet" in message, message


def test_a_config_json_verifies_and_trains_on_a_ring(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` from Qwen4-Exp's config.json, ring 2."""
    import math

    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config(FAMILY))
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


# Qwen4-Exp's PLE layers (seqmesh.hf.ngram_ple): hashed n-gram embeddings of earlier token ids and a dilated conv,
# both over each run's halo
PLE = "qwen4-exp-ple"


def _during_ple_calls(lm, replacement) -> None:
    """``seqmesh.hf.ngram_ple.halo`` replaced by ``replacement(halo)`` during each call of the model's PLE layers."""
    from seqmesh.hf import ngram_ple

    during_calls(lm, ngram_ple.is_ple_layer, ngram_ple, "halo", replacement(ngram_ple.halo))


def _halo_rows_blanked(halo, what: str):
    """A stand-in for the halo module whose ``extend`` (``what``: "ids", EOS where another rank's ids would be) or
    ``with_halo`` ("conv": zeros where another rank's rows would be) reads this rank's own rows only."""
    import types

    import torch

    def blanked(x, place, fill):
        extended = halo.extend(x, place)
        own = torch.zeros(extended.shape[1], dtype=torch.bool)
        own[place.mine.own] = True
        return extended.masked_fill(~own[None, :, None], fill)

    if what == "ids":
        return types.SimpleNamespace(placement=halo.placement, extend=lambda x, place: blanked(x, place, 231),
                                     with_halo=halo.with_halo)
    return types.SimpleNamespace(placement=halo.placement, extend=halo.extend, with_halo=lambda x, place, causal: causal(
        blanked(x, place, 0.0), place.mine.conv_bounds).index_select(1, place.mine.own))


def _ids_without_halo(lm) -> None:
    _during_ple_calls(lm, lambda halo: _halo_rows_blanked(halo, "ids"))


def _conv_without_halo(lm) -> None:
    _during_ple_calls(lm, lambda halo: _halo_rows_blanked(halo, "conv"))


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)], ids=["u1xr2", "u2xr1"])
def test_ple_layers_exact(pools, ulysses, ring):
    cases = [(PLE, ulysses, ring, layout, docs) for layout, docs in (("zigzag", False), ("contiguous", True))]
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), r


@pytest.mark.parametrize("mutation,seen", [(_ids_without_halo, "logits"), (_conv_without_halo, "grad")],
                         ids=["ids", "conv"])
def test_a_ple_halo_left_out_is_seen(pools, mutation, seen):
    """The conv's weights start at zero (transformers' init), so its halo shows in the gradients, not the logits."""
    for results in pools.run(2, _run_all, [(PLE, 1, 2, "zigzag", False)], alter=mutation):
        for r in results:
            assert seen in _outside_rounding(r), r
