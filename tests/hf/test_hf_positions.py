"""Families whose positions depend on the whole sequence (positions_cases): exact on every mesh, plain and with
packed documents, and each fix seen by its test when it is undone."""

from __future__ import annotations

import pytest

from positions_cases import decoder_refusals, position_parity, unrunnable, unsharded_refusal

# each family the installed transformers runs on one process (at the floor, 5.15, Llama 4 needs its chunks)
FAMILIES = [f for f in ("phi3-longrope", "llama-dynamic", "llama4-temperature", "llama4-chunked", "roberta",
                                "bart", "marian", "bigbird-pegasus", "trocr")
            if unrunnable(f) is None]
MESHES = [(1, 2), (2, 1)]  # which reach every line U2 x R2 reached here (docs/testing.md)
ROUNDING_MULTIPLE = 4  # as tests/hf/test_hf_families.py: a multiple of the reference's own measured rounding


def _outside(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


def _cases(ulysses: int, ring: int) -> list[tuple]:
    from seqmesh.hf.layers import chunks_per_document

    return [(f, ulysses, ring, layout, docs) for f in FAMILIES for layout, docs in (("zigzag", False), ("contiguous", True))
            if not (f == "llama4-chunked" and docs and not chunks_per_document())]  # refused there: test_..._refused


def _run_all(cases: list[tuple], mutation: str | None = None) -> list[dict]:
    return [{"case": c, **position_parity(*c, mutation=mutation)} for c in cases]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_whole_sequence_positions_exact(pools, ulysses, ring):
    """Logits, loss and every gradient within ROUNDING_MULTIPLE of the reference's rounding."""
    for results in pools.run(ulysses * ring, _run_all, _cases(ulysses, ring)):
        for r in results:
            assert not _outside(r), r
    print({r["case"]: (r["logits"] / r["rounding"]["logits"], r["grad"] / r["rounding"]["grad"]) for r in results})


@pytest.mark.parametrize("family,mutation", [("phi3-longrope", "shard_largest_position"),
                                             ("llama-dynamic", "shard_largest_position"),
                                             ("llama4-temperature", "local_temperature"),
                                             ("roberta", "positions_from_zero"),
                                             ("bart", "shard_numbered_from_zero"),
                                             ("marian", "shard_numbered_from_zero"),
                                             ("bigbird-pegasus", "self_attention_not_causal")])
def test_each_fix_undone_is_seen(pools, family, mutation):
    if family not in FAMILIES:
        pytest.skip(f"transformers cannot run {family} here: {unrunnable(family)}")
    """Each fix reverted on ring 2 (contiguous, no documents: rank 0's tokens all lie before every threshold, where
    zigzag would give both ranks a token near the end): the logits leave the bound by far."""
    for results in pools.run(2, _run_all, [(family, 1, 2, "contiguous", False)], mutation=mutation):
        for r in results:
            assert "logits" in _outside(r), r
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_offset_positions_need_the_model(pools):
    """RoBERTa sharded without the model (positions from 0) is refused at the decoder, naming the fix."""
    for message in pools.run(2, unsharded_refusal, "roberta"):
        assert "numbers its positions itself" in message and "model=model" in message, message


def test_what_a_decoder_numbering_from_zero_cannot_do_is_refused(pools):
    """Generation of BART's decoder, whose cache its attention keeps itself, is refused before the prompt is read;
    TrOCR's sinusoidal table, which numbers around padding tokens, is refused at parallelize."""
    for said in pools.run(2, decoder_refusals, "bart"):
        assert "decoder of an encoder-decoder family" in said["generate"], said
        assert "around its padding ids" in said["sinusoidal"], said
        assert "use_learned_position_embeddings=True" in said["sinusoidal"], said


def test_packed_chunks_counted_from_the_row_are_refused(pools):
    """A transformers that counts Llama 4's chunks from the row's start across packed documents (5.15) gets a
    refusal naming the difference, not seqmesh's per-document chunks."""
    from seqmesh.hf.layers import chunks_per_document

    if chunks_per_document():
        pytest.skip("this transformers counts chunks from each document's start, as seqmesh does")
    with pytest.raises(RuntimeError, match="counts the chunks from the row's start"):
        pools.run(2, _run_all, [("llama4-chunked", 1, 2, "contiguous", True)])
