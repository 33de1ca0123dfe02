"""Differentiable collectives. Each autograd Function is one collective whose backward is its adjoint.

Under the convention of distributed autograd (the training loss is the *sum* of every rank's local
loss), the adjoint pairs are:

- scatter heads / gather sequence all-to-all  <->  the inverse all-to-all      (SeqToHead, HeadToSeq)
- all-gather along a dim                      <->  reduce-scatter along it      (AllGather)
- keep this rank's chunk of a replicated tensor <-> all-gather the chunks        (Split)
- rows to chosen ranks, counts per rank        <->  the same all-to-all, counts swapped (ExchangeRows)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .stats import record

# Recent torch (2.13 here) names these collectives all_gather_single / reduce_scatter_single and
# deprecates all_gather_into_tensor / reduce_scatter_tensor with a FutureWarning; older releases that
# pyproject.toml accepts (torch >= 2.6) have only the old names. Same arguments, same collective.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Chunk = tuple[int, int, int]  # (which input tensor, first head, end head) sent as one piece


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all_rows(
    x: torch.Tensor, group: dist.ProcessGroup, send_rows: Sequence[int], recv_rows: Sequence[int], phase: str
) -> torch.Tensor:
    """All-to-all over dim 0 with per-rank row counts; ``x`` must be contiguous."""
    out, _ = launch_all_to_all_rows(x, group, send_rows, recv_rows, phase, async_op=False)
    return out


def launch_all_to_all_rows(
    x: torch.Tensor, group: dist.ProcessGroup, send_rows: Sequence[int], recv_rows: Sequence[int], phase: str,
    async_op: bool,
) -> tuple[torch.Tensor, dist.Work | None]:
    """:func:`all_to_all_rows`, optionally launched without waiting: (the receive buffer, its work handle or
    None). With ``async_op`` the buffer is valid only after ``work.wait()`` (on CUDA: NCCL's stream runs it,
    ``wait`` makes the current stream wait for it; on gloo a worker thread runs it, ``wait`` blocks)."""
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(recv_rows), list(send_rows), group=group, async_op=async_op)
    row_bytes = _nbytes(x[:1]) if x.shape[0] else x.element_size() * int(torch.Size(x.shape[1:]).numel())
    me = dist.get_rank(group)
    record("all_to_all", phase, (sum(send_rows) - send_rows[me]) * row_bytes, (sum(recv_rows) - recv_rows[me]) * row_bytes)
    return out, work


def pack_heads(xs: Sequence[torch.Tensor], chunks: Sequence[Chunk]) -> torch.Tensor:
    """``xs[i]`` (B, L, H_i, D) -> the send buffer (sum of chunk heads, B, L, D), destination-major."""
    head_major = [x.permute(2, 0, 1, 3) for x in xs]  # views (H_i, B, L, D)
    return torch.cat([head_major[i][h0:h1] for i, h0, h1 in chunks])


def unpack_heads(recv: torch.Tensor, world: int, recv_heads: int) -> torch.Tensor:
    """Received (G*recv_heads, B, L, D), source-major -> (B, G*L, recv_heads, D)."""
    _, b, n, d = recv.shape
    recv = recv.view(world, recv_heads, b, n, d).permute(2, 0, 3, 1, 4)  # (B, G, L, recv_heads, D)
    return recv.reshape(b, world * n, recv_heads, d)


def pack_sequence(y: torch.Tensor, world: int, recv_heads: int) -> torch.Tensor:
    """(B, G*L, recv_heads, D) -> the send buffer (G*recv_heads, B, L, D) of the inverse all-to-all."""
    b, gl, _, d = y.shape
    n = gl // world
    send = y.reshape(b, world, n, recv_heads, d).permute(1, 3, 0, 2, 4).contiguous()  # (G, heads, B, L, D)
    return send.view(world * recv_heads, b, n, d)


def unpack_sequence(back: torch.Tensor, chunks: Sequence[Chunk], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Received (sum of chunk heads, B, L, D) -> one (B, L, H_i, D) per input, summing where a head came from
    several ranks (kv heads replicated by the deal)."""
    if len(shapes) == 1 and _covers_in_order(chunks, shapes[0][2]):
        return [back.permute(1, 2, 0, 3).contiguous()]
    outs = [back.new_zeros(shape) for shape in shapes]
    row = 0
    for i, h0, h1 in chunks:
        outs[i][:, :, h0:h1] += back[row : row + h1 - h0].permute(1, 2, 0, 3)
        row += h1 - h0
    return outs


