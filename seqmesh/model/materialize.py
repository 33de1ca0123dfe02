"""A model built on the meta device made real: each parameter allocated on its device (after FSDP2 sharded it, only
the shards) and initialised from ``(seed, its name)``, so the values do not depend on how the model is sharded."""

from __future__ import annotations

import zlib

import torch
import torch.distributed.tensor
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode


def _parameter_seed(seed: int, name: str) -> int:
    """A generator seed from the run's seed and a module's qualified name (stable across processes)."""
    return zlib.crc32(f"{seed}:{name}".encode()) + (seed << 32)


def _init_functions(model: nn.Module, fn, prefix: str = ""):
    """``(qualified name, module, init function)`` in the order transformers' ``initialize_weights``
    visits them: children first, each sub-model (a ``PreTrainedModel`` inside) with its own
    ``_init_weights``."""
    from transformers import PreTrainedModel

    for name, child in model.named_children():
        child_fn = child._init_weights if isinstance(child, PreTrainedModel) else fn
        yield from _init_functions(child, child_fn, f"{prefix}{name}.")
    yield prefix.rstrip("."), model, fn


@torch.no_grad()
def initialize_by_name(lm: nn.Module, device: torch.device | str, seed: int) -> None:
    """Initialise ``lm`` (allocated on ``device``, possibly FSDP-sharded) as transformers does, but with
    every module's values drawn from ``(seed, the module's qualified name)`` on the CPU generator.

    Each module's parameters are initialised whole, on the CPU, one module at a time, and each rank keeps
    the slice its shard covers. The same seed therefore gives the same model for every world size,
    mesh, sharding and device (CPU or CUDA), and no rank ever holds more than one module's weights whole.
    Buffers (RoPE frequencies) are computed in place on ``device``. A parameter shared by two modules
    (tied embeddings) is initialised once, by the first module that owns it.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers.initialization import guard_torch_init_functions

    def store(p: torch.Tensor, values: torch.Tensor) -> None:
        if isinstance(p, DTensor):  # every rank holds the same whole tensor: slice locally, no traffic
            local = distribute_tensor(values.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(values.to(p.device))

    done: set[int] = set()
    for name, module, init in _init_functions(lm, lm._init_weights):
        owned = {n: p for n, p in module._parameters.items() if p is not None}
        whole = {n: nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                 for n, p in owned.items()}  # (full shape) on the CPU, zero where no init writes (Reformer's head bias)
        # what the module's init writes of its children's parameters (Mamba's mixer: dt_proj, conv1d, out_proj),
        # whole on the CPU as they are now (their own inits ran first)
        foreign = [(child, n, child._parameters[n]) for child, n in _children_written(module, init)]
        drafts = [nn.Parameter(_whole_value(p), requires_grad=p.requires_grad) for _, _, p in foreign]
        module._parameters.update(whole)
        for (child, n, _), draft in zip(foreign, drafts):
            child._parameters[n] = draft
        module._is_hf_initialized = False
        # the CPU generator alone, which every draw here uses: torch.manual_seed also seeds each accelerator, and on a
        # machine whose CUDA is not initialised queues that with a formatted stack trace, per module (a fifth of the
        # materialisation test's time)
        torch.default_generator.manual_seed(_parameter_seed(seed, name))
        _constructor_values(module, whole)
        try:
            with guard_torch_init_functions():
                init(module)
        finally:
            module._parameters.update(owned)
            for child, n, p in foreign:
                child._parameters[n] = p
        for n, p in owned.items():
            if id(p) in done:  # already initialised by its first owner
                continue
            done.add(id(p))
            store(p, whole[n].detach())
        for (_, _, p), draft in zip(foreign, drafts):
            store(p, draft.detach())
        module._is_hf_initialized = True


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: the same for the tensor, its ``.data`` and its views (meta tensors too)."""
    return t.untyped_storage()._cdata


