"""How a :class:`BlockMask` with a sliding window reaches the kernels that can compute it.

Two ways, both pure functions of the mask, so they are tested on the CPU without the kernels:

- FA2-family kernels (the flash-attn package and torch's vendored copy) take window sizes
  ``(left, right)``: :func:`flash_window` translates the mask into them, or says why it cannot;
  :class:`RowSplitFa2` runs a call FA2 reads differently as calls on row ranges it reads exactly.
- Kernels that take an additive bias (torch's CPU flash op, the cutlass memory-efficient kernel) run a
  windowed call as row bands (:func:`window_bands`), each against the keys its rows' windows reach,
  with the band's mask as a 0 / -inf bias (:func:`additive_bias`): memory ~ S x window, never S x S.
  :class:`BandedWindowKernel` holds that loop once. Bands overlap in keys: dK/dV partials are summed
  in float32, but an fp16/bf16 op has already rounded each band's partial, so half-precision key
  gradients carry one rounding per band a key falls in (about ``1 + window / rows``).
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from .base import BlockMask, PerDocumentKernel, lse_dtype


def flash_window(mask: BlockMask, sq: int, sk: int) -> tuple[int, int] | str:
    """FA2's ``(window_size_left, window_size_right)`` for ``mask`` on an (Sq, Sk) call, or the reason
    FA2 cannot express it exactly. Pass ``causal = (left < 0 and right == 0)`` with them.

    FA2 (flash-attn's docstring) lets query a see keys b with ``a + D - left <= b <= a + D + right``,
    ``D = Sk - Sq`` (bottom-right alignment; varlen calls use each segment's lengths), a negative
    size leaving that side open; and its C++ entry points turn a size ``>= Sk`` into -1. seqmesh's
    mask keeps ``b <= a + offset`` (causal) and ``b >= a + offset - window + 1`` (window), so with
    ``shift = offset - D``: ``right = shift`` and ``left = window - 1 - shift``. A bound no row reaches
    is dropped (-1); a bound FA2 would read differently (a negative size, or ``right >= Sk``) is refused.
    Beside a bounded left side, FA2 (``set_params_fprop``) reads an open right side as ``Sk`` keys wide, so
    rows ``a < -D - 1`` of an ``Sq > Sk + 1`` call would lose keys: such a window is refused (seen on an H100).
    """
    if mask.segments is not None:
        if sq != sk or mask.offset != 0:
            return "packed documents need a square call with offset 0"
        d = 0  # varlen: each segment is square, so its bottom-right corner is its diagonal
    else:
        d = sk - sq
    shift = mask.offset - d
    right = -1
    if mask.causal and mask.offset < sk - 1:  # row 0 would not see every key: the bound matters
        if shift < 0:
            return f"its causal diagonal lies {-shift} keys left of FA2's bottom-right corner"
        if shift >= sk:
            return f"its causal bound right={shift} is >= Sk={sk}, which FA2 reads as no bound"
        right = shift
    left = -1
    if mask.window is not None and sq - 1 + mask.offset - mask.window + 1 > 0:  # the last row misses some keys
        left = mask.window - 1 - shift
        if left < 0:
            return f"its window starts {-left} keys right of FA2's bottom-right diagonal"
    if left >= 0 and right < 0 and d < -1:  # FA2 reads the open right side as Sk keys past its diagonal
        return (f"beside its window, FA2 reads an open right side as Sk={sk} keys past the bottom-right diagonal,"
                f" which hides keys from the first {-d - 1} rows of this Sq={sq} > Sk call")
    return left, right


def fa2_row_splits(mask: BlockMask, sq: int, sk: int) -> list[tuple[int, int]] | str:
    """Query row ranges ``[a, b)`` that FA2 computes exactly, each as one call on rows ``a:b`` with the mask
    ``shift_rows(mask, a)``, or the reason it cannot. One range where :func:`flash_window` accepts the call.
    A refused call of ``Sq > Sk + 1`` rows (a window beside an open right side: a ring block of two query chunks
    against one of keys) splits where every part is exact: the last ``Sk + 1`` rows are one call, the rows above
    are split again."""
    window = flash_window(mask, sq, sk)
    if not isinstance(window, str):
        return [(0, sq)]
    if mask.segments is not None or sq <= sk + 1:  # no split helps: the bottom Sk + 1 rows would be the whole call
        return window
    cut = sq - sk - 1  # rows cut: onward, D = -1 and the widened side covers every key
    if isinstance(flash_window(shift_rows(mask, cut), sk + 1, sk), str):
        return window
    above = fa2_row_splits(mask, cut, sk)
    return window if isinstance(above, str) else [*above, (cut, sq)]


def shift_rows(mask: BlockMask, first: int) -> BlockMask:
    """``mask`` for the call on query rows ``first:``: their first row is ``first`` positions later."""
    return dataclasses.replace(mask, offset=mask.offset + first)


class RowSplitFa2:
    """forward/backward of an FA2 kernel as :func:`fa2_row_splits` calls: outputs and lse concatenated,
    dk and dv summed in float32. Subclasses compute one exact call in ``call_forward``/``call_backward``."""

    @abc.abstractmethod
    def call_forward(self, q, k, v, mask, scale): ...

    @abc.abstractmethod
    def call_backward(self, dout, q, k, v, out, lse, mask, scale): ...

    def forward(self, q, k, v, mask, scale):
        splits = fa2_row_splits(mask, q.shape[1], k.shape[1])
        if len(splits) == 1:
            return self.call_forward(q, k, v, mask, scale)
        parts = [self.call_forward(q[:, a:b], k, v, shift_rows(mask, a), scale) for a, b in splits]
        return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        splits = fa2_row_splits(mask, q.shape[1], k.shape[1])
        if len(splits) == 1:
            return self.call_backward(dout, q, k, v, out, lse, mask, scale)
        dq, dk, dv = [], torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for a, b in splits:
            gq, gk, gv = self.call_backward(dout[:, a:b], q[:, a:b], k, v, out[:, a:b], lse[:, :, a:b],
                                            shift_rows(mask, a), scale)
            dq.append(gq)
            dk += gk
            dv += gv
        return torch.cat(dq, dim=1), dk.to(k.dtype), dv.to(v.dtype)


def fa2_arguments(mask: BlockMask, sq: int, sk: int) -> tuple[bool, int, int]:
    """``(causal, window_size_left, window_size_right)`` for an FA2 call the kernel said it supports.
    The causal flag is set only where it means the same as the sizes (``(-1, 0)``), so FA2 takes its
    causal path rather than its local one."""
    window = flash_window(mask, sq, sk)
    if isinstance(window, str):
        raise ValueError(f"FA2 cannot compute this mask: {window}; check the kernel's unsupported() first.")
    left, right = window
    return left < 0 and right == 0, left, right


MIN_BAND_ROWS = 128  # query rows per banded call at least, so short windows still make sizeable calls


def window_bands(mask: BlockMask, sq: int, sk: int) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` chunks of a windowed call: rows and the keys their window reaches. Bands
    with no key left (``k1 == k0``) are listed too; callers skip them."""
    rows = max(MIN_BAND_ROWS, (mask.window or 0) // 4)  # keys per band: rows + window, ~1.25x the pairs kept
    return [(a, min(sq, a + rows), *mask.key_span(a, min(sq, a + rows), sk)) for a in range(0, sq, rows)]


ALIBI_BAND_ROWS = 256  # query rows per banded ALiBi call: its (heads, rows, keys) bias is the band's memory


def alibi_bands(mask: BlockMask, sq: int, sk: int) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` row bands of an ALiBi call (no window): every key a band's rows may see (causal: up to
    its last row's diagonal)."""
    bands = []
    for a in range(0, sq, ALIBI_BAND_ROWS):
        b = min(sq, a + ALIBI_BAND_ROWS)
        bands.append((a, b, 0, min(sk, b + mask.offset) if mask.causal else sk))
    return bands


def additive_bias(
    mask: BlockMask, rows: tuple[int, int], keys: tuple[int, int], dtype: torch.dtype,
    device: torch.device | str = "cpu", align: int = 1,
) -> torch.Tensor:
    """``(q1 - q0, k1 - k0)`` additive mask of ``mask.allowed()[q0:q1, k0:k1]``: 0 where a key is
    visible, -inf where not, in ``dtype``. Its last dim is contiguous and its row stride a multiple
    of ``align`` elements (the storage is padded, then sliced), as the cutlass kernel requires."""
    (q0, q1), (k0, k1) = rows, keys
    allowed = mask.allowed_part(q0, q1, k0, k1, device)
    width = -(-(k1 - k0) // align) * align
    padded = torch.zeros(q1 - q0, width, dtype=dtype, device=device)
    bias = padded[:, : k1 - k0]
    return bias.masked_fill_(~allowed, float("-inf"))


class BandedWindowKernel(PerDocumentKernel):
    """A per-document kernel whose op also takes an additive bias: windowed calls run as row bands
    (:func:`window_bands`), each with its band's bias. Every band row keeps at least one key (its
    window holds itself or the nearest key), so no band row is empty. ALiBi calls run as row bands too
    (:func:`alibi_bands`), their bias the mask's plus each head's distance bias, ``(1, Hq, rows, keys)``."""

    bias_align: int = 1  # row stride of the bias, in elements

    @abc.abstractmethod
    def biased_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One band, non-causal, with ``bias`` (rows, keys): out (B, rows, H, Dv), lse (B, H, rows)."""

    @abc.abstractmethod
    def biased_backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, bias: torch.Tensor, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def _band_bias(self, mask: BlockMask, band: tuple[int, int, int, int], q: torch.Tensor) -> torch.Tensor:
        a, b, k0, k1 = band
        bias = additive_bias(mask, (a, b), (k0, k1), q.dtype, q.device, self.bias_align)
        if mask.alibi is None:
            return bias
        return (bias + mask.distance_bias_part(a, b, k0, k1, q.dtype, q.device))[None]  # (1, Hq, rows, keys)

    @staticmethod
    def _bands(mask: BlockMask, sq: int, sk: int) -> list[tuple[int, int, int, int]]:
        return window_bands(mask, sq, sk) if mask.window is not None else alibi_bands(mask, sq, sk)

    def forward(self, q, k, v, mask, scale):
        if mask.window is None and mask.alibi is None:
            return super().forward(q, k, v, mask, scale)
        bsz, sq, h, _ = q.shape
        out = q.new_zeros(bsz, sq, h, v.shape[-1])  # (B, Sq, Hq, Dv)
        lse = torch.full((bsz, h, sq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        for a, b, k0, k1 in self._bands(mask, sq, k.shape[1]):
            if k1 > k0:
                bias = self._band_bias(mask, (a, b, k0, k1), q)
                o, l = self.biased_forward(q[:, a:b], k[:, k0:k1], v[:, k0:k1], bias, scale)
                out[:, a:b], lse[:, :, a:b] = o, l
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if mask.window is None and mask.alibi is None:
            return super().backward(dout, q, k, v, out, lse, mask, scale)
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)
        for a, b, k0, k1 in self._bands(mask, q.shape[1], k.shape[1]):
            if k1 > k0:
                bias = self._band_bias(mask, (a, b, k0, k1), q)
                gq, gk, gv = self.biased_backward(dout[:, a:b], q[:, a:b], k[:, k0:k1], v[:, k0:k1], out[:, a:b],
                                                  lse[:, :, a:b], bias, scale)
                dq[:, a:b] = gq
                dk[:, k0:k1] += gk  # bands overlap in keys: sum in lse precision
                dv[:, k0:k1] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype)
