"""Every workaround that lets a CPU machine rehearse a CUDA step on fake ``cuda:0`` tensors, in one place.

Fake tensors need no device memory, but torch still asks the device for streams, events, properties and a
device guard. On a CPU build of torch none exist, so the rehearsal supplies inert ones, in four parts:

1. C++ (``fake_cuda.cpp``): a CUDA device guard and CUDA hooks that do nothing, built and loaded by
   :mod:`.cuda_library` (preloaded on a CPU build; the guard swapped in on a CUDA build without a GPU).
2. Python (:func:`fake_cuda`): inside the rehearsal only, and restored on exit, the ``torch.cuda`` calls the step
   makes (FSDP2's streams and events, DeviceMesh's device count, the kernels' capability check, the memory
   tracker's peak statistics, autocast's availability check) answer as one H100 would, and
   ``Tensor.record_stream`` (no fake kernel) does nothing.
   Each patched attribute must exist in the installed torch: a missing one is named, not silently added.
3. Dispatch (:data:`FUSED_CUDA_BACKWARDS`): an operator that has a CPU kernel and a decomposition
   (``CompositeImplicitAutograd``) but, in a CPU build, no CUDA kernel, is decomposed on CUDA tensors, where a CUDA
   build runs its one fused kernel. For SiLU's backward that is ``grad * (s * (1 + x * (1 - s)))``, ``s = sigmoid(x)``:
   six (tokens x intermediate) tensors alive at its last product instead of one (in Llama-3-8B's MLP at 16,384 tokens
   a rank, 470 MB each: a layer's backward peaked 1.19 GB above a CUDA build's). Inside the rehearsal each gets a
   CUDA kernel that is never run (fake tensors stop at the fake mode, above it), so autograd calls the fused
   operator as on a CUDA build.

4. Meta (:func:`_efficient_backward_fix`): the memory-efficient kernel's backward gets a Meta kernel with its
   schema's arguments where torch's meta function lacks ``out`` (torch 2.13's does, on every build). And
   (:func:`_grouped_mm_fix`) the experts' grouped product (transformers' MoE default) gets one that takes float32
   and float16 as CUDA's kernel does: torch's meta function refuses all but bf16, where CUDA runs those two on its
   fallback (a product per group into the same output), so a float32 MoE step failed only in its rehearsal.

On either device, :func:`real_device_meshes` builds every ``DeviceMesh`` on real tensors (FSDP2 makes one inside
the fake mode under tensor parallelism), and :func:`collective_meta_kernels` gives the collectives the fake process
group runs a Meta kernel where the installed torch has none (torch 2.9.1 has none; 2.13 has them).

Not covered: expert parallelism's host reads.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from .cuda_library import CannotRehearse, has_gpu, needs_guard, needs_preload, swapped_guard

# the dtypes CUDA's grouped product runs on its fallback, beside its bf16 kernel (:func:`_grouped_mm_meta`)
GROUPED_MM_FALLBACK_DTYPES = (torch.float32, torch.float16)
CUDNN_VERSION = 91002  # cuDNN 9.10, as torch.backends.cudnn.version() reports it (what `--backend cuda_cudnn` sees)
# the GPU the fake device reports (the planner's default hardware, h100-nvlink)
H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3 (seqmesh rehearse)", major=9, minor=0,
                             total_memory=80 * 2**30, multi_processor_count=132, warp_size=32)


class _FakeEvent:
    """A CUDA event that is always complete."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _FakeStream:
    """A CUDA stream on which everything has already happened (fake tensors have no work to order)."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device, self.priority = torch.device("cuda", 0), priority

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _FakeEvent:
        return event if event is not None else _FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


# operators a CUDA build runs as one kernel but a CPU build decomposes on CUDA tensors (its only such operators with a
# CUDA kernel in a CUDA build; the third, native_channel_shuffle, is decomposed on a CUDA build too)
FUSED_CUDA_BACKWARDS = ("silu_backward", "mish_backward")


def _not_run(*args, **kwargs):
    raise RuntimeError("seqmesh rehearse: this CUDA kernel stands in for one a CPU build lacks and runs only on fake "
                       "tensors, which never reach it.")


def _fused_backwards() -> torch.library.Library | None:
    """On a CPU build, a never-run CUDA kernel for each of :data:`FUSED_CUDA_BACKWARDS` (see the module docstring);
    ``_destroy()`` the returned library to take them back. None on a CUDA build, which has the real ones."""
    if not needs_preload():
        return None
    lib = torch.library.Library("aten", "IMPL")
    for name in FUSED_CUDA_BACKWARDS:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CUDA"):
            lib.impl(name, _not_run, "CUDA")
    return lib


def _efficient_backward_meta(grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
                             bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
                             shared_storage_dqdkdv=False):
    """``aten::_efficient_attention_backward``'s schema, on torch's own meta function (the gradients' shapes do not
    depend on ``out`` or ``window_size``, which it lacks)."""
    from torch._meta_registrations import meta__efficient_attention_backward as meta

    return meta(grad_out, query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, logsumexp,
                dropout_p, philox_seed, philox_offset, custom_mask_type, bias_requires_grad, scale=scale,
                num_splits_key=num_splits_key, shared_storage_dqdkdv=shared_storage_dqdkdv)


def _efficient_backward_fix() -> torch.library.Library | None:
    """torch's meta function for the memory-efficient kernel's backward omits the schema's ``out`` argument, so under
    fake tensors every call fails ("got multiple values for argument 'scale'"), on any build. Where the installed
    torch's still does, a Meta kernel with the schema's arguments (``_destroy()`` it to take it back); else None."""
    import inspect

    from torch import _meta_registrations

    meta = getattr(_meta_registrations, "meta__efficient_attention_backward", None)
    if meta is None or "out" in inspect.signature(meta).parameters:
        return None
    lib = torch.library.Library("aten", "IMPL")
    # torch registers its own meta function from Python; before torch 2.13 replacing it needs the explicit flag
    lib.impl("_efficient_attention_backward", _efficient_backward_meta, "Meta", allow_override=True)
    return lib


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten::_grouped_mm`` on meta tensors: torch's own meta function for bf16 and for what CUDA refuses (other
    dtypes, a mix); for float32 and float16, the kernel's checks and an output of the operands' dtype laid out as the
    kernel lays it, each row padded to a multiple of 16 bytes (torch's meta function pads only on a CUDA build)."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    if mat_a.dtype not in GROUPED_MM_FALLBACK_DTYPES or mat_b.dtype != mat_a.dtype:
        return meta_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)
    torch._check(out_dtype in (None, mat_a.dtype), lambda: f"_grouped_mm of {mat_a.dtype} operands: CUDA's fallback "
                                                           f"makes no other output dtype (got {out_dtype}).")
    torch._check(bias is None, lambda: "_grouped_mm takes no bias.")
    align = 16 // mat_a.element_size()
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        torch._check(mat.dim() in (2, 3), lambda: f"{name} must be 2D or 3D, not {mat.dim()}D.")
        (rows, cols), (height, width) = mat.stride()[-2:], mat.shape[-2:]
        torch._check((cols == 1 and rows % align == 0 and rows >= width)
                     or (rows == 1 and cols % align == 0 and cols >= height),
                     lambda: f"{name}'s strides {mat.stride()} are not row- or column-major in rows of a multiple of "
                             "16 bytes.")
    if mat_a.dim() == 3 or mat_b.dim() == 3:
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: f"_grouped_mm's operands {list(mat_a.shape)} and "
                                                               f"{list(mat_b.shape)} do not share their inner size.")
    needs_offs = mat_a.dim() == 2 or mat_b.dim() == 2
    torch._check(needs_offs == (offs is not None), lambda: "_grouped_mm needs offsets exactly where an operand is 2D.")
    torch._check(offs is None or (offs.dim() == 1 and offs.dtype == torch.int32),
                 lambda: "_grouped_mm's offsets must be a 1D int32 tensor.")
    shape = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, mat_a.dtype).shape  # with its batch sizes' checks
    padded = -(-shape[-1] // align) * align
    strides = (shape[1] * padded, padded, 1) if len(shape) == 3 else (padded, 1)
    return torch.empty_strided(shape, strides, dtype=mat_a.dtype, device=mat_a.device)


def _grouped_mm_fix() -> torch.library.Library | None:
    """A Meta kernel for ``aten::_grouped_mm`` that takes float32 and float16 operands as CUDA's kernel does (see the
    module docstring; ``_destroy()`` it to take it back); None where torch's meta function already does."""
    from torch import _meta_registrations

    if not all(hasattr(_meta_registrations, f) for f in ("meta_grouped_mm", "_create_grouped_mm_output_tensor")):
        return None
    probe = [torch.empty(4, 8, device="meta"), torch.empty(2, 8, 4, device="meta")]
    try:
        _meta_registrations.meta_grouped_mm(*probe, torch.tensor([2, 4], dtype=torch.int32, device="meta"))
        return None  # float32 already passes
    except RuntimeError:
        pass
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_grouped_mm", _grouped_mm_meta, "Meta", allow_override=True)
    return lib


