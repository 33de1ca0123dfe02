"""The delta rule's carry across chunks (:class:`seqmesh.linear_attention.gated_delta._CarryChunks`' two loops) as
Triton kernels: the whole loop over a row's chunks in one launch each way, where the torch loop launches a few
operators a chunk (512 chunks a layer at 32K tokens: a GPU step bound by its launches, docs/gpu.md).

Each program owns one (batch, head) and a block of ``BV`` of the state's value columns: the state's ``(Dk, BV)``
block stays in registers from chunk to chunk, float32, its products in IEEE float32 (the rule's compute dtype, as
the torch loop's ``baddbmm``). Forward, per chunk ``i`` (tensors laid out ``(N, B*H, ...)``, as ``_by_chunk``)::

    states[i] = S                      (zero, or the segment's initial state, at a segment's first chunk)
    v_new[i]  = u[i] - w[i] S
    S         = S * decay[i] + k_write[i]^T v_new[i]      (decay: one a head, or one a state row)
    finals[j] = S                      (at segment j's last chunk)

Backward, chunks in reverse, with the state's gradient ``D`` (the segment's final state's own at its last chunk)::

    d_v_new[i]   = intra[i]^T d_out[i] + k_write[i] D
    d_k_write[i] = v_new[i] D^T                          (this block's columns' share, added atomically: the order
                                                          of a float32 sum varies run to run)
    d_decay[i]   = sum(D * states[i]) over what it scales (a share a block, summed over the blocks after)
    D            = D * decay[i] + q_read[i]^T d_out[i] - w[i]^T d_v_new[i]   (the segment's initial state's at its
                                                                              first chunk; then zero)

The products over all chunks at once (the outputs' reads, w's, q_read's and intra's gradients) stay torch's.
``intra`` is causal, as the rules make it (a token reads the chunk's tokens up to itself): the backward skips its
blocks above the diagonal.

:mod:`.gated_delta` imports this module on the kernel's first use, so a process that never calls it never imports
Triton; Triton decides at import whether the kernels run interpreted (a test sets ``TRITON_INTERPRET=1`` first).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# value columns a program carries (a (128, 16) float32 state block), a chunk's rows a product takes, warps, and the
# loop's software pipelining (none: each stage would hold another chunk's tiles in shared memory)
BLOCK_V, BLOCK_ROWS, WARPS, STAGES = 16, 16, 8, 1


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


@triton.jit
def _forward(U, W, KW, DECAY, INIT, START, END, STATES, VNEW, FINALS, N, BH,
             C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr):
    # a chunk's rows go BR at a time (whole (C, Dk) float32 tiles spilled registers): each row's v_new reads the state
    # entering the chunk, and the rows' writes are summed into the state once all are read
    bh = tl.program_id(0).to(tl.int64)
    rr, rk = tl.arange(0, BR), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    km, vm = rk < DK, rv < DV
    state_at = rk[:, None] * DV + rv[None, :]  # (BK, BV) offsets in a (Dk, Dv) state
    state_mask = km[:, None] & vm[None, :]
    state = tl.zeros((BK, BV), tl.float32)
    for i in range(N):
        chunk = i * BH + bh
        segment = tl.load(START + i)
        if segment >= 0:  # the segment's first chunk: its state starts here
            if HAS_INIT:
                state = tl.load(INIT + (segment * BH + bh) * DK * DV + state_at, mask=state_mask, other=0.0)
            else:
                state = tl.zeros((BK, BV), tl.float32)
        tl.store(STATES + chunk * DK * DV + state_at, state, mask=state_mask)
        written = tl.zeros((BK, BV), tl.float32)
        for r0 in range(0, C, BR):
            rows = r0 + rr
            tile_k = (rows < C)[:, None] & km[None, :]
            tile_v = (rows < C)[:, None] & vm[None, :]
            rows_k = chunk * C * DK + rows[:, None] * DK + rk[None, :]  # (BR, BK) offsets in a (C, Dk) tile
            rows_v = chunk * C * DV + rows[:, None] * DV + rv[None, :]  # (BR, BV) in a (C, Dv) tile
            w = tl.load(W + rows_k, mask=tile_k, other=0.0)
            v_new = tl.load(U + rows_v, mask=tile_v, other=0.0) - tl.dot(w, state, input_precision="ieee")
            tl.store(VNEW + rows_v, v_new, mask=tile_v)
            k_write = tl.load(KW + rows_k, mask=tile_k, other=0.0)
            written += tl.dot(tl.trans(k_write), v_new, input_precision="ieee")
        if ROWS == 1:
            state = state * tl.load(DECAY + chunk) + written
        else:
            decay = tl.load(DECAY + chunk * DK + rk, mask=km, other=0.0)
            state = state * decay[:, None] + written
        segment_end = tl.load(END + i)
        if segment_end >= 0:
            tl.store(FINALS + (segment_end * BH + bh) * DK * DV + state_at, state, mask=state_mask)


@triton.jit
def _backward(DOUT, INTRA, KW, W, QR, DECAY, STATES, VNEW, DFINAL, START, END, DVNEW, DKW, DDECAY, DINIT, N, BH,
              C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    rr, rk = tl.arange(0, BR), tl.arange(0, BK)
    rv = block * BV + tl.arange(0, BV)
    km, vm = rk < DK, rv < DV
    state_at = rk[:, None] * DV + rv[None, :]
    state_mask = km[:, None] & vm[None, :]
    grad = tl.zeros((BK, BV), tl.float32)  # d loss / d (the state leaving the chunk)
    for step in range(N):
        i = N - 1 - step
        chunk = i * BH + bh
        segment_end = tl.load(END + i)
        if segment_end >= 0:  # the segment's final state: its own gradient; none flows on from the next segment
            grad = tl.load(DFINAL + (segment_end * BH + bh) * DK * DV + state_at, mask=state_mask, other=0.0)
        entering = tl.load(STATES + chunk * DK * DV + state_at, mask=state_mask, other=0.0)
        shares = block * N * BH + chunk  # this block's share of chunk i's decay gradient, summed over blocks after
        if ROWS == 1:
            tl.store(DDECAY + shares, tl.sum(tl.sum(grad * entering, 1), 0))
            carried = grad * tl.load(DECAY + chunk)
        else:
            tl.store(DDECAY + shares * DK + rk, tl.sum(grad * entering, 1), mask=km)
            decay = tl.load(DECAY + chunk * DK + rk, mask=km, other=0.0)
            carried = grad * decay[:, None]
        for r0 in range(0, C, BR):  # BR rows of the chunk at a time, as the forward
            rows = r0 + rr
            tile_k = (rows < C)[:, None] & km[None, :]
            tile_v = (rows < C)[:, None] & vm[None, :]
            rows_k = chunk * C * DK + rows[:, None] * DK + rk[None, :]
            rows_v = chunk * C * DV + rows[:, None] * DV + rv[None, :]
            # d_v_new of these rows: through the state they write, and the outputs of every row at or after them
            k_write = tl.load(KW + rows_k, mask=tile_k, other=0.0)
            d_v = tl.dot(k_write, grad, input_precision="ieee")  # (BR, BV)
            for s0 in range(r0, C, BR):  # intra[s, r] is zero for s < r: the blocks before r0 add nothing
                later = s0 + rr
                intra = tl.load(INTRA + chunk * C * C + later[:, None] * C + rows[None, :],
                                mask=(later < C)[:, None] & (rows < C)[None, :], other=0.0)  # (BR, BR): intra[s, r]
                d_out = tl.load(DOUT + chunk * C * DV + later[:, None] * DV + rv[None, :],
                                mask=(later < C)[:, None] & vm[None, :], other=0.0)
                d_v += tl.dot(tl.trans(intra), d_out, input_precision="ieee")
            tl.store(DVNEW + rows_v, d_v, mask=tile_v)
            v_new = tl.load(VNEW + rows_v, mask=tile_v, other=0.0)
            d_k = tl.dot(v_new, tl.trans(grad), input_precision="ieee")  # (BR, BK): this block's columns' share
            tl.atomic_add(DKW + rows_k, d_k, mask=tile_k)
            q_read = tl.load(QR + rows_k, mask=tile_k, other=0.0)
            w = tl.load(W + rows_k, mask=tile_k, other=0.0)
            d_out = tl.load(DOUT + rows_v, mask=tile_v, other=0.0)
            carried += tl.dot(tl.trans(q_read), d_out, input_precision="ieee")
            carried -= tl.dot(tl.trans(w), d_v, input_precision="ieee")
        segment = tl.load(START + i)
        if segment >= 0:
            if HAS_INIT:
                tl.store(DINIT + (segment * BH + bh) * DK * DV + state_at, carried, mask=state_mask)
            grad = tl.zeros((BK, BV), tl.float32)
        else:
            grad = carried


def segment_flags(first_chunks: tuple[int, ...], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) int32 each: the segment a chunk starts (else -1), and the one it ends (else -1); the carry's and the
    decay scan's kernels read them. Made once per layout and device (a layer's every call would otherwise copy them
    from the host)."""
    return _flags(tuple(first_chunks), n, torch.device(device))


