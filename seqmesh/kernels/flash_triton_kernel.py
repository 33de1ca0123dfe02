"""``triton_flash``: seqmesh's Triton flash attention (:mod:`.flash_triton`) behind the kernel signature, on CUDA.

It takes what torch's fused CUDA ops refuse and the math kernel would compute with a whole ``(rows, keys)`` score
block per call: ALiBi (BLOOM, MPT: the bias by distance on every ring block, the log-sum-exp including it) and a
causal block whose diagonal is not its top-left corner. Not a soft-cap nor a sliding window (the fused ops and
:mod:`.windows` take those). Packed documents run one call per document (each a square causal block, offset 0).

Before its first call on a device the kernel runs once on a few tokens, forward and backward, held to the math
kernel (:data:`PROBE`): a Triton that fails or answers otherwise on this GPU leaves it refused there, with one
warning, and ``auto`` takes the math kernel as before. Sizes whose tiles Triton cannot fit on the device (it raises
before any launch) run on the math kernel, with one warning, and are declined from then on. Under fake tensors
(``seqmesh rehearse``) it launches nothing and allocates what the real call does (its outputs, the backward's float32
row sums, each document's part before they are joined), so a rehearsal counts what the GPU's run holds; it assumes
the probe passes where Triton is installed.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import torch

from .base import AttentionKernel, BlockMask
from .probe import Kernel, KernelProbe
from .reference import MathKernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # the widest head a program's (64 or 32, head) tiles hold in registers


def _is_fake(x: torch.Tensor) -> bool:
    return torch._subclasses.fake_tensor.is_fake(x)


@functools.lru_cache(maxsize=64)
def _slope_tensor(slopes: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """ALiBi's slopes on ``device``, copied from the host once per slopes and device (a copy per call would wait
    for the device's queue to drain)."""
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def _documents(mask: BlockMask, length: int) -> list[tuple[int, int]]:
    bounds = mask.segments if mask.segments is not None else (0, length)
    return list(zip(bounds[:-1], bounds[1:]))


def _fake_forward(q, k, v, slopes, causal, offset, scale):
    """What :func:`.flash_triton.forward` allocates, launching nothing (a rehearsal's fake tensors)."""
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)


def _fake_backward(dout, q, k, v, out, lse, slopes, causal, offset, scale):
    """What :func:`.flash_triton.backward` allocates: the gradients beside each row's float32 ``dout . out``."""
    b, sq, hq, _ = q.shape
    delta = q.new_empty(b, hq, sq, dtype=torch.float32)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    del delta
    return grads


_FAKE = {"forward": _fake_forward, "backward": _fake_backward}


