"""Peak live tensor bytes of a rank, by category, counted from torch's own mechanisms.

A ``TorchDispatchMode`` sees every tensor an operator reads or writes; each distinct storage is kept
in a table with a weak reference whose callback removes it when torch frees it. The table's sum is
the bytes alive on the tracked device, exact on the CPU; on CUDA the same figure sits next to
``torch.cuda.max_memory_allocated`` (the allocator rounds each block up, so it reads a little higher).
It is deterministic where the step is: a collective's buffers are freed when the backend lets go of
them, which for gloo (its worker thread) and NCCL (its watchdog) happens on another thread's schedule,
so two identical steps can peak one such buffer apart. The tests pin the byte-exact figure on torch's
fake process group, where collectives complete on the calling thread. A ``saved_tensors_hooks`` pair marks what autograd keeps for backward.

At the peak each live storage is put in the first category that claims it:

    parameters    the module's parameters and buffers (local shards, and FSDP2's gathered copies
                  while they are registered)
    gradients     their ``.grad``
    optimizer     the optimizer's state
    activations   tensors autograd saved for backward (packed through the tracker's hooks, or, for a
                  checkpointed layer, its inputs), and the attention outputs such a layer keeps
                  (``seqmesh.sharded_attention.kept``)
    transient     everything else: the working set of the operator running now

Storages held on the host by an :class:`~seqmesh.memory.offload.ActivationOffload` are counted apart
(``host_bytes``), never in the device total. FSDP2 frees a gathered parameter by resizing its storage
to zero, which no operator sees: sizes are refreshed whenever a storage is touched, and the whole table
whenever its sum passes the peak, so a stale size never inflates the peak.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..sharded_attention.kept import kept_through

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "transient")


@dataclass
class MemoryReport:
    """What one rank held at its peak: ``peak_bytes`` = the sum of ``by_category``."""

    peak_bytes: int = 0
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    host_bytes: int = 0
    """Bytes the activation offload held in host memory at the peak (not part of ``peak_bytes``)."""
    cuda_max_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the same span, on a CUDA device."""

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, **{f"{k}_bytes": v for k, v in self.by_category.items()},
                "host_bytes": self.host_bytes, "cuda_max_allocated": self.cuda_max_allocated}


def held_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the bytes this rank holds), another wrapper subclass's inner tensor (each view of an
    ``AsyncCollectiveTensor`` reports a storage of its own, with no bytes behind it), other tensors as they are."""
    if isinstance(t, DTensor):
        # the shard itself, as ``to_local`` returns it under no_grad, without dispatching an operator (the tracker
        # asks for every parameter's at each new peak: through ``to_local`` that was most of a rehearsal's own time)
        return t._local_tensor
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return held_tensor(getattr(t, inner[0]))
    return t


def _tensors(value, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """``found`` with the tensors in an operator's arguments or result appended: tensors in tuples (named ones and
    ``torch.return_types`` among them), lists and dicts, as ``tree_flatten`` reaches them. Once per operator, the
    tracker's own share of a step: a rehearsal's step spent about a twentieth of its time in ``tree_flatten``."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by all its views)."""
    return held_tensor(t).untyped_storage()._cdata