class _Writes(TorchDispatchMode):
    """Which of ``watched`` (storages, :func:`_storage`) an operator writes in place while the mode is on, through
    the tensor itself, its ``.data`` or a view of it."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched, self.written = watched, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor) and _storage(value) in self.watched:
                    self.written.add(_storage(value))
        return func(*args, **kwargs)


def _children_written(module: nn.Module, init) -> list[tuple[nn.Module, str]]:
    """``(child module, parameter name)`` of each parameter below ``module`` that ``init(module)`` writes: found by
    running it once on meta stand-ins of the module's and its children's parameters (nothing is written, no random
    number drawn). An init that cannot run on the meta device is taken to write none (what it writes is then left to
    the children's own inits, as before)."""
    from transformers.initialization import guard_torch_init_functions

    slots = [(child, n) for child in module.modules() if child is not module
             for n, p in child._parameters.items() if p is not None]
    if not slots:
        return []
    saved = {id(m): dict(m._parameters) for m in [module] + [child for child, _ in slots]}
    stand_ins: dict[int, tuple[nn.Module, str]] = {}
    for m, n in [(module, n) for n, p in module._parameters.items() if p is not None] + slots:
        p = saved[id(m)][n]
        stand_in = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        m._parameters[n] = stand_in
        if m is not module:
            stand_ins[_storage(stand_in)] = (m, n)
    flag = getattr(module, "_is_hf_initialized", None)
    module._is_hf_initialized = False
    try:
        with _Writes(set(stand_ins)) as spy, guard_torch_init_functions():
            init(module)
        return [slot for i, slot in stand_ins.items() if i in spy.written]  # in the modules' order, on every rank
    except Exception:  # noqa: BLE001  an init that needs real values
        return []
    finally:
        for m in [module] + [child for child, _ in slots]:
            m._parameters.update(saved[id(m)])
        module._is_hf_initialized = flag


def _whole_value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on the CPU (a sharded one all-gathered: every rank runs the same inits in order)."""
    value = p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p
    return value.detach().to("cpu", copy=True)


def _constructor_values(module: nn.Module, whole: dict[str, nn.Parameter]) -> None:
    """What a module's constructor gives its parameters where the family's ``_init_weights`` leaves them as they are:
    transformers' ``Conv1D`` (OpenAI-GPT's layers; GPT-2's ``_init_weights`` redraws them, OpenAI-GPT's does not)
    draws its weight from N(0, 0.02) and zeroes its bias in ``__init__``, which a model built on the meta device never
    ran."""
    if type(module).__name__ == "Conv1D" and type(module).__module__ == "transformers.pytorch_utils":
        whole["weight"].normal_(mean=0.0, std=0.02)
        whole["bias"].zero_()


@torch.no_grad()
def initialize_buffers(lm: nn.Module) -> None:
    """Compute the buffers of ``lm``'s parameter-free modules (RoPE frequencies) in place, as
    :func:`initialize_by_name` does; for a model whose weights are then loaded."""
    from transformers.initialization import guard_torch_init_functions

    for _, module, init in _init_functions(lm, lm._init_weights):
        if module._buffers and not any(p is not None for p in module._parameters.values()):
            module._is_hf_initialized = False
            with guard_torch_init_functions():
                init(module)
            module._is_hf_initialized = True


def allocate(root: nn.Module, device: torch.device | str) -> None:
    """Allocate a model built on the meta device (after FSDP sharded ``root``, or whole) on ``device``,
    uninitialised: every rank holds only its shards. Tied parameters stay tied."""
    device = torch.device(device)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied parameter is one object in several modules
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in root.modules()):
        root.to_empty(device=device)  # FSDP2 allocates its own shards
    else:  # new tensors in place of the meta ones: to_empty would swap them, which fake tensors refuse (rehearsals)
        for module in root.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = torch.empty_like(b, device=device)
    for tied in owners.values():  # to_empty off the meta device gives each owner its own copy: re-tie them
        first, name = tied[0]
        for module, other in tied[1:]:
            module._parameters[other] = first._parameters[name]


def materialize(root: nn.Module, device: torch.device | str, seed: int, values: bool = True) -> None:
    """:func:`allocate` ``root`` on ``device`` and initialise it with :func:`initialize_by_name`: the
    values do not depend on how the model is sharded. ``values=False``: the weights' storages only, for fake tensors,
    which hold no values (a rehearsal: drawing an 8B model's values there dispatched every init operator on fake
    tensors, a tenth of its time); the buffers are still computed, as for a model whose weights are then loaded."""
    allocate(root, device)
    lm = getattr(root, "lm", root)
    if values:
        initialize_by_name(lm, device, seed)
    else:
        initialize_buffers(lm)