class TritonFlashKernel(AttentionKernel):
    name = "triton_flash"

    def __init__(self) -> None:
        self._failed: set[tuple] = set()  # (dtype, widths, causal, alibi) whose kernels failed to compile here

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask,
                    v: torch.Tensor | None = None) -> str | None:
        if q.device.type != "cuda":
            return "seqmesh's Triton flash kernel runs on CUDA (on the CPU: the CPU flash op and the math kernel)"
        if q.dtype not in KERNEL_DTYPES:
            return f"seqmesh's Triton flash kernel takes bf16, fp16 and fp32, not {q.dtype}"
        if mask.softcap is not None or mask.window is not None:
            return "seqmesh's Triton flash kernel neither soft-caps scores nor takes a sliding window"
        widest = max(q.shape[-1], v.shape[-1] if v is not None else 0)
        if widest > MAX_HEAD_DIM:
            return f"seqmesh's Triton flash kernel takes heads up to {MAX_HEAD_DIM} wide, not {widest}"
        if self._config(q, v if v is not None else k, mask) in self._failed:
            return "seqmesh's Triton flash kernel failed to compile for these sizes on this device (warned)"
        if _is_fake(q):  # a rehearsal: the real run's verdict where Triton is installed (the probe cannot run here)
            return None if _loaded() is not None else "Triton is not installed"
        if not PROBE.works("triton_flash", q.device):
            return "seqmesh's Triton flash kernel is not installed (Triton) or failed its probe on this device"
        return None

    @staticmethod
    def _config(q: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> tuple:
        return q.dtype, q.shape[-1], v.shape[-1], mask.causal, mask.alibi is not None

    def _run(self, name: str, q, v, mask, fallback, *args):
        """``flash_triton.<name>(*args)``; where Triton cannot compile these sizes on this device (its shared memory
        or registers), one warning and ``fallback()`` (the math kernel) for this call and every later one."""
        from . import flash_triton

        try:
            return getattr(flash_triton, name)(*args)
        except Exception as err:  # Triton's OutOfResources or CompilationError, raised before any launch
            if type(err).__module__.split(".")[0] != "triton":
                raise
            self._failed.add(self._config(q, v, mask))
            warnings.warn(f"seqmesh's Triton flash kernel does not compile for {q.dtype} heads of {q.shape[-1]} on "
                          f"{q.device} ({type(err).__name__}: {err}); the math kernel computes these calls instead, "
                          "holding each call's (rows x keys) scores.", RuntimeWarning, stacklevel=3)
            return fallback()

    def _each_document(self, name: str, mask: BlockMask, scale: float, q: torch.Tensor, v: torch.Tensor,
                       *inputs: tuple[torch.Tensor, str]) -> tuple:
        """``flash_triton.<name>`` (``_fake_<name>`` on fake tensors) once per document of ``mask`` (with segments:
        Sq == Sk and offset 0), once over the whole call without, its results joined along the tokens. ``inputs``:
        the call's tensors in order, each with how a document cuts it: ``"rows"`` (B, Sq, ...), ``"keys"``
        (B, Sk, ...) or ``"lse"`` (B, H, Sq); ``q`` and ``v`` among them, for the call's sizes."""
        fake = _is_fake(q)
        slopes = None if mask.alibi is None or fake else _slope_tensor(mask.alibi, q.device)
        whole = replace(mask, segments=None)  # each document's call: its own square block
        parts = []
        for a, z in _documents(mask, q.shape[1]):
            keys = slice(a, z) if mask.segments is not None else slice(None)
            cut = {"rows": lambda t: t[:, a:z], "keys": lambda t: t[:, keys], "lse": lambda t: t[:, :, a:z]}
            tensors = tuple(cut[how](t).contiguous() for t, how in inputs)
            args = (*tensors, slopes, mask.causal, mask.offset, scale)
            if fake:
                parts.append(_FAKE[name](*args))
            else:
                fallback = lambda: getattr(MathKernel(), name)(*tensors, whole, scale)  # noqa: E731
                parts.append(self._run(name, q, v, mask, fallback, *args))
        if len(parts) == 1:
            return parts[0]
        dims = [2 if t.dim() == 3 else 1 for t in parts[0]]  # a log-sum-exp (B, H, Sq) joins along dim 2
        return tuple(torch.cat([p[i] for p in parts], dim=d) for i, d in enumerate(dims))

    def forward(self, q, k, v, mask, scale):
        return self._each_document("forward", mask, scale, q, v, (q, "rows"), (k, "keys"), (v, "keys"))

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        return self._each_document("backward", mask, scale, q, v, (dout, "rows"), (q, "rows"), (k, "keys"),
                                   (v, "keys"), (out, "rows"), (lse, "lse"))


def _loaded():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return TritonFlashKernel()


def _probe(kernel: TritonFlashKernel, device: torch.device, generator: torch.Generator) -> None:
    """bf16, 2 query heads on 1 kv head of 24, forward and backward, against the math kernel: a causal call with
    ALiBi (70 queries: a partial second tile) and a ring block 70 positions later; a kernel that runs but answers
    otherwise fails its probe too."""
    reference = MathKernel()
    q, k, v, dout = (torch.randn(1, 70, heads, 24, generator=generator, device=device).to(torch.bfloat16)
                     for heads in (2, 1, 1, 2))
    for mask in (BlockMask(causal=True, alibi=(0.5, 0.125)), BlockMask(offset=70, alibi=(0.5, 0.125))):
        got = kernel.forward(q, k, v, mask, 0.2)
        want = reference.forward(q, k, v, mask, 0.2)
        got += kernel.backward(dout, q, k, v, *want, mask, 0.2)
        want += reference.backward(dout, q, k, v, *want, mask, 0.2)
        for a, b in zip(got, want):
            error = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))
            if not error < 0.05:
                raise RuntimeError(f"the kernel's results are {error:.3g} (relative) from the math kernel's")


PROBE = KernelProbe({"triton_flash": Kernel("triton", _loaded, _probe)})