def _collective_meta(op: torch._ops.OpOverload):
    """A Meta kernel for the c10d collective ``op``: the work of a collective already complete, and in front of it
    the first argument (the tensors written in place) where the schema returns it."""
    from torch._C._distributed_c10d import FakeWork

    returns = len(op._schema.returns)

    def meta(*args):
        if returns == 0:
            return None
        work = FakeWork().boxed()
        return (args[0], work) if returns == 2 else work
    return meta


@contextlib.contextmanager
def collective_meta_kernels() -> Iterator[None]:
    """Inside, every c10d collective the installed torch has no Meta kernel for gets one (:func:`_collective_meta`),
    taken back on exit. Under the fake mode a collective on the fake process group dispatches on fake tensors, and
    torch 2.9.1 has none (2.13 has them): the first all-gather of FSDP2 or the sequence's all-to-all stopped the
    rehearsal with "UnsupportedOperatorException: c10d._allgather_base_"."""
    names = sorted({name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                    if name.startswith("c10d::")})
    lib = None
    try:
        for name in names:
            op = getattr(torch.ops.c10d, name).default
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
                continue
            lib = lib or torch.library.Library("c10d", "IMPL")
            lib.impl(name, _collective_meta(op), "Meta")
        yield
    finally:
        if lib is not None:
            lib._destroy()


