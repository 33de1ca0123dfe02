"""Tensor parallelism inside the sequence mesh, as the planner counts it: which layouts seqmesh refuses, each TP
rank's share of the weights, and the TP group's collectives per layer and per step (the per-rank data flow is
``seqmesh.tensor_parallel.plan``'s module docstring; docs/planner.md, "Tensor parallelism", the formulas).

On a rank of a ``U x R x T`` layout every per-token activation between the TP regions is one slice of ``L / T``
tokens, ``L = padded / (U x R)``; one collective moves ``(T - 1)`` such slices, ``c = B x L/T x hidden`` elements.
"""

from __future__ import annotations

from ..rules.degrees import TP_SIZE_NAMES, Degrees, tensor_parallel_misfits
from ..rules.own_attention import tensor_parallel_refusal as own_attention_refusal
from ..model.shapes import ModelShape
from .hardware import HardwareSpec
from .traffic import dtype_bytes
from .placement import placement
from .workload import Workload

POOLED_VALUES = 3  # seqmesh.model.loss.pool_mean: the loss sum, the valid targets and the bad labels, one all-reduce


def tensor_parallel_refusal(work: Workload, hw: HardwareSpec | None, layout: Degrees) -> str | None:
    """Why seqmesh cannot run ``layout``'s tensor parallelism (``seqmesh.tensor_parallel.check_tensor_parallel`` and
    ``seqmesh.compose`` refuse the same), or None. TP stays inside a node: its group is the innermost ranks."""
    m, tp = work.model, layout.tp
    node = hw.gpus_per_node if hw is not None else tp  # None: ranks of one host (seqmesh bench memory)
    if tp > node or node % tp:
        return f"tensor parallelism beyond one node (TP {tp} over nodes of {node} GPUs)"
    if m.experts:
        return "seqmesh's tensor parallelism does not split mixture-of-experts layers (tp 1 only)"
    if m.block_sparse_layers or m.compressed_layers or m.cross_domain is not None:  # their runtimes refuse tp > 1
        return ("seqmesh runs MiniMax-M3's block-sparse, DeepSeek-V4's compressed and Doge's cross-domain experts' "
                "layers without tensor parallelism (tp 1 only)")
    if m.inkling is not None:  # seqmesh.hf.inkling refuses tp > 1 (its bias over the gathered row)
        return "seqmesh runs Inkling's relative-bias attention without tensor parallelism (tp 1 only)"
    if (own := own_attention_refusal(m.family)) is not None:
        return own
    if m.linear_layers:  # seqmesh runs them (seqmesh.tensor_parallel.linear_attention); their cost is not modelled
        return "the planner does not model Gated DeltaNet layers under tensor parallelism yet (tp 1 only)"
    if m.hybrid is not None:
        return "the planner does not model hybrids (Mamba2, LFM2) under tensor parallelism (tp 1 only)"
    if m.latent is not None:  # seqmesh.hf.indexed_attention refuses tp > 1; MLA's split is not modelled
        return "the planner does not model MLA under tensor parallelism (tp 1 only)"
    if m.vision is not None or work.media is not None:
        return "seqmesh's tensor parallelism covers text decoders only, not vision-language models (tp 1 only)"
    misfits = tensor_parallel_misfits(tp, heads=m.heads, kv_heads=m.kv_heads, intermediate=m.intermediate,
                                      vocab=m.vocab)
    bad = [f"{v} {TP_SIZE_NAMES[k].removeprefix('MLP ')}" for k, v in misfits.items()]
    if bad:
        return f"TP {tp} does not fit the {', '.join(bad)} (seqmesh.rules.degrees.check_tensor_parallel_sizes)"
    if m.kv_heads % tp:  # seqmesh runs it, replicating k/v over the group; the planner splits k/v by tp
        return f"the planner does not model {m.kv_heads} kv heads replicated over TP {tp} yet (tp dividing them only)"
    return None


def sequence_share(work: Workload, layout: Degrees) -> int:
    """``L``: tokens of each sequence one sequence rank holds (its TP group together), padded so ``T`` divides it."""
    return placement(work, layout).sequence_share


def slice_bytes(work: Workload, layout: Degrees) -> int:
    """``c``: one rank's slice of the residual stream, ``B x L/T x hidden`` in the compute dtype."""
    return work.batch * sequence_share(work, layout) // layout.tp * work.model.hidden * dtype_bytes(work.torch_dtype)


def layer_traffic(work: Workload, layout: Degrees) -> dict[str, dict[str, int]]:
    """One decoder layer's TP collectives per phase, bytes one rank sends: forward the attention's and the MLP's
    input all-gathered and their outputs reduce-scattered, ``(T - 1) x c`` each; backward their adjoints, the same.
    Checkpointing replays the forward up to the MLP's down projection (torch's recompute stops at the last tensor
    backward needs), so the MLP's reduce-scatter is not repeated."""
    if layout.tp == 1:
        return {ph: {"tp_all_gather": 0, "tp_reduce_scatter": 0} for ph in ("forward", "backward", "recompute")}
    one = (layout.tp - 1) * slice_bytes(work, layout)
    each_way = {"tp_all_gather": 2 * one, "tp_reduce_scatter": 2 * one}
    recompute = {"tp_all_gather": 2 * one, "tp_reduce_scatter": one} if work.checkpointing else \
        {"tp_all_gather": 0, "tp_reduce_scatter": 0}
    return {"forward": each_way, "backward": dict(each_way), "recompute": recompute}


