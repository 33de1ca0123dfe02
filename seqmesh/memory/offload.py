"""Activations a model's decoder saves for backward, kept in host memory instead of on the device.

With activation checkpointing each decoder layer saves only its input hidden state ``(B, L, hidden)``
for backward; :func:`enable_activation_offload` moves those (and whatever else the decoder saves
outside checkpointed layers, such as the final norm's input) to host memory through
``saved_tensors_hooks``, so the device holds no activation of the sequence between forward and
backward. The values are copied, never changed: gradients are exactly those without offload.

On CUDA the host copy is pinned and made on a side stream (the device tensor is released once the copy
is done); in backward, fetching one tensor back starts the copies of the next ``prefetch`` to be
needed, so the transfers overlap the recomputation. On the CPU the same hooks run and the "host" copy
is a second CPU tensor: the mechanism is exercised, and :class:`~seqmesh.memory.MemoryTracker` counts
those copies as host bytes, apart from the device total.

Offloaded: tensors with a ``grad_fn`` (activations of the graph). Kept: parameters, inputs and
constants (token ids, RoPE tables), which are already held elsewhere.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..comm.ranks import is_dtensor
from ..model.lm import decoder_of


class OffloadedTensor:
    """One saved activation in host memory, and its way back to the device."""

    __slots__ = ("host", "device", "copied", "fetched", "fetched_ready", "index", "owner", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, index: int, owner: ActivationOffload):
        self.host, self.device, self.copied, self.index, self.owner = host, device, copied, index, owner
        self.fetched, self.fetched_ready = None, None
        owner.live += 1

    def __del__(self) -> None:
        self.owner.live -= 1

    def prefetch(self, stream) -> None:
        """Start the copy back to the device on ``stream`` (CUDA only)."""
        if self.fetched is not None or stream is None:
            return
        with torch.cuda.stream(stream):
            stream.wait_event(self.copied)
            self.fetched = self.host.to(self.device, non_blocking=True)
            self.fetched_ready = stream.record_event()

    def fetch(self, stream) -> torch.Tensor:
        """The tensor on the device (on the CPU: the host copy itself)."""
        if self.device.type != "cuda":
            return self.host
        self.prefetch(stream)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.fetched_ready)
        self.fetched.record_stream(current)  # made on the side stream, used on this one
        fetched, self.fetched = self.fetched, None
        return fetched


class _Distributed:
    """A saved DTensor whose local part was packed: how to put it back together."""

    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local, mesh, placements, shape, stride):
        self.local, self.mesh, self.placements, self.shape, self.stride = local, mesh, placements, shape, stride

    def rebuild(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


class ActivationOffload:
    """Pack and unpack hooks that keep saved activations in host memory (see the module docstring)."""

    def __init__(self, device: torch.device | str, *, prefetch: int = 2):
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.live = 0  # offloaded tensors alive (saved by a graph not yet run backward)
        self.moved_bytes = 0  # bytes copied to the host since the start
        self._order: list[weakref.ref] = []  # this step's offloaded tensors, in the order they were saved
        self._seen: dict[tuple, tuple] = {}  # a view saved twice (pow and mul both save x) moves once
        self._handles: list = []
        self.inner = None
        """(pack, unpack) hooks for the tensors it keeps, e.g. a MemoryTracker's, as hooks do not stack."""

    def pack(self, t: torch.Tensor):
        if t.grad_fn is None or t.device != self.device:
            return t if self.inner is None else (self.inner[1], self.inner[0](t))  # unpacked by its own hook
        if is_dtensor(t):  # a DTensor (tensor parallelism): its local part moves, its layout stays
            with torch.no_grad():
                local = t.to_local()
            return _Distributed(self._offload(local), t.device_mesh, t.placements, t.shape, t.stride())
        return self._offload(t)

    def _offload(self, t: torch.Tensor) -> OffloadedTensor:
        if self.live == 0:  # the previous step's graph is gone: start a new order
            self._order, self._seen = [], {}
        storage = t.untyped_storage()
        view = (storage._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        seen = self._seen.get(view)
        if seen is not None and seen[0]() is storage and seen[1]() is not None:  # not a new storage at that address
            return seen[1]()
        pinned = self.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)  # dense, as save_on_cpu
        copied = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written on the current stream
            with torch.cuda.stream(self.stream):
                host.copy_(t.detach(), non_blocking=True)
                copied = self.stream.record_event()
            t.record_stream(self.stream)  # the allocator reuses t's memory only after the copy
        else:
            host.copy_(t.detach())
        item = OffloadedTensor(host, t.device, copied, len(self._order), self)
        self._order.append(weakref.ref(item))
        self._seen[view] = (weakref.ref(storage), weakref.ref(item))
        self.moved_bytes += host.nbytes
        return item

    def unpack(self, item):
        if isinstance(item, _Distributed):
            return item.rebuild(self.unpack(item.local))
        if not isinstance(item, OffloadedTensor):
            return item[0](item[1]) if isinstance(item, tuple) else item
        for index in range(item.index - 1, max(item.index - 1 - self.prefetch, -1), -1):  # backward runs in reverse
            ahead = self._order[index]()
            if ahead is not None:
                ahead.prefetch(self.stream)
        return item.fetch(self.stream)

    def host_storage_keys(self) -> set[int]:
        """Storages of the host copies alive now (for :class:`~seqmesh.memory.MemoryTracker`)."""
        return {item.host.untyped_storage()._cdata for item in (ref() for ref in self._order) if item is not None}

    def host_bytes(self) -> int:
        """Bytes of the host copies alive now."""
        live = (ref() for ref in self._order)
        return sum(item.host.nbytes for item in live if item is not None)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context in which every saved activation is offloaded."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def attach(self, module: nn.Module) -> ActivationOffload:
        """Offload what ``module``'s forward saves (the hooks are entered and left around each call)."""
        contexts: list = []

        def enter(*_):
            contexts.append(self.hooks())
            contexts[-1].__enter__()

        def leave(*_):
            contexts.pop().__exit__(None, None, None)

        self._handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
        return self

    def remove(self) -> None:
        """Detach from every module it was attached to."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def enable_activation_offload(model: nn.Module, device: torch.device | str, *, prefetch: int = 2) -> ActivationOffload:
    """Offload the activations ``model``'s decoder (transformers' ``get_decoder()``) saves for backward;
    with activation checkpointing, the input hidden state of every decoder layer. ``remove()`` undoes it."""
    decoder = decoder_of(model)
    return ActivationOffload(device, prefetch=prefetch).attach(decoder)
