"""The per_document layout: a permutation, exact ring attention, and balanced work per document."""

from __future__ import annotations

import pytest
import torch

from reference import document_ids, reference_attention
from seqmesh.kernels import kernel_chooser
from seqmesh.sequence.layout import SequenceLayout
from seqmesh.sharded_attention.blocks import document_bounds
from seqmesh.sharded_attention.schedule import RingSchedule
from seqmesh.bench.emulate import emulate_ring

# documents over 48 tokens: lengths 1, 3, 17 (not a multiple of 2R), 8 and padding after 29+8=37
DOCS = (0, 1, 4, 21, 29, 37)
# over 1100 tokens at the default min_chunk of 64: some documents are cut, some stay whole
LONG_DOCS = (0, 300, 301, 900, 1049)


# chunks of one token allowed: the small examples here get cut
SMALL_CHUNKS = 1


@pytest.fixture(params=[SMALL_CHUNKS, 64], ids=["chunks-of-1", "default-chunks"])
def min_chunk(request):
    """Run with chunks of one token allowed (small examples get cut) and with the default."""
    return request.param


def _positions_by_hand(documents: tuple[int, ...] | None, ring: int, padded: int, min_chunk: int) -> list[list[int]]:
    """The placement written out token by token: every document (the padding is one more) gives ring
    rank r its chunk r from the start and chunk r from the end, c = len // 2R tokens each (none when
    c < min_chunk); the leftover tokens of all documents, in order, are cut in 2R equal consecutive
    pieces and rank r takes pieces r and 2R-1-r."""
    bounds = list(documents or (0,)) + ([padded] if (documents or (0,))[-1] < padded else [])
    ranks: list[list[int]] = [[] for _ in range(ring)]
    middle = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * ring)
        c = c if c >= min_chunk else 0
        for t in range(a, b):
            i = t - a
            if i < ring * c:
                ranks[i // c].append(t)
            elif t >= b - ring * c:
                ranks[(b - 1 - t) // c].append(t)
            else:
                middle.append(t)
    share = len(middle) // (2 * ring)
    for r in range(ring):
        ranks[r] += middle[r * share : (r + 1) * share] + middle[(2 * ring - 1 - r) * share : (2 * ring - r) * share]
    return [sorted(x) for x in ranks]


@pytest.mark.parametrize("ring,ulysses", [(1, 2), (2, 1), (2, 2), (4, 1), (3, 2), (8, 1)])
@pytest.mark.parametrize("docs", [None, DOCS, (0, 48), (0, 5, 6, 7, 48), LONG_DOCS])
def test_permutation_matches_the_hand_placement(ring, ulysses, docs, min_chunk):
    length = docs[-1] + 51 if docs == LONG_DOCS else 48
    layout = SequenceLayout.for_length("per_document", ring, ulysses, length, docs, min_chunk)
    n = layout.padded_len
    order, restore = layout.indices(), layout.indices(restore=True)
    assert sorted(order.tolist()) == list(range(n))
    assert torch.equal(order[restore], torch.arange(n))
    want = _positions_by_hand(docs, ring, n, min_chunk)
    for r in range(ring):
        runs = layout.ring_runs(r)
        got = [t for run in runs for t in range(run.start, run.stop)]
        assert got == want[r]
        assert [run.offset for run in runs] == [sum(x.length for x in runs[:i]) for i in range(len(runs))]
        for u in range(ulysses):  # Ulysses rank u holds the u-th equal piece of its ring rank's block
            piece = layout.ring_len // ulysses
            assert layout.local_positions(r * ulysses + u).tolist() == want[r][u * piece : (u + 1) * piece]


def test_without_documents_it_is_zigzag_and_the_docstring_example_holds():
    for ring, ulysses, n in [(2, 1, 16), (4, 2, 64), (3, 2, 36)]:
        a = SequenceLayout("per_document", ring, ulysses, n, min_chunk=SMALL_CHUNKS)
        assert torch.equal(a.indices(), SequenceLayout("zigzag", ring, ulysses, n).indices())
    drawn = SequenceLayout("per_document", 2, 1, 16, (0, 8, 13), SMALL_CHUNKS)
    assert drawn.indices().tolist() == [0, 1, 6, 7, 8, 10, 12, 15, 2, 3, 4, 5, 9, 11, 13, 14]
    assert SequenceLayout("zigzag", 2, 1, 16, (0, 8, 13)).documents is None  # only per_document reads them
    with pytest.raises(ValueError, match="strictly increasing"):
        SequenceLayout("per_document", 2, 1, 16, (0, 8, 8, 13), SMALL_CHUNKS)


def test_the_chunk_size_is_a_field_of_the_layout():
    """Two layouts that differ only in min_chunk place tokens differently side by side in one process
    (nothing global, nothing cached across them); kinds that never cut documents ignore it."""
    small = SequenceLayout("per_document", 2, 1, 16, (0, 8, 13), SMALL_CHUNKS)
    default = SequenceLayout("per_document", 2, 1, 16, (0, 8, 13))  # documents too short to cut: zigzag
    assert small != default and default.min_chunk == 64
    assert small.indices().tolist() == [0, 1, 6, 7, 8, 10, 12, 15, 2, 3, 4, 5, 9, 11, 13, 14]
    assert torch.equal(default.indices(), SequenceLayout("zigzag", 2, 1, 16).indices())
    assert SequenceLayout("zigzag", 2, 1, 16, min_chunk=SMALL_CHUNKS) == SequenceLayout("zigzag", 2, 1, 16)
    with pytest.raises(ValueError, match="min_chunk"):
        SequenceLayout("per_document", 2, 1, 16, (0, 8, 13), 0)


def _visible_pairs(positions: list[int], seq_len: int, cu: list[int]) -> int:
    """Causal (query, key) pairs of the given query positions, counted on the whole sequence."""
    docs = document_ids(seq_len, cu)
    return sum(int(((docs == docs[p]) & (torch.arange(seq_len) <= p)).sum()) for p in positions)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_schedule_computes_exactly_the_visible_pairs(ring):
    cu = [0, 3, 4, 40, 41, 60]
    layout = SequenceLayout("per_document", ring, 1, 64, tuple(cu), SMALL_CHUNKS)
    schedule = RingSchedule(layout, document_bounds(64, 60, cu), causal=True)
    for r in range(ring):
        positions = [t for run in layout.ring_runs(r) for t in range(run.start, run.stop)]
        pad = [t for t in positions if t >= 60]  # the padding is one document in the schedule
        want = _visible_pairs([t for t in positions if t < 60], 64, cu) + sum(t - 60 + 1 for t in pad)
        assert schedule.work(r) == want


@pytest.mark.parametrize("ring", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cu", [(0, 1, 4, 21, 29, 61), (0, 64), (0, 7, 9, 50), LONG_DOCS])
def test_ring_is_exact_for_every_rank_on_one_device(ring, causal, cu, min_chunk):
    """Every ring rank's kernel calls and merges (emulated on one device) give float64 attention."""
    n = 1056 if cu == LONG_DOCS else 64
    layout = SequenceLayout("per_document", ring, 1, n, cu, min_chunk)
    schedule = RingSchedule(layout, document_bounds(n, cu[-1], cu), causal)
    g = torch.Generator().manual_seed(ring)
    q, dout = (torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout[:, cu[-1] :] = 0
    out, dq, dk, dv = emulate_ring(q, k, v, dout, schedule, kernel_chooser("auto"), 8**-0.5)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, cu_seqlens=list(cu))
    ref.backward(dout)
    real = cu[-1]
    assert (out - ref)[:, :real].abs().max() < 1e-12
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got - want).abs().max() < 1e-12


def test_packed_documents_are_balanced_where_zigzag_is_not():
    """One long document among short ones: zigzag leaves ranks far apart, per_document near 1."""
    from seqmesh.bench.balance import causal_work_per_rank

    lengths = [40000] + [1000] * 24 + [1536]
    for ring in (4, 8):
        zig = causal_work_per_rank(lengths, ring, "zigzag")
        per_doc = causal_work_per_rank(lengths, ring, "per_document")
        assert sum(zig) == sum(per_doc)
        assert max(per_doc) * ring / sum(per_doc) < 1.01 < 1.1 < max(zig) * ring / sum(zig)


MESHES = [(2, 1), (1, 4)]  # which reach every line ring 2, U2 x R2 and Ulysses 4 reached here (docs/testing.md)


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_attention_is_exact_on_spawned_groups(pools, ulysses, ring):
    """Forward and dq/dk/dv on per_document shards equal float64 attention on the whole sequence,
    for documents of length 1, lengths that 2R does not divide, documents cut and kept whole,
    padding, GQA, causal and not."""
    import itertools

    from dist_cases import Case
    from document_cases import per_document_attention

    def docs(s: int) -> list[tuple[int, ...] | None]:
        return [None, (0, 1, 2, 7, 8, s - 6, s - 1), (0, 13, s), (0, 3, 4, 21, s - 3)]

    cases = [Case(s, hq, hk, causal, "per_document", cu, seed=i)
             for i, (causal, (hq, hk), s) in enumerate(itertools.product((True, False), [(4, 4), (4, 2), (4, 1)], (32, 29)))
             for cu in docs(s)]
    cases.append(Case(61, 8, 2, True, "per_document", (0, 1, 20, 21, 45, 60), dtype="float32", seed=99))
    # long enough for chunks of the default min_chunk = 64 tokens: documents cut at ring 2 and 4, others whole
    cases += [Case(s, 4, 2, causal, "per_document", cu, batch=1, seed=7)
              for causal in (True, False) for s in (560, 557)
              for cu in ((0, 1, 2, 7, 530, s - 12), (0, 200, 201, s - 3))]
    per_rank = pools.run(ulysses * ring, per_document_attention, ulysses, ring, cases)
    for results in per_rank:
        assert len(results) == len(cases)
        for case, r in zip(cases, results):
            tol = 1e-5 if case.dtype == "float32" else 1e-10
            assert max(r[k] for k in ("out", "dq", "dk", "dv")) < tol, r


@pytest.mark.parametrize("kind", ["zigzag", "per_document", "contiguous"])
def test_balance_report_counts_what_the_ring_computes(kind):
    """bench balance's work per rank (a formula over token positions) equals the pairs the ring
    schedule's kernel calls cover, padding included."""
    from seqmesh.bench.balance import causal_work_per_rank

    lengths = [1, 30, 7, 2, 50, 9]  # 99 tokens: padded to 104 for ring 4
    cu = tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0))
    for ring in (2, 4):
        layout = SequenceLayout.for_length(kind, ring, 1, cu[-1], cu, SMALL_CHUNKS)
        schedule = RingSchedule(layout, document_bounds(layout.padded_len, cu[-1], cu), causal=True)
        assert causal_work_per_rank(lengths, ring, kind, SMALL_CHUNKS) == [schedule.work(r) for r in range(ring)]