def fake_mode() -> "torch._subclasses.fake_tensor.FakeTensorMode":
    """The rehearsal's fake mode: torch's, except that

    - it knows whether this machine has a GPU from the driver (:func:`.cuda_library.has_gpu`), not from
      ``torch.cuda``, which answers as one H100 inside the rehearsal (with ``PYTORCH_NVML_BASED_CUDA_CHECK`` its
      availability reads the patched device count);
    - a real host tensor moved to a device this machine lacks becomes a fake one first, without its value, as torch
      2.13's fake mode moves it. torch 2.9.1's ran the real copy, on a CUDA build without a GPU through the driver,
      and Gated DeltaNet's halo indices stopped the rehearsal ("Cannot initialize CUDA")."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    no_gpu = not has_gpu()

    class RehearsalFakeMode(FakeTensorMode):
        avoid_device_init = property(lambda self: no_gpu)

        def dispatch(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            device, source = kwargs.get("device"), args[0] if args else None
            if (func is torch.ops.aten._to_copy.default and device is not None and device.type != "cpu" and no_gpu
                    and isinstance(source, torch.Tensor) and not isinstance(source, FakeTensor)):
                args = (self.from_tensor(source), *args[1:])
            return super().dispatch(func, types, args, kwargs)

    return RehearsalFakeMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def lift_on_autograd_threads(device: torch.device) -> Iterator[None]:
    """Inside, autograd's ``device`` thread builds ``torch.tensor(data, device=...)`` (and a list index's tensor) on
    the host and moves it under the fake mode, as the step's own thread does. ``FakeTensorMode`` sets that
    (``only_lift_cpu_tensors``) for its own thread only, so in a checkpointed layer's recompute, which runs on the
    device's thread, Gated DeltaNet's halo indices were allocated on the real CUDA backend, which a CPU build lacks.
    The flag is thread-local: a backward on ``device`` sets it there, and one more puts it back on exit."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    flags = ("_only_lift_cpu_tensors", "_set_only_lift_cpu_tensors")
    if not all(hasattr(torch._C, name) for name in flags):
        raise CannotRehearse(f"torch {torch.__version__} has no torch._C.{flags[1]}, which the rehearsal sets on "
                             "autograd's device thread; pass --device cpu for the CPU kernels.")

    def on_device_thread(value: bool | None) -> bool:
        seen = []

        def hook(grad):
            seen.append(torch._C._only_lift_cpu_tensors())
            if value is not None:
                torch._C._set_only_lift_cpu_tensors(value)

        with FakeTensorMode():
            x = torch.zeros(1, device=device, requires_grad=True)
            y = x * 1.0
            y.register_hook(hook)
            y.sum().backward()
        return seen[0]

    before = on_device_thread(True)
    try:
        yield
    finally:
        on_device_thread(before)


