"""The one place a model is put together for sequence-parallel training.

``parallelize_model(model, mesh, plan)`` applies every transformation seqmesh makes to a transformers
model, in this order (each step sees the model the previous one left):

    1. sequence parallelism   attention layers run Ulysses / ring / USP, Gated DeltaNet layers pass
                              their state along the sequence (``seqmesh.hf.parallelize``)
    1b. expert parallelism    with ``ep > 1``, each MoE layer's routed experts split over expert groups of
                              ``ep`` token ranks, tokens dispatched to them and back (``seqmesh.experts``)
    2. the loss               ``SequenceParallelLM``: the LM head and cross-entropy in chunks, over the
                              sequence shards, the mean of every valid target of the whole batch
    3. memory techniques      activation checkpointing, tiled MLP, the lean RMSNorm: each replaces a
                              layer's forward, so they come after the layers are final
    4. tensor parallelism     the innermost mesh axis (``mesh.tp``), inside Ulysses: DTensor shards the
                              projections, the embedding and the LM head, with sequence-parallel norms
                              between them (``seqmesh.tensor_parallel``); before FSDP2, which shards the
                              DTensor weights further (2-D FSDP x TP)
    5. (torch.compile)        per decoder layer, once no later step changes what a layer runs
    6. FSDP2                  over dp_shard x ring x ulysses (every rank of a replica), last: it wraps
                              what the steps above produced; split experts over the ranks holding the same ones

Rank 0 logs the mesh and each step it applies, one line each, on the ``seqmesh.compose`` logger at INFO
(``parallelize: mesh ...``, ``parallelize: 1/4 sequence parallelism ...``).

The job (``seqmesh train``), the Trainer and a user's own loop call it; nothing else composes. Weights
are loaded or materialized after it (FSDP2 shards are allocated by step 6); the activation offload and
the memory tracker act on a step, not on the model, and are set up by the loop that runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from .comm.ranks import is_rank0
from .hf import parallelize
from .hf.compressed_attention import is_compressed
from .hf.indexed_attention import is_indexed
from .hf.indexed_layouts import is_block_sparse
from .experts.layers import apply_expert_parallel, check_family, routed_experts
from .experts.mesh import expert_mesh
from .experts.rules import check_expert_parallel
from .memory.rmsnorm import enable_efficient_norm
from .memory.tiled_mlp import enable_tiled_mlp
from .mesh import SPMesh
from .rules.settings import RunSettings
from .model.fsdp import apply_fsdp, enable_checkpointing
from .model.lm import SequenceParallelLM, decoder_layers
from .tensor_parallel.plan import apply_tensor_parallel, check_tensor_parallel
from .vision.families import is_multimodal
from .vision.tower import VisionLanguageLM

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ParallelPlan(RunSettings):
    """What :func:`parallelize_model` applies: the run's settings (:class:`seqmesh.rules.settings.RunSettings`,
    checked there), with FSDP2 on unless ``fsdp=False``. Sequence parallelism is always applied; the degrees are the
    mesh's (a degree given here must match it); ``offload_checkpoints`` acts on a step and is set up by the loop that
    runs it (``seqmesh.training.step.step_offload``). Without FSDP2, ``bf16`` is the loop's autocast (as
    ``seqmesh train`` does on CUDA) rather than FSDP2's mixed precision."""

    fsdp: bool = True
    """Shard weights, gradients and optimizer state with FSDP2 over every rank of a replica."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_runnable()
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"fsdp={self.fsdp!r}: parallelize_model needs True or False (TrainConfig.uses_fsdp "
                             "resolves an unset one).")


def parallelize_model(model: nn.Module, mesh: SPMesh, plan: ParallelPlan = ParallelPlan(), *,
                      wrapper: type[SequenceParallelLM] | None = None) -> SequenceParallelLM:
    """``model`` (a transformers causal LM, or a vision-language model of ``seqmesh.vision.families``) ready to
    train on ``mesh``: the steps of the module docstring, in order. Returns the ``wrapper`` (by default a
    ``SequenceParallelLM``, a ``VisionLanguageLM`` for a vision-language model) whose forward on
    ``seqmesh.shard_batch(batch, mesh, model=...)`` is the batch's exact loss."""
    if wrapper is None:
        wrapper = VisionLanguageLM if is_multimodal(model.config) else SequenceParallelLM
    given = {name: getattr(plan, name) for name in ("ulysses", "ring", "dp", "dp_replicate", "tp")}
    meshed = {"ulysses": mesh.ulysses, "ring": mesh.ring, "dp": mesh.dp_shard, "dp_replicate": mesh.dp_replicate,
              "tp": mesh.tp}
    differ = [f"{k}={v} (the mesh has {meshed[k]})" for k, v in given.items()
              if v != "auto" and v != meshed[k] and not (k in ("dp_replicate", "tp") and v == 1)]
    if differ:
        raise ValueError(f"the plan's degrees are not the mesh's: {', '.join(differ)}. Build the mesh with those "
                         "degrees, or leave them out of the plan (the mesh decides).")
    if plan.compile and any(is_indexed(m) or is_block_sparse(m) or is_compressed(m) for m in model.modules()):
        raise ValueError("compile=True with DeepSeek Sparse Attention, DeepSeek-V4's compressed attention or "
                         "MiniMax-M3's block-sparse layers: seqmesh "
                         "selects each block of queries' keys in Python from the layout (how many keys a block "
                         "scores), which torch.compile would cut into many graphs. Turn compile off (--no-compile) "
                         "for this model.")
    if mesh.tp > 1:  # refused before any work: what the tensor-parallel layers cannot split
        if plan.linear_attention == "state_passing":
            raise ValueError(f"linear_attention='state_passing' with tp={mesh.tp}: the tensor-parallel Gated DeltaNet "
                             "layers run the all-to-all design only; use linear_attention='all_to_all' or 'auto'.")
        check_tensor_parallel(model, mesh)
        if plan.fsdp and mesh.dp_replicate > 1 and not hasattr(type(mesh.device_mesh), "_concatenate"):
            import torch

            raise ValueError(f"HSDP (dp_replicate={mesh.dp_replicate}) with tensor parallelism needs torch 2.10 or later "
                             f"(this is {torch.__version__}): FSDP2 needs its 2-D mesh and the TP mesh cut from one mesh, "
                             "which older releases cannot build. Upgrade torch, or use dp_replicate=1 (FSDP2 over every "
                             "data and sequence rank).")
    experts = None
    if plan.ep > 1:  # refused before any work, on every rank alike (the rule the planner calls too)
        check_family(model, plan.ep)
        check_expert_parallel(plan.ep, experts=routed_experts(model), token_ranks=mesh.batch_mesh.size(), tp=mesh.tp,
                              fsdp=plan.fsdp, compile=plan.compile, model=model.config.model_type)
        experts = expert_mesh(mesh, plan.ep)
    built = _Built(model)
    ranks = mesh.dp_replicate * mesh.dp_shard * mesh.ring * mesh.ulysses * mesh.tp
    _log_rank0(f"parallelize: mesh dp_replicate={mesh.dp_replicate} dp_shard={mesh.dp_shard} ring={mesh.ring} "
               f"ulysses={mesh.ulysses} tp={mesh.tp} ({ranks} ranks)")
    steps = _steps(mesh, plan, wrapper, experts)
    for i, (line, apply) in enumerate(steps, 1):
        _log_rank0(f"parallelize: {i}/{len(steps)} {line}")
        apply(built)
    return built.module


