"""The Hugging Face ``Trainer`` with seqmesh sequence parallelism: switch the class, give the degrees.

    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=rows, seqmesh_degrees=(2, 2))
    trainer = SequenceParallelTrainer(..., seqmesh_degrees=(2, 1, 2))   # ulysses, ring, tensor-parallel
    class MySFTTrainer(SequenceParallelTrainerMixin, SFTTrainer): ...  # any Trainer subclass

Launched with ``torchrun``, the world is ``dp x ring x ulysses x tp`` (``dp = world / (ulysses * ring * tp)``;
``tp`` is 1 unless ``seqmesh_degrees`` names a third degree).
Trainer keeps its optimizer, scheduler, callbacks, logging and checkpoint layout; the mixin changes:

- data: the sampler is accelerate's own, sharded over the data-parallel ranks (``mesh.dp_size``,
  ``mesh.dp_rank``) instead of the world, so every rank of a sequence group reads the same batch;
- model: ``seqmesh.compose.parallelize_model`` (attention, the chunked pooled loss, FSDP2 over every
  rank of the mesh), applied once at construction. ``_wrap_model`` hands Trainer that
  module, so accelerate prepares only the optimizer and never wraps the model in DDP or FSDP;
- loss: the micro-batch's pooled mean times (its targets / the optimizer step's targets), which is
  how single-device Trainer scales with ``num_items_in_batch``; the logged loss is the step's mean;
- activation checkpointing (the TrainingArguments' ``activation_checkpointing``): seqmesh's, through transformers'
  layers as the Trainer enables it; with ``seqmesh_keep_attention=True`` the recompute takes each layer's attention
  outputs from its forward instead of running the attention again;
- gradient accumulation: one FSDP2 reduce-scatter per optimizer step (``no_sync`` on the others);
  clipping: the global norm over the DTensor gradients;
- evaluation: the pooled loss of each batch; ``save_model``: every tensor gathered whole, one at a
  time, and streamed by rank 0 into a transformers folder; checkpoints keep the optimizer's shards with
  ``torch.distributed.checkpoint``, so ``train(resume_from_checkpoint=...)`` works.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from .compose import ParallelPlan, parallelize_model
from .mesh import SPMesh, init_mesh
from .inputs import shard_batch
from .sequence.batch import IGNORE_INDEX
from .model.fsdp import gradient_norm, keep_attention_in_checkpoints, keep_attention_problem
from .model.lm import LossTerms, SequenceParallelLM
from .vision.families import is_multimodal
from .vision.tower import VisionLanguageLM
from .model.pretrained import copy_pretrained
from .model.writer import write_model
from .versions import require
from .rules.degrees import resolve_degrees

# Trainer methods overridden here: _get_dataloader, _get_num_items_in_batch, _wrap_model, compute_loss,
# prediction_step and the save/load hooks exist throughout 5.x; _clip_grad_norm and _get_grad_norm
# (clipping over DTensor gradients) since 5.3 (earlier, Trainer clips inline and would miss the mesh).
# The floor enforced is the tested one (seqmesh/versions.py).
OPTIMIZER_FOLDER = "optimizer_dcp"


class NoSync:
    """The ``no_sync`` that accelerate looks for: FSDP2 skips the reduce-scatter on every micro-batch of an
    optimizer step but the last."""

    @contextlib.contextmanager
    def no_sync(self):
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)


class TermsApart:
    """``forward`` returns the loss's :class:`~seqmesh.model.lm.LossTerms`, not their sum: the Trainer weights
    the cross-entropy by its micro-batch's share of the step's targets and adds the router term as it is, as
    transformers' Trainer does (the model's own loss, divided by the step's targets, plus its router term)."""

    def loss_of(self, out, shift_labels, seqmesh, aux) -> LossTerms:
        return self.loss_terms(out, shift_labels, seqmesh, aux)


class TrainerLM(NoSync, TermsApart, SequenceParallelLM):
    """``SequenceParallelLM`` with accelerate's ``no_sync``, its loss in terms."""


class TrainerVisionLM(NoSync, TermsApart, VisionLanguageLM):
    """``VisionLanguageLM`` (the families of ``seqmesh.vision.families``) with accelerate's ``no_sync``, its loss
    in terms."""


