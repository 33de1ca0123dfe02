"""shard_batch (shift before slicing, documents, positions, padding) and the pooled losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_cases import pooled_loss, shard_batch_roundtrip
from seqmesh.model.loss import chunked_linear_cross_entropy


@pytest.mark.parametrize("ulysses,ring,layout", [(2, 2, "zigzag"), (1, 4, "contiguous"), (4, 1, "zigzag")])
def test_shard_batch_shifts_before_slicing(pools, ulysses, ring, layout):
    for back in pools.run(4, shard_batch_roundtrip, ulysses, ring, layout):
        ids = list(range(100, 123))
        assert back["input_ids"] == ids
        assert back["position_ids"] == list(range(5)) + [0] + list(range(17))
        # next token everywhere except the last token of each document (4, 5, 22)
        want = [ids[t + 1] if t not in (4, 5, 22) else -100 for t in range(23)]
        assert back["shift_labels"] == want
        assert back["cu_seqlens"] == (0, 5, 6, 23)
        assert back["local_len"] == 6  # 23 padded to 24 over 4 ranks


def right_padded_roundtrip(ulysses: int, ring: int) -> dict:
    """Shard a right-padded batch with its own labels, gather the fields back."""
    import seqmesh
    from dist_cases import get_mesh

    mesh = get_mesh(ulysses, ring)
    ids = torch.arange(100, 126).reshape(2, 13)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, 8:] = 0  # row 0: 8 real tokens, 5 of padding; row 1: all 13 real
    local = seqmesh.shard_batch({"input_ids": ids, "labels": ids + 1000, "attention_mask": mask}, mesh)
    return {k: seqmesh.gather_sequence(local[k], mesh, length=13).tolist()
            for k in ("input_ids", "position_ids", "shift_labels")}


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (1, 4)])
def test_shard_batch_right_padding(pools, ulysses, ring):
    ids = [list(range(100, 113)), list(range(113, 126))]
    real = [8, 13]
    # target t is the label (input + 1000) of token t + 1 while t + 1 is a real token of that row
    want = [[ids[r][t + 1] + 1000 if t + 1 < real[r] else -100 for t in range(13)] for r in range(2)]
    for back in pools.run(4, right_padded_roundtrip, ulysses, ring):
        assert back["input_ids"] == ids
        assert back["shift_labels"] == want
        assert back["position_ids"] == [list(range(13))] * 2  # one sequence per row: positions 0..12


@pytest.mark.parametrize("empty", [[], [2], [0, 1, 2, 3]], ids=["all-ranks", "one-rank-empty", "nothing-valid"])
def test_pooled_loss_equals_one_device(pools, empty):
    for r in pools.run(4, pooled_loss, empty):
        assert r["value"] == pytest.approx(r["ref"], abs=1e-12)
        assert r["grad_err"] < 1e-12


def test_chunked_head_equals_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(29, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 29, (2, 13))
    labels[0, 3] = labels[1, -1] = -100
    loss = chunked_linear_cross_entropy(hidden, weight, labels, None, chunk=5)
    loss.backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.t()).reshape(-1, 29), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    torch.testing.assert_close(hidden.grad, h2.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(weight.grad, w2.grad, atol=1e-12, rtol=0)


def test_chunked_head_makes_its_logits_once_and_its_gradients_match_full_logits():
    """The loss makes each tile's gradients in its forward (seqmesh.model.loss): its matrix products are 6 FLOPs a
    weight and token in all (the planner's count), and its gradients equal plain PyTorch's on full logits with a
    bias, a soft-cap, an incoming gradient that is not 1, a second backward through a retained graph, a frozen
    head, and no gradient at all."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    n, h, v, cap = 26, 8, 29, 2.0
    labels = torch.randint(0, v, (2, 13))
    labels[0, 3] = labels[1, -1] = -100
    hidden, weight, bias = (torch.randn(*shape, dtype=torch.float64) for shape in ((2, 13, h), (v, h), (v,)))

    def reference(x, w, b):
        logits = (cap * torch.tanh((x @ w.t() + b) / cap)).reshape(-1, v)
        return F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = chunked_linear_cross_entropy(*leaves[:2], labels, None, chunk=5, softcap=cap, bias=leaves[2])
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = reference(*ref_leaves)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    for _ in range(2):  # the second backward through the retained graph adds the same gradients again
        (0.3 * loss).backward(retain_graph=True)
        (0.3 * ref).backward(retain_graph=True)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=0)

    frozen = hidden.clone().requires_grad_()
    chunked_linear_cross_entropy(frozen, weight, labels, None, chunk=5).backward()
    plain = hidden.clone().requires_grad_()
    F.cross_entropy((plain @ weight.t()).reshape(-1, v), labels.reshape(-1), ignore_index=-100).backward()
    torch.testing.assert_close(frozen.grad, plain.grad, atol=1e-12, rtol=0)
    with torch.no_grad():
        evaluated = chunked_linear_cross_entropy(hidden, weight, labels, None, chunk=5, softcap=cap, bias=bias)
    assert evaluated.item() == pytest.approx(ref.item(), abs=1e-12) and evaluated.grad_fn is None

    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        chunked_linear_cross_entropy(x, w, labels, None, chunk=5).backward()
    assert counter.get_total_flops() == 6 * n * h * v


def test_shard_batch_errors():
    from seqmesh.sequence.batch import documents_from_positions, real_lengths

    with pytest.raises(ValueError, match="different packed documents"):
        documents_from_positions(torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="right padding"):
        real_lengths(torch.tensor([[0, 1, 1, 1]]))


def test_head_errors_list_the_degrees_that_work():
    from types import SimpleNamespace

    from seqmesh.hf import check_heads

    with pytest.raises(ValueError, match="too few for ulysses=8.*ulysses=1 x ring=8, ulysses=2 x ring=4, ulysses=4 x ring=2"):
        check_heads(4, 2, SimpleNamespace(ulysses=8, sp_size=8))


def parallelize_roundtrip() -> str:
    from dist_cases import get_mesh
    from transformers import AttentionInterface

    from seqmesh.hf import parallelize, unparallelize
    from seqmesh.model.lm import build_model

    model = build_model("llama-tiny")
    parallelize(model, get_mesh(2, 1))
    name = model.config._attn_implementation
    assert name.startswith("seqmesh_") and name in AttentionInterface._global_mapping
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
        raise AssertionError("a call without the 'seqmesh' entry must fail")
    except ValueError as err:
        assert "seqmesh.shard_batch" in str(err)
    unparallelize(model)
    assert model.config._attn_implementation == "sdpa" and name not in AttentionInterface._global_mapping
    return "ok"


def test_parallelize_is_undone(pools):
    assert pools.run(2, parallelize_roundtrip) == ["ok", "ok"]
