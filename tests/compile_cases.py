"""``torch.compile`` of a model parallelized by seqmesh.hf, on every rank: the compiled model (``fullgraph=True``,
which raises on any graph break, naming it: one trace instead of ``torch._dynamo.explain``'s second) and the
eager one against the unmodified single-process transformers model on the whole sequence (float64):
logits, loss and every parameter's gradient, with the reference's own rounding as the scale."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from family_cases import family_config, _batch, _reference_loss, _worst_grad, build, reference_rounding
from seqmesh.hf import parallelize, unparallelize


def llama_config(layers: int = 2):
    import transformers as tf

    return tf.LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=64, attention_dropout=0.0)


def _loss_and_grads(call, lm, local: dict, mesh, seq_len: int, positions: torch.Tensor) -> dict:
    """The whole sequence's logits, the mean loss over every target, and each parameter's gradient
    summed over the sequence group, from ``call`` (the model, eager or compiled) on this rank's shard."""
    lm.zero_grad(set_to_none=True)
    logits = call(input_ids=local["input_ids"], position_ids=positions, seqmesh=local["seqmesh"]).logits
    targets = local["shift_labels"]
    count = (targets != -100).sum()
    dist.all_reduce(count, group=mesh.sp_group)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / count
    loss.backward()
    for p in lm.parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.sp_group)
    whole = seqmesh.gather_sequence(logits.detach(), mesh, layout=local["seqmesh"].layout, length=seq_len)
    return {"logits": whole, "loss": total, "grads": {n: p.grad.clone() for n, p in lm.named_parameters()}}


def _errors(got: dict, ref_logits: torch.Tensor, ref_loss: torch.Tensor, ref_grads: dict) -> dict:
    worst, name = 0.0, ""
    for n, g in got["grads"].items():
        err = float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-12))
        if err > worst:
            worst, name = err, n
    return {"logits": float((got["logits"] - ref_logits).abs().max()), "loss": abs(got["loss"].item() - ref_loss.item()),
            "grad": worst, "worst": name}


def compiled_parity(ulysses: int, ring: int, documents: bool, family: str = "llama", backend: str = "aot_eager",
                    seq_len: int = 45, shift_positions_on: int | None = None) -> dict:
    """The parallelized model (``family``: ``llama``, a 2-layer Llama, or a tiny config of
    ``family_cases.family_config``, e.g. ``qwen3_5`` with a Gated DeltaNet layer) compiled whole
    (``fullgraph=True``: a graph break raises, with its reason, and fails the case), and the errors against the
    float64 single-process reference of the eager and the compiled model, with the reference's rounding
    (``reference_rounding``). ``shift_positions_on``: a deliberate sharding error in the compiled run only (that
    rank's positions one too far), for the test that the bound sees one."""
    mesh = get_mesh(ulysses, ring)
    config = llama_config() if family == "llama" else family_config(family)
    reference = build(config)
    batch = _batch(seq_len, config.vocab_size, documents)
    ref_logits, ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    lm = parallelize(build(config), mesh)
    local = seqmesh.shard_batch(batch, mesh)
    torch._dynamo.reset()
    eager = _loss_and_grads(lm, lm, local, mesh, seq_len, local["position_ids"])
    compiled_lm = torch.compile(lm, backend=backend, fullgraph=True)
    compiled = _loss_and_grads(compiled_lm, lm, seqmesh.shard_batch(batch, mesh), mesh, seq_len, local["position_ids"])
    apart = _errors(compiled, eager["logits"], eager["loss"], eager["grads"])
    shifted = {}
    if shift_positions_on is not None:
        positions = local["position_ids"] + (1 if shift_positions_on == dist.get_rank() else 0)
        wrong = _loss_and_grads(compiled_lm, lm, seqmesh.shard_batch(batch, mesh), mesh, seq_len, positions)
        shifted = {"shifted_vs_eager": _errors(wrong, eager["logits"], eager["loss"], eager["grads"])}
    torch._dynamo.reset()
    unparallelize(lm)
    return {"eager": _errors(eager, ref_logits.detach(), ref_loss.detach(), ref_grads),
            "compiled": _errors(compiled, ref_logits.detach(), ref_loss.detach(), ref_grads),
            "compiled_vs_eager": apart, "rounding": rounding, **shifted}


def compiled_cases(cases: list[tuple], shifted: tuple | None = None, shift_positions_on: int = 1) -> list[dict]:
    """``compiled_parity`` of each case; the one equal to ``shifted`` also runs its deliberate error on rank
    ``shift_positions_on``."""
    return [{"case": c, **compiled_parity(*c, shift_positions_on=shift_positions_on if c == shifted else None)}
            for c in cases]


def compiles_over_packed_batches(ulysses: int, ring: int, cuts: list[list[int]]) -> dict:
    """The compiled model (whole; dynamo's recompiles are the subject, so no AOTAutograd behind it: the eager backend)
    over one packed batch per entry of ``cuts`` (document
    boundaries of 48 tokens): dynamo frames compiled after each batch, the largest logit difference from the
    eager model on every batch (the boundaries reach the op as ints, or as SymInts once they vary), and the
    scale: the same model's float32 copy against it (the model computes its norms in float32 anyway)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    mesh = get_mesh(ulysses, ring)
    lm = parallelize(build(llama_config()), mesh)
    low = parallelize(build(llama_config()).float(), mesh)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lm, backend=counter)
    frames, worst, rounding = [], 0.0, 0.0
    g = torch.Generator().manual_seed(3)
    for bounds in cuts:
        positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
        batch = {"input_ids": torch.randint(0, 64, (1, bounds[-1]), generator=g), "position_ids": positions}
        local = seqmesh.shard_batch(batch, mesh, layout="zigzag")
        inputs = {k: local[k] for k in ("input_ids", "position_ids", "seqmesh")}
        with torch.no_grad():
            got = compiled(**inputs).logits
            want = lm(**{**inputs, "seqmesh": seqmesh.shard_batch(batch, mesh, layout="zigzag")["seqmesh"]}).logits
            single = low(**{**inputs, "seqmesh": seqmesh.shard_batch(batch, mesh, layout="zigzag")["seqmesh"]}).logits
        worst = max(worst, float((got - want).abs().max()))
        rounding = max(rounding, float((single.double() - want).abs().max()))
        frames.append(counter.frame_count)
    torch._dynamo.reset()
    unparallelize(lm)
    unparallelize(low)
    return {"frames": frames, "logits_diff": worst, "rounding": rounding}


def compiled_attention_on_device(device: str, cu_seqlens: tuple[int, ...] | None) -> dict:
    """On one rank (NCCL for ``cuda``): bf16 ``seqmesh.attention`` eager and under ``torch.compile(fullgraph=True)``
    (inductor), forward and backward, each one's largest error against float64 attention on the CPU."""
    from reference import reference_attention

    mesh = get_mesh(1, 1)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 256, h, 64, generator=g) for h in (8, 2, 2, 8))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True, cu_seqlens=list(cu_seqlens) if cu_seqlens else None)
    ref.backward(dout.double())
    want = {"out": ref.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    errors = {}
    torch._dynamo.reset()
    for name, attend in (("eager", seqmesh.attention), ("compiled", torch.compile(seqmesh.attention, fullgraph=True))):
        leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, mesh, causal=True, cu_seqlens=cu_seqlens)
        out.backward(dout.to(device, torch.bfloat16))
        got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
        errors[name] = {key: float((got[key].double().cpu() - want[key]).abs().max()) for key in want}
    return errors
