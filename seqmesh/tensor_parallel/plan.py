"""Tensor parallelism of a transformers decoder inside the sequence mesh, with torch's DTensor
(``torch.distributed.tensor.parallel``): Megatron's TP with sequence parallelism between the regions.

On a rank of tensor-parallel group ``T`` that holds a sequence shard of ``L = S / P`` tokens::

    embedding (vocabulary-parallel)       ids (B, L)            -> (B, L/T, hidden)   reduce-scatter
    norm (sequence-parallel)              (B, L/T, hidden)      -> (B, L/T, hidden)   none
    attention input                       (B, L/T, hidden)      -> (B, L, hidden)     all-gather
    q / k / v (column-wise)               (B, L, hidden)        -> (B, L, heads/T * D)
    seqmesh attention over the sequence group: Ulysses deals these heads/T heads, the ring passes K/V
    o (row-wise)                          (B, L, heads/T * D)   -> (B, L/T, hidden)   reduce-scatter
    MLP: all-gather, gate / up column-wise, down row-wise, reduce-scatter, as attention
    final norm                            (B, L/T, hidden)
    loss (vocabulary-parallel head)       all-gather, each rank its V/T logits (seqmesh.model.vocab_parallel)

So every per-token activation outside attention and the MLP is ``1 / (T x P)`` of the sequence per rank,
and each weight matrix ``1 / T`` before FSDP2 shards it further over the data and sequence ranks. Between
the regions activations are ``DTensor`` sharded on the sequence dimension; inside them, plain tensors.
Per-head parameters (Qwen3's q/k norms, gpt-oss's sinks) follow their heads.

What cannot be split is refused by :func:`check_tensor_parallel` before any work, naming the degrees
that would work.
"""

from __future__ import annotations

import torch.nn as nn

from ..comm.ranks import partial_local
from ..rules.degrees import check_tensor_parallel_sizes
from ..mesh import SPMesh
from ..model.lm import decoder_layers, decoder_of
from .linear_attention import check_heads as check_gated_delta_heads
from .linear_attention import shard_gated_delta
from .linear_attention import supports as supports_gated_delta


def check_tensor_parallel(model: nn.Module, mesh: SPMesh) -> None:
    """Raise a ValueError, before any work, for a model ``mesh.tp`` cannot split: sizes it does not divide
    (listing the degrees that would work), or layers seqmesh does not yet shard by heads (mixture of
    experts, linear attention other than Qwen3.5's Gated DeltaNet, a vision tower), naming the layer and the
    way out (``tp=1``)."""
    tp = mesh.tp
    if tp == 1:
        return
    from ..vision.families import is_multimodal

    config = model.config
    if is_multimodal(config):
        raise ValueError(f"{type(model).__name__} is a vision-language model; seqmesh's tensor parallelism covers "
                         "text decoders only so far. Train it with tp=1 (Ulysses and ring shard its tower and decoder).")
    text = config.get_text_config()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith(("Experts", "SparseMoeBlock", "MoE", "Moe")) or "MoE" in kind:
            raise ValueError(f"{name} ({kind}) is a mixture of experts, which seqmesh's tensor parallelism does not "
                             f"split yet; train with tp=1 (experts stay whole, FSDP2 shards them) or a dense model.")
        if kind.endswith("GatedDeltaNet") and supports_gated_delta(module):
            check_gated_delta_heads(module, tp, mesh.ulysses * mesh.ring)
        elif "DeltaNet" in kind or "LinearAttention" in kind:
            raise ValueError(f"{name} ({kind}) is a linear-attention layer seqmesh's tensor parallelism does not split "
                             "(it runs Qwen3.5's Gated DeltaNet, with separate q/k/v, z, b and a projections); train this "
                             "model with tp=1 (its sequence parallelism is exact).")
    from ..hf.mixers import mixer_layers  # recurrent mixers other than Gated DeltaNet: sequence-parallel only

    for kind, layers in mixer_layers(model, mesh, "auto").items():
        if kind.name != "Gated DeltaNet":
            raise ValueError(f"{layers[0][0]} ({type(layers[0][1]).__name__}) is a {kind.name} layer, which seqmesh's "
                             "tensor parallelism does not split; train this model with tp=1 (its sequence parallelism "
                             "is exact).")
    embedding = model.get_input_embeddings()
    if type(embedding).forward is not nn.Embedding.forward and _torch_release() < (2, 13):
        import torch

        raise ValueError(f"{type(embedding).__name__} computes on the looked-up rows (Gemma 3 scales them), which DTensor's "
                         f"vocabulary-parallel embedding loses track of in torch {torch.__version__} (tested from 2.13). "
                         "Upgrade torch to 2.13 or later for tensor parallelism of this model, or train it with tp=1.")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    check_tensor_parallel_sizes(tp, mesh.ulysses, heads=heads, kv_heads=kv_heads, intermediate=text.intermediate_size,
                                vocab=text.vocab_size)


