"""Bytes one GPU holds at its peak during a training step, by purpose: the largest of the step's ``MOMENTS``. What
each moment holds and what was checked: docs/planner.md ("Memory moments"); what each op saves: :mod:`.activations`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from .activations import (ATTENTION_STEPS, TILED_RECOMPUTE, attention_backward_bytes, efficient_norm, final_norm_bytes,
                          gated_residual_saved, gathered_tokens, hyper_connection_backward_bytes, kept_attention_bytes,
                          layer_backward_timeline, layer_input_bytes, local_tokens, mlp_tile_tokens, norm_saved,
                          outside_layers_bytes, timeline_peak, tokens)
from .expert_activations import dense_layer, first_layer
from .depth_states import block_states_bytes, messages_bytes
from .inkling2 import layers_saved_bytes
from .experts import local_layer_params, sharded_params, unit_shard
from .attention_layer import Attention
from .layers import IndexedAttention, layer_kinds
from .placement import placement
from .traffic import dtype_bytes
from ..rules.degrees import Degrees
from .workload import Workload

MASTER, GRAD_SHARD, ADAM = 4, 4, 8  # bytes per parameter held sharded
HYPER_CONNECTION_BACKWARD = "hyper-connection backward"  # :func:`.activations.hyper_connection_backward_bytes`
MOMENTS = ("loss forward", "loss backward", "layer backward", "first layer backward", "end of backward",
           "optimizer step")

__all__ = ["MOMENTS", "MemoryBreakdown", "memory_at", "memory_per_gpu", "parameter_memory", "host_memory",
           "activation_memory", "loss_memory", "end_of_backward_grads", "held_reduce_scatter_input", "local_tokens",
           "layer_saved_bytes", "mlp_tile_tokens", "optimizer_temporaries"]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU at one moment of the step (``moment``), by purpose; ``total`` adds them."""

    weights: int  # fp32 shards (or, offloaded, the gathered units' shards) + gathered compute-dtype copies
    grads: int  # fp32 gradient shards + the unsharded gradients alive at this moment
    optimizer: int  # AdamW first and second moments, fp32, sharded, and the step's temporaries
    activations: int  # tensors saved for backward + backward buffers alive at this moment
    attention: int  # attention backward's buffers, when the peak falls inside it (else under activations)
    logits: int  # the chunked loss's working set (at the loss)
    reserved: int  # CUDA context, communication buffers, allocator slack
    moment: str = "layer backward"  # one of MOMENTS

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations + self.attention + self.logits
                + self.reserved)

    def as_dict(self) -> dict[str, int]:
        """Bytes by purpose and their total (the moment is left out: every value is an int)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "moment"}, "total": self.total}


def end_of_backward_grads(work: Workload, layout: Degrees) -> dict[str, int]:
    """Unsharded gradient bytes per GPU at each reduce-scatter of the end of backward: ``embedding`` (an untied
    embedding's, beside the root's; absent when tied) and ``root`` (last), as docs/planner.md ("Memory") says."""
    e, split = work.act_bytes, placement(work, layout).split
    root, emb = split["root"], split["embedding"]
    reduce_copy = 4 if e != 4 else 0
    out = {"root": root * (e + reduce_copy)}
    if emb:
        out = {"embedding": root * e + emb * (e + reduce_copy), **out}
    return out


def held_reduce_scatter_input(work: Workload, layout: Degrees) -> int:
    """Bytes of the float32 reduce-scatter input (the layer's unsharded gradients, in the reduce dtype) that FSDP2
    keeps after a layer's gradients are reduce-scattered, through the whole backward of the layer below it. torch
    2.13's ``FSDPParamGroup.post_backward`` appends it to ``comm_ctx.reduce_scatter_states``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, ``reduce_scatter_states.append(ReduceScatterState(
    reduce_scatter_input, ...))``) and pops it only at the next group's ``post_backward``, once that layer's own
    gradients are done (``reduce_scatter_max_input_buffers`` 1), on CUDA and CPU alike. The rehearsal of Llama-3-8B
    (8 ranks, Ulysses 8, 131,072 tokens) measured it: one 872 MB float32 storage of the layer above in every layer's
    backward but the top one's. Counted at the first layer's backward; ``layer backward`` (the top layer) has none:
    the layer under it peaks 0.847 GB higher there (this buffer and the top's gradient shard, one kept input less),
    but the top layer's moment already counts all its weight gradients where only ``down_proj``'s exist at the MLP
    peak (0.32 GB over at 8B), and on real CPU steps of small models (tests/planner/test_planner_measured.py) adding
    it to every layer over-predicts by up to 8%: modelling both needs the weight gradients in the timeline."""
    m = work.model
    graded = placement(work, layout).split["graded_layer"]  # TrOCR's cross-attention gets no gradient
    return dtype_bytes(work.reduce_dtype) * local_layer_params(graded, m, layout)


def optimizer_temporaries(work: Workload, layout: Degrees, shard: int) -> int:
    """Bytes AdamW allocates during its step beside the moments, for ``shard`` parameters a GPU: none on the fused
    kernel (seqmesh train's, ``training.step.make_optimizer``: each parameter updated in place), one float32 copy of
    every parameter on the foreach path (its ``_foreach_sqrt`` of the second moments), two of the largest
    parameter's on the per-tensor path."""
    if work.optimizer == "fused":
        return 0
    if work.optimizer == "foreach":
        return 4 * shard
    m = work.model
    return 2 * 4 * -(-max(m.vocab * m.hidden, m.hidden * m.intermediate) // (layout.tp * layout.fsdp_group))


def parameter_memory(work: Workload, layout: Degrees, moment: str = "layer backward") -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per GPU at ``moment``, as docs/planner.md ("Memory") says FSDP2 holds them
    (at the loss the LM head's gradient is still the loss's accumulator, counted in :func:`loss_memory`)."""
    if moment not in MOMENTS:
        raise ValueError(f"moment {moment!r}: choose one of {', '.join(MOMENTS)}.")
    m, e, split = work.model, work.act_bytes, placement(work, layout).split
    shard = sharded_params(m, layout, split["total"])
    root = split["root"]
    layer = local_layer_params(split["layer"], m, layout)  # under EP a rank gathers only its own experts
    prefetch = layout.fsdp_group > 1  # the next unit's all-gather, issued during this layer's backward; in the
    # loss's backward the last layer's, which FSDP2's root prefetches as backward starts (measured: Llama-3-8B's
    # 436 MB bf16 layer alive at the loss backward's peak, at 131,072 and 1,048,576 tokens); in the loss's forward
    # the last layer's all-gather output, which FSDP2 frees only at the next all-gather (measured: a rehearsed
    # TrOCR's, whose loss forward is its peak)
    layers = {"loss forward": 1 if prefetch else 0, "loss backward": 1 if prefetch else 0,
              "layer backward": 2 if prefetch else 1, "first layer backward": 1}.get(moment, 0)
    gathered = 0 if moment == "optimizer step" else root + layers * layer
    if moment == "first layer backward" and prefetch:  # the next unit is the input embedding's (untied; measured:
        gathered += split["embedding"]  # its 1.05 GB bf16 all-gather of Llama-3-8B during layer 0's backward)
    graded = local_layer_params(split["graded_layer"], m, layout)  # what of it gets a gradient
    unsharded = {"layer backward": (root + graded) * e, "first layer backward": (root + graded) * e,
                 "end of backward": max(end_of_backward_grads(work, layout).values())}.get(moment, 0)
    if moment == "layer backward":  # Zamba's shared-block units, gathered with their gradients through the backward
        gathered, unsharded = gathered + split["held"], unsharded + split["held"] * e  # of the layers that run them
    grad_shards = 0
    if moment in ("end of backward", "optimizer step"):
        grad_shards = GRAD_SHARD * sharded_params(m, layout, split["graded_total"])
    if moment == "first layer backward" and m.layers > 1:  # the layers above have been reduce-scattered (and Zamba's
        # shared-block units)
        grad_shards = (GRAD_SHARD * ((m.layers - 1) * unit_shard(split["graded_layer"], m, layout)
                                     + unit_shard(split["held"], m, layout)) + held_reduce_scatter_input(work, layout))
    step_temps = optimizer_temporaries(work, layout, shard) if moment == "optimizer step" else 0
    if work.fsdp_cpu_offload:  # the shards live on the host; the gathered units' fp32 shards are copied in
        copied = (-(-gathered // layout.fsdp_group) if layout.ep == 1 or not gathered else
                  -(-(gathered - layers * layer) // layout.fsdp_group) + layers * unit_shard(split["layer"], m, layout))
        return gathered * e + MASTER * copied, unsharded, 0
    return MASTER * shard + gathered * e, grad_shards + unsharded, ADAM * shard + step_temps


def host_memory(work: Workload, layout: Degrees) -> int:
    """Host bytes per GPU the techniques need: FSDP2's offloaded fp32 shards, gradients and AdamW moments,
    and the offloaded checkpointed inputs with the final norm's saved tensors."""
    m, e = work.model, work.act_bytes
    host = 0
    if work.fsdp_cpu_offload:
        host += (MASTER + GRAD_SHARD + ADAM) * sharded_params(m, layout, placement(work, layout).split["total"])
    if work.offload_checkpoints:
        final_norm = e * m.hidden if efficient_norm(work) else norm_saved(m, e)  # the efficient norm's rstd stays
        host += m.layers * layer_input_bytes(work, layout) + tokens(work, layout) * final_norm
    return host


def layer_saved_bytes(work: Workload, layout: Degrees) -> int:
    """Bytes one layer keeps for backward on one GPU: the largest of the model's layer kinds."""
    return max(kind.saved_bytes() for kind, _ in layer_kinds(work, layout))


def shared_picks_bytes(work: Workload, layout: Degrees) -> int:
    """The indexer's picks (int64, ``top-k`` a token) that layers sharing the previous layer's selection (GLM-5's,
    HY-V4's ``indexer_types`` "shared") take as an input, which checkpointing keeps with their hidden states: one
    tensor a run of shared layers."""
    lat = work.model.latent
    if lat is None or not lat.shared_runs:
        return 0
    return lat.shared_runs * selection_bytes(work, layout)


def selection_bytes(work: Workload, layout: Degrees) -> int:
    """One sparse layer's selection: ``top-k`` int64 indices a token of this GPU."""
    return tokens(work, layout) * min(work.model.latent.index_topk, work.seq_len) * 8


def kept_outputs_bytes(work: Workload, layout: Degrees, at_loss: bool) -> int:
    """What ``keep_attention`` keeps on the device (:mod:`seqmesh.sharded_attention.kept`): each seqmesh-attention
    layer's output and log-sum-exp, each indexer's selection; at the loss every layer's, in a layer's backward the
    layers' below it (the top layer's: the smallest of the kinds, an estimate from above where kinds differ)."""
    if not (work.checkpointing and work.keep_attention):
        return 0
    each = []
    for kind, n in layer_kinds(work, layout):  # the layers' own kernels (compressed, block-sparse, QSA) keep nothing
        if isinstance(kind, Attention):  # at its own sizes (dots.llm3's sliding layers' heads)
            each += [kept_attention_bytes(kind.work, layout)] * n
        elif isinstance(kind, IndexedAttention) and kind.indexer:
            each += [selection_bytes(work, layout)] * n
    return sum(each) - (0 if at_loss or not each else min(each))


def _kept_by_layers(work: Workload, layout: Degrees, at_loss: bool) -> int:
    """What the layers below the one in backward keep (all of them at the loss)."""
    m = work.model
    if work.checkpointing:
        inputs = m.layers
        if work.offload_checkpoints:
            inputs = 0 if at_loss else min(m.layers, work.offload_prefetch + 1 if work.offload_prefetch else 0)
        # the shared layers' input selection: offloaded with the inputs, or the one an indexer keeps (counted there)
        picks = 0 if work.offload_checkpoints or work.keep_attention else shared_picks_bytes(work, layout)
        # Inkling 2's block states, each block's kept once by the layers that take it; Inkling2-Loop's calls of its
        # looped layers after the first pass, each with its messages
        states = tokens(work, layout) * block_states_bytes(work, inputs)
        if inputs == m.layers and m.inkling is not None and m.inkling.gate_rank:
            inputs += m.inkling.extra_passes
            states += tokens(work, layout) * messages_bytes(work)
        return (inputs * layer_input_bytes(work, layout) + picks + states
                + kept_outputs_bytes(work, layout, at_loss))
    if m.inkling is not None:  # each layer by its kind (Inkling 2's stacks by its index)
        return layers_saved_bytes(work, layout, m.layers - (0 if at_loss else 1))
    layer = layer_saved_bytes(work, layout)
    # the dense_layers of an MoE model keep their dense MLP's tensors, not the experts'
    dense = m.dense_layers * (layer - layer_saved_bytes(dense_layer(work), layout)) if m.dense_layers else 0
    return (m.layers - (0 if at_loss else 1)) * layer - dense


def activation_memory(work: Workload, layout: Degrees, moment: str = "layer backward",
                      after_recompute: bool = False) -> tuple[int, str, Workload]:
    """Activations at the peak of the last (or the first) layer's backward, the op at which it falls and the workload
    of the layer kind it falls in (dots.llm3's sliding layers: a model of them alone): what the layers below keep,
    the layer's own saved tensors, the gradient of its output and the timeline's peak (from the tiled MLP's recompute
    on, or ``after_recompute``, once it is done)."""
    first = moment == "first layer backward"
    if first:
        fetched = not work.offload_checkpoints or work.offload_prefetch
        below = layer_input_bytes(work, layout) if work.checkpointing and fetched else 0
    else:
        below = _kept_by_layers(work, layout, at_loss=False)
    # recomputed; in fp32 or with the efficient norm the first norm saves the kept input itself (HY-V4: the mixed
    # stream, one of the kept input's hc_mult)
    shared = tokens(work, layout) * work.model.hidden * work.act_bytes if work.checkpointing and (
        work.act_bytes == 4 or efficient_norm(work)) else 0
    # the first layer of an MoE model whose first layers are dense: as a dense layer of theirs
    top, op, where = _top_layer(first_layer(work) if first else work, layout, after_recompute)
    kept = below + top - shared + outside_layers_bytes(work, layout)
    return kept + layer_input_bytes(work, layout), op, where  # + the gradient of the layer's output


def _top_layer(work: Workload, layout: Degrees, after_recompute: bool) -> tuple[int, str, Workload]:
    """The peak of one layer's backward beyond what is below it, its op and its kind's workload: the largest of the
    model's kinds'. An attention kind's timeline is its own workload's (dots.llm3's sliding layers at their sizes)."""
    peaks: dict[int, tuple[tuple[int, str], tuple[int, str]]] = {}

    def timeline(w: Workload) -> tuple[tuple[int, str], tuple[int, str]]:  # (the whole's peak, the MLP's), once each
        if id(w) not in peaks:
            steps = layer_backward_timeline(w, layout)
            if after_recompute:
                steps = steps[next(i for i, (op, _, _) in enumerate(steps) if op == TILED_RECOMPUTE) + 1:]
            # before the attention's steps: a recurrent layer's feed-forward (its mixer's backward is its kind's own)
            mlp = list(itertools.takewhile(lambda s: not s[0].startswith(ATTENTION_STEPS), steps))
            peaks[id(w)] = timeline_peak(steps), timeline_peak(mlp)
        return peaks[id(w)]

    def moment(kind) -> tuple[int, str, Workload]:  # the peak of a layer of this kind in backward, beyond what is below
        (extra, op), mlp = timeline(kind.work)
        # DeepSeek-V4's hyper-connection at the start of any kind's backward, where it is larger
        hyper = hyper_connection_backward_bytes(kind.work, layout)
        streams = [(hyper, HYPER_CONNECTION_BACKWARD)] if hyper else []
        if not hasattr(kind, "backward_bytes"):  # an attention layer's timeline
            extra, op = max([(extra, op), *streams])
            return kind.saved_bytes() + extra, op, kind.work
        # a recurrence's gradients (seqmesh.planner.diagonal, .mamba2, .lightning, .kda), or its layer's other moments:
        # Falcon-H1's attention beside it, the timeline whole; a feed-forward's, unless the kind has none (Nemotron-H)
        other = (extra, op) if getattr(kind, "beside_attention", False) else (
            (0, "") if getattr(kind, "ffn", None) == "" else mlp)
        own = max([(kind.backward_bytes(), getattr(kind, "backward_op", "recurrence backward")), other, *streams])
        return kind.saved_bytes() + own[0], own[1], kind.work

    return max((moment(kind) for kind, _ in layer_kinds(work, layout)), key=lambda m: m[:2])


def loss_memory(work: Workload, layout: Degrees, moment: str) -> int:
    """The chunked loss's working set beyond what the layers keep (docs/planner.md, "Memory moments"). Its forward
    makes the gradients (``seqmesh.model.loss``, and ``seqmesh.model.vocab_parallel`` under TP): the hidden
    states' and the head's float32 accumulator, beside one chunk's logits and their gradient; backward scales them
    into new tensors, the head's in its dtype, the saved ones still held. Under TP the loss works on its group's
    gathered tokens, a copy of the hidden states it holds in forward beside the final norm's output, and each
    tile's logits are this rank's ``V / tp`` columns, three float32 tiles at once (the logits, less their maximum,
    and its exponential)."""
    m, e, t = work.model, work.act_bytes, gathered_tokens(work, layout)
    head_streams = _head_streams_bytes(work, layout, moment)
    n = min(t, work.loss_chunk) if work.chunked_loss else t
    v, h, tp = m.head_vocab // layout.tp, m.hidden, layout.tp > 1
    head = -(-m.head_vocab * h // layout.tp)
    if moment == "loss backward":
        return head_streams + 2 * t * h * e + head * (4 + e)
    if e == 4:  # one float32 tile of logits, then its gradient in place, beside a product of the head or the tile
        chunk = n * v * 4 + 4 * max(n * h, head)
    else:  # the logits in the compute dtype and float32, or the gradient's compute-dtype copy beside a product
        chunk = max(n * v * (4 + e), n * v * e + max(n * h * e, head * (e + 4)))
    if tp:  # the gathered hidden states and the final norm's output, which the caller holds until the loss returns
        return head_streams + t * h * e + tokens(work, layout) * h * e + t * h * e + head * 4 + max(chunk, n * v * 12)
    return head_streams + t * h * e + head * 4 + chunk


def _head_streams_bytes(work: Workload, layout: Degrees, moment: str) -> int:
    """Qwen4-Exp's last gated residual (:func:`.activations.gated_residual_saved`). DeepSeek-V4's head
    hyper-connection, which collapses the last layer's streams before the final norm: it keeps
    those streams, their float32 copy (unless the model is float32) and their normed float32 form (its mixing
    weights' input); in the loss's backward, their float32 gradients too (:data:`HEAD_STREAM_GRADIENTS` tensors)."""
    m, e = work.model, work.act_bytes
    if m.qwen_exp is not None:  # its last gated residual, which mixes the streams into the head's input
        return tokens(work, layout) * gated_residual_saved(work, inject=False)
    if m.compressed is None:
        return 0
    streams = tokens(work, layout) * m.compressed.hc_mult * m.hidden
    kept = streams * (e + 4 * (2 if e < 4 else 1))
    return kept + (streams * 4 * HEAD_STREAM_GRADIENTS if moment == "loss backward" else 0)


# the float32 (tokens, streams x hidden) tensors DeepSeek-V4's head hyper-connection's backward holds at once (the
# normed streams' gradient, the norm's scale, square and gradient sum), measured in a rehearsal
HEAD_STREAM_GRADIENTS = 4


def memory_at(work: Workload, layout: Degrees, moment: str) -> MemoryBreakdown:
    """What one GPU holds at ``moment`` (one of MOMENTS; see the module docstring)."""
    weights, grads, optimizer = parameter_memory(work, layout, moment)
    outside = outside_layers_bytes(work, layout)
    activations = attention = logits = 0
    if moment in ("loss forward", "loss backward"):
        activations = _kept_by_layers(work, layout, at_loss=True) + final_norm_bytes(work, layout) + outside
        logits = loss_memory(work, layout, moment)
    elif moment in ("layer backward", "first layer backward"):
        activations, op, where = activation_memory(work, layout, moment)
        if op == TILED_RECOMPUTE:  # the layer's own weight gradients come after it: the larger of the two moments
            own = local_layer_params(placement(work, layout).split["layer"], work.model, layout) * work.act_bytes
            later, later_op, later_where = activation_memory(work, layout, moment, after_recompute=True)
            if later + own > activations:
                activations, op, where = later, later_op, later_where
            else:
                grads -= own
        if op == "attention backward":  # the peak is inside attention: its buffers apart
            attention = attention_backward_bytes(where, layout)
            activations -= attention
    elif moment in ("end of backward", "optimizer step"):
        activations = outside
    return MemoryBreakdown(weights, grads, optimizer, activations, attention, logits, work.reserve_bytes, moment)


def memory_per_gpu(work: Workload, layout: Degrees) -> MemoryBreakdown:
    """The peak: the moment of the step at which one GPU holds the most."""
    return max((memory_at(work, layout, moment) for moment in MOMENTS), key=lambda b: b.total)

