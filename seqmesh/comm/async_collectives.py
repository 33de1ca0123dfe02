"""The Ulysses all-to-alls launched without waiting, so compute can run while they are in flight.

Each collective is still one differentiable op, split into a start and a wait::

    pending = seq_to_head_start([q, k, v], group, chunks, send_heads, recv_heads)  # packs, launches
    ...                                                                            # compute meanwhile
    y = pending.wait()                                                             # (B, G*L, h, D)

Forward, the start packs and launches the all-to-all and the wait waits for it and unpacks. Backward the
roles swap: the wait's backward packs the gradient and launches the inverse all-to-all (the adjoint), the
start's backward waits for it and unpacks. The gradient passed between the two is the exact gradient of
the receive buffer (unpacking is a permutation), so the pair composes like any other op. Autograd runs
the nodes created last first, so a forward "start 1, project 2, start 2, ..., wait 1, wait 2" runs
backward as "launch 2, launch 1, wait 2, project-backward 2 while 1 is in flight, wait 1, ...": the
backward overlaps symmetrically without any scheduling of its own.

On CUDA the collective runs on the process group's communication stream (NCCL), launched in the same order
on every rank; ``wait`` makes the current stream wait on it without blocking the host. On gloo (CPU) a
worker thread runs it and ``wait`` blocks until it is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import Chunk, launch_all_to_all_rows, pack_heads, pack_sequence, unpack_heads, unpack_sequence


@dataclass(frozen=True)
class HeadExchange:
    """The Ulysses all-to-all between sequence shards ``(B, L, H_i, D)`` (one per input tensor) and head
    shards ``(B, G*L, recv_heads, D)``, in either direction. ``chunks``, destination-major, are the head
    ranges sent; ``send_heads[g]`` how many go to rank g (see ``HeadDeal.send_chunks``)."""

    group: dist.ProcessGroup
    chunks: tuple[Chunk, ...]
    send_heads: tuple[int, ...]
    recv_heads: int
    shapes: tuple[torch.Size, ...]  # the sequence-side tensors' shapes

    @property
    def world(self) -> int:
        return len(self.send_heads)

    def rows(self, to_heads: bool) -> tuple[list[int], list[int]]:
        """(rows sent to each rank, rows received from each) of the buffer of one direction."""
        heads = [self.recv_heads] * self.world
        return (list(self.send_heads), heads) if to_heads else (heads, list(self.send_heads))

    def pack(self, to_heads: bool, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The send buffer ``(rows, B, L, D)``: sequence-side tensors when ``to_heads``, else one head-side one."""
        return pack_heads(xs, self.chunks) if to_heads else pack_sequence(xs[0], self.world, self.recv_heads)

    def unpack(self, to_heads: bool, recv: torch.Tensor) -> list[torch.Tensor]:
        """The received buffer as the head-side tensor (``to_heads``) or the sequence-side tensors."""
        return [unpack_heads(recv, self.world, self.recv_heads)] if to_heads else unpack_sequence(recv, self.chunks, self.shapes)


class InFlight:
    """One collective between its start and its wait: the work handles and the buffers they use."""

    __slots__ = ("work", "send", "back", "back_work", "back_send")

    def __init__(self) -> None:
        self.work = self.send = self.back = self.back_work = self.back_send = None


def _launch(exchange: HeadExchange, to_heads: bool, send: torch.Tensor, phase: str):
    send_rows, recv_rows = exchange.rows(to_heads)
    return launch_all_to_all_rows(send, exchange.group, send_rows, recv_rows, phase, async_op=True)


class _Start(torch.autograd.Function):
    """Forward: pack and launch the all-to-all, return its receive buffer (still arriving); backward: wait
    for the inverse all-to-all that the matching wait's backward launched and unpack the input gradients."""

    @staticmethod
    def forward(ctx, flight, exchange, to_heads, *xs):  # type: ignore[override]
        ctx.flight, ctx.exchange, ctx.to_heads = flight, exchange, to_heads
        flight.send = exchange.pack(to_heads, xs)
        recv, flight.work = _launch(exchange, to_heads, flight.send, "forward")
        return recv

    @staticmethod
    def backward(ctx, grad_recv):  # type: ignore[override]
        flight = ctx.flight
        flight.back_work.wait()
        grads = ctx.exchange.unpack(not ctx.to_heads, flight.back)
        flight.back = flight.back_work = flight.back_send = None
        return (None, None, None, *grads)


class _Wait(torch.autograd.Function):
    """Forward: wait for the all-to-all the matching start launched and unpack it; backward: pack the
    gradient and launch the inverse all-to-all (the matching start's backward waits for it)."""

    @staticmethod
    def forward(ctx, recv, flight, exchange, to_heads):  # type: ignore[override]
        ctx.flight, ctx.exchange, ctx.to_heads = flight, exchange, to_heads
        flight.work.wait()
        flight.work = flight.send = None
        return exchange.unpack(to_heads, recv)[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        flight, exchange = ctx.flight, ctx.exchange
        send = exchange.pack(not ctx.to_heads, [grad.contiguous()])  # the gradient of the receive buffer
        flight.back_send = send
        flight.back, flight.back_work = _launch(exchange, not ctx.to_heads, send, "backward")
        return send, None, None, None


class PendingExchange:
    """An all-to-all in flight; :meth:`wait` returns its differentiable result."""

    def __init__(self, recv: torch.Tensor, flight: InFlight, exchange: HeadExchange, to_heads: bool) -> None:
        self._recv, self._flight, self._exchange, self._to_heads = recv, flight, exchange, to_heads

    def wait(self) -> torch.Tensor:
        """``(B, G*L, recv_heads, D)`` after :func:`seq_to_head_start`, ``(B, L, H, D)`` after
        :func:`head_to_seq_start`. Call it once, in the same order on every rank."""
        return _Wait.apply(self._recv, self._flight, self._exchange, self._to_heads)


def seq_to_head_start(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup, chunks: Sequence[Chunk], send_heads: Sequence[int],
    recv_heads: int,
) -> PendingExchange:
    """Launch ``seqmesh.comm.collectives.seq_to_head`` (``(B, L, H_i, D)`` inputs -> ``(B, G*L, recv_heads, D)``)."""
    exchange = HeadExchange(group, tuple(chunks), tuple(send_heads), recv_heads, tuple(x.shape for x in xs))
    flight = InFlight()
    return PendingExchange(_Start.apply(flight, exchange, True, *xs), flight, exchange, True)


def head_to_seq_start(
    y: torch.Tensor, group: dist.ProcessGroup, chunks: Sequence[Chunk], send_heads: Sequence[int], recv_heads: int,
    shape: torch.Size,
) -> PendingExchange:
    """Launch ``seqmesh.comm.collectives.head_to_seq`` (``(B, G*L, recv_heads, D)`` -> ``(B, L, H, D)`` of ``shape``)."""
    exchange = HeadExchange(group, tuple(chunks), tuple(send_heads), recv_heads, (torch.Size(shape),))
    flight = InFlight()
    return PendingExchange(_Start.apply(flight, exchange, False, y), flight, exchange, False)