def _torch_release() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _layer_plan(layer: nn.Module, kv_heads: int, tp: int) -> dict:
    """The parallel styles of one decoder layer, keyed by submodule path (names as transformers' Llama,
    Qwen3, Mistral, Gemma 3 and their relatives spell them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {}
    for name, child in layer.named_children():  # every norm of the layer runs on the sequence slices
        if type(child).__name__.endswith(("RMSNorm", "LayerNorm")):
            plan[name] = SequenceParallel()
    attn, mlp = getattr(layer, "self_attn", None), layer.mlp
    if attn is not None:  # else a Gated DeltaNet layer, which takes and returns the sequence slices itself
        plan.update(_attention_plan(attn, kv_heads, tp))
    plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for proj in ("gate_proj", "up_proj"):
        if getattr(mlp, proj, None) is not None:
            plan[f"mlp.{proj}"] = ColwiseParallel()
    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    missing = [p for p in plan if not _has_submodule(layer, p)]
    if missing or (attn is not None and not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))):
        raise ValueError(f"{type(layer).__name__} does not have the q/k/v/o and gate/up/down projections seqmesh's "
                         "tensor parallelism splits; train it with tp=1.")
    return plan


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _attention_plan(attn: nn.Module, kv_heads: int, tp: int) -> dict:
    """The parallel styles of an attention block, keyed by path from the decoder layer."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {}
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
    plan["self_attn.q_proj"] = ColwiseParallel()
    if kv_heads % tp == 0:
        plan["self_attn.k_proj"] = plan["self_attn.v_proj"] = ColwiseParallel()
    # else: fewer kv heads than ranks, see _replicate_key_value (applied after)
    plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    for norm in ("q_norm", "k_norm"):  # per-head norms (Qwen3, Gemma 3) on (B, L, heads/T, D): this rank's heads
        if getattr(attn, norm, None) is not None:
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _replicate_key_value(attn: nn.Module, mesh: SPMesh, heads: int, kv_heads: int, head_dim: int) -> None:
    """Fewer kv heads than tensor-parallel ranks (``tp`` a multiple of them; MQA): k_proj and v_proj stay whole
    on every rank (replicated DTensors) and each rank keeps the columns of the one kv head its query heads
    read, rank ``t`` head ``t // (tp / kv_heads)``. Each rank's gradient then covers its own head's columns
    only: the kept output's gradient is marked partial, so the weights' gradients are summed over the group
    (as a norm's are) and the input's join the column-parallel projections' partial sums."""
    from torch.distributed.tensor import DTensor, Replicate

    tp = mesh.tp
    head = mesh.tp_rank // (tp // kv_heads)
    keep = slice(head * head_dim, (head + 1) * head_dim)

    def one_head(module, args, out):  # out: a Replicate DTensor (B, L, kv_heads * head_dim)
        return partial_local(out)[..., keep]

    for proj in (attn.k_proj, attn.v_proj):
        for name, p in list(proj.named_parameters(recurse=False)):
            whole = DTensor.from_local(p.data, mesh.tp_mesh, [Replicate()], run_check=False)  # the same on every rank
            proj.register_parameter(name, nn.Parameter(whole, requires_grad=p.requires_grad))
        proj.register_forward_hook(one_head)


def _shard_sinks(attn: nn.Module, mesh: SPMesh) -> None:
    """gpt-oss's per-head sinks: each rank keeps those of its heads (the attention function reads the local part)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, nn.Parameter):
        attn.sinks = nn.Parameter(distribute_tensor(sinks.data, mesh.tp_mesh, [Shard(0)]), requires_grad=sinks.requires_grad)


def apply_tensor_parallel(lm: nn.Module, mesh: SPMesh) -> nn.Module:
    """Shard ``lm`` (a transformers causal LM, parallelized by ``seqmesh.hf``) over ``mesh.tp_mesh`` as the
    module docstring lays out; a no-op for ``mesh.tp == 1``. Returns ``lm``. Run before FSDP2 (which then
    shards each DTensor weight over the data and sequence ranks: 2-D FSDP x TP)."""
    if mesh.tp == 1:
        return lm
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    check_tensor_parallel(lm, mesh)
    tp_mesh = mesh.tp_mesh
    decoder = decoder_of(lm)
    head = lm.get_output_embeddings()
    tied = head is not None and head.weight is lm.get_input_embeddings().weight
    parallelize_module(lm.get_input_embeddings(), tp_mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False))
    parallelize_module(decoder.norm, tp_mesh, SequenceParallel())
    if head is not None:  # called only by the model's own forward: whole-vocabulary logits of this shard's tokens
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
        if tied:  # both are Shard(0) over the vocabulary: one parameter again
            head.weight = lm.get_input_embeddings().weight
    text = lm.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    for layer in decoder_layers(lm):
        parallelize_module(layer, tp_mesh, _layer_plan(layer, kv_heads, mesh.tp))
        attn = getattr(layer, "self_attn", None)
        if attn is not None and kv_heads % mesh.tp:
            _replicate_key_value(attn, mesh, heads, kv_heads, head_dim)
        if attn is not None:
            _shard_sinks(attn, mesh)
        for module in layer.modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                shard_gated_delta(module, mesh)
    return lm
