"""Image blocks (Gemma 3: the tokens of one image see each other both ways) in the ring's block plan.

Every (layout, ring, Ulysses, documents, window, blocks) combination small enough to enumerate: the
kernel calls each ring rank makes over the schedule's steps cover every visible (query, key) pair exactly
once and no other, against a dense mask built from positions alone (``reference.reference_attention``'s
rule); the steps are exactly those where some rank has a visible pair; and the emulated ring (every rank's
kernel calls and merges on one device) gives float64 attention and gradients.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import document_ids, reference_attention
from seqmesh.bench.emulate import emulate_ring
from seqmesh.kernels import kernel_chooser
from seqmesh.sequence.layout import SequenceLayout
from seqmesh.sharded_attention.blocks import document_bounds, plan_block
from seqmesh.sharded_attention.checks import check_image_blocks
from seqmesh.sharded_attention.schedule import RingSchedule

N = 48  # padded length; the real tokens end at REAL, the rest is padding (a document of its own)
REAL = 44
DOCUMENTS = {"one": None, "three": (0, 13, 14, 44)}
# blocks: at position 0, of one token, across zigzag's chunk edges (6, 12, 24 at ring 2..4), adjacent at a
# document boundary (13 | 14 is the one-token document), at the end of the real tokens
BLOCKS = {
    "none": (),
    "spread": ((0, 3), (5, 9), (11, 13), (20, 21), (22, 30), (40, 44)),
    "adjacent": ((9, 13), (13, 14), (14, 18), (23, 26)),
}
WINDOWS = [None, 3, 8, 11]
LAYOUTS = [(kind, ring, ulysses) for kind in ("contiguous", "zigzag", "per_document")
           for ring, ulysses in ((1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (4, 1))]


def dense_mask(documents: tuple[int, ...] | None, blocks, window: int | None) -> torch.Tensor:
    """``(N, N)`` bool, from positions alone: same document (the padding is one more) AND (key not after
    the query OR both in the same block) AND (within the window)."""
    bounds = list(documents or (0, REAL)) + [N]
    doc = document_ids(N, bounds)
    block = torch.full((N,), -1)
    for i, (a, b) in enumerate(blocks):
        block[a:b] = i
    q, k = torch.arange(N)[:, None], torch.arange(N)[None, :]
    same_block = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    ok = (doc[:, None] == doc[None, :]) & ((k <= q) | same_block)
    if window is not None:
        ok &= k > q - window
    return ok


def _positions(layout: SequenceLayout, ring_rank: int) -> torch.Tensor:
    """Global position of every local row of ``ring_rank``'s block."""
    out = torch.empty(sum(r.length for r in layout.ring_runs(ring_rank)), dtype=torch.long)
    for run in layout.ring_runs(ring_rank):
        out[run.offset : run.offset + run.length] = torch.arange(run.start, run.stop)
    return out


def _cases():
    for (kind, ring, ulysses), docs, blocks, window in itertools.product(LAYOUTS, DOCUMENTS, BLOCKS, WINDOWS):
        documents, spans = DOCUMENTS[docs], BLOCKS[blocks]
        if check_image_blocks(spans, documents, REAL, window) is None:  # else the checks refuse it (below)
            yield kind, ring, ulysses, docs, blocks, window


def _schedule(kind, ring, ulysses, docs, blocks, window) -> RingSchedule:
    documents = DOCUMENTS[docs]
    layout = SequenceLayout(kind, ring, ulysses, N, documents if kind == "per_document" else None, 1)
    return RingSchedule(layout, document_bounds(N, REAL, documents), True, window, BLOCKS[blocks])


CASES = list(_cases())


def test_the_cases_cover_blocks_windows_and_refusals():
    assert len(CASES) > 200 and any(c[5] == 3 and c[4] == "spread" for c in CASES) is False  # 8-token block > 3
    assert any(c[5] == 8 and c[4] == "spread" for c in CASES)


