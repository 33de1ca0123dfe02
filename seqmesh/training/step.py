"""One training step of a run, shared by ``seqmesh train`` and ``seqmesh rehearse``: the batch shard on the device,
bf16 autocast where FSDP2 does not cast, the activation offload, the loss and gradients (summed, clipped), and the
held-out accuracy."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..inputs import shard_batch
from ..memory.offload import ActivationOffload, enable_activation_offload
from ..mesh import SPMesh
from ..model.fsdp import gradient_norm, sync_gradients
from ..model.lm import SequenceParallelLM
from .config import TrainConfig


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over ``module``'s parameters as ``seqmesh train`` steps them (and its rehearsal and benchmarks), on
    torch's fused kernel on every device (transformers' Trainer's choice on torch 2.8 and later): each parameter is
    updated in place, where the foreach path (torch's default on CUDA) holds a float32 copy of every parameter
    through the step (16.4 GiB a GPU for Llama-3-70B on 16), and the step is one operator where DTensor's dispatch
    of the other paths misses its sharding cache for every parameter at every step. The planner counts this path
    (``planner.memory.optimizer_temporaries``)."""
    return torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


def to_device(batch: dict, device: torch.device) -> dict:
    """The tensors of a sharded batch moved to ``device``, a vision shard's with them (other entries as they are)."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.to(device, non_blocking=True)
        else:  # a VisionShard / FixedSizeShard moves its own tensors; SequenceInfo holds none
            out[key] = value.to(device) if key == "seqmesh_vision" else value
    return out


def step_autocast(cfg: TrainConfig, device: torch.device, fsdp: bool) -> torch.autocast:
    """bf16 autocast for a run without FSDP2 (with it, FSDP2's mixed precision casts the weights instead)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and not fsdp)


def step_offload(cfg: TrainConfig, module: SequenceParallelLM, device: torch.device) -> ActivationOffload | None:
    """The activation offload ``--offload-checkpoints`` attaches to the decoder (None without it); ``seqmesh train``
    and ``seqmesh rehearse`` both take it from here, and hand it to the memory tracker."""
    return enable_activation_offload(module.lm, device) if cfg.offload_checkpoints else None


def forward_backward(module: SequenceParallelLM, local: dict, mesh: SPMesh, cfg: TrainConfig,
                     autocast: torch.autocast, fsdp: bool,
                     phase: Callable[[str], None] = lambda name: None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch shard's loss and gradients, summed over the ranks (without FSDP2) and clipped to ``cfg.grad_clip``:
    the step up to the optimizer's, telling ``phase`` "forward", "backward", then "gradients and optimizer".
    Returns the loss and the gradient norm. ``seqmesh train`` and ``seqmesh rehearse`` both step through it."""
    phase("forward")
    with autocast:
        loss = module(**local)
    phase("backward")
    loss.backward()
    phase("gradients and optimizer")
    if not fsdp:
        sync_gradients(module, mesh)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")  # inf: measure the norm, clip nothing
    return loss, gradient_norm(module.parameters(), max_norm)


def evaluate(module: SequenceParallelLM, data, mesh: SPMesh, cfg: TrainConfig, device: torch.device) -> float:
    """Accuracy of argmax predictions on the scored tokens of the data's held-out batch."""
    module.eval()
    batch = data.eval_batch(mesh.dp_rank, cfg.batch, mesh.dp_size)
    local = to_device(shard_batch(batch, mesh, model=module, layout=cfg.layout), device)
    with torch.no_grad():
        counts = module.score(**local)
    dist.all_reduce(counts, group=mesh.batch_group)
    module.train()
    return float(counts[0] / counts[1].clamp(min=1))
