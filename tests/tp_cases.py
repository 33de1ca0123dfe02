"""Tensor parallelism inside the sequence mesh on spawned ranks, against the unmodified transformers model
on the whole sequence in one process (float64): the loss and every parameter's gradient, and the
reference's own rounding (``family_cases.reference_rounding``)."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import get_mesh
from family_cases import _batch, _reference_loss, build, computed_once, family_config, gradients_of, reference_rounding
from seqmesh.comm.ranks import full_value
from seqmesh.compose import ParallelPlan, parallelize_model
from seqmesh.model.fsdp import sync_gradients

SEQ_LEN = 45


# (family, kv_heads, documents, samples) -> _tp_reference's tuple, in each rank process (a pool outlives its tests)
TP_REFERENCES: dict[tuple, tuple] = {}


def _config(family: str, kv_heads: int | None):
    config = family_config(family)
    if kv_heads is not None:
        config.num_key_value_heads = kv_heads
    return config


def _batches(config, documents: bool, samples: int) -> list[dict]:
    """``samples`` sequences: one stream per data-parallel rank (and micro-batch), each its own tokens."""
    batches = [_batch(SEQ_LEN, config.vocab_size, documents) for _ in range(samples)]
    g = torch.Generator().manual_seed(11)
    for b in batches[1:]:  # different samples per data-parallel rank
        b["input_ids"] = torch.randint(0, config.vocab_size, b["input_ids"].shape, generator=g)
    return batches


def _tp_reference(family: str, kv_heads: int | None, documents: bool, samples: int) -> tuple:
    """``(loss, gradients, rounding)`` of the single-process model on all ``samples`` sequences: the whole batch's
    mean, the sum of each sample's target losses over all targets (``gradients``: ``family_cases.gradients_of``)."""
    config = _config(family, kv_heads)
    batches = _batches(config, documents, samples)
    reference = build(config)
    total_targets, total = 0, 0.0
    for b in batches:
        logits, loss = _reference_loss(reference, b)
        n = SEQ_LEN - 1 - (int((b["position_ids"][0, 1:] == 0).sum()) if "position_ids" in b else 0)
        total = total + loss * n
        total_targets += n
    ref_loss = total / total_targets
    ref_loss.backward()
    rounding = reference_rounding(config, batches[-1], logits.detach(), loss.detach(), reference)
    return ref_loss.detach(), gradients_of(reference), rounding


def _reference_key(family: str, options: dict) -> tuple:
    """The reference a case of ``tp_parity(family, ..., **options)`` compares with: one sequence per data-parallel
    rank (replicas included) and micro-batch row."""
    samples = options.get("dp", 1) * options.get("replicas", 1) * options.get("batch_size", 1)
    return family, options.get("kv_heads"), options.get("documents", False), samples


def tp_parity_all(cases: list[tuple]) -> list[dict]:
    """:func:`tp_parity` of each ``(family, ulysses, ring, tp, options)``, the references they need computed once
    over the group (``family_cases.computed_once``)."""
    computed_once([_reference_key(c[0], c[4]) for c in cases], _tp_reference, TP_REFERENCES)
    return [{"case": c[:4] + (tuple(sorted(c[4].items())),), **tp_parity(*c[:4], **c[4])} for c in cases]


def tp_parity(family: str, ulysses: int, ring: int, tp: int, *, dp: int = 1, layout: str = "zigzag",
              documents: bool = False, fsdp: bool = True, batch_size: int = 1, shift_positions_on: int | None = None,
              kv_heads: int | None = None, replicas: int = 1, checkpointing: bool = False, offload: bool = False,
              efficient_norm: bool = False, tiled_mlp: bool = False) -> dict:
    """Loss error, worst relative gradient error (and whose), the reference's rounding of both, for
    ``family`` composed on a ``dp x ring x ulysses x tp`` mesh, each data-parallel rank on its own samples.
    ``shift_positions_on``: a deliberate error for the test that the comparison sees one, the position ids of
    that rank one too far (so only its tensor-parallel slice of the heads rotates wrongly)."""
    mesh = get_mesh(ulysses, ring, dp, replicas, tp)
    config = _config(family, kv_heads)
    key = _reference_key(family, dict(dp=dp, replicas=replicas, batch_size=batch_size, kv_heads=kv_heads,
                                      documents=documents))
    if key not in TP_REFERENCES:
        TP_REFERENCES[key] = _tp_reference(*key)
    ref_loss, want, rounding = TP_REFERENCES[key]
    batches = _batches(config, documents, key[3])

    module = parallelize_model(build(config), mesh, ParallelPlan(fsdp=fsdp, loss_chunk=16, checkpointing=checkpointing,
                                                                  efficient_norm=efficient_norm, tiled_mlp=tiled_mlp,
                                                                  mlp_tiles=3))
    moved = 0
    if offload:  # the activation offload the training loop sets up: the layers' saved DTensor inputs moved
        from seqmesh.memory.offload import enable_activation_offload

        offloader = enable_activation_offload(module.lm, "cpu")
    mine = batches[mesh.dp_rank * batch_size : (mesh.dp_rank + 1) * batch_size]
    batch = {k: torch.cat([b[k] for b in mine]) for k in mine[0]}
    local = seqmesh.shard_batch(batch, mesh, layout=layout)
    if shift_positions_on == torch.distributed.get_rank():
        local["position_ids"] = local["position_ids"] + 1
    module.train()
    loss = module(**local)
    if offload:
        moved = offloader.moved_bytes
    loss.backward()
    if not fsdp:
        sync_gradients(module, mesh)
    worst, name_of = 0.0, ""
    for name, p in module.lm.named_parameters():
        ref = want[name].grad
        err = float((full_value(p.grad) - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        if err > worst:
            worst, name_of = err, name
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": worst, "worst": name_of, "rounding": rounding,
            "tp_sharded": sum(1 for p in module.parameters() if "Shard" in str(getattr(p, "placements", ""))),
            "offloaded_bytes": moved}


def settled_gradients() -> list[str]:
    """Placements of every gradient after a step without FSDP2 and ``sync_gradients``: none may stay partial."""
    mesh = get_mesh(1, 1, 1, 1, 2)
    config = family_config("qwen3")
    module = parallelize_model(build(config), mesh, ParallelPlan(fsdp=False, loss_chunk=16))
    module(**seqmesh.shard_batch(_batch(SEQ_LEN, config.vocab_size, False), mesh)).backward()
    sync_gradients(module, mesh)
    return sorted({str(getattr(p.grad, "placements", "plain")) for p in module.parameters()})


def hsdp_refusal() -> str:
    """The error of composing TP 2 under two HSDP replicas (on a torch that cannot build that mesh)."""
    mesh = get_mesh(1, 1, 1, 2, 2)
    try:
        parallelize_model(build(family_config("qwen3")), mesh, ParallelPlan())
    except ValueError as err:
        return str(err)
    return "no error"