def _replacements(cudnn: bool = False, fake_hooks: bool = False) -> list[tuple[object, str, object]]:
    default = _FakeStream()
    # cuDNN 9 answers when asked for (--backend cuda_cudnn): `auto` would try its fused attention first on Hopper, and
    # the grid of docs/rehearse.md was measured on cuda_flash (torch's meta kernels serve both). Under the fake hooks
    # (a CPU build, or a CUDA build without a GPU) cuDNN is otherwise not there: a CUDA build's torch asks its version
    # of the hooks, which the fake ones do not answer ("Cannot query cuDNN version without ATen_cuda library")
    cudnn_patches = [(torch.backends.cudnn, "is_available", lambda: cudnn),
                     (torch.backends.cudnn, "version", lambda: CUDNN_VERSION if cudnn else None)]
    return (cudnn_patches if cudnn or fake_hooks else []) + [
        (torch.cuda, "_lazy_init", lambda: None),  # factory functions initialise CUDA before dispatch
        (torch.cuda, "device_count", lambda: 1),  # DeviceMesh picks rank % device count
        (torch.cuda, "set_device", lambda device: None),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "Stream", _FakeStream),  # FSDP2's all-gather and reduce-scatter streams
        (torch.cuda, "Event", _FakeEvent),
        (torch.cuda, "current_stream", lambda device=None: default),
        # FSDP2 waits on an unshard's event no backward used (a module whose weights get no gradient, as DeepSeek-V4's
        # indexer) through the accelerator's stream, which a fake event does not fit
        (torch.accelerator, "current_stream", lambda device=None: default),
        (torch.cuda, "default_stream", lambda device=None: default),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        (torch.cuda, "set_stream", lambda stream: None),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "get_device_capability", lambda device=None: (H100.major, H100.minor)),  # the kernels' check
        (torch.cuda, "get_device_properties", lambda device=None: H100),
        (torch.cuda, "get_device_name", lambda device=None: H100.name),
        (torch.cuda, "reset_peak_memory_stats", lambda device=None: None),  # the memory tracker's allocator figures
        (torch.cuda, "max_memory_allocated", lambda device=None: 0),
        (torch.cuda, "memory_allocated", lambda device=None: 0),
        (torch.cuda, "empty_cache", lambda: None),
        (torch.backends.cuda, "is_flash_attention_available", lambda: True),  # an H100's torch has it
        # torch.autocast("cuda") asks both, and without them turns itself off with a warning: a bf16 run without
        # FSDP2 (--bf16 --no-fsdp, autocast) would then rehearse float32 compute, the recompute of a checkpointed
        # layer included (torch.utils.checkpoint enters autocast again)
        (torch.cuda.amp.common, "amp_definitely_not_available", lambda: False),
        (torch.cuda, "is_bf16_supported", lambda including_emulation=True: True),
        (torch.Tensor, "record_stream", lambda self, stream: None),  # no fake kernel; nothing to keep alive
    ]


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """Inside, every ``DeviceMesh`` is built on real tensors, fake mode or not. Its rank tables are host metadata,
    but FSDP2 over a tensor-parallel model concatenates the data and TP meshes (``DeviceMesh._concatenate``) while
    it wraps the model, inside the rehearsal's fake mode, where the new mesh's coordinate lookup (``nonzero``) has
    no values and raises. Restored on exit; :class:`CannotRehearse` if this torch's ``DeviceMesh`` has no
    ``__init__`` of its own to wrap."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__dict__.get("__init__")
    if init is None:
        raise CannotRehearse(f"torch {torch.__version__}'s DeviceMesh has no __init__ of its own, which the rehearsal "
                             "wraps; rehearse without --tp, or with another torch.")

    def real_init(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


@contextlib.contextmanager
def fake_cuda(*, cudnn: bool = False) -> Iterator[torch.device]:
    """Inside: ``torch.cuda`` answers as one H100 and the fused backwards a CPU build lacks have CUDA kernels (see
    the module docstring); yields the fake device ``cuda:0``. Every attribute and kernel is restored on exit.
    Raises :class:`CannotRehearse` when the C++ part is not in this process or
    the installed torch lacks an attribute the step calls (the list above needs revisiting for that version)."""
    if needs_preload() and getattr(torch.accelerator.current_accelerator(), "type", None) != "cuda":
        raise CannotRehearse("the fake CUDA library is not loaded in this process: run the rehearsal through "
                             "seqmesh rehearse (it preloads the library), or pass --device cpu.")
    guard = needs_guard()
    patches = _replacements(cudnn, fake_hooks=guard or needs_preload())
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in patches if not hasattr(owner, name)]
    if missing:
        raise CannotRehearse(f"torch {torch.__version__} has no {', '.join(missing)}, which the fake CUDA rehearsal "
                             "replaces; pass --device cpu for the CPU kernels.")
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    kernels = []
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        for make in (_fused_backwards, _efficient_backward_fix, _grouped_mm_fix):  # each kept as made: the
            kernels += [lib for lib in (make(),) if lib is not None]  # finally destroys those made before a failure
        with swapped_guard(guard), lift_on_autograd_threads(torch.device("cuda", 0)):
            yield torch.device("cuda", 0)
    finally:
        for lib in kernels:
            lib._destroy()
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
