"""One rank's training step at full size without its memory: fake tensors on torch's fake process group.

The step is ``seqmesh train``'s own: :func:`~seqmesh.training.train.build_mesh` and
:func:`~seqmesh.training.train.build_module` (the model composed and sharded with FSDP2),
:func:`~seqmesh.training.step.forward_backward` (loss, backward, clipping) and AdamW, run under torch's
``FakeTensorMode`` as one rank (``--rank``, 0 by default) of a world of ``--gpus`` ranks on the ``fake`` backend
(``torch.testing._internal.distributed.fake_pg``), where every collective completes at once and moves
nothing. Fake tensors carry shapes, dtypes, devices and storages of the right size, but no data: the
8-billion-parameter model and its activations cost no memory and the kernels no time.

The peak is counted by seqmesh's own :class:`~seqmesh.memory.MemoryTracker`, which works on fake tensors
unchanged: each fake tensor has a storage of its true size, freed when the real one would be, so the
tracker's weak references see the same live set as in a real step (``tests/rehearsal`` checks that a real
and a fake step at a toy size peak at the same byte). The step tracked is one that every step of a run but the
first repeats: AdamW's state is made before it (:func:`~seqmesh.memory.prime_optimizer`: zero gradients and one
optimizer step, where a first training step, about a fifth of a rehearsal's time, would only have created it). :class:`PhaseTracker` also notes the phase and the
operator at the peak.

:func:`rehearse_rank` is meant for a fresh process (:mod:`seqmesh.tools.rehearse` starts one): the fake process
group and the fake mode must not leak into the caller.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..memory import MemoryTracker, prime_optimizer
from ..planner.media import Media
from ..training.config import TrainConfig

# the attention kernel an operator belongs to (the rehearsal reports the ones its step ran)
KERNEL_OPS = {"_scaled_dot_product_flash_attention_for_cpu": "cpu_flash", "_flash_attention_forward": "cuda_flash",
              "_efficient_attention_forward": "cuda_efficient", "_scaled_dot_product_cudnn_attention": "cuda_cudnn",
              "_scaled_dot_product_flash_attention": "cuda_flash", "_scaled_dot_product_efficient_attention":
              "cuda_efficient", "flash_attn_func": "flash_attn", "_flash_attn_forward": "flash_attn"}


class PhaseTracker(MemoryTracker):
    """A :class:`~seqmesh.memory.MemoryTracker` that also remembers the phase (set by the step) and the operator
    running when the peak was reached, the attention kernels it saw run, and the ``top`` largest storages at the
    peak that are neither weights, gradients nor optimizer state, each with the operator and phase that first
    touched it (for a storage made while tracking: the operator that created it)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device, top: int = 6,
                 offload=None):
        super().__init__(module, optimizer, device=device, offload=offload)
        self.phase, self.op = "start", ""
        self.peak_phase, self.peak_op = "start", ""
        self.top = top
        self.origins: dict[int, tuple[str, str, list[int], str]] = {}  # storage key -> (op, phase, shape, dtype)
        self.peak_largest: list[dict] = []  # the ``top`` largest saved or transient storages at the peak
        self.kernels: set[str] = set()

    def _entered(self, key: int, t: torch.Tensor) -> None:
        self.origins[key] = (self.op, self.phase, list(t.shape), str(t.dtype).removeprefix("torch."))

    def _forget(self, key: int) -> None:
        self.origins.pop(key, None)
        super()._forget(key)

    def _check_peak(self) -> None:
        before = self._report.peak_bytes
        super()._check_peak()
        if self._report.peak_bytes > before:
            self.peak_phase, self.peak_op = self.phase, self.op
            owned = set().union(*self.owned_at_classify)  # the new peak was just classified with them
            largest = sorted(((size, key) for key, (_, size) in self._live.items() if key not in owned),
                             reverse=True)[:self.top]
            self.peak_largest = [self._describe(key, size) for size, key in largest]

    def _describe(self, key: int, size: int) -> dict:
        op, phase, shape, dtype = self.origins.get(key, ("", "", [], ""))
        return {"bytes": size, "kind": "saved" if key in self._saved else "transient", "shape": shape,
                "dtype": dtype, "op": op, "phase": phase}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func.name().split("::")[-1]
        kernel = KERNEL_OPS.get(self.op.split(".")[0])
        if kernel is not None:
            self.kernels.add(kernel)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _phase_hooks(module: nn.Module, tracker: PhaseTracker) -> list:
    """Hooks on the decoder layers that tell ``tracker`` which layer the step is in: "layer N forward", "loss
    forward" once the last layer is done, "layer N backward" (its recompute included) from the moment its output's
    gradient is ready, and "end of backward" once the first layer's input gradient is."""
    from ..model.lm import decoder_layers

    layers = decoder_layers(module.lm)
    handles = []
    for i, layer in enumerate(layers):
        def before(_, args, i=i):
            if "backward" not in tracker.phase:  # in backward, a checkpointed layer's recompute
                tracker.phase = f"layer {i} forward"

        def after(_, args, out, i=i):
            if i == len(layers) - 1 and tracker.phase == f"layer {i} forward":
                tracker.phase = "loss forward"

        def before_backward(_, grad_out, i=i):
            tracker.phase = f"layer {i} backward"

        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after),
                    layer.register_full_backward_pre_hook(before_backward)]
    handles.append(layers[0].register_full_backward_hook(lambda *_: setattr(tracker, "phase", "end of backward")))
    return handles


