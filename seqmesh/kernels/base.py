"""The one signature every local attention kernel implements.

Shapes (any strides)::

    q    (B, Sq, Hq, D)      k  (B, Sk, Hk, D)   v  (B, Sk, Hk, Dv)   with Hq % Hk == 0 (grouped-query heads)
    out  (B, Sq, Hq, Dv)     in q's dtype; Dv may differ from D only where ``unsupported`` allows it
    lse  (B, Hq, Sq)         log-sum-exp of the scaled scores, float32 (float64 for float64 inputs)

``forward`` returns ``(out, lse)``. ``backward(dout, q, k, v, out, lse)`` returns ``(dq, dk, dv)``
and must be exact for the ``out`` and ``lse`` it is given, even when they are the merged results of
several calls (ring attention passes the final output and log-sum-exp of the whole row).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMask:
    """Which keys each query of one kernel call may see.

    - ``causal``: query a sees key b only if ``b <= a + offset`` (top-left aligned: offset is 0 on
      the diagonal, the only place seqmesh uses it without a window).
    - ``segments``: local cumulative boundaries ``(0, ..., S)`` of packed documents inside this call;
      a query sees only keys of its own segment (Sq == Sk). ``None`` means one segment.
    - ``window``: sliding window (transformers' ``sliding_window``): query at global position i sees
      key j only if ``i - j < window``; with ``causal`` that is ``i - window < j <= i``, the last
      ``window`` tokens including itself. ``None``: no window.
    - ``offset``: global position of local query row 0 minus that of local key column 0, so local
      query ``a`` and key ``b`` are ``offset + a - b`` positions apart: a ring block knows how far
      its keys lie from its queries. Rows and columns of a windowed call are consecutive positions.
    - ``softcap``: not a mask but the one score transform seqmesh computes, carried with it to every kernel
      call: the scaled scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2's
      ``attn_logit_softcapping``). A kernel that cannot apply it says so in ``unsupported``.
    - ``alibi``: ALiBi (BLOOM, MPT): one slope per query head of the call, and each scaled score of query ``a``
      and key ``b`` gets ``-slope * (offset + a - b)``, minus the slope times their distance (after the soft-cap,
      if any). With it every call's rows and columns are consecutive positions (the block planner plans each
      run pair on its own), so ``offset`` carries the distance across ring blocks; the log-sum-exp includes the
      bias, so partial results of different blocks merge exactly. The math kernel takes it, the CPU flash op in
      fp32 and fp64 as row bands with the bias added (``windows.BandedWindowKernel``), and seqmesh's Triton flash
      kernel on CUDA (``flash_triton_kernel``); torch's fused ops refuse it (:func:`alibi_problem`).
    """

    causal: bool = False
    segments: tuple[int, ...] | None = None
    window: int | None = None
    offset: int = 0
    softcap: float | None = None
    alibi: tuple[float, ...] | None = None

    def allowed(self, sq: int, sk: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dense ``(Sq, Sk)`` boolean matrix of the mask (for kernels without native support)."""
        return self.allowed_part(0, sq, 0, sk, device)

    def allowed_part(self, q0: int, q1: int, k0: int, k1: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``allowed(...)[q0:q1, k0:k1]`` without building the whole matrix."""
        rows = torch.arange(q0, q1, device=device)[:, None]
        cols = torch.arange(k0, k1, device=device)[None, :]
        gap = rows + self.offset - cols
        ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        if self.causal:
            ok &= gap >= 0
        if self.window is not None:
            ok &= gap < self.window
        if self.segments is not None:
            seg = segment_ids(self.segments, device)
            ok &= seg[q0:q1, None] == seg[None, k0:k1]
        return ok

    def distance_bias(self, sq: int, sk: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """ALiBi's ``(Hq, Sq, Sk)`` bias of this call, ``-slope * (offset + a - b)``, in ``dtype``."""
        return self.distance_bias_part(0, sq, 0, sk, dtype, device)

    def distance_bias_part(self, q0: int, q1: int, k0: int, k1: int, dtype: torch.dtype,
                           device: torch.device | str = "cpu") -> torch.Tensor:
        """``distance_bias(...)[:, q0:q1, k0:k1]`` without building the whole call's."""
        assert self.alibi is not None
        rows = torch.arange(q0, q1, device=device, dtype=dtype)[:, None]
        cols = torch.arange(k0, k1, device=device, dtype=dtype)[None, :]
        slopes = torch.tensor(self.alibi, device=device, dtype=dtype)[:, None, None]
        return -slopes * (rows + self.offset - cols)

    def key_span(self, q0: int, q1: int, sk: int) -> tuple[int, int]:
        """Key columns ``[k0, k1)`` that rows ``[q0, q1)`` of a windowed call can see."""
        assert self.window is not None
        k0 = max(0, q0 + self.offset - self.window + 1)
        k1 = min(sk, q1 + self.offset) if self.causal else sk
        return k0, max(k0, k1)

    def score_entries(self, sq: int, sk: int) -> int:
        """How many (query, key) pairs the mask keeps: the work of the call."""
        if self.window is not None:
            return self._windowed_entries(sq, sk)
        if self.segments is None:
            lengths = [sq] if self.causal else None
        else:
            lengths = [b - a for a, b in zip(self.segments[:-1], self.segments[1:])]
        if lengths is None:
            return sq * sk
        if self.causal:
            return sum(n * (n + 1) // 2 for n in lengths)
        return sum(n * n for n in lengths)

    def _windowed_entries(self, sq: int, sk: int) -> int:
        """Visible pairs of a windowed call, one row at a time in closed form (O(Sq), no matrix)."""
        rows = torch.arange(sq, dtype=torch.int64)
        first = rows + self.offset - self.window + 1  # lowest key column inside the window
        last = rows + self.offset if self.causal else torch.full_like(rows, sk - 1)
        if self.segments is not None:  # only with Sq == Sk and offset 0: clip to the row's segment
            seg = segment_ids(self.segments)
            bounds = torch.tensor(self.segments, dtype=torch.int64)
            first = torch.maximum(first, bounds[seg])
            last = torch.minimum(last, bounds[seg + 1] - 1)
        counts = (last.clamp(max=sk - 1) - first.clamp(min=0) + 1).clamp(min=0)
        return int(counts.sum())


FULL = BlockMask()
CAUSAL = BlockMask(causal=True)


def segment_ids(bounds: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """``(bounds[-1],)`` int64: the segment index of every position."""
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


# Input dtypes seqmesh attention accepts (fp64 runs only where a kernel has it: CPU and the math
# kernel), and the half types the fused GPU kernels take. The one table: checks and kernels read it.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


def alibi_problem(mask: BlockMask, kernel: str) -> str | None:
    """The reason a kernel that takes no per-head distance bias gives for an ALiBi call, or None."""
    if mask.alibi is None:
        return None
    return (f"{kernel} takes no ALiBi slopes (seqmesh's Triton flash kernel computes them on CUDA, the CPU flash op in "
            "fp32 and fp64, and the math kernel)")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of log-sum-exp and of every merge: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class AttentionKernel(abc.ABC):
    """A local attention implementation with an explicit backward."""

    name: str = "?"

    @abc.abstractmethod
    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        """``None`` if this kernel can run the call, else the reason it cannot (shown to users).
        ``v`` is given when its head dim may differ from q's (MLA-style)."""

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask: BlockMask,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def __repr__(self) -> str:
        return f"<attention kernel {self.name}>"


def widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` (..., D) with zero columns up to ``width`` (x itself when it is that wide)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


class PadsHeadDims:
    """For a kernel whose op needs one head dim for q, k and v, listed before it among the bases: MLA's differ
    (DeepSeek's q/k 192, v 128), and the narrower side is padded with zeros to the wider one, as transformers does
    for flash-attn. It is exact: a zero value column only adds a zero output column (sliced off), zero query and key
    columns add nothing to a score (the scale is passed, never derived from the width); in backward the output and
    its gradient get the same zero columns, so ``dout . out`` per row and every ``dq``, ``dk`` and ``dv`` entry are
    the unpadded ones, and the padded columns' gradients are dropped."""

    def forward(self, q, k, v, mask, scale):
        # (B, S, H, Dqk), (B, S, Hk, Dqk), (B, S, Hk, Dv) -> (B, S, H, Dv), (B, H, S)
        width, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        if q.shape[-1] == dv:
            return super().forward(q, k, v, mask, scale)
        out, lse = super().forward(widen(q, width), widen(k, width), widen(v, width), mask, scale)
        return out[..., :dv].contiguous(), lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        width, dqk, dv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        if dqk == dv:
            return super().backward(dout, q, k, v, out, lse, mask, scale)
        dq, dk, dval = super().backward(widen(dout, width), widen(q, width), widen(k, width), widen(v, width),
                                        widen(out, width), lse, mask, scale)
        return dq[..., :dqk].contiguous(), dk[..., :dqk].contiguous(), dval[..., :dv].contiguous()


class PerDocumentKernel(AttentionKernel):
    """A kernel whose op only knows causal or full attention. Packed documents run as one call per
    document: each is a square block on the diagonal of the call (its tokens are adjacent in the
    buffer), so no (S, S) mask is ever built and memory stays linear in the sequence."""

    @abc.abstractmethod
    def dense_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def dense_backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def forward(self, q, k, v, mask, scale):
        if mask.segments is None:
            return self.dense_forward(q, k, v, mask.causal, scale)
        parts = [self.dense_forward(q[:, a:b], k[:, a:b], v[:, a:b], mask.causal, scale)
                 for a, b in zip(mask.segments[:-1], mask.segments[1:])]
        return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if mask.segments is None:
            return self.dense_backward(dout, q, k, v, out, lse, mask.causal, scale)
        parts = [
            self.dense_backward(dout[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], out[:, a:b], lse[:, :, a:b],
                                mask.causal, scale)
            for a, b in zip(mask.segments[:-1], mask.segments[1:])
        ]
        return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(3))  # type: ignore[return-value]
