"""Weights sharded with FSDP2 over the data-parallel and sequence-parallel ranks together.

The sequence ranks hold different tokens of the same samples and the data-parallel ranks hold
different samples; with the loss of ``seqmesh.model.loss`` (each rank's gradient is its share of the
one-device gradient) the right reduction over all of them is a *sum*. FSDP2 averages by default,
which would scale gradients by 1 / (dp x sp), so seqmesh sets its divide factor to 1.

Order of wrapping (as torchtitan does): sequence parallelism (``seqmesh.hf.parallelize``), then
activation checkpointing, then FSDP2 per decoder layer and at the root.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.ranks import full_value
from ..comm.collectives import all_reduce_
from ..mesh import SPMesh
from ..sharded_attention.kept import kept_attention_contexts
from ..rules.own_attention import checkpointing_refusal
from .lm import SequenceParallelLM, decoder_layers, vision_blocks

if TYPE_CHECKING:
    from ..experts.mesh import ExpertMesh


def enable_checkpointing(lm: nn.Module, keep_attention: bool = False) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations (transformers'
    own non-reentrant checkpointing; active in training mode). With ``keep_attention`` each layer keeps its
    attention's output from the forward and the recompute skips the attention (``seqmesh.sharded_attention.kept``).
    transformers 5.24 renamed the method (``activation_checkpointing_enable``; the old name warns at every call and
    goes in v6)."""
    if not getattr(lm, "supports_gradient_checkpointing", True):  # transformers' own refusal names no way out
        raise ValueError(checkpointing_refusal(type(lm).__name__) + ".")
    kwargs = {"use_reentrant": False} | ({"context_fn": kept_attention_contexts} if keep_attention else {})
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def keep_attention_problem(kwargs: dict | None) -> str | None:
    """Why checkpoints made with transformers' ``kwargs`` (a Trainer's ``activation_checkpointing_kwargs``; None: its
    default) cannot keep the attention outputs, or None: the kept outputs travel in the checkpoint's ``context_fn``,
    which must be seqmesh's, and which torch takes only in its non-reentrant checkpoint (transformers' default; where
    the kwargs leave it unsaid, keeping sets it)."""
    kwargs = kwargs or {}
    if kwargs.get("context_fn") not in (None, kept_attention_contexts):
        return (f"the checkpoint kwargs already give a context_fn ({kwargs['context_fn']!r}), and keeping the "
                "attention outputs needs seqmesh's own; remove it")
    if kwargs.get("debug"):
        return "the checkpoint kwargs ask for debug=True, which torch runs only without a context_fn; drop it"
    if kwargs.get("use_reentrant") is True:
        return ("the checkpoint kwargs ask for use_reentrant=True, torch's reentrant checkpoint, which takes no "
                "context_fn; drop it or give \"use_reentrant\": False")
    return None


