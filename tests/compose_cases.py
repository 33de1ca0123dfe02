"""seqmesh.compose.parallelize_model on spawned ranks against the unmodified transformers model on the
whole sequence, in float64: the loss and every parameter's gradient, and the reference's own rounding."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from family_cases import build, family_config, reference_rounding
from seqmesh.compose import ParallelPlan, parallelize_model
from seqmesh.model.fsdp import sync_gradients
from seqmesh.model.lm import SequenceParallelLM

SEQ_LEN = 45


class _CountingLM(SequenceParallelLM):
    """A wrapper subclass, as the Trainer passes one: counts its forwards."""

    calls = 0

    def forward(self, *args, **kwargs):
        _CountingLM.calls += 1
        return super().forward(*args, **kwargs)


def composed_parity(ulysses: int, ring: int, plan: dict) -> dict:
    """Loss error, worst relative gradient error and the reference's rounding of both, for the llama
    family composed with ``ParallelPlan(**plan)`` on a ``ulysses x ring`` mesh (dp takes the rest)."""
    mesh = get_mesh(ulysses, ring)
    config = family_config("llama")
    ids = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(5))
    reference = build(config)
    logits = reference(input_ids=ids, use_cache=False).logits
    ref_loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
    ref_loss.backward()
    rounding = reference_rounding(config, {"input_ids": ids}, logits.detach(), ref_loss.detach(), reference)

    _CountingLM.calls = 0
    logged = _Lines()
    logger = logging.getLogger("seqmesh.compose")
    logger.addHandler(logged)
    level = logger.level
    logger.setLevel(logging.INFO)  # not `logger.level = ...`: that skips the cache logging keeps once a logger has
    # been asked (a pooled rank that composed a model before answered "INFO is off" from it and logged nothing)
    try:
        module = parallelize_model(build(config), mesh, ParallelPlan(**plan, loss_chunk=16), wrapper=_CountingLM)
    finally:
        logger.removeHandler(logged)
        logger.setLevel(level)
    loss = module(**seqmesh.shard_batch({"input_ids": ids}, mesh))
    loss.backward()
    if not plan.get("fsdp", True):  # replicated weights: the loop sums the gradients, as seqmesh train does
        sync_gradients(module, mesh)
    want = dict(reference.named_parameters())
    worst = 0.0
    for name, p in module.lm.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ref = want[name].grad
        worst = max(worst, float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
    sharded = any(hasattr(p, "full_tensor") for p in module.parameters())
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": worst, "rounding": rounding,
            "sharded": sharded, "wrapper_calls": _CountingLM.calls, "log": logged.lines}


class _Lines(logging.Handler):
    """The messages logged while it is attached, in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
