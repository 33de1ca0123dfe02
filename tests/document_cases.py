"""Rank functions for the per_document layout and the vectorised data path (see conftest.Pools)."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import Case, _inputs, _max_err, get_mesh
from reference import reference_attention


def per_document_attention(ulysses: int, ring: int, cases: list[Case]) -> list[dict]:
    """seqmesh.attention on per_document shards (placed by each case's documents) against float64
    attention on the whole sequence: max error of out, dq, dk, dv."""
    mesh = get_mesh(ulysses, ring)
    results = []
    for case in cases:
        q, k, v, dout = _inputs(case, case.seed)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        place = dict(layout=case.layout, cu_seqlens=case.cu_seqlens)
        shard = lambda t: seqmesh.shard_sequence(t, mesh, **place)  # noqa: E731
        out = seqmesh.attention(shard(q), shard(k), shard(v), mesh, causal=case.causal, layout=case.layout,
                                cu_seqlens=case.cu_seqlens, seq_len=case.seq_len, backend=case.backend)
        (out * shard(dout)).sum().backward()
        whole = seqmesh.gather_sequence(out.detach(), mesh, length=case.seq_len, **place)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        cu = list(case.cu_seqlens) if case.cu_seqlens else None
        ref = reference_attention(qr, kr, vr, causal=case.causal, cu_seqlens=cu)
        ref.backward(dout.double())
        real = case.cu_seqlens[-1] if case.cu_seqlens else case.seq_len
        results.append({"case": case.name, "out": _max_err(whole, ref, real), "dq": _max_err(q.grad, qr.grad),
                        "dk": _max_err(k.grad, kr.grad), "dv": _max_err(v.grad, vr.grad)})
    return results


def shard_batch_gathered(ulysses: int, ring: int, batches: list[dict], layout: str) -> list[dict]:
    """shard_batch of each batch, every field gathered back to natural order (with the layout and
    documents shard_batch chose), and the local positions that sequence_positions predicts."""
    mesh = get_mesh(ulysses, ring)
    results = []
    for batch in batches:
        local = seqmesh.shard_batch(batch, mesh, layout=layout)
        info = local["seqmesh"]
        s = batch["input_ids"].shape[1]
        back = {k: seqmesh.gather_sequence(local[k], mesh, layout=info.layout, cu_seqlens=info.cu_seqlens, length=s)
                for k in ("input_ids", "position_ids", "shift_labels")}
        global_positions = seqmesh.sequence_positions(s, mesh, layout=info.layout, cu_seqlens=info.cu_seqlens)
        padded_ids = torch.nn.functional.pad(batch["input_ids"], (0, len(global_positions) * mesh.sp_size - s))
        back["placed"] = torch.equal(local["input_ids"], padded_ids[:, global_positions])
        back["layout"], back["cu_seqlens"] = info.layout, info.cu_seqlens
        results.append(back)
    return results