class SequenceParallelTrainerMixin:
    """Put before ``Trainer`` (or a subclass such as TRL's ``SFTTrainer``) in the bases.

    Extra keyword arguments: ``seqmesh_degrees=(ulysses, ring)`` or ``(ulysses, ring, tp)`` (the
    data-parallel degree is what remains of the world) or ``seqmesh_mesh`` (an :class:`~seqmesh.mesh.SPMesh`); ``seqmesh_chunk``:
    tokens whose logits exist at once in the loss; ``seqmesh_ep``: the expert-parallel degree of an MoE model
    (``ParallelPlan.ep``: each MoE layer's experts split over groups of that many ranks holding different tokens);
    ``seqmesh_keep_attention``: the layers the TrainingArguments' activation checkpointing recomputes keep their
    attention outputs (``ParallelPlan.keep_attention``; the recompute skips the attention). Or, instead of those three,
    ``seqmesh_plan``: a :class:`~seqmesh.compose.ParallelPlan` with any of :data:`TRAINER_PLAN_SETTINGS` (the memory
    techniques, kernels, the loss's tiles, the layout); its ``bf16`` and ``checkpointing`` are the TrainingArguments'.
    """

    loss_is_scaled_for_ga = True  # compute_loss divides by the optimizer step's targets itself

    def __init__(self, *args: Any, seqmesh_degrees: tuple[int, ...] | None = None, seqmesh_mesh: SPMesh | None = None,
                 seqmesh_chunk: int | None = None, seqmesh_ep: int | None = None,
                 seqmesh_keep_attention: bool | None = None, seqmesh_plan: ParallelPlan | None = None, **kwargs: Any):
        if (seqmesh_degrees is None) == (seqmesh_mesh is None):
            raise ValueError("give the degrees as seqmesh_degrees=(ulysses, ring) or (ulysses, ring, tp), or a mesh as "
                             "seqmesh_mesh=seqmesh.init_mesh(...); exactly one of the two.")
        if seqmesh_degrees is not None and len(seqmesh_degrees) not in (2, 3):
            raise ValueError(f"seqmesh_degrees={seqmesh_degrees!r}: give (ulysses, ring) or (ulysses, ring, tp).")
        require("transformers", "seqmesh's Trainer")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init is not supported with seqmesh: build the model and pass it as model=.")
        super().__init__(*args, **kwargs)
        self._refuse_other_parallelism()
        shorthands = {name: value for name, value in (("loss_chunk", seqmesh_chunk), ("ep", seqmesh_ep),
                                                      ("keep_attention", seqmesh_keep_attention)) if value is not None}
        if seqmesh_plan is not None and shorthands:
            named = ", ".join(f"seqmesh_{_SHORTHAND[n]}" for n in shorthands)
            raise ValueError(f"seqmesh_plan and {named} both given: put {', '.join(shorthands)} inside the plan "
                             "(ParallelPlan(...)).")
        keep = seqmesh_plan.keep_attention if seqmesh_plan is not None else bool(seqmesh_keep_attention)
        checkpointing = self._checkpointing(keep)
        plan = trainer_plan(seqmesh_plan, self.args, checkpointing, shorthands)
        if not dist.is_initialized():
            raise ValueError("seqmesh's Trainer runs on a process group: launch the script with torchrun "
                             "(torchrun --nproc-per-node N script.py), even for one process.")
        mesh = seqmesh_mesh if seqmesh_mesh is not None else mesh_for_world(*seqmesh_degrees)
        self.seqmesh_mesh = mesh
        self._seqmesh_layout = plan.layout
        wrapper = TrainerVisionLM if is_multimodal(self.model.config) else TrainerLM
        self.seqmesh_model = parallelize_model(self.model, mesh, plan, wrapper=wrapper)
        self.model_wrapped = self.seqmesh_model
        self.gather_function = self.accelerator.gather  # every rank holds whole losses: no truncation to undo
        self._targets_per_micro_batch: deque[float] = deque()
        self._sharded: deque[tuple[dict[str, Any], dict[str, Any]]] = deque()  # (batch, shard) of the step's micro-batches
        if plan.keep_attention:  # the Trainer enables checkpointing again at train(), with its own kwargs
            self.add_callback(KeepAttentionCallback())

    def _checkpointing(self, keep: bool) -> bool:
        """Whether the TrainingArguments turn on activation checkpointing; refused here, before any work and in the
        Trainer's own terms, where the model cannot be checkpointed or ``keep`` (keeping the attention outputs) cannot
        reach the checkpoints they ask for."""
        on, field, kwargs = trainer_checkpointing(self.args)
        if on and not getattr(self.model, "supports_gradient_checkpointing", True):
            raise ValueError(f"{type(self.model).__name__} cannot be checkpointed by transformers (its layers are not "
                             f"checkpointable modules): set {field}=False in the TrainingArguments.")
        if not keep:
            return on
        if not on:
            raise ValueError("keeping the attention outputs (seqmesh_keep_attention, or keep_attention in "
                             "seqmesh_plan) saves what checkpointed layers would compute twice: set "
                             f"{field}=True in the TrainingArguments, or stop keeping them.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"{field}_kwargs={kwargs!r} is not a dict of checkpoint arguments; give a dict.")
        problem = keep_attention_problem(kwargs)
        if getattr(getattr(self.model, "gradient_checkpointing_enable", None), "_is_sac_wrapped", False):
            problem = ("TRL's selective checkpointing (gradient_checkpointing_kwargs={'selective': True}) keeps the "
                       "attention through a context_fn of its own; use it or seqmesh_keep_attention, not both")
        if problem is not None:
            raise ValueError(f"keeping the attention outputs: {problem} (the TrainingArguments' {field}_kwargs).")
        return on

    def _refuse_other_parallelism(self) -> None:
        args = self.args
        other = [name for name, on in (
            ("deepspeed", self.is_deepspeed_enabled), ("fsdp", self.is_fsdp_enabled or bool(args.fsdp)),
            ("parallelism_config", getattr(args, "parallelism_config", None) is not None),
            ("model_parallel", self.is_model_parallel), ("n_gpu > 1 (DataParallel)", args.n_gpu > 1),
            ("train_sampling_strategy='batch_rebalance'", getattr(args, "train_sampling_strategy", "") == "batch_rebalance"),
        ) if on]
        if other:
            raise ValueError(f"seqmesh shards the model and the batches itself; turn off {', '.join(other)} in the "
                             "TrainingArguments / accelerate config.")

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, checked to leave the loss as compute_loss weighted it."""
        super().create_accelerator_and_postprocess()
        # accelerator.backward divides the loss by accelerate's own gradient_accumulation_steps. transformers
        # accumulates itself and sets that to 1 (5.15, the floor, and later); 5.3-5.5.3 left it at the
        # TrainingArguments' value, which divided seqmesh's already weighted loss a second time.
        if self.accelerator.gradient_accumulation_steps != 1:
            raise ValueError(f"accelerate would divide the loss by gradient_accumulation_steps="
                             f"{self.accelerator.gradient_accumulation_steps} after seqmesh weighted it; upgrade "
                             "transformers to 5.15 or later, and set no num_steps in accelerator_config.")

    # -- data ---------------------------------------------------------------------------------------
    def _get_dataloader(self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
                        dataloader_key: str | None = None) -> DataLoader:
        """Trainer's DataLoader, sharded over the data-parallel ranks only (accelerate's sampler and
        seeding, as single-device Trainer gets them)."""
        from accelerate.data_loader import prepare_data_loader
        from transformers.utils import is_datasets_available

        args, acc, mesh = self.args, self.accelerator, self.seqmesh_mesh
        collator = self.data_collator
        if is_datasets_available() and type(dataset).__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        params: dict[str, Any] = dict(
            batch_size=batch_size, collate_fn=collator, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
        )
        if not isinstance(dataset, IterableDataset):
            params["sampler"] = sampler_fn(dataset) if sampler_fn is not None else None
            params["drop_last"] = args.dataloader_drop_last
        loader = DataLoader(dataset, **params)
        return prepare_data_loader(
            loader, acc.device, num_processes=mesh.dp_size, process_index=mesh.dp_rank,
            split_batches=acc.split_batches, put_on_device=acc.device_placement, rng_types=list(acc.rng_types),
            dispatch_batches=False, even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=args.data_seed, non_blocking=acc.non_blocking,
        )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """The optimizer step's targets over the whole mesh; keeps each micro-batch's for compute_loss."""
        mesh = self.seqmesh_mesh
        self._sharded = deque((b, shard_batch(b, mesh, model=self.seqmesh_model, layout=self._seqmesh_layout))
                              for b in batch_samples)
        local = [float((shard["shift_labels"] != IGNORE_INDEX).sum()) for _, shard in self._sharded]
        counts = torch.tensor(local, dtype=torch.float64, device=mesh.collective_device())
        dist.all_reduce(counts, group=mesh.batch_group)  # sequence shards partition a batch: each counted once
        self._targets_per_micro_batch = deque(counts.tolist())
        return counts.sum().to(device)

    def _shard(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard of ``inputs``: the one the step's count already cut when ``inputs`` is its next
        micro-batch (the same keys and equal tensors: the Trainer hands it over as a copy), else cut now."""
        if self._sharded and _same_batch(self._sharded[0][0], inputs):
            return self._sharded.popleft()[1]
        self._sharded.clear()  # called outside the step's order: the cached shards no longer line up
        return shard_batch(inputs, self.seqmesh_mesh, model=self.seqmesh_model, layout=self._seqmesh_layout)

    # -- model, loss, gradients ---------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None) -> nn.Module:
        return self.seqmesh_model  # already sharded: Trainer then lets accelerate prepare the optimizer only

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """The pooled cross-entropy of the micro-batch, scaled to its share of the optimizer step's targets, plus
        its router term (MoE models asking for one) unscaled, as transformers' Trainer adds the model's own."""
        terms = self.seqmesh_model(**self._shard(inputs))
        loss = terms.cross_entropy
        if num_items_in_batch is not None and self.seqmesh_model.training:
            if not self._targets_per_micro_batch:
                raise RuntimeError("compute_loss got num_items_in_batch from a batch list seqmesh did not count; "
                                   "call it through Trainer.training_step.")
            loss = loss * _share_of_step(self._targets_per_micro_batch.popleft(), float(num_items_in_batch))
        if terms.router is not None:
            loss = loss + terms.router
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The batch's pooled loss (the same on every rank); no logits (they are sharded by sequence)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            terms = self.seqmesh_model(**shard_batch(inputs, self.seqmesh_mesh, model=self.seqmesh_model,
                                                     layout=self._seqmesh_layout))
        loss = terms.cross_entropy if terms.router is None else terms.cross_entropy + terms.router
        return loss.detach(), None, None

    def _grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole gradient (all shards of every parameter); clips to ``max_norm``."""
        return gradient_norm(self.seqmesh_model.parameters(), max_norm)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        return self._grad_norm(float("inf")) if grad_norm is None else grad_norm

    # -- saving and resuming ------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A transformers folder, streamed as ``seqmesh train`` exports: each parameter gathered whole in
        turn (a collective on every rank) and appended by rank 0 to the open safetensors file, so no rank
        holds more than one whole tensor beyond its shards; then the tokenizer and the training arguments."""
        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir or self.args.output_dir
        keep = self.args.should_save
        if keep:
            os.makedirs(output_dir, exist_ok=True)
            for name in os.listdir(output_dir):  # an earlier save's weights (its shards may be named otherwise)
                if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
                    os.remove(os.path.join(output_dir, name))
        write_model(self.model, output_dir, write=keep)
        if keep:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        dist.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Each rank writes its optimizer shards (torch.distributed.checkpoint); rank 0 the scheduler."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        from transformers.trainer import SCHEDULER_NAME

        state = get_optimizer_state_dict(self.seqmesh_model, _torch_optimizer(self.optimizer))
        dcp.save({"optimizer": state}, checkpoint_id=os.path.join(output_dir, OPTIMIZER_FOLDER))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer shards through seqmesh's checked reader (a folder's DCP metadata and non-tensor
        items cannot run code; every rank raises the same ValueError if they try); the scheduler with
        ``weights_only``."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        from transformers.trainer import SCHEDULER_NAME

        from .model.checkpoint_reader import load_checked

        if checkpoint is None:
            return
        optimizer = _torch_optimizer(self.optimizer)
        state = {"optimizer": get_optimizer_state_dict(self.seqmesh_model, optimizer)}
        load_checked(state, os.path.join(checkpoint, OPTIMIZER_FOLDER),
                     fix="resume from a checkpoint this Trainer saved, or start without resume_from_checkpoint.")
        set_optimizer_state_dict(self.seqmesh_model, optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The weights of a folder written by :meth:`save_model`, each rank copying only its shards."""
        copy_pretrained(getattr(self.model, "lm", self.model), resume_from_checkpoint)


class KeepAttentionCallback(TrainerCallback):
    """At the start of training, after the Trainer has enabled activation checkpointing with its arguments' kwargs
    (replacing the checkpoint function seqmesh set when it built the model), each checkpointed layer keeps its
    attention outputs again (``seqmesh.model.fsdp.keep_attention_in_checkpoints``)."""

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is None:
            raise RuntimeError("the Trainer began training without handing its callbacks the model; seqmesh cannot "
                               "keep the attention outputs (leave seqmesh_keep_attention out).")
        keep_attention_in_checkpoints(model, option="seqmesh_keep_attention")


# the ParallelPlan fields the Trainer runs as seqmesh train does (tests/hf/test_hf_trainer.py); the degrees come from
# the mesh (TRAINER_PLAN_MESH), bf16 and checkpointing from the TrainingArguments, and the rest is refused by name
# (NOT_IN_TRAINER; a test holds every field of ParallelPlan to one of the four)
TRAINER_PLAN_SETTINGS = ("backend", "linear_attention", "indexer_precision", "layout", "tiled_mlp", "mlp_tiles",
                         "efficient_norm", "loss_chunk", "ep", "keep_attention", "async_ulysses")
TRAINER_PLAN_MESH = ("ulysses", "ring", "dp", "dp_replicate", "tp")
_SHORTHAND = {"loss_chunk": "chunk", "ep": "ep", "keep_attention": "keep_attention"}  # the mixin's own keyword names
# what the Trainer does not run, each with what to use instead
NOT_IN_TRAINER = {
    "offload_checkpoints": "the Trainer's step is its own, not seqmesh's; with transformers 5.24, "
                           "activation_checkpointing_kwargs={'offload': True} keeps the checkpoints in host memory",
    "compile": "seqmesh's Trainer is not tested compiled; compile with seqmesh train (--compile) or your own loop",
    "fsdp": "the Trainer's gradients are FSDP2's (its accumulation and clipping are written for them)",
    "fsdp_cpu_offload": "seqmesh's Trainer is not tested with FSDP2's CPU offload; use seqmesh train "
                        "(--fsdp-cpu-offload) or your own loop",
}


def trainer_plan(given: ParallelPlan | None, args: TrainingArguments, checkpointing: bool,
                 shorthands: dict[str, Any]) -> ParallelPlan:
    """The plan the Trainer parallelizes with: ``given`` (or the mixin's shorthands) with the TrainingArguments' bf16
    and checkpointing; what it asks that the Trainer does not run, or asks against the TrainingArguments, refused by
    name."""
    from dataclasses import replace

    if given is None:
        return ParallelPlan(bf16=args.bf16, checkpointing=checkpointing, **shorthands)
    defaults = ParallelPlan()
    for name, why in NOT_IN_TRAINER.items():
        if getattr(given, name) != getattr(defaults, name):
            raise ValueError(f"seqmesh_plan.{name}={getattr(given, name)!r}: {why}.")
    field = trainer_checkpointing(args)[1]
    for name, wanted, arg in (("bf16", args.bf16, "bf16"), ("checkpointing", checkpointing, field)):
        if getattr(given, name) and not wanted:
            raise ValueError(f"seqmesh_plan.{name}=True, but the Trainer's {name} is the TrainingArguments': set "
                             f"{arg}=True there.")
    return replace(given, bf16=args.bf16, checkpointing=checkpointing)


def trainer_checkpointing(args: TrainingArguments) -> tuple[bool, str, Any]:
    """Whether ``args`` turn on transformers' activation checkpointing, the name of that field, and its kwargs as given
    (transformers 5.24 renamed gradient_checkpointing to activation_checkpointing, and keeps the old name as an
    alias it reads into the new one; its TrainingArguments parse a JSON dict given as a string)."""
    if getattr(args, "activation_checkpointing", None) is not None:
        return bool(args.activation_checkpointing), "activation_checkpointing", args.activation_checkpointing_kwargs
    return bool(args.gradient_checkpointing), "gradient_checkpointing", args.gradient_checkpointing_kwargs


def mesh_for_world(ulysses: int, ring: int, tp: int = 1) -> SPMesh:
    """``ulysses x ring`` sequence parallelism with ``tp``-way tensor parallelism inside, data parallelism (FSDP)
    over the rest of the world."""
    ulysses, ring, dp = resolve_degrees(dist.get_world_size(), ulysses=ulysses, ring=ring, tp=tp)
    return init_mesh(ulysses, ring, dp_shard=dp, tp=tp)


def _same_batch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two batches hold the same keys and equal values (tensors compared on their own devices)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y.to(x.device)):
                return False
        elif x is not y and not (isinstance(x, (int, float, str, bool, type(None))) and x == y):
            return False  # other values (lists of tensors, ...) only when they are the same object
    return True


def _share_of_step(micro_batch_targets: float, step_targets: float) -> float:
    """The weight of a micro-batch's pooled mean in its optimizer step: its targets / the step's.

    A step whose labels are all ignored has no targets in any micro-batch: each pooled mean is already 0
    with zero gradients, and one device's Trainer logs loss 0 and gradient norm 0 there and goes on, so
    the weight is 0 rather than 0 / 0."""
    return micro_batch_targets / step_targets if step_targets > 0 else 0.0


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


class SequenceParallelTrainer(SequenceParallelTrainerMixin, Trainer):
    """transformers' ``Trainer`` with seqmesh sequence parallelism (see the module docstring)."""
