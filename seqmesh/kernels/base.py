"""The one signature every local attention kernel implements.

Shapes (any strides)::

    q    (B, Sq, Hq, D)      k, v  (B, Sk, Hk, D)   with Hq % Hk == 0 (grouped-query heads)
    out  (B, Sq, Hq, D)      in q's dtype
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

    - ``causal``: query i sees key j only if j <= i (top-left aligned; only used with Sq == Sk).
    - ``segments``: local cumulative boundaries ``(0, ..., S)`` of packed documents inside this call;
      a query sees only keys of its own segment (Sq == Sk). ``None`` means one segment.
    """

    causal: bool = False
    segments: tuple[int, ...] | None = None

    def allowed(self, sq: int, sk: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dense ``(Sq, Sk)`` boolean matrix of the mask (for kernels without native support)."""
        ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if self.causal:
            ok = torch.tril(ok)
        if self.segments is not None:
            seg = segment_ids(self.segments, device)
            ok = ok & (seg[:sq, None] == seg[None, :sk])
        return ok

    def score_entries(self, sq: int, sk: int) -> int:
        """How many (query, key) pairs the mask keeps: the work of the call."""
        if self.segments is None:
            lengths = [sq] if self.causal else None
        else:
            lengths = [b - a for a, b in zip(self.segments[:-1], self.segments[1:])]
        if lengths is None:
            return sq * sk
        if self.causal:
            return sum(n * (n + 1) // 2 for n in lengths)
        return sum(n * n for n in lengths)


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


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of log-sum-exp and of every merge: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class AttentionKernel(abc.ABC):
    """A local attention implementation with an explicit backward."""

    name: str = "?"

    @abc.abstractmethod
    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask) -> str | None:
        """``None`` if this kernel can run the call, else the reason it cannot (shown to users)."""

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
