"""Memory accounting and techniques on spawned ranks: each function returns plain numbers to assert on."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import get_mesh
from seqmesh.hf import parallelize
from seqmesh.memory import MemoryTracker
from seqmesh.memory.rmsnorm import enable_efficient_norm
from seqmesh.memory.tiled_mlp import enable_tiled_mlp
from seqmesh.model.fsdp import apply_fsdp, enable_checkpointing
from seqmesh.model.lm import SequenceParallelLM, build_model
from seqmesh.training.step import make_optimizer


def _batch(seq_len: int, vocab: int = 256) -> dict:
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids}


def _local_bytes(tensors) -> int:
    """Bytes of this rank's part of ``tensors``, counted from shapes (not from storages)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _step(ulysses: int, *, tiled: bool = False, norm: bool = False, cpu_offload: bool = False,
          checkpointing: bool = False, seq_len: int = 96, steps: int = 1, track: bool = False) -> dict:
    """``steps`` AdamW steps of llama-tiny, sequence-parallel over ``ulysses`` ranks with FSDP2."""
    mesh = get_mesh(ulysses, 1)
    model = SequenceParallelLM(parallelize(build_model("llama-tiny", seed=0), mesh), mesh, chunk=16)
    if checkpointing:
        enable_checkpointing(model.lm)
    if tiled:
        enable_tiled_mlp(model.lm, 3)
    if norm:
        assert enable_efficient_norm(model.lm) == 2 * 2 + 1  # two per layer, the final norm
    apply_fsdp(model, mesh, cpu_offload=cpu_offload)
    optimizer = make_optimizer(model, lr=1e-3)  # seqmesh train's
    local = seqmesh.shard_batch(_batch(seq_len), mesh)
    result = {"loss": [], "reports": [], "state": {}}
    for _ in range(steps):
        tracker = MemoryTracker(model, optimizer) if track else None
        with tracker or torch.enable_grad():
            if tracker is not None:
                result.setdefault("start", tracker.current())
            loss = model(**local)
            loss.backward()
            if "grads" not in result:  # step 1's (setdefault would gather them, and free them, every step)
                result["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            if tracker is not None:
                result.setdefault("after_backward", tracker.current())
                result.setdefault("grad_bytes", _local_bytes(p.grad for p in model.parameters()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        result["loss"].append(loss.item())
        if tracker is not None:
            result["reports"].append(tracker.report().as_dict())
    result["param_bytes"] = _local_bytes(model.parameters()) + _local_bytes(model.buffers())
    result["optimizer_bytes"] = _local_bytes(v for s in optimizer.state.values() for v in s.values())
    result["weights"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return result


def tracked_fsdp_steps(ulysses: int) -> dict:
    return _step(ulysses, steps=3, track=True)


def tracked_steps_on_fake_world(rank: int, ulysses: int) -> dict:
    """``tracked_fsdp_steps`` as ``rank`` of ``ulysses`` ranks, alone in a fresh process on torch's fake
    process group: FSDP2 shards and the all-to-alls allocate exactly as on gloo, but every collective
    completes on the calling thread and moves no data. On gloo, a collective's buffers are released by
    gloo's worker thread after it wakes the caller, so whether one is still alive a few operators later
    (and in a step's peak) depends on thread scheduling; here nothing does."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ulysses)
    try:
        result = tracked_fsdp_steps(ulysses)
    finally:
        dist.destroy_process_group()
    keep = ("start", "after_backward", "reports", "param_bytes", "grad_bytes", "optimizer_bytes")
    return {k: result[k] for k in keep}


def technique_pair(ulysses: int, option: str) -> tuple[dict, dict]:
    """Two runs of two AdamW steps, without and with ``option`` (tiled, norm, cpu_offload)."""
    base = dict(checkpointing=True, steps=2)
    return _step(ulysses, **base), _step(ulysses, **base, **{option: True})


def kept_attention_pair(ulysses: int, ring: int, family: str = "llama-tiny", seq_len: int = 96,
                        backwards: int = 1, async_ulysses: bool = False) -> dict:
    """One step of ``family`` (llama-tiny, or a tiny config of ``family_cases``, in float32) under checkpointing on a
    ``ulysses x ring`` mesh (FSDP2; with ``backwards`` > 1, that many backward passes through the graph, kept with
    ``retain_graph``, without FSDP2; ``async_ulysses``: its all-to-alls beside the projections), without and with
    ``keep_attention``: the loss, every full gradient, what the step held after its forward and after its backward,
    and how often the attention's forward (one process's kernel calls, the ring's passes) and a sparse layer's
    indexer ran."""
    from family_cases import build, family_config
    from seqmesh.hf import indexed_attention
    from seqmesh.sharded_attention import ring as ring_module

    mesh = get_mesh(ulysses, ring)
    counted = {(ring_module, "local_forward"): "attention", (ring_module, "ring_forward"): "attention",
               (indexed_attention, "_select"): "indexer"}
    originals = {where: getattr(*where) for where in counted}
    runs = {}
    for keep in (False, True):
        calls = dict.fromkeys(counted.values(), 0)

        def counting(fn, kind):
            def call(*args, **kwargs):
                calls[kind] += 1
                return fn(*args, **kwargs)
            return call

        lm = build_model("llama-tiny", seed=0) if family == "llama-tiny" else build(family_config(family)).float()
        model = SequenceParallelLM(parallelize(lm, mesh, async_ulysses=async_ulysses), mesh, chunk=16)
        enable_checkpointing(model.lm, keep_attention=keep)
        if backwards == 1:
            apply_fsdp(model, mesh)
        local = seqmesh.shard_batch(_batch(seq_len, lm.config.vocab_size), mesh)
        for (module, name), kind in counted.items():
            setattr(module, name, counting(originals[(module, name)], kind))
        try:
            with MemoryTracker(model) as tracker:
                loss = model(**local)
                after_forward = tracker.current()
                for i in range(backwards):
                    loss.backward(retain_graph=i + 1 < backwards)
                value = loss.item()
                del loss  # its graph, and with it what the layers kept
                after_backward = tracker.current()
        finally:
            for (module, name), fn in originals.items():
                setattr(module, name, fn)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        runs[keep] = {"loss": value, "calls": calls, "after_forward": after_forward, "after_backward": after_backward,
                      "grads": {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}}
    return runs


def kept_attention_families(cases: list[tuple[str, int, int]]) -> list[dict]:
    """:func:`kept_attention_pair` of each ``(family, ulysses, ring)`` at 45 tokens: whether the loss and every gradient
    with ``keep_attention`` are plain checkpointing's bit for bit, and the attention's forward calls of each run."""
    rows = []
    for family, ulysses, ring in cases:
        runs = kept_attention_pair(ulysses, ring, family, 45)
        plain, keeping = runs[False], runs[True]
        same = keeping["grads"].keys() == plain["grads"].keys() and all(
            torch.equal(keeping["grads"][n], g) for n, g in plain["grads"].items())
        rows.append({"case": (family, ulysses, ring), "loss_equal": keeping["loss"] == plain["loss"],
                     "grads_equal": same, "calls": (plain["calls"]["attention"], keeping["calls"]["attention"])})
    return rows
