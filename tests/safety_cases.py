"""Rank functions for tests/test_run_safety.py: what every rank sees of the job's guards."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqmesh
from dist_cases import get_mesh


def train_error(cfg) -> str:
    """The error ``train(cfg)`` raises on this rank, as ``"Type: message"`` ("" if it finished)."""
    from seqmesh.training.train import train

    try:
        train(cfg)
    except Exception as err:  # the test asserts which error, and that every rank raised it
        return f"{type(err).__name__}: {err}"
    return ""


def p2p_issue_order(ulysses: int, ring: int, seq_len: int, causal: bool, documents: tuple[int, ...] | None,
                    layout: str = "zigzag", window: int | None = None) -> list:
    """Every point-to-point op this rank posts during one forward and backward of seqmesh.attention:
    ``[kind, global peer, shape, dtype]`` in the order they were issued."""
    from seqmesh.comm import p2p as ring_comm

    mesh = get_mesh(ulysses, ring, dist.get_world_size() // (ulysses * ring))
    issued: list = []
    original = ring_comm.dist.batch_isend_irecv

    def recording(ops):
        for op in ops:
            kind = "send" if op.op in (dist.isend, dist.send) else "recv"
            peer = dist.get_global_rank(op.group, op.group_peer) if op.group_peer is not None else op.peer
            issued.append([kind, peer, list(op.tensor.shape), str(op.tensor.dtype)])
        return original(ops)

    torch.manual_seed(0)
    full = torch.randn(3, 1, seq_len, 4, 8, dtype=torch.float64)
    local = [seqmesh.shard_sequence(t, mesh, layout=layout, dim=1).requires_grad_() for t in full]
    ring_comm.dist.batch_isend_irecv = recording
    try:
        out = seqmesh.attention(*local, mesh, causal=causal, cu_seqlens=documents, layout=layout, window=window,
                                seq_len=None if documents else seq_len)
        out.sum().backward()
    finally:
        ring_comm.dist.batch_isend_irecv = original
    return issued


def attention_under_autocast(ulysses: int, ring: int) -> dict:
    """seqmesh.attention with fp32 inputs inside bf16 autocast, against the same call without autocast on the
    inputs cast to bf16 (torch's SDPA casts under autocast too; transformers' rotary leaves q and k in fp32 beside
    a bf16 v there, which an H100 run of ``seqmesh train --bf16`` met): the math kernel's forward and backward
    must both see autocast off and bf16 tensors, so output and fp32 gradients are bit-identical."""
    from seqmesh.kernels import reference as math_kernel

    mesh = get_mesh(ulysses, ring, dist.get_world_size() // (ulysses * ring))
    seen: list = []
    kernel = math_kernel.MathKernel
    forward, backward = kernel.forward, kernel.backward

    def spy_forward(self, q, k, v, mask, scale):
        seen.append(("forward", torch.is_autocast_enabled("cpu"), str(q.dtype)))
        return forward(self, q, k, v, mask, scale)

    def spy_backward(self, dout, q, k, v, out, lse, mask, scale):
        seen.append(("backward", torch.is_autocast_enabled("cpu"), str(dout.dtype)))
        return backward(self, dout, q, k, v, out, lse, mask, scale)

    torch.manual_seed(1)
    full = torch.randn(3, 1, 40, 4, 8)
    results = []
    kernel.forward, kernel.backward = spy_forward, spy_backward
    try:
        for autocast in (True, False):
            local = [seqmesh.shard_sequence(t, mesh, layout="zigzag", dim=1).requires_grad_() for t in full]
            inputs = list(local) if autocast else [t.to(torch.bfloat16) for t in local]
            inputs[2] = inputs[2].to(torch.bfloat16)  # v as a bf16 projection gives it, q and k in fp32
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = seqmesh.attention(*inputs, mesh, causal=True, backend="math")
                out.float().square().sum().backward()
            results.append([out.detach()] + [t.grad for t in local])
    finally:
        kernel.forward, kernel.backward = forward, backward
    return {"seen": sorted(set(seen)), "out_dtype": str(results[0][0].dtype),
            "grad_dtype": str(results[0][1].dtype), "identical": all(torch.equal(a, b) for a, b in zip(*results))}


def overwrite_with_a_late_rank(cfg) -> dict:
    """``choose_start`` with --overwrite where rank 1 looks a second after rank 0 (which clears the old
    run at once): every rank must take the same path, so a collective right after pairs up."""
    import time

    from seqmesh.training.resume import choose_start

    if dist.get_rank() == 1:
        time.sleep(1.0)
    start = choose_start(cfg)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dist.get_rank())  # pairs with a stray barrier if one rank skipped the clearing
    return {"step": start.step, "ranks": ranks}
