"""Functions that run on every rank of a spawned group (see conftest.Pools); each returns plain data
that the test asserts on in the main process."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import asdict, dataclass

import torch

import seqmesh
from reference import reference_attention

_MESHES: dict[tuple[int, int, int, int], seqmesh.SPMesh] = {}


def refusals_said(calls: dict) -> dict[str, str]:
    """Each of ``calls`` (name -> a call that should refuse) run: the ValueError's message, or "" where it ran."""
    said = {}
    for name, call in calls.items():
        try:
            call()
            said[name] = ""
        except ValueError as err:
            said[name] = str(err)
    return said


def get_mesh(ulysses: int, ring: int, dp_shard: int = 1, dp_replicate: int = 1, tp: int = 1) -> seqmesh.SPMesh:
    """One mesh per shape per process: building a mesh creates process groups, which is collective."""
    key = (ulysses, ring, dp_shard, dp_replicate, tp)
    if key not in _MESHES:
        _MESHES[key] = seqmesh.init_mesh(ulysses, ring, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp)
    return _MESHES[key]


@dataclass(frozen=True)
class Case:
    seq_len: int
    q_heads: int
    kv_heads: int
    causal: bool
    layout: str
    cu_seqlens: tuple[int, ...] | None = None
    batch: int = 2
    head_dim: int = 8
    dtype: str = "float64"
    backend: str = "auto"
    seed: int = 0
    window: int | None = None
    sinks: bool = False
    v_dim: int | None = None  # value head dim when it differs from head_dim (MLA-style)
    image_blocks: tuple[tuple[int, int], ...] | None = None  # Gemma 3's images: seen both ways by their tokens
    chunk: int | None = None  # Llama 4's chunked attention: keys of the query's own chunk of the row only
    softcap: float | None = None  # Gemma 2's logit soft-capping: scores capped before the softmax
    alibi: tuple[float, ...] | None = None  # ALiBi's slope per query head (BLOOM, MPT)

    @property
    def name(self) -> str:
        docs = "docs" if self.cu_seqlens else "nodocs"
        extra = "".join(f"-{n}" for n, on in ((f"w{self.window}", self.window), ("sinks", self.sinks),
                                                (f"dv{self.v_dim}", self.v_dim), ("images", self.image_blocks),
                                                (f"chunk{self.chunk}", self.chunk), (f"cap{self.softcap}", self.softcap),
                                                ("alibi", self.alibi))
                        if on)
        return (f"S{self.seq_len}-h{self.q_heads}/{self.kv_heads}-{'causal' if self.causal else 'full'}-"
                f"{self.layout}-{docs}-{self.dtype}-{self.backend}{extra}")


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case.dtype)
    b, s, d, dv = case.batch, case.seq_len, case.head_dim, case.v_dim or case.head_dim
    q = torch.randn(b, s, case.q_heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, case.kv_heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, case.kv_heads, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, case.q_heads, dv, generator=g, dtype=torch.float64)
    if case.cu_seqlens is not None:  # positions past the last document are padding: no gradient flows in
        dout[:, case.cu_seqlens[-1] :] = 0
    return q.to(dt), k.to(dt), v.to(dt), dout.to(dt)


def _max_err(a: torch.Tensor, b: torch.Tensor, upto: int | None = None) -> float:
    if upto is not None:
        a, b = a[:, :upto], b[:, :upto]
    return float((a.detach().double() - b.detach().double()).abs().max())


