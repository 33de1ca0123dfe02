"""``seqmesh.attention`` under ``torch.compile(fullgraph=True)`` (the ``seqmesh::attention_forward`` /
``attention_backward`` ops) against float64 attention on the whole sequence: every variant the eager
path supports, on Ulysses, ring and USP meshes, to the eager path's own float64 bound."""

from __future__ import annotations

import pytest

from dist_cases import Case, attention_cases, named_backend_refuses_documents

MESHES = [(1, 2), (2, 1), (2, 2)]
DOCS = (0, 1, 2, 7, 8, 17, 22)  # length-1 documents, one crossing shards, padding after the last
CASES = [
    Case(24, 8, 2, True, "zigzag"),
    Case(23, 6, 3, False, "contiguous"),  # uneven head grouping, padding, non-causal
    Case(24, 4, 4, True, "zigzag", DOCS),
    Case(24, 4, 2, True, "per_document", DOCS),
    Case(24, 4, 2, True, "zigzag", window=5, sinks=True),
    Case(24, 4, 4, True, "contiguous", v_dim=6),  # MLA-style value head dim
    Case(24, 4, 1, False, "zigzag", DOCS, sinks=True),  # MQA: kv replication under Ulysses
    # images seen both ways by their tokens (Gemma 3), across shards, in documents, under a window
    Case(24, 4, 2, True, "zigzag", DOCS, window=5, image_blocks=((2, 6), (9, 13), (13, 16), (18, 21))),
    Case(24, 4, 2, True, "per_document", DOCS, chunk=4),  # Llama 4's chunked attention
    Case(24, 4, 2, True, "zigzag", DOCS, alibi=(0.5, 0.25, 0.125, 2 ** -0.5)),  # ALiBi (BLOOM, MPT): slopes by head
]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_compiled_attention_exact_float64(pools, ulysses, ring):
    per_rank = pools.run(ulysses * ring, attention_cases, ulysses, ring, 1, CASES, compiled="aot_eager")
    bad = [(rank, r) for rank, results in enumerate(per_rank) for r in results
           if any(v > 1e-10 for k, v in r.items() if k != "case")]
    assert not bad, bad[:3]
    assert len(per_rank[0]) == len(CASES)


def test_compiled_attention_refuses_on_every_rank_like_eager(pools):
    """A named kernel's refusal (documents only inside rank 0's blocks) reaches every rank before any sends,
    from inside the compiled op as from the eager path."""
    answers = pools.run(2, named_backend_refuses_documents, "aot_eager", timeout=120)
    assert all("backend 'math' cannot run this call: no documents" in a for a in answers), answers
