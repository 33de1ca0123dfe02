"""Async Ulysses on every rank: tiny transformers models (float64) run with the projections overlapped with
the all-to-alls, against the single-process model on the whole sequence (the independent reference) and
against seqmesh's synchronous path on the same mesh; and the order in which the async path issues its
collectives and projections, from torch.profiler's record of the layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqmesh
from dist_cases import get_mesh
from family_cases import _batch, _reference_loss, _worst_grad, build, family_config, reference_rounding
from seqmesh.hf import parallelize, unparallelize
from seqmesh.model.fsdp import sync_gradients
from seqmesh.model.lm import SequenceParallelLM


def async_config(family: str):
    """``family_config``'s families, and ``llama-uneven``: 5 query heads over 1 kv head (Ulysses 2 deals 3 + 2
    query heads, Ulysses 4 deals 2 + 1 + 1 + 1; the kv head goes to every rank)."""
    if family == "llama-uneven":
        import transformers as tf

        return tf.LlamaConfig(hidden_size=40, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
                              head_dim=8, vocab_size=64, intermediate_size=64, attention_dropout=0.0)
    return family_config(family)


def _run(config, batch: dict, mesh, layout: str, async_ulysses: bool, pieces: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Gathered logits, loss and every parameter's gradient (summed over the sequence group) of the parallelized model."""
    lm = parallelize(build(config), mesh, async_ulysses=async_ulysses, async_pieces=pieces)
    installed = sum(1 for m in lm.modules() if getattr(m, "_seqmesh_async_ulysses", False))
    assert installed == (config.num_hidden_layers if async_ulysses else 0), installed
    local = seqmesh.shard_batch(batch, mesh, layout=layout)
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], position_ids=local["position_ids"], seqmesh=local["seqmesh"],
                    use_cache=False).logits
    whole = seqmesh.gather_sequence(logits, mesh, layout=layout, length=batch["input_ids"].shape[1])
    sp = SequenceParallelLM(lm, mesh, chunk=16)
    loss = sp(**seqmesh.shard_batch(batch, mesh, layout=layout))
    loss.backward()
    sync_gradients(sp, mesh)
    grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters()}
    unparallelize(lm)
    assert not any(getattr(m, "_seqmesh_async_ulysses", False) for m in lm.modules())
    return whole, loss.detach(), grads


def async_parity(family: str, ulysses: int, ring: int, layout: str = "zigzag", documents: bool = False,
                 pieces: int = 3, seq_len: int = 45) -> dict:
    """Errors of the async and the synchronous path against the float64 single-process model, of the async
    path against the synchronous one, and the reference's own rounding (``reference_rounding``)."""
    mesh = get_mesh(ulysses, ring)
    config = async_config(family)
    reference = build(config)
    batch = _batch(seq_len, config.vocab_size, documents)
    ref_logits, ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference)
    want = dict(reference.named_parameters())
    out = {"rounding": rounding}
    runs = {mode: _run(config, batch, mesh, layout, mode == "async", pieces) for mode in ("sync", "async")}
    for mode, (logits, loss, grads) in runs.items():
        worst, name = 0.0, ""
        for n, ref in want.items():
            err = float((grads[n] - ref.grad).abs().max() / ref.grad.abs().max().clamp(min=1e-12))
            if err > worst:
                worst, name = err, n
        out[mode] = {"logits": float((logits - ref_logits).abs().max()), "loss": abs(loss.item() - ref_loss.item()),
                     "grad": worst, "worst": name}
    (la, sa, ga), (ls, ss, gs) = runs["async"], runs["sync"]
    out["async_vs_sync"] = {
        "logits": float((la - ls).abs().max()), "loss": abs(sa.item() - ss.item()),
        "grad": max(float((ga[n] - gs[n]).abs().max() / gs[n].abs().max().clamp(min=1e-12)) for n in gs),
    }
    return out


def issue_order(async_ulysses: bool, pieces: int = 2, seq_len: int = 64) -> dict:
    """torch.profiler's record of one forward and backward of a tiny Llama on this rank (Ulysses over the
    whole group): for the first attention layer, in issue order on the main thread, the q_proj matmuls and the
    all-to-alls. Returns the sequence of ``"project"`` / ``"all_to_all"`` labels of that layer's forward."""
    from torch.profiler import ProfilerActivity, profile, record_function

    mesh = get_mesh(dist.get_world_size(), 1)
    lm = parallelize(build(family_config("llama")), mesh, async_ulysses=async_ulysses, async_pieces=pieces)
    batch = seqmesh.shard_batch(_batch(seq_len, lm.config.vocab_size, False), mesh)
    layer = lm.model.layers[0].self_attn
    handles = [layer.q_proj.register_forward_pre_hook(lambda m, a: torch.ops.profiler._record_function_enter_new("q_proj", None))]
    labels = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("layer0"):
            lm(**batch).logits.sum().backward()
    for h in handles:
        h.remove()
    unparallelize(lm)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    first_layer_end = next(e for e in events if e.name == "q_proj")  # noqa: F841 (keeps the hook's events named)
    for e in events:
        if e.name == "q_proj":
            labels.append("project")
        elif "all_to_all" in e.name or "alltoall" in e.name:
            labels.append("all_to_all")
    return {"labels": labels}
