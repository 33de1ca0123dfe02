"""Labels that are neither a class nor the ignore index fail on every rank, with the same message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqmesh.training.loss import chunked_linear_cross_entropy, sequence_parallel_cross_entropy


def bad_label_on_one_rank(bad: int, which: str) -> str:
    """Rank 2 alone holds one bad label; every rank must raise the pooled error (none left waiting)."""
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    hidden, weight = torch.randn(2, 6, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (2, 6))
    if dist.get_rank() == 2:
        labels[1, 3] = bad
    try:
        if which == "chunked":
            chunked_linear_cross_entropy(hidden, weight, labels, dist.group.WORLD, chunk=5)
        else:
            sequence_parallel_cross_entropy(hidden @ weight.t(), labels, dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("which", ["chunked", "full"])
def test_bad_label_fails_on_every_rank(pools, which):
    for bad in (-1, -101, 11):
        messages = pools.run(4, bad_label_on_one_rank, bad, which)
        assert all("1 target label(s) across the group are outside [0, 11)" in m for m in messages), messages
        assert f"e.g. {bad}" in messages[2]


@pytest.mark.parametrize("ignore", [-100, -1])
def test_other_ignore_index_is_ignored_not_class_zero(ignore):
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 7, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :3] = ignore
    labels[2, 5] = ignore
    want = F.cross_entropy((hidden @ weight.t()).reshape(-1, 11), labels.reshape(-1), ignore_index=ignore)
    got = chunked_linear_cross_entropy(hidden, weight, labels, None, chunk=4, ignore_index=ignore)
    full = sequence_parallel_cross_entropy(hidden @ weight.t(), labels, None, ignore_index=ignore)
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    assert full.item() == pytest.approx(want.item(), abs=1e-12)