def run_attention(case: Case, mesh: seqmesh.SPMesh, with_grad: bool = True, compiled: str | None = None):
    """seqmesh on the sharded inputs vs the float64 reference on the whole sequence; ``compiled``: through
    ``torch.compile(seqmesh.attention, backend=compiled, fullgraph=True)`` (a fresh compile per case).

    Returns ``(errors, stats)``: max abs error of out, dq, dk, dv over real tokens, and comm stats."""
    seed = case.seed * 1000 + mesh.dp_rank  # data-parallel ranks see different samples
    q, k, v, dout = _inputs(case, seed)
    q, k, v = (t.clone().requires_grad_(with_grad) for t in (q, k, v))
    sinks = None
    if case.sinks:
        sinks = torch.randn(case.q_heads, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
        sinks = sinks.to(q.dtype).requires_grad_(with_grad)
    shard = lambda t: seqmesh.shard_sequence(t, mesh, layout=case.layout)  # noqa: E731
    attend = seqmesh.attention
    if compiled is not None:
        torch._dynamo.reset()  # each case compiles afresh: no fallback to eager past dynamo's recompile limit
        attend = torch.compile(seqmesh.attention, backend=compiled, fullgraph=True)
    # the byte counters are a dispatch mode, which torch.compile refuses: a compiled run counts nothing
    with (seqmesh.comm_stats() if compiled is None else contextlib.nullcontext()) as stats:
        out = attend(
            shard(q), shard(k), shard(v), mesh, causal=case.causal, layout=case.layout,
            cu_seqlens=case.cu_seqlens, seq_len=case.seq_len, backend=case.backend, window=case.window, sinks=sinks,
            image_blocks=case.image_blocks, chunk=case.chunk, softcap=case.softcap, alibi=case.alibi,
        )
        if with_grad:
            (out * shard(dout)).sum().backward()
    gathered = seqmesh.gather_sequence(out.detach(), mesh, layout=case.layout, length=case.seq_len)

    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    sr = sinks.detach().double().requires_grad_() if sinks is not None else None
    ref = reference_attention(qr, kr, vr, causal=case.causal, cu_seqlens=list(case.cu_seqlens) if case.cu_seqlens else None,
                              window=case.window, sinks=sr, image_blocks=case.image_blocks, chunk=case.chunk,
                              softcap=case.softcap, alibi=case.alibi)
    ref.backward(dout.double())
    real = case.cu_seqlens[-1] if case.cu_seqlens else case.seq_len
    errors = {"out": _max_err(gathered, ref, real)}
    if with_grad:
        errors.update(dq=_max_err(q.grad, qr.grad), dk=_max_err(k.grad, kr.grad), dv=_max_err(v.grad, vr.grad))
        if sinks is not None:  # each rank holds its heads' and rows' part: the group's sum is the gradient
            grad = sinks.grad.clone()
            if mesh.sp_size > 1:
                torch.distributed.all_reduce(grad, group=mesh.sp_group)
            errors["dsinks"] = _max_err(grad, sr.grad)
    return errors, stats


def attention_cases(ulysses: int, ring: int, dp_shard: int, cases: list[Case], compiled: str | None = None) -> list[dict]:
    mesh = get_mesh(ulysses, ring, dp_shard)
    results = []
    for case in cases:
        errors, _ = run_attention(case, mesh, compiled=compiled)
        results.append({"case": case.name, **errors})
    return results


def shifted_alibi_cases(ulysses: int, ring: int, cases: list[Case]) -> list[dict]:
    """:func:`attention_cases` with the ALiBi distance of every call between disjoint runs one position short (a
    mutation the test must see: a ring block's bias off by one, though each block on its own is still ALiBi)."""
    from seqmesh.sharded_attention import blocks, schedule

    right = blocks._cross_distance

    def one_short(q, k, bounds):
        piece = right(q, k, bounds)
        return None if piece is None else dataclasses.replace(
            piece, mask=dataclasses.replace(piece.mask, offset=piece.mask.offset - 1))

    schedule.ring_schedule.cache_clear()  # plans made before (or, after, with the mutation) are not reused
    blocks._cross_distance = one_short
    try:
        return attention_cases(ulysses, ring, 1, cases)
    finally:
        blocks._cross_distance = right
        schedule.ring_schedule.cache_clear()


def shifted_chunk_cases(ulysses: int, ring: int, cases: list[Case]) -> list[dict]:
    """:func:`attention_cases` with seqmesh's chunk boundaries one position late (a mutation the test must see)."""
    from seqmesh.sharded_attention import planning

    right = planning.chunk_bounds
    planning.chunk_bounds = lambda bounds, chunk: tuple(sorted(set(bounds) | set(range(1, bounds[-1], chunk))))
    # (one late in every document of one: the cases have none)
    try:
        return attention_cases(ulysses, ring, 1, cases)
    finally:
        planning.chunk_bounds = right


def traffic_cases(ulysses: int, ring: int, cases: list[Case]) -> list[dict]:
    """Per-rank calls and bytes of each collective, by phase, plus this rank's coordinates."""
    mesh = get_mesh(ulysses, ring)
    out = []
    for case in cases:
        _, stats = run_attention(case, mesh)
        out.append({"case": asdict(case), "ulysses_rank": mesh.ulysses_rank, "ring_rank": mesh.ring_rank,
                    "stats": stats.as_dict()})
    return out


def ring_peers(ulysses: int, ring: int, cases: list[Case]) -> list[dict]:
    """Every point-to-point message this rank posts, seen by wrapping ``torch.distributed.batch_isend_irecv``
    (not seqmesh's counters): per phase, ``{"send"/"recv": {offset: count}}`` where the offset is the
    peer's ring rank minus this one's, mod ring."""
    import torch.distributed as dist

    mesh = get_mesh(ulysses, ring)
    posted = dist.batch_isend_irecv
    log: list[tuple[str, int]] = []

    def spy(ops):
        log.extend(("send" if op.op is dist.isend else "recv", (op.group_peer - mesh.ring_rank) % ring) for op in ops)
        return posted(ops)

    def tally() -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {"send": {}, "recv": {}}
        for kind, offset in log:
            out[kind][offset] = out[kind].get(offset, 0) + 1
        log.clear()
        return out

    results = []
    dist.batch_isend_irecv = spy
    try:
        for case in cases:
            q, k, v, dout = (seqmesh.shard_sequence(t, mesh, layout=case.layout) for t in _inputs(case, case.seed))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = seqmesh.attention(q, k, v, mesh, causal=case.causal, layout=case.layout, seq_len=case.seq_len,
                                    window=case.window)
            forward = tally()
            (out * dout).sum().backward()
            results.append({"case": case.name, "forward": forward, "backward": tally()})
    finally:
        dist.batch_isend_irecv = posted
    return results


def bf16_errors(ulysses: int, ring: int, cases: list[Case]) -> list[dict]:
    mesh = get_mesh(ulysses, ring)
    return [{"case": c.name, **run_attention(c, mesh)[0]} for c in cases]


def plain_kernel_errors(cases: list[Case]) -> list[dict]:
    """The single-device bf16 kernel (torch's CPU flash op, no seqmesh code around it) on the whole
    sequence, against float64: the bar the sequence-parallel error is held to."""
    from seqmesh.kernels.base import BlockMask
    from seqmesh.kernels.cpu_flash import CpuFlashKernel

    results = []
    for case in cases:
        q, k, v, dout = _inputs(case, case.seed * 1000)
        mask = BlockMask(causal=case.causal, segments=case.cu_seqlens if case.cu_seqlens else None)
        kernel, scale = CpuFlashKernel(), case.head_dim**-0.5
        out, lse = kernel.forward(q, k, v, mask, scale)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, mask, scale)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qr, kr, vr, causal=case.causal, cu_seqlens=list(case.cu_seqlens) if case.cu_seqlens else None)
        ref.backward(dout.double())
        results.append({"case": case.name, "out": _max_err(out, ref), "dq": _max_err(dq, qr.grad),
                        "dk": _max_err(dk, kr.grad), "dv": _max_err(dv, vr.grad)})
    return results