@functools.lru_cache(maxsize=64)
def _flags(first_chunks: tuple[int, ...], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.full((n,), -1, dtype=torch.int32)
    end = torch.full((n,), -1, dtype=torch.int32)
    for j, first in enumerate(first_chunks):
        start[first] = j
        end[(first_chunks[j + 1] if j + 1 < len(first_chunks) else n) - 1] = j
    return start.to(device), end.to(device)


def _sizes(c: int, dk: int, dv: int, rows: int, has_init: bool) -> dict:
    return dict(C=c, DK=dk, DV=dv, ROWS=rows, BR=BLOCK_ROWS, BK=_pow2(dk), BV=BLOCK_V, HAS_INIT=has_init,
                num_warps=WARPS, num_stages=STAGES)


def forward(us: torch.Tensor, ws: torch.Tensor, k_write: torch.Tensor, decays: torch.Tensor,
            initial: torch.Tensor | None, start: torch.Tensor, end: torch.Tensor, states: torch.Tensor,
            v_new: torch.Tensor, finals: torch.Tensor) -> None:
    """Fill ``states`` (N, BH, Dk, Dv), ``v_new`` (N, BH, C, Dv) and ``finals`` (J, BH, Dk, Dv) from us (N, BH, C, Dv),
    ws and k_write (N, BH, C, Dk), decays (N, BH, 1 or Dk, 1), initial (J, BH, Dk, Dv) or None, all float32 (the
    outputs contiguous); start, end from :func:`segment_flags`."""
    n, bh, c, dv = us.shape
    dk, rows = ws.shape[-1], decays.shape[-2]
    sizes = _sizes(c, dk, dv, rows, initial is not None)
    us, ws, k_write, decays = (x.contiguous() for x in (us, ws, k_write, decays))  # (a permuted view may not be)
    initial = initial.contiguous() if initial is not None else finals
    _forward[(bh, triton.cdiv(dv, BLOCK_V))](us, ws, k_write, decays, initial, start, end, states, v_new, finals, n,
                                            bh, **sizes)


def backward(d_out: torch.Tensor, intra: torch.Tensor, k_write: torch.Tensor, ws: torch.Tensor, q_read: torch.Tensor,
             decays: torch.Tensor, states: torch.Tensor, v_new: torch.Tensor, d_final: torch.Tensor,
             start: torch.Tensor, end: torch.Tensor, d_initial: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reverse loop: (d_v_new (N, BH, C, Dv), d_k_write (N, BH, C, Dk), d_decay (N, BH, 1 or Dk, 1)), and
    ``d_initial`` (J, BH, Dk, Dv) filled where given; inputs as :func:`forward`'s (d_out (N, BH, C, Dv), intra
    (N, BH, C, C), q_read (N, BH, C, Dk), d_final (J, BH, Dk, Dv)), float32 (``d_initial`` contiguous)."""
    n, bh, c, dv = d_out.shape
    dk, rows = ws.shape[-1], decays.shape[-2]
    blocks = triton.cdiv(dv, BLOCK_V)
    d_v_new = torch.empty_like(v_new)
    d_k = d_out.new_zeros(n, bh, c, dk)  # each block's share added in (shares kept apart would be Dv / BV of it)
    d_decay = d_out.new_empty(blocks, n, bh, rows, 1)
    sizes = _sizes(c, dk, dv, rows, d_initial is not None)
    d_out, intra, k_write, ws, q_read, decays, states, v_new, d_final = (
        x.contiguous() for x in (d_out, intra, k_write, ws, q_read, decays, states, v_new, d_final))
    _backward[(bh, blocks)](d_out, intra, k_write, ws, q_read, decays, states, v_new, d_final, start, end, d_v_new,
                            d_k, d_decay, d_initial if d_initial is not None else d_final, n, bh, **sizes)
    return d_v_new, d_k, d_decay.sum(0)
