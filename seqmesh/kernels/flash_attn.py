"""The flash-attn package (2.7 or newer), when it is installed.

Its forward/backward entry points (``_flash_attn_forward``, ``_flash_attn_varlen_forward`` and the
backward pair) take the same tensors as torch's vendored FA2 but their optional arguments have moved
between releases, so calls are built from each function's signature: the tensors, flags and window
sizes named here, the soft-cap (Gemma 2: FA2's ``softcap``, backward included), and neutral values (no ALiBi,
no dropout) for the rest.

Sliding windows and causal masks go in as FA2's ``(window_size_left, window_size_right)``, bottom-right
aligned; :func:`~seqmesh.kernels.windows.flash_window` derives them from the mask's offset and
refuses what FA2 cannot express, and :class:`~seqmesh.kernels.windows.RowSplitFa2` splits by rows the calls FA2
would read differently. FA2 (every 2.x release) checks v against q's head size, so a v head
dim unlike q's is refused and ``auto`` falls back to a kernel that takes it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch

from .base import HALF_DTYPES, AttentionKernel, BlockMask, alibi_problem
from .cuda import cuda_problem, varlen_args
from .windows import RowSplitFa2, fa2_arguments, fa2_row_splits

_NEUTRAL: dict[str, Any] = {
    "dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False, "deterministic": False, "rng_state": None,
}


@functools.lru_cache(maxsize=1)
def _interface() -> tuple[Any, str] | None:
    try:
        package = importlib.import_module("flash_attn")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception:  # not installed, or built for another torch/CUDA: the kernel is simply unavailable
        return None
    return interface, getattr(package, "__version__", "0")


def _call(fn: Any, **given: Any) -> Any:
    """Call ``fn`` by keyword with the arguments its signature names. flash-attn 2.7+ wraps these
    functions in ``torch.library.custom_op``; the wrapped Python function (``_init_fn``) carries the
    real signature, and the op itself accepts the same keywords."""
    python_fn = getattr(fn, "_init_fn", fn)
    kwargs = {}
    for name, param in inspect.signature(python_fn).parameters.items():
        if name in given:
            kwargs[name] = given[name]
        elif name in _NEUTRAL:
            kwargs[name] = _NEUTRAL[name]
        elif param.default is inspect.Parameter.empty:
            label = getattr(python_fn, "__name__", repr(fn))
            raise TypeError(f"flash-attn's {label} wants an argument seqmesh does not know: {name!r}")
    return fn(**kwargs)


def _window_arguments(mask: BlockMask, sq: int, sk: int) -> dict[str, Any]:
    """causal and the window sizes, under each name a release may use (``_call`` keeps the ones it takes)."""
    causal, left, right = fa2_arguments(mask, sq, sk)
    return {"causal": causal, "window_size": (left, right), "window_size_left": left, "window_size_right": right,
            "softcap": 0.0 if mask.softcap is None else float(mask.softcap)}  # FA2's 0.0: no capping


class FlashAttnKernel(RowSplitFa2, AttentionKernel):
    """The flash-attn package's FA2: fp16/bf16, one head dim <= 256, grouped-query heads, varlen
    documents, sliding windows as window sizes."""

    name = "flash_attn"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        found = _interface()
        if found is None:
            return "the flash-attn package is not installed"
        major_minor = tuple(int(x) for x in found[1].split(".")[:2] if x.isdigit())
        if major_minor < (2, 7):
            return f"flash-attn {found[1]} is older than 2.7"
        if reason := alibi_problem(mask, f"seqmesh's call of flash-attn {found[1]} (its slopes are bottom-right aligned)"):
            return reason
        if v is not None and v.shape[-1] != q.shape[-1]:
            return (f"flash-attn {found[1]}'s FA2 kernels need one head dim for q, k and v "
                    f"(got {q.shape[-1]} and {v.shape[-1]})")
        splits = fa2_row_splits(mask, q.shape[1], k.shape[1])
        return splits if isinstance(splits, str) else cuda_problem(q, HALF_DTYPES, 256, 8, v)

    def call_forward(self, q, k, v, mask, scale):
        fa, _ = _interface()  # type: ignore[misc]
        b, sq, h, d = q.shape
        flags = _window_arguments(mask, sq, k.shape[1])
        if mask.segments is None:
            out, lse, *_ = _call(fa._flash_attn_forward, q=q, k=k, v=v, softmax_scale=scale, **flags)
            return out, lse
        cu, longest = varlen_args(mask.segments, b, sq, q.device)
        out, lse, *_ = _call(
            fa._flash_attn_varlen_forward, q=q.reshape(b * sq, h, d), k=k.reshape(-1, k.shape[2], d),
            v=v.reshape(-1, v.shape[2], d), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
            max_seqlen_k=longest, softmax_scale=scale, **flags,
        )
        return out.view(b, sq, h, d), lse.view(h, b, sq).permute(1, 0, 2)

    def call_backward(self, dout, q, k, v, out, lse, mask, scale):
        fa, _ = _interface()  # type: ignore[misc]
        b, sq, h, d = q.shape
        hk = k.shape[2]
        flags = _window_arguments(mask, sq, k.shape[1])
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous: written in place
        if mask.segments is None:
            _call(fa._flash_attn_backward, dout=dout.contiguous(), q=q.contiguous(), k=k.contiguous(),
                  v=v.contiguous(), out=out.contiguous(), softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv,
                  softmax_scale=scale, **flags)
            return dq, dk, dv
        cu, longest = varlen_args(mask.segments, b, sq, q.device)
        flat = lambda x, heads: x.reshape(-1, heads, d)  # noqa: E731
        _call(fa._flash_attn_varlen_backward, dout=flat(dout, h).contiguous(), q=flat(q, h).contiguous(),
              k=flat(k, hk).contiguous(), v=flat(v, hk).contiguous(), out=flat(out, h).contiguous(),
              softmax_lse=lse.float().permute(1, 0, 2).reshape(h, b * sq).contiguous(),
              dq=flat(dq, h), dk=flat(dk, hk), dv=flat(dv, hk), cu_seqlens_q=cu, cu_seqlens_k=cu,
              max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=scale, **flags)
        return dq, dk, dv
