"""DeepSeek-V4's compressed attentions (seqmesh.hf.compressed_attention): an HCA and a CSA layer, their sliding
window, compressed entries, indexer, sinks, hyper-connections and hash-routed experts, against transformers' model on
the whole sequence: logits, loss and every parameter's gradient within a multiple of the reference's own rounding,
on Ulysses, ring and both, with the zigzag and contiguous layouts. Each piece that crosses ranks, mutated, is seen."""

from __future__ import annotations

import pytest

from family_cases import family_parity, share_references

MESHES = [(1, 2), (2, 1), (2, 2)]
ROUNDING_MULTIPLE = 4  # as tests/hf/test_hf_families.py


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    share_references(cases, 45)
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_compressed_attention_exact(pools, ulysses, ring):
    cases = [("deepseek-v4", ulysses, ring, layout, docs)
             for layout, docs in (("zigzag", False), ("contiguous", False), ("zigzag", True), ("per_document", True))]
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), (r["worst"], r)
            assert r["rounding"]["logits"] < 1e-4, r
    print(f"u{ulysses}xr{ring} (layout, documents, logits, loss, relative grad): "
          f"{[(*r['case'][3:], r['logits'], r['loss'], r['grad']) for r in results]}")


def test_the_data_keeps_csa_selections_clear_of_ties():
    """CSA's top k is taken here over the whole row's entries (other documents' masked), by transformers over each
    document's: the same picks wherever the k-th score stands clear of the next. The test data keeps every such gap,
    exact ties included, above 1e-5 relative, so no test above hangs on a tie or on one machine's rounding."""
    import torch

    from family_cases import _batch, _reference_loss, build, family_config
    from generate_cases import SelectionMargin

    config = family_config("deepseek-v4")
    with SelectionMargin(config.index_topk, ties=True) as margin, torch.no_grad():
        for documents in (False, True):
            _reference_loss(build(config), _batch(45, config.vocab_size, documents))
    print(f"least CSA selection margin: {margin.least:.3g}")
    assert margin.least > 1e-5, margin.least


def _run_in_small_blocks(cases: list[tuple]) -> list[dict]:
    """:func:`_run_all` with blocks of 1 to 3 queries (each checkpointed), as long rows on large models run, and CSA's
    indexer scoring one query at a time within each block (a GPU's blocks hold more queries than its scores fit)."""
    from seqmesh.hf import compressed_attention, indexed_attention

    saved = indexed_attention.BLOCK_ELEMENTS, compressed_attention.INDEXER_ELEMENTS
    indexed_attention.BLOCK_ELEMENTS = 2048  # 4 heads x (6 + 3 to 5 picks) x 16 wide: 2 or 3 queries
    compressed_attention.INDEXER_ELEMENTS = 8 * 11  # 8 indexer heads x 11 entries: one query
    try:
        return _run_all(cases)
    finally:
        indexed_attention.BLOCK_ELEMENTS, compressed_attention.INDEXER_ELEMENTS = saved


def test_exact_in_blocks_of_a_few_queries(pools):
    cases = [("deepseek-v4", 1, 2, "zigzag", False), ("deepseek-v4", 1, 2, "per_document", True)]
    for results in pools.run(2, _run_in_small_blocks, cases):
        for r in results:
            assert not _outside_rounding(r), (r["worst"], r)


def _run_on_the_kernel(cases: list[tuple]) -> list[dict]:
    """:func:`_run_all` with the attention on the Triton kernel (a GPU's path; here Triton's interpreter): keys and
    values one row (no separate rotated part), the sinks in its softmax."""
    from seqmesh.kernels import sparse_latent

    saved = sparse_latent.uses_kernel
    sparse_latent.uses_kernel = lambda x, name="sparse_latent": True
    try:
        return _run_all(cases)
    finally:
        sparse_latent.uses_kernel = saved