def test_bench_balance_command(capsys):
    from seqmesh.tools.cli import main

    assert main(["bench", "balance", "--seq-len", "4096", "--rings", "2"]) == 0
    out = capsys.readouterr().out
    assert "per_doc" in out and "one long first + short" in out


@pytest.mark.parametrize("ulysses,ring,layout", [(1, 4, "per_document"), (2, 2, "auto")])
def test_training_with_packed_documents_matches_one_process(pools, ulysses, ring, layout):
    """A transformers model trained on per_document shards (RoPE positions, loss, gradients, AdamW)
    matches one process on the whole batch."""
    from train_cases import TrainCase, training_parity

    case = TrainCase("llama-tiny", ulysses, ring, fsdp=False, documents=True, layout=layout)
    for rank, r in enumerate(pools.run(case.world, training_parity, case, timeout=600)):
        assert max(r["loss"]) < 1e-5 and r["grad"][0] < 1e-5, (rank, r)
        assert max(r["grad"]) < 1e-3 and r["weight"] < 1e-4, (rank, r)


def test_many_runs_take_the_vectorised_permutation():
    """Hundreds of documents (hundreds of runs): indices() still matches the hand placement."""
    docs = tuple(range(0, 16 * 300 + 1, 16)) + (4817,)  # 300 documents of 16 tokens and one of 17
    layout = SequenceLayout.for_length("per_document", 2, 2, 4820, docs, SMALL_CHUNKS)
    assert sum(len(layout.ring_runs(r)) for r in range(2)) > 256
    want = _positions_by_hand(docs, 2, layout.padded_len, SMALL_CHUNKS)
    assert layout.indices().tolist() == want[0] + want[1]
    restore = layout.indices(restore=True)
    assert torch.equal(layout.indices()[restore], torch.arange(layout.padded_len))