@pytest.mark.parametrize("kind,ring,ulysses,docs,blocks,window", CASES)
def test_plan_covers_every_visible_pair_once(kind, ring, ulysses, docs, blocks, window):
    """Each rank's calls over the schedule's steps cover the dense mask exactly once; the steps are those
    where some rank sees some key of the block it holds then."""
    schedule = _schedule(kind, ring, ulysses, docs, blocks, window)
    want = dense_mask(DOCUMENTS[docs], BLOCKS[blocks], window)
    covered = torch.zeros(N, N, dtype=torch.long)
    for r in range(ring):
        rows = _positions(schedule.layout, r)
        for t in schedule.steps:
            cols = _positions(schedule.layout, schedule.source(r, t))
            for p in schedule.pieces(r, t):
                seen = p.mask.allowed(p.q1 - p.q0, p.k1 - p.k0).long()
                covered.index_put_((rows[p.q0 : p.q1, None].expand_as(seen), cols[None, p.k0 : p.k1].expand_as(seen)),
                                   seen, accumulate=True)
    assert torch.equal(covered, want.long())
    needed = [t for t in range(ring) if t == 0 or any(
        bool(want[_positions(schedule.layout, r)][:, _positions(schedule.layout, schedule.source(r, t))].any())
        for r in range(ring))]
    assert schedule.steps == tuple(needed)


def test_an_image_on_another_rank_makes_a_step_of_its_own():
    """Contiguous, ring 4, window 3: without blocks only steps 0 and 1 have work (each rank's previous
    neighbour); an image block reaching from rank 1's chunk into rank 2's makes rank 1's last queries see
    rank 2's first key, which reaches rank 1 at step ring - 1 = 3, so the ring runs that step too."""
    layout = SequenceLayout("contiguous", 4, 1, N)
    plain = RingSchedule(layout, document_bounds(N, REAL, None), True, 3)
    image = RingSchedule(layout, document_bounds(N, REAL, None), True, 3, ((22, 25),))
    assert plain.steps == (0, 1) and image.steps == (0, 1, 3)
    assert not plain.pieces(1, 3) and image.pieces(1, 3)  # rank 1 (positions 12..23) reads rank 2's 24


def test_a_block_holds_one_full_call_on_the_diagonal():
    """One run holding text, an image, text: the image's rows see their block and the keys before it in one
    full call, merged with the later text's rows over the same keys; the text on the diagonal stays causal."""
    from seqmesh.kernels.base import FULL
    from seqmesh.sequence.runs import Run

    pieces = plan_block((Run(0, 12, 0),), (Run(0, 12, 0),), (0, 12), True, None, ((4, 8),))
    assert [(p.q0, p.q1, p.k0, p.k1, p.mask.causal) for p in pieces] == [
        (0, 4, 0, 4, True), (4, 12, 0, 8, False), (8, 12, 8, 12, True)]
    assert pieces[1].mask == FULL


@pytest.mark.parametrize("kind,ring,docs,blocks,window", [
    ("zigzag", 4, "one", "spread", None), ("per_document", 3, "three", "adjacent", 8),
    ("contiguous", 2, "three", "spread", 11), ("zigzag", 2, "three", "adjacent", 4)])
def test_emulated_ring_is_exact(kind, ring, docs, blocks, window):
    """Every ring rank's kernel calls and merges on one device: float64 output and gradients of q, k, v."""
    schedule = _schedule(kind, ring, 1, docs, blocks, window)
    g = torch.Generator().manual_seed(ring)
    q, dout = (torch.randn(2, N, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, N, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout[:, REAL:] = 0
    out, dq, dk, dv = emulate_ring(q, k, v, dout, schedule, kernel_chooser("auto"), 8**-0.5)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    documents = list(DOCUMENTS[docs] or (0, REAL))
    ref = reference_attention(qr, kr, vr, causal=True, cu_seqlens=documents, window=window,
                              image_blocks=list(BLOCKS[blocks]))
    ref.backward(dout)
    assert (out - ref)[:, :REAL].abs().max() < 1e-12
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got - want)[:, :REAL].abs().max() < 1e-12


def test_the_checks_name_the_block_and_the_fix():
    assert "holds 8 tokens, more than the sliding window of 3" in check_image_blocks(((22, 30),), None, REAL, 3)
    assert "crosses the document boundary 13" in check_image_blocks(((10, 16),), (0, 13, 44), REAL, None)
    assert "after the previous block" in check_image_blocks(((4, 9), (8, 12)), None, REAL, None)
    assert "before 44" in check_image_blocks(((40, 46),), None, REAL, None)
    assert check_image_blocks(((0, 3), (3, 5)), None, REAL, 3) is None