def loss_tiles(work: Workload, layout: Degrees) -> list[int]:
    """Tokens of each tile of the loss on one rank: its TP group's ``B x L`` gathered tokens, ``loss_chunk`` at a time."""
    total = work.batch * sequence_share(work, layout)
    chunk = work.loss_chunk if work.chunked_loss else total
    return [min(chunk, total - s) for s in range(0, total, chunk)]


def all_reduce_bytes(elements: int, group: int, element_bytes: int) -> int:
    """An all-reduce over ``group`` ranks, as ``seqmesh.comm.stats`` counts it: ``2 (G - 1) / G`` of the tensor."""
    return 2 * (group - 1) * elements * element_bytes // group


def step_traffic(work: Workload, layout: Degrees) -> dict[str, dict[str, int]]:
    """The TP collectives of a step outside the decoder layers, per phase (forward, backward): the embedding's output
    reduce-scattered (its adjoint all-gathered), the loss's input all-gathered (reduce-scattered back), per loss tile
    two all-reduces (the maximum of ``n`` and the sums of ``2 x n`` float32 values), and, in backward, the
    TP-replicated norm weights' gradients all-reduced (compute dtype)."""
    zero = {"tp_all_gather": 0, "tp_reduce_scatter": 0, "tp_all_reduce": 0}
    if layout.tp == 1:
        return {"forward": zero, "backward": dict(zero)}
    m, tp = work.model, layout.tp
    one = (tp - 1) * slice_bytes(work, layout)
    wide = 4  # float32 (the loss's accumulation dtype for bf16 and fp32)
    tiles = sum(all_reduce_bytes(n, tp, wide) + all_reduce_bytes(2 * n, tp, wide) for n in loss_tiles(work, layout))
    norm_grads = sum(all_reduce_bytes(n, tp, dtype_bytes(work.torch_dtype)) for n in norm_weights(m))
    return {"forward": {"tp_all_gather": one, "tp_reduce_scatter": one, "tp_all_reduce": tiles},
            "backward": {"tp_all_gather": one, "tp_reduce_scatter": one, "tp_all_reduce": norm_grads}}


def norm_weights(m: ModelShape) -> list[int]:
    """Sizes of the TP-replicated norm weights, one entry per weight: each layer's RMSNorms (and q/k norms), the
    final norm."""
    count = 4 if m.family == "gemma3_text" else 2  # ModelShape.norm_params: RMSNorms of the hidden size ...
    per_head = (m.norm_params - count * m.hidden) // 2  # ... and q and k norms of the head size, if any
    return ([m.hidden] * count + [per_head] * (2 if per_head else 0)) * m.layers + [m.hidden]


def pooled_loss_bytes(work: Workload, layout: Degrees) -> int:
    """The loss pooled over the batch group (every rank but the TP ranks): one all-reduce of three float32 values."""
    return all_reduce_bytes(POOLED_VALUES, layout.dp_shard * layout.ulysses * layout.ring, 4)


def _collective_seconds(nbytes: int, hw: HardwareSpec, layout: Degrees) -> float:
    """One all-gather or reduce-scatter (or all-reduce) of ``nbytes`` sent per rank, every TP group at once: the
    innermost level that joins a TP group, or a link several GPUs share if that is slower (ring algorithms send
    everything to the next rank)."""
    from .network import every_group, gather_seconds, shared_links_seconds

    groups = every_group(layout, "tp")
    return max(gather_seconds(nbytes, hw, list(groups[0])), shared_links_seconds(nbytes, hw, groups, ring=True))


def layer_seconds(work: Workload, layout: Degrees, hw: HardwareSpec) -> dict[str, float]:
    """Seconds of one layer's TP collectives per phase (forward, backward, recompute), issued one after another and
    on the critical path: each TP region waits for its gathered input, the next norm for the reduce-scatter."""
    if layout.tp == 1:
        return dict.fromkeys(("forward", "backward", "recompute"), 0.0)
    one = _collective_seconds((layout.tp - 1) * slice_bytes(work, layout), hw, layout)
    return {"forward": 4 * one, "backward": 4 * one, "recompute": 3 * one if work.checkpointing else 0.0}


def step_seconds(work: Workload, layout: Degrees, hw: HardwareSpec) -> float:
    """Seconds of the step's TP collectives outside the layers (:func:`step_traffic`), none overlapped."""
    if layout.tp == 1:
        return 0.0
    tp = layout.tp
    one = _collective_seconds((tp - 1) * slice_bytes(work, layout), hw, layout)
    tiles = sum(_collective_seconds(all_reduce_bytes(n, tp, 4), hw, layout)
                + _collective_seconds(all_reduce_bytes(2 * n, tp, 4), hw, layout) for n in loss_tiles(work, layout))
    norms = sum(_collective_seconds(all_reduce_bytes(n, tp, dtype_bytes(work.torch_dtype)), hw, layout)
                for n in norm_weights(work.model))
    return 4 * one + tiles + norms