@dataclass
class Rehearsal:
    """What one rehearsed step measured on one rank, beside the planner's prediction for the same run."""

    measured_peak_bytes: int
    by_category: dict[str, int]
    peak_phase: str
    peak_op: str
    kernels: list[str]
    device: str
    mesh: str
    planned_peak_bytes: int | None
    planned_moment: str
    planned_by_purpose: dict[str, int] = field(default_factory=dict)
    largest_at_peak: list[dict] = field(default_factory=list)
    wall_seconds: float = 0.0
    rank: int = 0

    @property
    def ratio(self) -> float | None:
        """Planned over measured (1.0: the planner is exact; above 1: it over-predicts)."""
        return self.planned_peak_bytes / self.measured_peak_bytes if self.planned_peak_bytes else None

    def as_dict(self) -> dict:
        return {"measured_peak_bytes": self.measured_peak_bytes, "planned_peak_bytes": self.planned_peak_bytes,
                "ratio": self.ratio, "peak_phase": self.peak_phase, "peak_op": self.peak_op,
                "planned_moment": self.planned_moment, "kernels": self.kernels, "device": self.device,
                "mesh": self.mesh, "measured_by_category": self.by_category,
                "planned_by_purpose": self.planned_by_purpose, "largest_at_peak": self.largest_at_peak,
                "wall_seconds": self.wall_seconds, "rank": self.rank}


def planned_peak(cfg: TrainConfig, gpus: int, device: str,
                 media: Media | None = None) -> tuple[int | None, str, dict[str, int]]:
    """The planner's tensor peak for ``cfg`` on ``gpus`` ranks (``seqmesh plan``'s memory model, with no reserve:
    the CUDA context and allocator slack are not tensors) and ``media`` per sequence, its moment and its parts by
    purpose."""
    from ..planner.memory import memory_per_gpu
    from ..planner.workload import plan_inputs

    try:
        work, layout = plan_inputs(cfg, gpus, device=device, reserve_bytes=0, media=media)
    except ValueError as err:
        return None, f"not modelled: {err}", {}
    peak = memory_per_gpu(work, layout)
    return peak.total, peak.moment, peak.as_dict()


def _fake(mode, value):
    return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


