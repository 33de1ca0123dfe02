"""Whether an optional kernel runs on this device, found once per kernel and device, before its first use there: the
recurrent mixers' (``seqmesh.linear_attention.kernels``) and DeepSeek Sparse Attention's Triton kernels
(``seqmesh.kernels.sparse_latent``).

Some GPU and Triton pairs fail inside flash-linear-attention only when a kernel runs, some only in its backward:
on Hopper with Triton >= 3.4.0 and < 3.7.1 (torch 2.11 ships 3.6) its gated chunk backward raises ("... produces
incorrect results for gated chunk_bwd_dqkwg ... upgrade Triton to >= 3.7.1 or install tilelang") in the first
step's backward, after the model is built and the data loaded. So before a kernel's first call on a device,
:class:`KernelProbe` runs it once on a few tokens, forward and backward, through the same call the layer makes. A
kernel that raises is replaced by seqmesh's torch rule (exact, slower) for the rest of the process, with one
warning naming the kernel, the device, the error and the fix.

Where a package states the condition of its refusal in flags of its own (flash-linear-attention's Triton version
flags), :attr:`Kernel.refuses` reads them first: on an H200 the probe of a refused kernel otherwise spent over a
minute compiling and autotuning the forward's Triton kernels before the backward raised.

The probe runs in a thread of its own: grad mode, autocast, saved-tensor hooks (activation checkpointing, the memory
tracker) and dispatch modes are per thread, so the step that asked sees none of its tensors. Its inputs come from a
generator of its own (the caller's random streams do not move).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

# what flash-linear-attention's Hopper refusal asks for (its own words), named in the warning beside the error
HOPPER_FIX = "on Hopper with Triton >= 3.4.0 and < 3.7.1, upgrade Triton to >= 3.7.1 or install tilelang"


class KernelFallbackWarning(RuntimeWarning):
    """An installed kernel failed its probe on a device; seqmesh's torch rule runs in its place."""


@dataclass(frozen=True)
class Kernel:
    """An optional kernel: ``load()`` returns the package's function, or None where the package is not installed;
    ``run(fn, device, generator)`` calls it as the layer does on a few tokens, forward and backward."""

    package: str
    load: Callable[[], Callable | None]
    run: Callable[[Callable, torch.device, torch.Generator], None]
    refuses: Callable[[torch.device], str | None] = lambda device: None
    """the refusal the package itself would raise on ``device``, read from its flags before anything compiles
    (its error's words), or None: then the probe runs the kernel."""


class KernelProbe:
    """The verdict on each ``kernels[name]`` per device, probed on first demand and kept for the process.
    ``devices``: the device types the kernels are for (the CUDA packages: ``("cuda",)``)."""

    def __init__(self, kernels: dict[str, Kernel], devices: tuple[str, ...] = ("cuda",)):
        self.kernels, self.devices = kernels, devices
        self._verdicts: dict[tuple[str, str], bool] = {}
        self._lock = threading.Lock()

    def works(self, name: str, device: torch.device) -> bool:
        """Whether ``kernels[name]`` is installed and ran forward and backward on ``device``. The first failure on a
        device warns once (:class:`KernelFallbackWarning`); every later call answers from the verdict."""
        device = torch.device(device)
        key = (name, str(device))
        with self._lock:
            if key not in self._verdicts:
                self._verdicts[key] = self._probe(name, device)
            return self._verdicts[key]

    def probe_all(self, device: torch.device) -> dict[str, bool]:
        """Every kernel's verdict on ``device``: what a job calls before its first step."""
        return {name: self.works(name, device) for name in self.kernels}

    def load(self, name: str) -> Callable:
        fn = self.kernels[name].load()
        assert fn is not None, f"{name} was probed as installed"
        return fn

    def _probe(self, name: str, device: torch.device) -> bool:
        kernel = self.kernels[name]
        if device.type not in self.devices:
            return False
        fn = kernel.load()
        if fn is None:
            return False
        try:
            refusal = kernel.refuses(device)
        except Exception:  # reading the package's flags failed (another release's layout): the probe runs it
            refusal = None
        error = _in_own_thread(kernel.run, fn, device) if refusal is None else None
        if error is None and refusal is None:
            return True
        text = refusal or " ".join(f"{type(error).__name__}: {error}".split())
        text = text if len(text) <= 400 else text[:400] + " ..."
        warnings.warn(f"{kernel.package}'s {name} fails on {_describe(device)} ({text}). seqmesh computes these layers "
                      "with its own torch rule instead (exact, slower) for the rest of this process. To use the "
                      f"kernel, fix what its error names ({HOPPER_FIX}), or uninstall {kernel.package} to silence "
                      "this warning.", KernelFallbackWarning, stacklevel=4)
        return False


def float32_loop_kernel(probe: KernelProbe, name: str, x: torch.Tensor, atomic: bool = False):
    """``probe``'s kernel ``name`` (seqmesh's Triton form of a recurrent rule's loop over chunks) where it runs for
    float32 tensors like ``x`` on a CUDA device: Triton installed and the kernel through its probe there. None
    elsewhere, and while torch.compile traces, on fake tensors (a rehearsal measures the torch loops' memory), and,
    for a kernel whose backward adds with ``atomic`` adds, under ``torch.use_deterministic_algorithms``: the torch
    loops run."""
    if x.device.type != "cuda" or x.dtype != torch.float32 or torch.compiler.is_compiling() \
            or torch._subclasses.fake_tensor.is_fake(x) or (atomic and torch.are_deterministic_algorithms_enabled()):
        return None
    return probe.load(name) if probe.works(name, x.device) else None


def triton_module(name: str):
    """``seqmesh.<name>``, a module of Triton kernels, or None where Triton is not installed (a probe's ``load``)."""
    import importlib

    try:
        return importlib.import_module(f"seqmesh.{name}")
    except ImportError:
        return None


def _in_own_thread(run: Callable, fn: Callable, device: torch.device) -> BaseException | None:
    """``run(fn, device, generator)`` in a fresh thread (fresh grad mode, autocast, saved-tensor hooks and dispatch
    modes); the exception it raised, or None."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            generator = torch.Generator(device=device).manual_seed(0)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    run(fn, device, generator)
                torch.cuda.synchronize(device)  # an asynchronous launch failure surfaces here, not in the step
            else:
                run(fn, device, generator)
        except Exception as err:  # any failure of the kernel is a verdict; the caller warns with it
            failure.append(err)

    thread = threading.Thread(target=target, name="seqmesh-kernel-probe", daemon=True)
    thread.start()
    thread.join()
    return failure[0] if failure else None


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    try:
        import triton

        triton_version = f", Triton {triton.__version__}"
    except ImportError:
        triton_version = ""
    return f"{torch.cuda.get_device_name(device)} ({device}{triton_version})"