def bad_inputs(ulysses: int, ring: int, problem: str) -> str:
    """Provoke an input error on some ranks only; return what this rank raised (or 'no error')."""
    mesh = get_mesh(ulysses, ring)
    rank = mesh.sp_rank
    b, n, h, d = 1, 4, 4, 8
    q, k, v = (torch.randn(b, n, h, d) for _ in range(3))
    kwargs: dict = {}
    if problem == "local_len" and rank == 1:
        q, k, v = (torch.randn(b, n + 2, h, d) for _ in range(3))
    elif problem == "head_dim" and rank == 0:
        k = torch.randn(b, n, h, d + 8)
        v = torch.randn(b, n, h, d + 8)
    elif problem == "dtype" and rank == 1:
        q, k, v = (t.double() for t in (q, k, v))
    elif problem == "cu_seqlens":
        kwargs["cu_seqlens"] = [0, 5, 3, n * mesh.sp_size]
    elif problem == "cu_too_long":
        kwargs["cu_seqlens"] = [0, 5, n * mesh.sp_size + 3]
    elif problem == "heads":
        k = torch.randn(b, n, 3, d)
        v = torch.randn(b, n, 3, d)
    elif problem == "causal" and rank == 1:
        kwargs["causal"] = False
    elif problem == "documents" and rank == 3:  # valid boundaries, but not the other ranks'
        kwargs["cu_seqlens"] = [0, 6, n * mesh.sp_size]
    elif problem == "documents":
        kwargs["cu_seqlens"] = [0, 5, n * mesh.sp_size]
    elif problem == "window" and rank == 1:  # one rank with another window: every rank raises
        kwargs["window"] = 3
    elif problem == "window_full":
        kwargs.update(window=3, causal=False)
    elif problem == "sinks":
        kwargs["sinks"] = torch.zeros(h + 1)
    elif problem == "cu_not_ints" and rank == 2:
        kwargs["cu_seqlens"] = torch.tensor([[0, 5], [9, 16]])  # 2-D: this rank alone cannot read it
    try:
        seqmesh.attention(q, k, v, mesh, **kwargs)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def shard_batch_roundtrip(ulysses: int, ring: int, layout: str) -> dict:
    """Shard a packed batch, gather every field back, and return it for the test to check."""
    mesh = get_mesh(ulysses, ring)
    ids = torch.arange(100, 123)[None]  # 23 tokens: padding needed for P = 4
    positions = torch.cat([torch.arange(5), torch.arange(1), torch.arange(17)])[None]  # docs 5, 1, 17
    local = seqmesh.shard_batch({"input_ids": ids, "position_ids": positions}, mesh, layout=layout)
    back = {k: seqmesh.gather_sequence(local[k], mesh, layout=layout, length=23)[0].tolist()
            for k in ("input_ids", "position_ids", "shift_labels")}
    back["cu_seqlens"] = local["seqmesh"].cu_seqlens
    back["local_len"] = local["input_ids"].shape[1]
    return back


