"""``seqmesh verify``: one step of a configuration with sequence parallelism and without, compared.

Every rank also runs the unmodified model (transformers' own SDPA attention) on the whole batch of
every data-parallel rank, with the same loss definition written independently here, and compares
the loss and every parameter's gradient with the sequence-parallel step. Use it when a loss looks
off: a wrong degree, layout or data pipeline shows up as a difference far above rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .loss import IGNORE_INDEX
from .model import build_model
from .config import TrainConfig
from .train import build, make_dataset


def _reference_loss(model, batches: list[dict], device: torch.device) -> torch.Tensor:
    """Mean next-token loss over all valid targets of ``batches``, one device, whole sequences,
    written without seqmesh's data pipeline: target t is label t+1, except where the next token starts
    a new packed document (its position restarts at 0). transformers' SDPA attention keeps packed
    documents apart from the same position_ids."""
    total = torch.zeros((), device=device)
    count = 0
    for batch in batches:
        ids = batch["input_ids"].to(device)
        positions = batch.get("position_ids")
        targets = batch.get("labels", batch["input_ids"])[:, 1:].clone()
        if positions is not None:
            targets[positions[:, 1:] == 0] = IGNORE_INDEX
            positions = positions.to(device)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, :-1]
        targets = targets.to(device)
        total = total + F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="sum")
        count += int((targets != IGNORE_INDEX).sum())
    return total / max(count, 1)


def verify(cfg: TrainConfig, *, rtol: float | None = None) -> dict:
    """Returns ``{"loss_diff", "worst": [(name, relative difference)], "tolerance", "ok"}``."""
    from .data import shard_batch

    data = make_dataset(cfg)  # data and vocabulary errors come before any model is built
    mesh, module, device = build(cfg)
    reference = build_model(cfg.model, seed=cfg.seed, device=device)
    with torch.no_grad():  # the same weights, however the sharded model was initialised
        ref_params = dict(reference.named_parameters())
        for name, p in module.named_parameters():
            ref_params[name.removeprefix("lm.")].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
    batches = [data.batch(0, d, cfg.batch, mesh.dp_size) for d in range(mesh.dp_size)]
    ref_loss = _reference_loss(reference, batches, device)
    ref_loss.backward()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and not cfg.fsdp):
        local = shard_batch(batches[mesh.dp_rank], mesh, layout=cfg.layout)
        loss = module(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in local.items()})
    loss.backward()
    if not cfg.fsdp:
        from .fsdp import sync_gradients

        sync_gradients(module, mesh)
    ref_params = dict(reference.named_parameters())
    diffs = []
    for name, p in module.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref_params[name.removeprefix("lm.")].grad
        diffs.append((name.removeprefix("lm."), float((grad.float() - want).abs().max() / want.abs().max().clamp(min=1e-12))))
    tolerance = rtol if rtol is not None else (5e-2 if cfg.bf16 else 1e-4)
    loss_diff = abs(float(loss) - float(ref_loss))
    worst = sorted(diffs, key=lambda x: -x[1])[:5]
    ok = loss_diff <= tolerance * max(1.0, abs(float(ref_loss))) and worst[0][1] <= tolerance
    dist.barrier()
    return {"loss": float(loss), "reference_loss": float(ref_loss), "loss_diff": loss_diff, "worst": worst,
            "tolerance": tolerance, "ok": ok, "mesh": repr(mesh)}