@dataclass
class _Built:
    """What the steps have made so far: the transformers model (its layers replaced in place) and its wrapper."""

    lm: nn.Module
    module: SequenceParallelLM | None = None


def _log_rank0(line: str) -> None:
    if is_rank0():
        log.info(line)


def _steps(mesh: SPMesh, plan: ParallelPlan, wrapper: type[SequenceParallelLM],
           experts) -> list[tuple[str, Callable[[_Built], None]]]:
    """The steps :func:`parallelize_model` applies to this plan, in its order: what each one logs, and the step."""
    def sequence(b: _Built) -> None:
        b.lm = parallelize(b.lm, mesh, backend=plan.backend, linear_attention=plan.linear_attention,
                           async_ulysses=plan.async_ulysses, indexer_precision=plan.indexer_precision)

    def loss(b: _Built) -> None:
        b.module = wrapper(b.lm, mesh, chunk=plan.loss_chunk)

    def memory(b: _Built) -> None:
        if plan.checkpointing:
            enable_checkpointing(b.lm, keep_attention=plan.keep_attention)
        if plan.tiled_mlp:
            enable_tiled_mlp(b.lm, plan.mlp_tiles)
        if plan.efficient_norm and enable_efficient_norm(b.lm) == 0:
            raise ValueError(f"efficient_norm: {type(b.lm).__name__} has no Llama-style RMSNorm to replace; turn it "
                             "off.")

    checkpointing = "activation checkpointing" + (" keeping the attention outputs" if plan.keep_attention else "")
    techniques = [name for name, on in ((checkpointing, plan.checkpointing),
                                        (f"tiled MLP ({plan.mlp_tiles or 'auto'} tiles)", plan.tiled_mlp),
                                        ("lean RMSNorm", plan.efficient_norm)) if on]
    extras = [x for x, on in (("bf16", plan.bf16), ("cpu offload", plan.fsdp_cpu_offload)) if on]
    steps = [
        (f"sequence parallelism (ulysses {mesh.ulysses} x ring {mesh.ring}, attention backend {plan.backend}, "
         f"linear attention {plan.linear_attention}{', async Ulysses' if plan.async_ulysses else ''})", sequence, True),
        (f"expert parallelism (ep={plan.ep})", lambda b: apply_expert_parallel(b.lm, experts), experts is not None),
        (f"the loss ({wrapper.__name__}, {plan.loss_chunk} tokens a chunk)", loss, True),
        (f"memory techniques ({', '.join(techniques)})", memory, bool(techniques)),
        (f"tensor parallel (tp={mesh.tp})", lambda b: apply_tensor_parallel(b.lm, mesh), mesh.tp > 1),
        ("torch.compile per decoder layer", lambda b: compile_layers(b.lm), plan.compile),
        (f"FSDP2 over dp_shard x ring x ulysses = {mesh.dp_shard * mesh.ring * mesh.ulysses} ranks"
         + (f" ({', '.join(extras)})" if extras else ""),
         lambda b: apply_fsdp(b.module, mesh, bf16=plan.bf16, cpu_offload=plan.fsdp_cpu_offload, experts=experts),
         plan.fsdp),
    ]
    return [(line, apply) for line, apply, on in steps if on]


def compile_layers(model: nn.Module, **options) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (``nn.Module.compile``: the layer stays the
    same module, so FSDP2 and checkpoints see the same names); ``options`` go to ``torch.compile``. Returns
    how many layers were compiled. Each layer is one graph (seqmesh attention is a single op inside it);
    layers of the same class share the compiled code."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(**options)
    return len(layers)
