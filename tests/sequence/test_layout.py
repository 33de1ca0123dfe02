"""Layouts as permutations: padding, inverses, zigzag placement, and shard/gather round trips."""

from __future__ import annotations

import pytest
import torch

from seqmesh.sequence.layout import SequenceLayout


def test_zigzag_places_chunks_head_and_tail():
    lay = SequenceLayout("zigzag", 4, 1, 16)  # chunks of 2
    assert lay.indices().tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert [(r.start, r.length, r.offset) for r in lay.ring_runs(1)] == [(2, 2, 0), (12, 2, 2)]


def test_usp_zigzag_splits_the_ring_pair_over_ulysses():
    lay = SequenceLayout("zigzag", 2, 2, 8)  # ring chunks of 2: ring 0 holds (0,1,6,7)
    assert [lay.local_positions(i).tolist() for i in range(4)] == [[0, 1], [6, 7], [2, 3], [4, 5]]


@pytest.mark.parametrize("kind,ring,ulysses", [("zigzag", 3, 2), ("zigzag", 2, 3), ("contiguous", 3, 2), ("zigzag", 1, 4)])
def test_indices_restore_is_the_inverse(kind, ring, ulysses):
    lay = SequenceLayout.for_length(kind, ring, ulysses, 50)
    assert lay.padded_len >= 50 and lay.padded_len % (ring * ulysses) == 0
    order, restore = lay.indices(), lay.indices(restore=True)
    assert sorted(order.tolist()) == list(range(lay.padded_len))
    assert torch.equal(order[restore], torch.arange(lay.padded_len))


def test_indices_are_built_once_per_layout_and_positions_are_the_callers_own():
    """Every layer that meets an equal layout gets the same permutation tensor (no rebuild per call);
    ``local_positions`` hands out a copy, so a caller writing into it leaves the permutation intact."""
    lay = SequenceLayout("zigzag", 4, 1, 16)
    assert lay.indices() is SequenceLayout("zigzag", 4, 1, 16).indices()
    assert lay.indices(restore=True) is lay.indices(restore=True, device="cpu") is not lay.indices()
    positions = lay.local_positions(1)
    positions += 100
    assert lay.indices().tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]


def test_minimal_padding():
    assert SequenceLayout.for_length("zigzag", 2, 2, 17).padded_len == 20  # multiple of 2*lcm(2,2)=4
    assert SequenceLayout.for_length("zigzag", 2, 3, 17).padded_len == 24  # multiple of 2*lcm(2,3)=12
    assert SequenceLayout.for_length("contiguous", 2, 3, 17).padded_len == 18


def test_bad_lengths_name_the_multiple():
    with pytest.raises(ValueError, match="positive multiple of 8, got 12"):
        SequenceLayout("zigzag", 4, 1, 12)
    with pytest.raises(ValueError, match="unknown layout 'spiral'"):
        SequenceLayout.for_length("spiral", 2, 1, 8)