def rehearse_rank(cfg: TrainConfig, gpus: int, *, device: str = "cuda", fake: bool = True, top: int = 6,
                  media: Media | None = None, rank: int = 0) -> Rehearsal:
    """Rank ``rank`` of ``gpus`` ranks running a training step of ``cfg`` on fake tensors on ``device`` (``cuda``:
    fake ``cuda:0`` tensors and CUDA's kernels, through :func:`.workarounds.fake_cuda`; ``cpu``: the CPU kernels),
    measured with AdamW's state already made. ``fake=False`` runs real CPU tensors on the same fake process group (a toy size's
    reference: what the fake step must match); ``top``: how many of the largest storages at the peak to describe;
    ``media``: the images every sequence shows a vision-language model (:class:`~seqmesh.training.vision_data.ImageRows`
    in place of the built-in image task, and the planner told the same).
    Initialises (and destroys) the fake process group: call it in a
    process of its own."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from .cuda_library import CannotRehearse
    from .workarounds import collective_meta_kernels, fake_cuda, real_device_meshes

    if device not in ("cuda", "cpu") or (device == "cuda" and not fake):
        raise ValueError(f"device {device!r}: rehearse on 'cuda' (fake tensors) or 'cpu'.")
    cudnn = cfg.backend == "cuda_cudnn"  # cuDNN answers only when asked for (see workarounds._replacements)
    with fake_cuda(cudnn=cudnn) if device == "cuda" else contextlib.nullcontext(torch.device("cpu")) as where, \
            real_device_meshes(), collective_meta_kernels():
        try:
            return _rehearse(cfg, gpus, where, fake, top, media, rank)
        except DataDependentOutputException as err:
            raise CannotRehearse(data_dependent_read(err)) from err


def data_dependent_read(err: BaseException) -> str:
    """What to tell a user whose step read a fake tensor's value on the host (``err``, torch's
    ``DataDependentOutputException``): the model's own line that did, found as the innermost frame outside torch and
    the rehearsal's dispatch modes."""
    import os
    import traceback

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inside = tuple(os.path.join(folder, "") for folder in (os.path.dirname(torch.__file__),
                                                           os.path.dirname(os.path.abspath(__file__)),
                                                           os.path.join(package, "memory")))
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(inside)]
    if not frames:
        return f"the step reads a tensor's value on the host, which the rehearsal's fake tensors do not have ({err})."
    frame = frames[-1]
    said = (f"the step reads a tensor's value on the host at {frame.filename}:{frame.lineno} "
            f"({(frame.line or '').strip()!r}), which the rehearsal's fake tensors do not have ({err}). ")
    if frame.filename.startswith(os.path.join(package, "")):
        return said + "That is seqmesh's own code, which should ask seqmesh.tensor_values.has_values first: report it."
    return said + ("The rehearsal cannot run this code as it is: if it is your model's, skip the read where "
                   "seqmesh.tensor_values.has_values(tensor) is False; if it is transformers', a newer transformers "
                   "may not read it.")


def _rehearse(cfg: TrainConfig, gpus: int, where: torch.device, fake: bool, top: int, media: Media | None,
              rank: int) -> Rehearsal:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from ..inputs import shard_batch
    from ..training.run_data import make_dataset, read_run_model
    from ..training.step import forward_backward, make_optimizer, step_autocast, step_offload, to_device
    from ..training.train import build_mesh, build_module, uses_fsdp
    from .workarounds import fake_mode

    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=gpus)
    try:
        source = read_run_model(cfg)  # the model read once, for the data, the mesh and the module
        data = make_dataset(cfg, media=media, source=source)  # real: the batch is drawn, sharded and only then made fake
        mesh, device = build_mesh(cfg, where, source=source)  # real: the mesh's rank tables are read on the host
        mode = fake_mode() if fake else contextlib.nullcontext()
        with mode:
            module = build_module(cfg, mesh, device, source, fake=fake)
            optimizer = make_optimizer(module, cfg.lr, cfg.weight_decay)
            offload = step_offload(cfg, module, device)  # --offload-checkpoints: as seqmesh train's Trainer
        fsdp = uses_fsdp(cfg)
        autocast = step_autocast(cfg, device, fsdp)
        module.train()
        batch = data.batch(1, mesh.dp_rank, cfg.batch, mesh.dp_size)
        local = shard_batch(batch, mesh, model=module, layout=cfg.layout)
        with mode:
            local = {k: _fake(mode, v) for k, v in local.items()} if fake else local
            prime_optimizer(module, optimizer)  # AdamW's state, as every step after the first holds it
            tracker = PhaseTracker(module, optimizer, device=device, top=top, offload=offload)
            hooks = _phase_hooks(module, tracker)
            try:
                with tracker:  # the batch goes to the device inside the step, as seqmesh train's does
                    forward_backward(module, to_device(local, device), mesh, cfg, autocast, fsdp,
                                     phase=_setter(tracker))
                    tracker.phase = "optimizer step"
                    optimizer.step()
                    tracker.phase = "zero grad"
                    optimizer.zero_grad(set_to_none=True)
            finally:
                for handle in hooks:
                    handle.remove()
        report = tracker.report()
        planned, moment, parts = planned_peak(cfg, gpus, device.type, media)
        return Rehearsal(report.peak_bytes, dict(report.by_category), tracker.peak_phase, tracker.peak_op,
                         sorted(tracker.kernels), device.type, repr(mesh), planned, moment, parts,
                         tracker.peak_largest, time.perf_counter() - start, rank)
    finally:
        dist.destroy_process_group()


def _setter(tracker: PhaseTracker):
    def phase(name: str) -> None:
        # forward_backward's "backward" starts at the loss: the layers' hooks take over from the top layer down
        tracker.phase = {"backward": "loss backward", "gradients and optimizer": "gradient clipping"}.get(name, name)
    return phase
