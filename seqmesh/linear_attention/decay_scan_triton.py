"""The scalar-decay scan's carry across chunks (:class:`seqmesh.linear_attention.decay_scan._ChunkStates`' two loops:
Mamba2's and lightning attention's torch rule) as Triton kernels, the whole loop over a row's chunks in one launch
each way where the torch loop launches one ``addcmul`` a chunk (512 a layer at 32K tokens).

Each program owns one (batch, head) and ``BLOCK`` of its state's ``Dk x Dv`` elements, carried in registers in
float32 (the rule's compute dtype) from chunk to chunk. Forward, per chunk ``i``::

    entering[i] = S                 (zero, or the segment's initial state, at a segment's first chunk)
    S           = S * decay[i] + written[i]
    finals[j]   = S                 (at segment j's last chunk)

Backward, chunks in reverse, with ``D`` the gradient of the state leaving chunk ``i`` (the segment's final state's
own at its last chunk)::

    d_written[i] = D
    D            = d_entering[i] + D * decay[i]     (the segment's initial state's at its first chunk; then zero)

The decays' gradients (one dot product a chunk and head) stay torch's, after the loop. :mod:`.decay_scan` imports
this module on the kernel's first use, so a process that never calls it never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import carry_triton

BLOCK, WARPS = 1024, 4  # state elements a program carries (8 a thread)


@triton.jit
def _forward(WRITTEN, DECAY, INIT, FIRST, LAST, ENTERING, FINALS, N, H, J, SIZE,
             BLOCK: tl.constexpr, HAS_INIT: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    em = e < SIZE
    state = tl.zeros((BLOCK,), tl.float32)
    for i in range(N):
        segment = tl.load(FIRST + i)
        if segment >= 0:  # the segment's first chunk: its state starts here
            if HAS_INIT:
                state = tl.load(INIT + ((b * J + segment) * H + h) * SIZE + e, mask=em, other=0.0)
            else:
                state = tl.zeros((BLOCK,), tl.float32)
        at = (bh * N + i) * SIZE + e  # (B, H, N, Dk, Dv) contiguous
        tl.store(ENTERING + at, state, mask=em)
        state = state * tl.load(DECAY + bh * N + i) + tl.load(WRITTEN + at, mask=em, other=0.0)
        last = tl.load(LAST + i)
        if last >= 0:
            tl.store(FINALS + ((b * J + last) * H + h) * SIZE + e, state, mask=em)


@triton.jit
def _backward(D_ENTERING, DECAY, D_FINALS, FIRST, LAST, D_WRITTEN, D_INIT, N, H, J, SIZE,
              BLOCK: tl.constexpr, HAS_INIT: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    em = e < SIZE
    grad = tl.zeros((BLOCK,), tl.float32)  # d loss / d (the state leaving the chunk)
    for step in range(N):
        i = N - 1 - step
        last = tl.load(LAST + i)
        if last >= 0:  # the segment's final state: its own gradient; none flows on from the next segment
            grad = tl.load(D_FINALS + ((b * J + last) * H + h) * SIZE + e, mask=em, other=0.0)
        at = (bh * N + i) * SIZE + e
        tl.store(D_WRITTEN + at, grad, mask=em)
        carried = tl.load(D_ENTERING + at, mask=em, other=0.0) + grad * tl.load(DECAY + bh * N + i)
        segment = tl.load(FIRST + i)
        if segment >= 0:
            if HAS_INIT:
                tl.store(D_INIT + ((b * J + segment) * H + h) * SIZE + e, carried, mask=em)
            grad = tl.zeros((BLOCK,), tl.float32)
        else:
            grad = carried


def forward(written: torch.Tensor, decay: torch.Tensor, initial: torch.Tensor | None, firsts: tuple[int, ...],
            lasts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """written (B, H, N, Dk, Dv), decay (B, H, N), initial (B, J, H, Dk, Dv) or None, float32 -> (the states entering
    each chunk (B, H, N, Dk, Dv), each segment's final state (B, J, H, Dk, Dv)), as ``_ChunkStates.forward``."""
    b, h, n, dk, dv = written.shape
    written, decay = written.contiguous(), decay.contiguous()
    entering = torch.empty_like(written)
    finals = written.new_empty(b, len(firsts), h, dk, dv)
    first, last = carry_triton.segment_flags(firsts, n, written.device)  # (lasts: the chunks before the next firsts)
    grid = (b * h, triton.cdiv(dk * dv, BLOCK))
    _forward[grid](written, decay, initial.contiguous() if initial is not None else finals, first, last, entering,
                   finals, n, h, len(firsts), dk * dv, BLOCK=BLOCK, HAS_INIT=initial is not None, num_warps=WARPS)
    return entering, finals


def backward(d_entering: torch.Tensor, decay: torch.Tensor, d_finals: torch.Tensor, firsts: tuple[int, ...],
             lasts: tuple[int, ...], d_initial: torch.Tensor | None) -> torch.Tensor:
    """The reverse loop: the gradient of the state leaving each chunk (B, H, N, Dk, Dv), and ``d_initial``
    (B, J, H, Dk, Dv, contiguous) filled where given; float32."""
    b, h, n, dk, dv = d_entering.shape
    d_entering, decay, d_finals = d_entering.contiguous(), decay.contiguous(), d_finals.contiguous()
    d_written = torch.empty_like(d_entering)
    first, last = carry_triton.segment_flags(firsts, n, d_entering.device)
    grid = (b * h, triton.cdiv(dk * dv, BLOCK))
    _backward[grid](d_entering, decay, d_finals, first, last, d_written,
                    d_initial if d_initial is not None else d_finals, n, h, len(firsts), dk * dv, BLOCK=BLOCK,
                    HAS_INIT=d_initial is not None, num_warps=WARPS)
    return d_written
