"""Rank functions for tests/experts/test_expert_checkpoints.py: a model with split experts saved and resumed at
another ``ep``, exported to a transformers folder, and loaded from one shard by shard.

Every figure is against the unmodified transformers model in one process (float64), the losses relative to that
model's own noise (:func:`experts_cases.reference_noise`: the same batch with its rows summed the other way round).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqmesh
from dist_cases import get_mesh
from experts_cases import ROWS, _batch, _full, _model, reference_noise, rows_loss

LR = 0.01
SAVED_STEPS = 2
RESUMED_STEPS = 2


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)  # seqmesh train's kernel (make_optimizer)


def reference_run(family: str, steps: int) -> dict:
    """The one-process run: every step's loss, the loss noise, and after ``SAVED_STEPS`` steps each parameter's
    AdamW ``exp_avg`` (what a resumed run must start from)."""
    reference = _model(family)
    batch = _batch(reference.config.vocab_size)
    opt = _adamw(reference.parameters())
    losses, noise, exp_avg = [], 0.0, {}
    for step in range(steps):
        loss = rows_loss(reference, batch)[1]
        loss.backward()
        if step == 0:
            want = {n: p.grad.clone() for n, p in reference.named_parameters()}
            noise = reference_noise(reference, batch, loss.item(), want)["loss"]
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if step + 1 == SAVED_STEPS:
            exp_avg = {n: opt.state[p]["exp_avg"].clone() for n, p in reference.named_parameters()}
    return {"losses": losses, "noise": noise, "exp_avg": exp_avg}


def _parallel(family: str, mesh, ep: int):
    from seqmesh.compose import ParallelPlan, parallelize_model

    lm = _model(family)
    sp = parallelize_model(lm, mesh, ParallelPlan(fsdp=True, ep=ep, loss_chunk=16))
    return lm, sp, _adamw(sp.parameters())


def _steps(sp, opt, mesh, dp: int, count: int) -> list[float]:
    rows = ROWS // dp
    local = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for k, v in _batch(sp.lm.config.vocab_size).items()}
    losses = []
    for _ in range(count):
        loss = sp(**seqmesh.shard_batch(local, mesh))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def resume_at_other_ep(family: str, folder: str, ulysses: int, ring: int, dp: int, saved_ep: int,
                       resumed: list[int]) -> dict:
    """Train ``SAVED_STEPS`` steps at ``saved_ep`` and save; for each ``ep`` of ``resumed``, a fresh model at that
    ``ep`` on the same ranks loads the checkpoint and trains ``RESUMED_STEPS`` more. Returns per resumed ``ep`` the
    largest loss error over all steps in units of the reference's noise, and the largest relative error of the
    loaded AdamW ``exp_avg`` (every parameter's gathered whole)."""
    from seqmesh.training.checkpoint import load_checkpoint, save_checkpoint

    mesh = get_mesh(ulysses, ring, dp_shard=dp)
    want = reference_run(family, SAVED_STEPS + RESUMED_STEPS)
    _, sp, opt = _parallel(family, mesh, saved_ep)
    first = _steps(sp, opt, mesh, dp, SAVED_STEPS)
    path = save_checkpoint(folder, SAVED_STEPS, sp, opt)
    del sp, opt
    out = {}
    for ep in resumed:
        lm, sp, opt = _parallel(family, mesh, ep)
        load_checkpoint(path, sp, opt)
        state_err = 0.0
        for name, p in lm.named_parameters():
            got, ref = _full(opt.state[p]["exp_avg"]), want["exp_avg"][name]
            state_err = max(state_err, float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
        losses = first + _steps(sp, opt, mesh, dp, RESUMED_STEPS)
        errors = [abs(a - b) / want["noise"] for a, b in zip(losses, want["losses"])]
        out[ep] = {"loss": max(errors), "exp_avg": state_err, "losses": losses}
        del sp, opt
    dist.barrier()
    return out


def save_tiny(family: str, folder: str) -> None:
    """The tiny ``family`` as transformers saves it (per-expert tensors for the families that fuse on load)."""
    _model(family).save_pretrained(folder)


def _reference(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa",
                                                experts_implementation="eager")


def load_then_export(family: str, folder: str, out: str, ulysses: int, ring: int, dp: int, ep: int) -> dict:
    """``folder`` loaded shard by shard (seqmesh's loader) into a meta model split with ``ep`` and FSDP2: the bytes
    this rank read and the bytes of its parts (equal: it read no expert and no row it does not hold); the
    largest difference of any parameter's gathered whole from ``from_pretrained``'s; one SGD step's loss against
    the reference's in units of its noise; then ``export_pretrained`` to ``out`` and, on rank 0, the exported
    folder through ``from_pretrained``: largest difference from the parallel model's gathered weights, and its
    logits' relative difference from the one-process model after the same step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from seqmesh.compose import ParallelPlan, parallelize_model
    from seqmesh.comm.ranks import local_part
    from seqmesh.model.pretrained import load_pretrained, saved_tensors
    from seqmesh.model.writer import export_pretrained

    mesh = get_mesh(ulysses, ring, dp_shard=dp)
    reference = _reference(folder)
    batch = _batch(reference.config.vocab_size)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float64,
                                              attn_implementation="sdpa", experts_implementation="eager")
    sp = parallelize_model(lm, mesh, ParallelPlan(fsdp=True, ep=ep, loss_chunk=16))
    read = load_pretrained(sp, folder, "cpu")
    held = sum(local_part(t).numel() * t.element_size() for t in saved_tensors(lm).values())
    want = dict(reference.named_parameters())
    loaded = max(float((_full(p) - want[n]).abs().max()) for n, p in lm.named_parameters())

    ref_loss = rows_loss(reference, batch)[1]
    ref_loss.backward()
    grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    noise = reference_noise(reference, batch, ref_loss.item(), grads)["loss"]
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    rows = ROWS // dp
    local = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for k, v in batch.items()}
    opt = torch.optim.SGD(sp.parameters(), lr=LR)
    loss = sp(**seqmesh.shard_batch(local, mesh))
    loss.backward()
    opt.step()
    gathered = {n: _full(p).detach() for n, p in lm.named_parameters()}
    export_pretrained(sp, out, overwrite=True)
    result = {"loaded": loaded, "read": read, "held": held, "loss": abs(loss.item() - ref_loss.item()) / noise}
    if dist.get_rank() == 0:
        exported = _reference(out)
        result["exported"] = max(float((p - gathered[n]).abs().max()) for n, p in exported.named_parameters())
        result["names"] = sorted(exported.state_dict()) == sorted(reference.state_dict())
        with torch.no_grad():
            got, ref = rows_loss(exported, batch)[0], rows_loss(reference, batch)[0]
        result["logits"] = float((got - ref).abs().max() / ref.abs().max())
    dist.barrier()
    return result


def load_export_all(cases: list[tuple]) -> list[dict]:
    return [{"case": c, **load_then_export(*c)} for c in cases]
