"""The expert-parallel route's counts: per expert as ``torch.bincount`` counts them, picks outside the experts named
by ``plan_route`` (not counted), and the one host read that a rehearsal's fake tensors answer by assumption."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from seqmesh.experts.dispatch import pair_counts, plan_route
from seqmesh.tensor_values import host_ints


def test_pair_counts_are_bincounts_and_the_order_sorts_by_expert():
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, 7, (50, 3), generator=g)
    order, counts = pair_counts(picks, 8)  # expert 7 is never picked: a zero, not a shorter table
    assert torch.equal(counts, torch.bincount(picks.reshape(-1), minlength=8))
    assert torch.equal(picks.reshape(-1)[order], torch.sort(picks.reshape(-1)).values)
    assert torch.equal(pair_counts(picks.int(), 8)[1], counts)  # a router that picks in int32


def test_a_pick_outside_the_experts_is_named_not_counted():
    picks = torch.tensor([[0, 1], [3, -1], [4, 2]])  # -1: a "no expert" slot; 4: past the last of 4 experts
    _, counts = pair_counts(picks, 4)
    assert counts.tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="picked 2 expert indices outside"):
        plan_route(picks, 4, 1, None)


def test_host_ints_reads_values_or_takes_the_assumption_on_fake_tensors():
    assert host_ints(torch.tensor([3, 4]), lambda: [0, 0]) == [3, 4]
    with FakeTensorMode():
        fake = torch.tensor([3, 4]) + 0
        assert host_ints(fake, lambda: [7, 7]) == [7, 7]
