"""Worker-side cases for Doge's cross-domain experts (seqmesh.hf.doge_moe): several rows, plain and packed, against
transformers' model on one process (float64), and the mutations the comparison must see."""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist

import seqmesh
from dist_cases import get_mesh, refusals_said
from family_cases import build, family_config
from seqmesh.hf import doge_moe, parallelize, unparallelize
from seqmesh.model.doge import is_doge_moe

CUTS = (0, 7, 8, 25, 40)  # the packed rows' documents (every row alike)


def _batch(rows: int, documents: bool, length: int) -> dict:
    """``rows`` rows of ``length`` tokens (an odd count of rows: a call's second half starts inside a row); packed:
    the documents of CUTS in every row."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (rows, length), generator=g)
    if not documents:
        return {"input_ids": ids}
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CUTS[:-1], CUTS[1:])])
    return {"input_ids": ids, "position_ids": positions.expand(rows, -1).clone()}


def _reference(model, batch: dict) -> torch.Tensor:
    """(B, S, V) logits of transformers' model: the rows in one call, packed documents one call each (every row's
    share of a document in it)."""
    ids = batch["input_ids"]
    if "position_ids" not in batch:
        return model(input_ids=ids, use_cache=False).logits
    return torch.cat([model(input_ids=ids[:, a:b], position_ids=batch["position_ids"][:, a:b], use_cache=False).logits
                      for a, b in zip(CUTS[:-1], CUTS[1:])], dim=1)


def rows_parity(ulysses: int, ring: int, layout: str, documents: bool, length: int = CUTS[-1], norm_topk: bool = False,
                mutate=None) -> dict:
    """Largest logit error and largest gradient error (relative to the gradient's largest entry) of the
    parallelized model on ``rows`` rows against transformers' float64 model; beside them (``rounding``), how far the
    same reference moves in float32, the tolerance's scale. The gradients are of ``sum(logits x W)`` for a fixed
    random ``W``. ``length``: the plain rows' tokens (41: the layout pads them); ``norm_topk``: the routing weights
    normalised (norm_topk_prob); ``mutate(model)`` changes the parallelized model only."""
    mesh = get_mesh(ulysses, ring)
    rows = 2 if documents else 3
    assert not documents or length == CUTS[-1], length
    batch = _batch(rows, documents, length)
    config = family_config("doge-moe")
    config.norm_topk_prob = norm_topk
    pristine = build(config)
    weights = torch.randn(rows, length, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    reference = copy.deepcopy(pristine)
    ref = _reference(reference, batch)
    (ref * weights).sum().backward()
    single = copy.deepcopy(pristine).float()
    low = _reference(single, batch)
    (low * weights.float()).sum().backward()
    moved = max(float((p.grad.double() - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-300))
                for p, q in zip(single.parameters(), reference.parameters()) if q.grad is not None)
    model = parallelize(copy.deepcopy(pristine), mesh)
    if mutate is not None:
        mutate(model)
    local = seqmesh.shard_batch(batch, mesh, layout=layout)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], seqmesh=local["seqmesh"],
                   use_cache=False).logits
    mine = seqmesh.sequence_positions(length, mesh, layout=layout, cu_seqlens=local["seqmesh"].cu_seqlens)
    real = mine < length
    (logits[:, real] * weights[:, mine[real]]).sum().backward()
    grad = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        if q.grad is None:  # a weight the logits do not reach
            continue
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grad = max(grad, float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-300)))
    whole = seqmesh.gather_sequence(logits.detach(), mesh, layout=layout, length=length)
    unparallelize(model)
    return {"logits": float((whole - ref.detach()).abs().max()), "grad": grad,
            "rounding": {"logits": float((low.detach().double() - ref.detach()).abs().max()), "grad": moved}}


def routed_by_own_shard(model) -> None:
    """Each layer run as transformers' forward on this rank's tokens (the experts routed by the shard's logits)."""
    for m in model.modules():
        if is_doge_moe(m):
            m.forward = types.MethodType(type(m).forward, m)


class _ShardOrder:
    """A layout whose shard order is taken for the sequence's (no restore)."""

    def __init__(self, layout):
        self.layout, self.padded_len = layout, layout.padded_len

    def indices(self, restore: bool = False, device=None) -> torch.Tensor:
        return torch.arange(self.padded_len, device=device)


def routed_in_shard_order(cases: list[tuple]) -> list[dict]:
    """:func:`rows_parity` of each case, the gathered logits read in shard order as if it were the sequence's."""
    original = doge_moe.sequence_layout
    doge_moe.sequence_layout = lambda *args, **kwargs: _ShardOrder(original(*args, **kwargs))
    try:
        return [{"case": c, **rows_parity(*c)} for c in cases]
    finally:
        doge_moe.sequence_layout = original


def parity(cases: list[tuple], mutation: str | None = None) -> list[dict]:
    """:func:`rows_parity` of each ``(ulysses, ring, layout, documents)``; ``mutation``: "own shard" or "shard
    order"."""
    if mutation == "shard order":
        return routed_in_shard_order(cases)
    mutate = routed_by_own_shard if mutation == "own shard" else None
    return [{"case": c, **rows_parity(*c, mutate=mutate)} for c in cases]


def refusals() -> dict[str, str]:
    """What a parallelized Doge with experts says for right-padded rows, for generation's check and for a prefill onto
    a kept cache: each ValueError's message ("" where the call ran: rows whose attention_mask is all ones, under
    "whole rows")."""
    from seqmesh.inference.generate import check_extension, check_generate

    mesh = get_mesh(2, 1)
    model = parallelize(build(family_config("doge-moe")), mesh)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 15:] = 0
    whole = model(**seqmesh.shard_batch({"input_ids": ids, "attention_mask": torch.ones_like(mask)}, mesh),
                  use_cache=False).logits
    said = {"whole rows": "" if torch.isfinite(whole).all() else "not finite"}
    padded = seqmesh.shard_batch({"input_ids": ids, "attention_mask": mask}, mesh)
    said |= refusals_said({"padded rows": lambda: model(**padded, use_cache=False),
                           "generate": lambda: check_generate(model, mesh),
                           "extension": lambda: check_extension(model, mesh, None, ids)})
    unparallelize(model)
    return said


def mlp_saved_bytes(seq_len: int = 96, norm_topk: bool = False) -> dict:
    """Bytes the first decoder layer's MLP of Doge with its cross-domain experts (:func:`experts_config`) keeps for
    backward on this rank of Ulysses 2, in bfloat16 (:func:`planner_cases.mlp_saved_bytes`)."""
    from planner_cases import mlp_saved_bytes as saved

    config = experts_config(True)
    config.norm_topk_prob = norm_topk
    return saved(build(config), seq_len)


def experts_config(is_moe: bool):
    """Doge with rows wide enough that the experts' tensors are most of the layer's (64 wide, 256 experts, 16 a
    token)."""
    import transformers as tf

    return tf.DogeConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=64, keep_window_size=128, is_moe=is_moe, num_experts=256,
                         num_experts_per_tok=16)