def keep_attention_in_checkpoints(lm: nn.Module, option: str = "keep_attention") -> int:
    """Each layer of ``lm`` that transformers checkpoints (whatever enabled it last: a Trainer enables it again with its
    own arguments when it starts training) keeps its attention outputs from now on: seqmesh's contexts are added to the
    checkpoint function transformers set on it, its other arguments (and ``every_n_layers``' choice of layers) as they
    were. Returns how many decoder layers now keep; refuses what :func:`keep_attention_problem` names, naming
    ``option`` (the setting that asked for keeping)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = 0
    for module in lm.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if not isinstance(fn, functools.partial):
            raise ValueError(f"{type(module).__name__} checkpoints through {fn!r}, not transformers' partial of "
                             "torch.utils.checkpoint.checkpoint; keeping the attention outputs cannot reach it. Turn "
                             f"{option} off for this model.")
        problem = keep_attention_problem(fn.keywords)
        if problem is not None:
            raise ValueError(f"{option}: {problem}.")
        keywords = {**fn.keywords, "use_reentrant": False, "context_fn": kept_attention_contexts}
        module._gradient_checkpointing_func = functools.partial(fn.func, *fn.args, **keywords)
        layers += isinstance(module, GradientCheckpointingLayer)
    return layers


def _sum_not_average(module: nn.Module) -> None:
    module.set_gradient_divide_factor(1.0)  # torch >= 2.8 (the floor is 2.9.1): covers the replicate all-reduce too
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:  # plain SUM collectives: gloo has no PREMUL_SUM, and NCCL's SUM is zero-copy
        force_sum(True)


def float32_modules(lm: nn.Module) -> list[nn.Module]:
    """The largest modules of ``lm`` all of whose parameters its family keeps in float32 in a bfloat16 model
    (transformers' ``_keep_in_fp32_modules_strict``, its names read as regular expressions over the parameters' names,
    as transformers reads them): Inkling 2's router, whose input it casts to float32, and its block residuals and
    convolutions; HY-V4's and DeepSeek-V4's hyper-connections. Not the embeddings or the LM head (HY-V4's): the loss
    reads the head's weight outside its forward, so it is gathered with the root, in bfloat16."""
    import re

    keep = getattr(lm, "_keep_in_fp32_modules_strict", None) or ()
    if not keep:
        return []
    pattern = re.compile("|".join(name.replace("*", ".*") for name in keep))
    strict = {id(p) for name, p in lm.named_parameters() if pattern.search(name)}
    found: list[nn.Module] = []
    # never the embeddings: the loss reads the head's weight outside the head's forward (HY-V4 keeps its head in
    # float32), where a unit of its own would still be sharded; they stay with the root, gathered for the step
    embeddings = {id(lm.get_input_embeddings()), id(lm.get_output_embeddings())}

    def visit(module: nn.Module) -> None:
        if id(module) in embeddings:
            return
        params = list(module.parameters())
        if params and all(id(p) in strict for p in params):
            found.append(module)  # the module whose forward runs (a conv's parent, which reads its weight), not below
            return
        for child in module.children():
            visit(child)

    visit(lm)
    return found


def _other_dtype_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` whose own weights have another dtype than most of the layer's (DeepSeek-V3's router,
    kept in float32 by transformers in a bfloat16 or float64 model): each is an FSDP2 unit of its own."""
    from torch.distributed.fsdp import FSDPModule

    if len({p.dtype for p in layer.parameters()}) < 2:
        return []
    main = _main_dtype(layer)
    odd = []
    for module in layer.modules():
        own = {p.dtype for p in module.parameters(recurse=False) if p.requires_grad}  # FSDP2's rule: trainable ones
        if own and own != {main} and not isinstance(module, FSDPModule):
            if len(own) > 1:
                raise ValueError(f"{type(module).__name__} holds weights of dtypes {sorted(map(str, own))}; FSDP2 "
                                 "shards one dtype per unit. Cast the model to one dtype, or turn FSDP off.")
            odd.append(module)
    # innermost first (ERNIE-4.5-MoE's float32 router holds its float32 score-correction module): FSDP2 then leaves a
    # nested unit's weights to it, where sharding the outer one first made them DTensors the inner one refused
    return odd[::-1]


def _check_one_dtype_per_unit(lm: nn.Module, layers: list[nn.Module]) -> None:
    """Raise, before anything is sharded, where FSDP2 would meet weights of two dtypes in one unit (its own assertion
    comes at the first forward): a module whose own weights have another dtype than its children's (HY-V4's float32
    attention sinks beside its projections), or the root's (HY-V4's float32 LM head beside its final norm)."""
    def problem(where: str, dtypes: dict) -> ValueError:
        listed = "; ".join(f"{dtype}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                           for dtype, names in sorted(dtypes.items(), key=lambda kv: str(kv[0])))
        return ValueError(f"{where} holds weights of more than one dtype ({listed}), which FSDP2 cannot shard as one "
                          "unit (transformers keeps some of a family's weights in float32 whatever the model's dtype). "
                          "Load the model in float32 (seqmesh's --bf16 computes in bfloat16 from float32 weights), "
                          "or turn FSDP off.")

    def dtypes_of(named) -> dict:  # of the trainable weights: FSDP2 leaves frozen ones out of its rule
        found: dict = {}
        for name, p in named:
            if p.requires_grad:
                found.setdefault(p.dtype, []).append(name)
        return found

    elsewhere = {id(p) for layer in layers for p in layer.parameters()}
    embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:  # an untied embedding is a unit of its own
        elsewhere.add(id(embedding.weight))
    for layer in layers:
        main = _main_dtype(layer)
        for name, module in layer.named_modules():
            own = {p.dtype for p in module.parameters(recurse=False) if p.requires_grad}
            below = dtypes_of((f"{name}.{n}", p) for n, p in module.named_parameters()
                              if p.dtype == main and "." in n)
            if own and main not in own and below:
                own_named = dtypes_of((f"{name}.{n}", p) for n, p in module.named_parameters(recurse=False))
                raise problem(f"{type(module).__name__} ({name})", {**below, **own_named})
    rest = dtypes_of((n, p) for n, p in lm.named_parameters() if id(p) not in elsewhere)
    if len(rest) > 1:
        raise problem(f"{type(lm).__name__} outside its layers", rest)


def _main_dtype(layer: nn.Module) -> torch.dtype | None:
    """The dtype of most of ``layer``'s weights (by elements)."""
    sizes: dict[torch.dtype, int] = {}
    for p in layer.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.get) if sizes else None


def units_of(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """``layers`` as FSDP units, in order: each layer alone, but layers that hold the same parameter (Zamba's hybrid
    layers share one attention block's weights) together in one unit, since a parameter may belong to one unit only."""
    owner: dict[int, int] = {}  # parameter -> the first layer that holds it
    group = list(range(len(layers)))  # each layer's unit: the first layer of its unit

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i, layer in enumerate(layers):
        for p in layer.parameters():
            first = owner.setdefault(id(p), i)
            a, b = root(first), root(i)
            group[max(a, b)] = min(a, b)
    units: dict[int, list[nn.Module]] = {}
    for i, layer in enumerate(layers):
        units.setdefault(root(i), []).append(layer)
    return list(units.values())


def apply_fsdp(root: nn.Module, mesh: SPMesh, *, bf16: bool = False, reshard_after_forward: bool = True,
               cpu_offload: bool = False, experts: "ExpertMesh | None" = None) -> nn.Module:
    """Shard ``root`` (e.g. a ``SequenceParallelLM``) with ``fully_shard`` over ``mesh.fsdp_mesh``:
    each decoder layer on its own (layers that share weights, Zamba's hybrid layers, together:
    :func:`units_of`); each vision-tower block on its own (in a step where any rank's batch
    has an image every rank runs the tower, on padding if it has none; in one where none has, no rank
    does); an untied input embedding on its own (gathered only for its forward and backward, at the two
    ends of the step); the rest (final norm, LM head, a tied embedding) at the root, which stays gathered
    for the step because the loss reads the head's weight inside it.

    ``bf16``: parameters gathered and computed in bfloat16, gradients reduced in float32, float32
    master weights and optimizer states; the modules the family keeps in float32 (:func:`float32_modules`) are units
    of their own, gathered in float32 and given their inputs as they come, but not an LM head kept in float32 (HY-V4's):
    it stays with the root and is gathered in bfloat16 (transformers computes it in float32).

    ``cpu_offload``: sharded parameters, gradients and optimizer state live in (pinned) host memory; each
    unit's parameters are copied to the device for its all-gather (torch's ``CPUOffloadPolicy``), and the
    optimizer steps on the CPU.

    ``experts``: the expert groups of a model whose experts ``seqmesh.experts`` split; each experts module is a
    unit of its own, sharded over the ranks that hold the same experts (``ExpertMesh.shard_mesh``).
    """
    from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                        register_fsdp_forward_method)

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    shard = dict(mesh=mesh.fsdp_mesh, mp_policy=policy, offload_policy=offload)
    lm = getattr(root, "lm", root)
    _check_one_dtype_per_unit(lm, vision_blocks(lm) + decoder_layers(lm))
    if bf16:  # first: the units holding them then leave their weights to them
        wide = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for module in float32_modules(lm):
            fully_shard(module, reshard_after_forward=reshard_after_forward, **{**shard, "mp_policy": wide})
    if experts is not None:  # before their layers: a layer's unit then leaves the experts' weights to them
        from ..experts.layers import experts_modules

        for module in experts_modules(lm):
            fully_shard(module, reshard_after_forward=reshard_after_forward, **{**shard, "mesh": experts.shard_mesh})
    for unit in units_of(vision_blocks(lm) + decoder_layers(lm)):
        for odd in (m for layer in unit for m in _other_dtype_modules(layer)):  # FSDP2 needs one dtype per unit
            fully_shard(odd, reshard_after_forward=reshard_after_forward, **shard)
        fully_shard(unit[0] if len(unit) == 1 else unit, reshard_after_forward=reshard_after_forward, **shard)
    family = getattr(root, "family", None)  # a VisionLanguageLM's
    method = family.attach_layer_steps(vision_blocks(lm)) if family is not None else None
    if method is not None:  # tower layers seqmesh runs from their modules: gathered around that call as for forward
        for layer in vision_blocks(lm):
            register_fsdp_forward_method(layer, method)
    embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:  # a tied weight must stay in one unit
        fully_shard(embedding, reshard_after_forward=reshard_after_forward, **shard)
    # the root's backward starts at once with the loss, which needs the head: keep it gathered (one
    # all-gather per step, not a reshard and a second all-gather)
    fully_shard(root, reshard_after_forward=False, **shard)
    if isinstance(root, SequenceParallelLM):  # its score() reads the weights outside forward: gather them for it too
        register_fsdp_forward_method(root, "score")
    for module in root.modules():
        if isinstance(module, FSDPModule):
            _sum_not_average(module)
    return root


def settle_partial_gradients(module: nn.Module) -> None:
    """Tensor parallelism leaves the gradient of a weight it replicates (a norm's, used on every rank's slice of
    the tokens) as a pending sum over the tensor-parallel group (DTensor ``Partial``): sum it into the weight's
    own placement (an all-reduce). FSDP2 does this itself when it reduces; a loop without FSDP calls this
    (through :func:`sync_gradients`) before reading, clipping or stepping on the gradients."""
    from torch.distributed.tensor import DTensor, Partial

    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def sync_gradients(module: nn.Module, mesh: SPMesh, bucket_bytes: int = 64 << 20) -> None:
    """Without FSDP: sum every gradient over the ranks that hold different tokens (all ranks of the mesh but the
    tensor-parallel axis), in flat buckets."""
    settle_partial_gradients(module)
    group = mesh.batch_group
    world = dist.get_world_size(group)
    if world == 1:
        return
    # tensor parallelism: each rank sums its own slices (DTensor gradients, local parts), over the ranks that
    # hold other tokens of the same slices (the batch group: every rank with the same tp coordinate)
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in module.parameters() if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes or i == len(grads) - 1:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            all_reduce_(flat, group, phase="backward")
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            bucket, size = [], 0


def gradients_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` grouped by their gradient's device mesh (plain tensors in one group), in order of first
    appearance (the same on every rank: the groups' norms are collectives)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def gradient_norm(parameters: Iterable[torch.Tensor], max_norm: float = float("inf")) -> torch.Tensor:
    """The 2-norm of the whole gradient (every shard of every parameter; a plain tensor, also under FSDP2),
    clipping the gradients to ``max_norm`` only when it is finite (no multiply-by-1 over every gradient).

    torch's norm and clip stack their DTensors, which must share one mesh; with expert parallelism the experts'
    gradients live on their own 2-D mesh: each mesh's part is taken whole over its mesh, the parts combined (the
    square root of the sum of their squares: inf or NaN if any is), and every gradient clipped by that one norm."""
    from torch.nn.utils import get_total_norm

    params = [p for p in parameters if p.grad is not None]
    groups = gradients_by_mesh(params)
    if len(groups) <= 1:  # one mesh (or none): torch's own lines, as they were
        norm = full_value(get_total_norm([p.grad for p in params]))
    else:
        parts = [full_value(get_total_norm([p.grad for p in group])) for group in groups]
        dtype = functools.reduce(torch.promote_types, [part.dtype for part in parts])
        norm = torch.linalg.vector_norm(torch.stack([part.to(parts[0].device, dtype) for part in parts]))
    if max_norm != float("inf"):
        clip_to_norm([p.grad for p in params], max_norm, norm)
    return norm


def clip_to_norm(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip (every gradient times ``max_norm / (norm + 1e-6)`` when that is below 1) applied to each
    DTensor's own shard: a product is the same on every placement, and the shards' one foreach call per device
    skips DTensor's dispatch, whose sharding cache misses this list of gradients with a plain tensor factor."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        local = getattr(grad, "_local_tensor", grad)
        by_device.setdefault(local.device, []).append(local)
    for device, locals_ in by_device.items():
        torch._foreach_mul_(locals_, coef.to(device))