def scatter_heads(
    xs: Sequence[torch.Tensor],
    chunks: Sequence[Chunk],
    send_heads: Sequence[int],
    recv_heads: int,
    group: dist.ProcessGroup,
    phase: str,
) -> torch.Tensor:
    """``xs[i]``: (B, L, H_i, D) -> (B, G*L, recv_heads, D). ``chunks`` lists, destination-major, the
    head ranges sent; ``send_heads[g]`` is how many heads go to rank g."""
    world = len(send_heads)
    recv = all_to_all_rows(pack_heads(xs, chunks), group, send_heads, [recv_heads] * world, phase)
    return unpack_heads(recv, world, recv_heads)


def gather_heads(
    y: torch.Tensor,
    chunks: Sequence[Chunk],
    shapes: Sequence[torch.Size],
    send_heads: Sequence[int],
    recv_heads: int,
    group: dist.ProcessGroup,
    phase: str,
) -> list[torch.Tensor]:
    """The adjoint of :func:`scatter_heads`: (B, G*L, recv_heads, D) -> one (B, L, H_i, D) per input,
    summing where a head was sent to several ranks."""
    world = len(send_heads)
    back = all_to_all_rows(pack_sequence(y, world, recv_heads), group, [recv_heads] * world, send_heads, phase)
    return unpack_sequence(back, chunks, shapes)


def _covers_in_order(chunks: Sequence[Chunk], heads: int) -> bool:
    expect = 0
    for i, h0, h1 in chunks:
        if i != 0 or h0 != expect:
            return False
        expect = h1
    return expect == heads


class SeqToHead(torch.autograd.Function):
    """Forward: scatter heads, gather sequence (B, L, H, D) -> (B, G*L, h, D); backward: the inverse
    all-to-all, summing gradients of heads that were sent to several ranks."""

    @staticmethod
    def forward(ctx, group, chunks, send_heads, recv_heads, *xs):  # type: ignore[override]
        ctx.group, ctx.chunks, ctx.send_heads, ctx.recv_heads = group, chunks, send_heads, recv_heads
        ctx.shapes = [x.shape for x in xs]
        return scatter_heads(xs, chunks, send_heads, recv_heads, group, "forward")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grads = gather_heads(grad, ctx.chunks, ctx.shapes, ctx.send_heads, ctx.recv_heads, ctx.group, "backward")
        return (None, None, None, None, *grads)


class HeadToSeq(torch.autograd.Function):
    """Forward: scatter sequence, gather heads (B, G*L, h, D) -> (B, L, H, D); backward: SeqToHead."""

    @staticmethod
    def forward(ctx, y, group, chunks, send_heads, recv_heads, shape):  # type: ignore[override]
        ctx.group, ctx.chunks, ctx.send_heads, ctx.recv_heads = group, chunks, send_heads, recv_heads
        (out,) = gather_heads(y, chunks, [shape], send_heads, recv_heads, group, "forward")
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        y = scatter_heads([grad], ctx.chunks, ctx.send_heads, ctx.recv_heads, ctx.group, "backward")
        return y, None, None, None, None, None


