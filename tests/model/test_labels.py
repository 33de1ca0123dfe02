"""Labels that are neither a class nor the ignore index fail on every rank, with the same message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqmesh.model.loss import chunked_linear_cross_entropy, sequence_parallel_cross_entropy


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


def model_loss_with_ignore_index(ignore: int) -> list[float]:
    """shard_batch(..., ignore_index) then the model's own loss, against plain cross-entropy of the
    one-process model with the same ignore_index (the issue's case: -1 used to score as class 0)."""
    import seqmesh
    from dist_cases import get_mesh
    from seqmesh.hf import parallelize
    from seqmesh.model.lm import SequenceParallelLM, build_model

    mesh = get_mesh(2, 1)
    reference = build_model("llama-tiny", seed=0)
    sp = SequenceParallelLM(parallelize(build_model("llama-tiny", seed=0), mesh), mesh, chunk=8)
    torch.manual_seed(3)
    ids = torch.randint(0, reference.config.vocab_size, (1, 30))
    labels = ids.clone()
    labels[0, :9] = ignore  # a prompt that is not scored
    labels[0, 20:23] = ignore
    loss = sp(**seqmesh.shard_batch({"input_ids": ids, "labels": labels}, mesh, ignore_index=ignore))
    logits = reference(input_ids=ids, use_cache=False).logits[0, :-1]
    want = F.cross_entropy(logits, labels[0, 1:], ignore_index=ignore)
    return [float(loss), float(want)]


def test_shard_batch_ignore_index_reaches_the_model_loss(pools):
    for ignore in (-100, -1):
        got, want = pools.run(2, model_loss_with_ignore_index, ignore)[0]
        assert got == pytest.approx(want, abs=1e-5), ignore
