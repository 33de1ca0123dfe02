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
from seqmesh.comm.stats import comm_stats
from seqmesh.hf import parallelize, unparallelize
from seqmesh.model.fsdp import enable_checkpointing, sync_gradients
from seqmesh.model.lm import SequenceParallelLM


def async_config(family: str):
    """``family_config``'s families; ``llama-uneven``: 5 query heads over 1 kv head (Ulysses 2 deals 3 + 2 query
    heads, Ulysses 4 deals 2 + 1 + 1 + 1; the kv head goes to every rank); ``qwen2`` (q/k/v biases) and
    ``qwen3-moe``, the other families async Ulysses lists."""
    import transformers as tf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                 intermediate_size=64, attention_dropout=0.0)
    if family == "qwen2":
        return tf.Qwen2Config(**small)
    if family == "qwen3-moe":
        return tf.Qwen3MoeConfig(**small, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    if family == "llama-uneven":
        return tf.LlamaConfig(hidden_size=40, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
                              head_dim=8, vocab_size=64, intermediate_size=64, attention_dropout=0.0)
    return family_config(family)


def _run(config, batch: dict, mesh, layout: str, async_ulysses: bool, pieces: int,
         checkpointing: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Gathered logits, loss and every parameter's gradient (summed over the sequence group) of the parallelized
    model; ``checkpointing``: each decoder layer recomputed in backward (its all-to-alls launched again)."""
    lm = parallelize(build(config), mesh, async_ulysses=async_ulysses, async_pieces=pieces)
    if checkpointing:
        enable_checkpointing(lm)
    installed = sum(1 for m in lm.modules() if getattr(m, "_seqmesh_async_ulysses", False))
    assert installed == (config.num_hidden_layers if async_ulysses else 0), installed
    local = seqmesh.shard_batch(batch, mesh, layout=layout)
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], position_ids=local["position_ids"], seqmesh=local["seqmesh"],
                    use_cache=False).logits
    whole = seqmesh.gather_sequence(logits, mesh, layout=layout, length=batch["input_ids"].shape[1])
    sp = SequenceParallelLM(lm, mesh, chunk=16)
    loss = sp(**seqmesh.shard_batch(batch, mesh, layout=layout))
    with comm_stats() as stats:
        loss.backward()
    sync_gradients(sp, mesh)
    grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters()}
    unparallelize(lm)
    assert not any(getattr(m, "_seqmesh_async_ulysses", False) for m in lm.modules())
    calls = stats.count("all_to_all") if mesh.ulysses > 1 else None  # during backward, the recompute's included
    per_layer = (2 * pieces if async_ulysses else 2) * (2 if checkpointing else 1)
    assert calls in (None, config.num_hidden_layers * per_layer), (calls, per_layer)
    return whole, loss.detach(), grads


def async_parity(family: str, ulysses: int, ring: int, layout: str = "zigzag", documents: bool = False,
                 pieces: int = 3, seq_len: int = 45, reversed_pieces: bool = False, checkpointing: bool = False) -> dict:
    """Errors of the async and the synchronous path against the float64 single-process model, of the async
    path against the synchronous one, and the reference's own rounding (``reference_rounding``).
    ``reversed_pieces``: a deliberate error for the test that the tolerance sees one, the async path's
    pieces of tokens projected and reassembled in reverse order (each piece's rotary still its own).
    ``checkpointing``: both paths with activation checkpointing."""
    mesh = get_mesh(ulysses, ring)
    if reversed_pieces:
        from seqmesh.sharded_attention import async_ulysses

        original = async_ulysses.token_pieces
        async_ulysses.token_pieces = lambda tokens, n: original(tokens, n)[::-1]
    config = async_config(family)
    reference = build(config)
    batch = _batch(seq_len, config.vocab_size, documents)
    ref_logits, ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference)
    want = dict(reference.named_parameters())
    out = {"rounding": rounding}
    runs = {mode: _run(config, batch, mesh, layout, mode == "async", pieces, checkpointing) for mode in ("sync", "async")}
    for mode, (logits, loss, grads) in runs.items():
        worst, name = 0.0, ""
        for n, ref in want.items():
            err = float((grads[n] - ref.grad).abs().max() / ref.grad.abs().max().clamp(min=1e-12))
            if err > worst:
                worst, name = err, n
        out[mode] = {"logits": float((logits - ref_logits).abs().max()), "loss": abs(loss.item() - ref_loss.item()),
                     "grad": worst, "worst": name}
    if reversed_pieces:
        async_ulysses.token_pieces = original
    (la, sa, ga), (ls, ss, gs) = runs["async"], runs["sync"]
    out["async_vs_sync"] = {
        "logits": float((la - ls).abs().max()), "loss": abs(sa.item() - ss.item()),
        "grad": max(float((ga[n] - gs[n]).abs().max() / gs[n].abs().max().clamp(min=1e-12)) for n in gs),
    }
    return out


def issue_order(async_ulysses: bool, pieces: int = 2, seq_len: int = 64) -> dict:
    """torch.profiler's record of one forward and backward of a tiny Llama, Ulysses over the whole group.
    ``labels``: the main thread's matmuls (``"mm"``) and all-to-all launches (``"a2a"``) in issue order, from the
    first all-to-all's layer on; ``overlap_us``: microseconds during which a gloo worker thread ran an
    all-to-all while the main thread ran a matmul (``aten::mm``: the projections), in the first of up to 3
    profiled steps that shows any (``attempts``); ``all_to_all``: per phase, (calls, bytes sent) of the step."""
    from torch.profiler import ProfilerActivity, profile

    mesh = get_mesh(dist.get_world_size(), 1)
    lm = parallelize(build(family_config("llama")), mesh, async_ulysses=async_ulysses, async_pieces=pieces)
    batch = seqmesh.shard_batch(_batch(seq_len, lm.config.vocab_size, False), mesh)
    with comm_stats() as stats:  # (a dispatch mode: kept apart from the profiled step, whose operators it would change)
        lm(**batch).logits.sum().backward()  # the input check's one exchange happens here, outside the record
    for attempt in range(1, 4):  # an oversubscribed machine may run the threads of one step one after another
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            lm(**batch).logits.sum().backward()
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
        main = next(e.thread for e in events if e.name == "aten::mm")
        comm = [(e.time_range.start, e.time_range.end) for e in events if e.name == "gloo:all_to_all" and e.thread != main]
        mms = [(e.time_range.start, e.time_range.end) for e in events if e.name == "aten::mm" and e.thread == main]
        overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in mms)
        seen = torch.tensor([int(overlap > 0 or not async_ulysses)])
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # every rank runs the same steps
        if seen.item():
            break
    unparallelize(lm)
    labels = [{"aten::mm": "mm", "c10d::alltoall_base_": "a2a"}[e.name] for e in events
              if e.thread == main and e.name in ("aten::mm", "c10d::alltoall_base_")]
    moved = {phase: [stats.count("all_to_all", phase), stats.sent("all_to_all", phase)] for phase in ("forward", "backward")}
    return {"labels": labels[labels.index("a2a") - 3:], "overlap_us": overlap, "attempts": attempt,
            "comm_spans": len(comm), "all_to_all": moved}


def async_refusals() -> dict:
    """What ``parallelize(..., async_ulysses=True)`` says for MLA (DeepSeek-V3), gated attention (Qwen3.5) and
    tensor parallelism; and whether the refused model was left as it was."""
    errors, untouched = {}, {}
    for what, family, mesh in (("mla", "deepseek-v3", get_mesh(2, 1)), ("gated", "qwen3_5", get_mesh(2, 1)),
                               ("tp", "llama", get_mesh(1, 1, tp=2))):
        model = build(family_config(family))
        before = model.config._attn_implementation
        try:
            parallelize(model, mesh, async_ulysses=True)
        except ValueError as err:
            errors[what] = str(err)
        untouched[what] = (model.config._attn_implementation == before
                           and not any("forward" in vars(m) for m in model.modules()))
    return {"errors": errors, "untouched": untouched}


def cuda_exchange_parity(dtype: str = "bfloat16", device: str = "cuda") -> dict:
    """On this rank's GPU (NCCL): the async start/wait pair against the synchronous all-to-all, forward and
    backward, with a matmul queued on the current stream while the collective is in flight (NCCL runs it on its
    own stream; ``wait`` orders the current stream after it). Both directions; largest differences. ``device``
    "cpu" runs the same on gloo."""
    from seqmesh.comm.async_collectives import head_to_seq_start, seq_to_head_start
    from seqmesh.comm.collectives import head_to_seq, seq_to_head
    from seqmesh.sharded_attention.heads import HeadPlan

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    plan = HeadPlan(6, 2, world)
    g = torch.Generator(device=device).manual_seed(rank)
    dt = getattr(torch, dtype)
    q = torch.randn(2, 64, 6, 16, device=device, dtype=dt, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 64, 2, 16, device=device, dtype=dt, generator=g, requires_grad=True) for _ in range(2))
    side = torch.randn(2048 if device == "cuda" else 128, 2048 if device == "cuda" else 128, device=device, dtype=dt,
                       generator=g)
    u = rank
    nq, nk = plan.q_count(u), plan.kv_count(u)
    chunks = [(0, *plan.q_range(r)) for r in range(world)]
    counts = [plan.q_count(r) for r in range(world)]
    results = {}
    for mode in ("sync", "async"):
        for t in (q, k, v):
            t.grad = None
        if mode == "sync":
            heads = seq_to_head([q, k, v], group, plan.send_chunks(), plan.send_heads(), nq + 2 * nk)
            busy = side @ side
            back = head_to_seq(heads[:, :, :nq] * 2, group, chunks, counts, nq, q.shape)
        else:
            pending = seq_to_head_start([q, k, v], group, plan.send_chunks(), plan.send_heads(), nq + 2 * nk)
            busy = side @ side  # queued on the current stream while the all-to-all runs on NCCL's
            heads = pending.wait()
            back = head_to_seq_start(heads[:, :, :nq] * 2, group, chunks, counts, nq, q.shape).wait()
        (back.float() * torch.arange(back.numel(), device=device).view_as(back).sin()).sum().backward()
        results[mode] = [back.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone(), busy.sum()]
    return {"diffs": [float((a.float() - b.float()).abs().max()) for a, b in zip(results["sync"][:4], results["async"][:4])],
            "scale": float(q.detach().float().abs().max())}


def cuda_async_parity(family: str = "llama", device: str = "cuda") -> dict:
    """Two GPUs (NCCL), Ulysses 2: the float32 model on CUDA with async Ulysses against the synchronous path
    (logits and every gradient, relative to its largest) and both against the float64 single-process model."""
    mesh = get_mesh(dist.get_world_size(), 1)  # a CUDA mesh on an NCCL group
    config = async_config(family)
    reference = build(config)
    batch = _batch(64, config.vocab_size, False)
    ref_logits, ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    ref_logits = ref_logits.detach()
    out = {}
    for mode in ("sync", "async"):
        lm = parallelize(build(config).to(device, torch.float32), mesh, async_ulysses=mode == "async", async_pieces=3)
        local = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in seqmesh.shard_batch(batch, mesh).items()}
        logits = lm(**local).logits
        logits.float().pow(2).mean().backward()
        whole = seqmesh.gather_sequence(logits.detach(), mesh, layout="zigzag", length=64).cpu().double()
        grads = {}
        for n, p in lm.named_parameters():
            dist.all_reduce(p.grad, group=mesh.sp_group)
            grads[n] = p.grad.detach().cpu().double()
        unparallelize(lm)
        out[mode] = (whole, grads)
    (ls, gs), (la, ga) = out["sync"], out["async"]
    return {"logits_vs_sync": float((la - ls).abs().max()), "logits_vs_reference": float((la - ref_logits).abs().max()),
            "sync_logits_vs_reference": float((ls - ref_logits).abs().max()),
            "grad_vs_sync": max(float((ga[n] - gs[n]).abs().max() / gs[n].abs().max().clamp(min=1e-12)) for n in gs)}