def _all_gather_dim(x: torch.Tensor, group: dist.ProcessGroup, dim: int, phase: str) -> torch.Tensor:
    world = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    all_gather_single(out, moved, group=group)
    record("all_gather", phase, (world - 1) * _nbytes(moved), (world - 1) * _nbytes(moved))
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, group: dist.ProcessGroup, dim: int, phase: str) -> torch.Tensor:
    world = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    reduce_scatter_single(out, moved, group=group)
    record("reduce_scatter", phase, (world - 1) * _nbytes(out), (world - 1) * _nbytes(out))
    return out.movedim(0, dim)


class AllGather(torch.autograd.Function):
    """Forward: all-gather along ``dim`` in group-rank order; backward: reduce-scatter along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _all_gather_dim(x, group, dim, "forward")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter_dim(grad, ctx.group, ctx.dim, "backward"), None, None


class Split(torch.autograd.Function):
    """Forward: keep this rank's chunk along ``dim`` of a tensor replicated on the group;
    backward: all-gather the chunks' gradients, so every replica receives the whole gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(world, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather_dim(grad, ctx.group, ctx.dim, "backward"), None, None


class ExchangeRows(torch.autograd.Function):
    """Forward: an all-to-all over dim 0 that sends ``send_rows[r]`` consecutive rows to group rank ``r``
    and receives ``recv_rows[r]`` from it; backward: the same exchange with the counts swapped, which
    returns every row's gradient to the rank that sent it."""

    @staticmethod
    def forward(ctx, x, group, send_rows, recv_rows):  # type: ignore[override]
        ctx.group, ctx.send_rows, ctx.recv_rows = group, send_rows, recv_rows
        return all_to_all_rows(x.contiguous(), group, send_rows, recv_rows, "forward")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return all_to_all_rows(grad.contiguous(), ctx.group, ctx.recv_rows, ctx.send_rows, "backward"), None, None, None


def exchange_rows(
    x: torch.Tensor, group: dist.ProcessGroup, send_rows: Sequence[int], recv_rows: Sequence[int]
) -> torch.Tensor:
    """Differentiable uneven all-to-all: ``x`` ``(sum(send_rows), ...)`` sorted by destination rank ->
    ``(sum(recv_rows), ...)`` sorted by source rank. Every rank of ``group`` must call it (with zero
    counts when it has nothing to send or receive); its backward is collective too."""
    return ExchangeRows.apply(x, group, tuple(send_rows), tuple(recv_rows))


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM, phase: str = "forward") -> torch.Tensor:
    """``t`` all-reduced over ``group`` in place (not differentiable: totals, maxima, summed gradients), counted
    as the ring algorithm sends it, ``2 (G - 1) / G`` of its bytes; returns ``t``."""
    dist.all_reduce(t, op=op, group=group)
    world = dist.get_world_size(group)
    nbytes = 2 * (world - 1) * _nbytes(t) // world
    record("all_reduce", phase, nbytes, nbytes)
    return t


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Differentiable all-gather along ``dim`` (backward: reduce-scatter)."""
    return AllGather.apply(x, group, dim)


def split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's chunk of a replicated tensor (backward: all-gather)."""
    return Split.apply(x, group, dim)


def seq_to_head(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup, chunks: Sequence[Chunk], send_heads: Sequence[int], recv_heads: int
) -> torch.Tensor:
    """Differentiable all-to-all: (B, L, H_i, D) inputs -> (B, G*L, recv_heads, D)."""
    return SeqToHead.apply(group, tuple(chunks), tuple(send_heads), recv_heads, *xs)


def head_to_seq(
    y: torch.Tensor,
    group: dist.ProcessGroup,
    chunks: Sequence[Chunk],
    send_heads: Sequence[int],
    recv_heads: int,
    shape: torch.Size,
) -> torch.Tensor:
    """Differentiable inverse all-to-all: (B, G*L, recv_heads, D) -> (B, L, H, D) of ``shape``."""
    return HeadToSeq.apply(y, group, tuple(chunks), tuple(send_heads), recv_heads, shape)