class _Saved:
    """One tensor autograd saved; the tracker counts its storage as an activation while this lives."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: MemoryTracker):
        self.tensor, self.tracker = tensor.detach(), tracker  # detached: no cycle through grad_fn
        self.key = storage_key(tensor)
        tracker._saved[self.key] = tracker._saved.get(self.key, 0) + 1

    def __del__(self) -> None:
        saved = self.tracker._saved
        left = saved.get(self.key, 0) - 1
        if left > 0:
            saved[self.key] = left
        else:
            saved.pop(self.key, None)


class MemoryTracker(TorchDispatchMode):
    """``with MemoryTracker(module, optimizer) as tracker: <a training step>``, then ``tracker.report()``.

    Counts the storages on ``device`` (default: the module's) that operators touch while it is active,
    and those of the module, its gradients and the optimizer's state from the start. Each rank tracks
    its own. It costs Python work per operator: an option, off by default in ``seqmesh train``."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 device: torch.device | str | None = None, offload=None):
        super().__init__()
        self.module, self.optimizer, self.offload = module, optimizer, offload
        first = next(iter(module.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            held_tensor(first).device if first is not None else torch.device("cpu"))
        if self.device.type == "meta":
            raise ValueError("MemoryTracker on the meta device: meta tensors hold no memory. Pass device= the device "
                             "the step runs on (a rehearsal's fake tensors report theirs).")
        self._params = list(module.parameters())  # FSDP2's sharded parameters, kept once registered
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # storage key -> (storage, bytes when last seen)
        self._total = 0  # sum of the recorded sizes: never below the true live bytes
        self._saved: dict[int, int] = {}  # storage key -> saved-tensor slots holding it
        self._report = MemoryReport()
        self.owned_at_classify: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self._pack, self._unpack = (lambda t: _Saved(t, self)), (lambda saved: saved.tensor)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # --- the live table -------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._total -= entry[1]

    def _touch(self, t: torch.Tensor) -> None:
        t = held_tensor(t)
        if t.device != self.device:  # a meta tensor too: the tracked device is never meta (a fake tensor's is_meta
            return  # costs microseconds, a tenth of a rehearsal's time once per tensor an operator touches)
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = (weakref.ref(storage, lambda _, k=key: self._forget(k)), size)
            self._total += size
            self._entered(key, t)
        elif entry[1] != size:
            self._live[key] = (entry[0], size)
            self._total += size - entry[1]

    def _entered(self, key: int, t: torch.Tensor) -> None:
        """A storage not in the table before, ``t`` (a plain tensor) one of its tensors: for a subclass that notes
        where storages come from."""

    def _refresh(self) -> None:
        total = 0
        for key, (ref, size) in list(self._live.items()):
            storage = ref()
            now = storage.nbytes() if storage is not None else 0
            self._live[key] = (ref, now)
            total += now
        self._total = total

    def _owned(self) -> tuple[set[int], set[int], set[int]]:
        """Storage keys of the parameters and buffers, their gradients and the optimizer state."""
        params = {*self._params, *self.module.parameters()}
        param_keys = {storage_key(p) for p in params} | {storage_key(b) for b in self.module.buffers()}
        grad_keys = {storage_key(p.grad) for p in params if p.grad is not None}
        opt_keys = set()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                opt_keys.update(storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
        return param_keys, grad_keys, opt_keys

    def _classify(self) -> tuple[dict[str, int], int]:
        """Live device bytes by category, and the bytes held on the host by the offload; the keys of what the module
        and optimizer own are kept in ``owned_at_classify`` for a subclass that reads the same moment."""
        param_keys, grad_keys, opt_keys = self.owned_at_classify = self._owned()
        host = self.offload.host_storage_keys() if self.offload is not None else set()
        by = dict.fromkeys(CATEGORIES, 0)
        hosted = self.offload.host_bytes() if self.offload is not None else 0
        # a snapshot: a storage freed on another thread (gloo's, autograd's) drops its entry while this loop runs
        for key, (_, size) in list(self._live.items()):
            if key in param_keys:
                by["parameters"] += size
            elif key in grad_keys:
                by["gradients"] += size
            elif key in opt_keys:
                by["optimizer"] += size
            elif key in host:  # a host copy (on a CPU-only run, where host and device are one memory)
                continue
            elif key in self._saved:
                by["activations"] += size
            else:
                by["transient"] += size
        return by, hosted

    def _device_total(self) -> int:
        """The recorded sum less the offload's host copies it holds (on a CPU run host and device are one
        memory, so they are in the table; they never count towards the peak, and without this every
        operator after the first offload would reclassify the whole table)."""
        if self.offload is None:
            return self._total
        # .get: a storage freed on another thread may have left the table since host_storage_keys was read
        return self._total - sum(self._live.get(k, (None, 0))[1] for k in self.offload.host_storage_keys())

    def _check_peak(self) -> None:
        if self._device_total() <= self._report.peak_bytes:
            return
        self._refresh()  # drop sizes FSDP2 shrank behind the operators' backs
        if self._device_total() <= self._report.peak_bytes:
            return
        by, hosted = self._classify()
        if sum(by.values()) > self._report.peak_bytes:
            self._report.peak_bytes, self._report.by_category, self._report.host_bytes = sum(by.values()), by, hosted

    def current(self) -> dict[str, int]:
        """Live device bytes by category now, plus ``host`` (offloaded)."""
        self._refresh()
        by, hosted = self._classify()
        return {**by, "host": hosted}

    # --- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors((args, kwargs, out), []):
            self._touch(t)
        self._check_peak()
        return out

    def __enter__(self) -> MemoryTracker:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for t in self._state_tensors():
            self._touch(t)
        self._check_peak()
        self._hooks.__enter__()
        if self.offload is not None:  # what the offload keeps on the device is still a saved activation
            self.offload.inner = (self._pack, self._unpack)
        entered = super().__enter__()
        self._keeper = kept_through(self._pack, self._unpack)  # kept attention outputs are activations too
        self._keeper.__enter__()
        return entered

    def __exit__(self, *exc) -> None:
        self._keeper.__exit__(*exc)
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        if self.offload is not None:
            self.offload.inner = None
        if self.device.type == "cuda":
            self._report.cuda_max_allocated = torch.cuda.max_memory_allocated(self.device)

    def _state_tensors(self) -> list[torch.Tensor]:
        params = {*self._params, *self.module.parameters()}
        tensors = [*params, *self.module.buffers(), *(p.grad for p in params if p.grad is not None)]
        if self.optimizer is not None:
            tensors += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return tensors

    def report(self) -> MemoryReport:
        """The peak so far and what made it up."""
        return self._report

    def live_bytes(self) -> int:
        """Bytes alive on the device now (host-offloaded storages included)."""
        self._refresh()
        return self._total


def prime_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s state as a first step leaves it, without the step: a zero gradient for every trainable
    parameter (its layout: a DTensor shard for FSDP2's), one optimizer step (AdamW: zero moments, the step count 1,
    the weights decayed once), gradients cleared. For measuring the step every later step of a run repeats, whose
    memory a first step's only lasting effect, this state, is part of; cheaper than running that first step. A
    parameter a real step would leave without a gradient gets state here too (none of the models measured has one)."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