def pooled_loss(empty_ranks: list[int]) -> dict:
    """Cross-entropy pooled over the group, with the given ranks holding no valid target."""
    import torch.nn.functional as F

    mesh = get_mesh(1, 4)
    rank = mesh.sp_rank
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1, 6, 11, generator=g, dtype=torch.float64)  # every rank's (1, 6, 11)
    labels = torch.randint(0, 11, (4, 1, 6), generator=g)
    labels[:, :, ::3] = -100
    for r in empty_ranks:
        labels[r] = -100
    mine = logits[rank].clone().requires_grad_()
    loss = seqmesh.sequence_parallel_cross_entropy(mine, labels[rank], mesh.sp_group)
    loss.backward()
    whole = logits.clone().requires_grad_()
    valid = labels != -100
    if valid.any():
        ref = F.cross_entropy(whole.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
        ref.backward()
        ref_grad, ref_value = whole.grad[rank], float(ref)
    else:
        ref_grad, ref_value = torch.zeros_like(mine), 0.0
    return {"value": float(loss), "ref": ref_value, "grad_err": float((mine.grad - ref_grad).abs().max())}


def named_backend_refuses_documents(compiled: str | None = None) -> str:
    """A named kernel that cannot mask documents, with documents only inside rank 0's diagonal block:
    every rank must raise before any rank sends (no rank left waiting). ``compiled``: through
    ``torch.compile(seqmesh.attention, backend=compiled, fullgraph=True)``."""
    import seqmesh.kernels as kernels
    from seqmesh.kernels.reference import MathKernel

    class NoDocuments(MathKernel):
        name = "math"

        def unsupported(self, q, k, mask, v=None):
            return "no documents" if mask.segments is not None else None

    mesh = get_mesh(1, 2)
    original = kernels.KERNELS["math"]
    kernels.KERNELS["math"] = NoDocuments()
    try:
        q = torch.randn(1, 8, 2, 8)
        torch._dynamo.reset()
        attend = seqmesh.attention if compiled is None else torch.compile(seqmesh.attention, backend=compiled,
                                                                          fullgraph=True)
        attend(q, q, q, mesh, cu_seqlens=(0, 2, 16), backend="math")
    except ValueError as err:
        return str(err)
    finally:
        kernels.KERNELS["math"] = original
    return "no error"


def zigzag_positions_by_hand(seq_len: int, ulysses: int, ring: int, ulysses_rank: int, ring_rank: int) -> list[int]:
    """The USP zigzag placement written out independently: pad to a multiple of ring x lcm(2, U) (or
    U when ring = 1), cut 2 x ring chunks, ring rank r takes chunks r and 2R-1-r, Ulysses rank u
    the u-th of U equal pieces of that pair."""
    import math

    multiple = ring * math.lcm(2, ulysses) if ring > 1 else ulysses
    padded = -(-seq_len // multiple) * multiple
    if ring == 1:
        pair = list(range(padded))
    else:
        c = padded // (2 * ring)
        pair = list(range(ring_rank * c, (ring_rank + 1) * c)) + list(range((2 * ring - 1 - ring_rank) * c, (2 * ring - ring_rank) * c))
    piece = len(pair) // ulysses
    return pair[ulysses_rank * piece : (ulysses_rank + 1) * piece]


def sharding_checks(ulysses: int, ring: int) -> dict:
    """Rank placement, positions, both mesh constructors, and the gradients of shard/gather."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = get_mesh(ulysses, ring)
    world_rank = dist.get_rank()
    out: dict = {"placement": (mesh.ulysses_rank, mesh.ring_rank) == (world_rank % ulysses, world_rank // ulysses)}
    wrapped = seqmesh.mesh_from_device_mesh(
        init_device_mesh("cpu", (1, 1, ring, ulysses), mesh_dim_names=("dp_replicate", "dp_shard", "ring", "ulysses")))
    out["wrapped_same_rank"] = (wrapped.sp_rank, wrapped.ulysses_rank, wrapped.ring_rank) == (
        mesh.sp_rank, mesh.ulysses_rank, mesh.ring_rank)
    out["positions"] = {}
    out["roundtrip"] = {}
    out["grad_err"] = {}
    for layout in ("zigzag", "contiguous"):
        for seq_len in (23, 32):
            got = seqmesh.sequence_positions(seq_len, mesh, layout=layout).tolist()
            want = (zigzag_positions_by_hand(seq_len, ulysses, ring, mesh.ulysses_rank, mesh.ring_rank)
                    if layout == "zigzag" else None)
            if want is None:  # contiguous: rank i holds [i*L, (i+1)*L) of the padded sequence
                length = len(got)
                want = list(range(mesh.sp_rank * length, (mesh.sp_rank + 1) * length))
            out["positions"][f"{layout}-{seq_len}"] = got == want

            g = torch.Generator().manual_seed(seq_len)
            x = torch.randn(2, seq_len, 3, generator=g, dtype=torch.float64, requires_grad=True)
            weight = torch.randn(2, seq_len, 3, generator=g, dtype=torch.float64)  # the same on every rank
            local = seqmesh.shard_sequence(x, mesh, layout=layout)
            whole = seqmesh.gather_sequence(local, mesh, layout=layout, length=seq_len)
            out["roundtrip"][f"{layout}-{seq_len}"] = torch.equal(whole.detach(), x.detach())
            (whole * weight).sum().backward()  # every rank adds the same loss: d/dx of the sum is P x weight
            out["grad_err"][f"{layout}-{seq_len}"] = float((x.grad - mesh.sp_size * weight).abs().max())
    return out


def saved_for_backward(ulysses: int, ring: int, cases: list[Case]) -> list[int]:
    """Bytes that seqmesh.attention keeps for backward on this rank (autograd's saved tensors)."""
    mesh = get_mesh(ulysses, ring)
    results = []
    for case in cases:
        q, k, v, _ = _inputs(case, case.seed)
        shard = lambda t: seqmesh.shard_sequence(t, mesh, layout=case.layout).detach().requires_grad_()  # noqa: E731
        ql, kl, vl = shard(q), shard(k), shard(v)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # each buffer once
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            seqmesh.attention(ql, kl, vl, mesh, causal=case.causal, layout=case.layout, seq_len=case.seq_len)
        results.append(sum(seen.values()))
    return results


def nested_gather_warnings() -> dict[str, list[str]]:
    """On 4 ranks: what torch's redistribute logger says while a tensor cut twice along one dimension (a 2 x 2 mesh,
    as FSDP2 over tensor-parallel shards of the same dimension cuts it) is gathered whole, through
    ``seqmesh.comm.ranks.full_value`` and, with the other dimension cut, through ``full_tensor`` itself. torch says it
    once per pair of layouts, so each call has a mesh and a layout of its own."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from seqmesh.comm.ranks import full_value

    said: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    log, kept = logging.getLogger("torch.distributed.tensor._redistribute"), Kept()
    log.addHandler(kept)
    heard = {}
    try:
        for name, gather, dim in (("full_value", full_value, 0), ("full_tensor", lambda t: t.full_tensor(), 1)):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(f"{name}_outer", f"{name}_inner"))
            whole = torch.arange(64.0).reshape(8, 8)
            assert torch.equal(gather(distribute_tensor(whole, mesh, [Shard(dim), Shard(dim)])), whole)
            heard[name], said[:] = list(said), []
    finally:
        log.removeHandler(kept)
    return heard