def test_exact_on_the_triton_kernel(pools):
    pytest.importorskip("triton")
    for results in pools.run(2, _run_on_the_kernel, [("deepseek-v4", 1, 2, "zigzag", False)]):
        for r in results:
            assert not _outside_rounding(r), (r["worst"], r)


def _entries_one_window_late(original):
    def late(entries, index, count, mesh):
        return original(entries, (index + 1) % count, count, mesh)
    return late


def _without_previous(original):
    def alone(compressor, ext, gate, current, previous, index, rate):
        return original(compressor, ext, gate, current, previous.new_full(previous.shape, -1), index, rate)
    return alone


def _window_one_short(model) -> None:
    from seqmesh.hf.compressed_attention import is_compressed

    for module in model.modules():
        if is_compressed(module):
            module.sliding_window -= 1


# one deliberate error in each piece that crosses ranks: the function of seqmesh.hf.compressed_attention replaced
# (by its replacement made from the original), or the parallelized model altered
MUTATIONS = {
    "each entry placed at the next window": ("_gather_entries", _entries_one_window_late, None),
    "CSA's previous half-window left out": ("_entries", _without_previous, None),
    "the sliding window one key short": (None, None, _window_one_short),
}


def _run_mutated(name: str, ulysses: int, ring: int) -> list[dict]:
    from seqmesh.hf import compressed_attention

    function, mutant, alter = MUTATIONS[name]
    original = getattr(compressed_attention, function) if function else None
    if function:
        setattr(compressed_attention, function, mutant(original))
    try:
        return _run_all([("deepseek-v4", ulysses, ring, "zigzag", False)], alter=alter)
    finally:
        if function:
            setattr(compressed_attention, function, original)


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_mutation_is_seen(pools, name):
    for results in pools.run(2, _run_mutated, name, 1, 2):
        for r in results:
            assert "logits" in _outside_rounding(r), r


def _unequal_rows_refusal() -> str:
    import torch

    import seqmesh
    from dist_cases import get_mesh
    from family_cases import build, family_config
    from seqmesh.hf import parallelize

    mesh = get_mesh(1, 2)
    model = parallelize(build(family_config("deepseek-v4")), mesh)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0  # the second row is 30 tokens long
    batch = seqmesh.shard_batch({"input_ids": torch.randint(0, 64, (2, 40)), "attention_mask": mask}, mesh)
    try:
        model(**batch)
    except ValueError as err:
        return str(err)
    return ""


def test_rows_of_unequal_length_are_refused_by_name(pools):
    for message in pools.run(2, _unequal_rows_refusal):
        assert "DeepSeek-V4's compressed attention" in message and "rows of one length" in message, message


def test_a_deepseek_v4_config_json_verifies_and_trains_on_four_ranks(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` from DeepSeek-V4's config.json on a ring of 4 (77 tokens: chunks of
    about 10, so a halo of 7 reaches into the rank before) with FSDP2 and checkpointing: the single process's loss
    and gradients, then training."""
    import math

    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config("deepseek-v4"), ring=4, checkpointing=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def _generate_refusal() -> str:
    from dist_cases import get_mesh
    from family_cases import build, family_config
    from seqmesh.hf import parallelize
    from seqmesh.inference.generate import check_generate

    mesh = get_mesh(1, 2)
    try:
        check_generate(parallelize(build(family_config("deepseek-v4")), mesh), mesh)
    except ValueError as err:
        return str(err)
    return ""


def test_generation_is_refused_by_name(pools):
    """seqmesh generate does not decode the compressed layers yet: it says so before the prompt is read."""
    for message in pools.run(2, _generate_refusal):
        assert "DeepSeek-V4's compressed attention layers, whose decode seqmesh does not run yet" in message, message


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_batch_of_two_rows(pools, layout):
    """Each row its own windows, entries and selection: two rows on ring 2 within the float32 model's rounding."""
    from family_cases import two_rows_error

    for error, rounding in pools.run(2, two_rows_error, "deepseek-v4", layout):
        assert error <= 4 * rounding and rounding < 1e-4, (error, rounding)
