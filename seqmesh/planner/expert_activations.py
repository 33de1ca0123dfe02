"""What an MoE layer keeps for backward and how its backward frees it, on the busiest rank (docs/planner.md,
"Activations"): its routed rows' tensors and its shared experts' (:func:`experts_saved`), its backward step by step
(:func:`experts_backward_steps`), and an MoE model's first layers where they have a dense MLP
(:func:`dense_layer`, :func:`first_layer`). Below :mod:`.activations`, which reads them.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.shapes import ModelShape
from ..rules.degrees import Degrees
from .placement import placement
from .workload import Workload


def _tokens(work: Workload, layout: Degrees) -> int:
    """Tokens one GPU holds between the layers, all ``batch`` sequences (:func:`.activations.tokens`)."""
    return work.batch * placement(work, layout).local_tokens


# tensors of an expert's width a routed row keeps where its family's SwiGLU is not gate, up, SiLU and product (4):
# DeepSeek-V4 clamps gate and up (6); gpt-oss and MiniMax-M3 clamp and scale them, gate by a sigmoid, add one to up (7)
EXPERT_TENSORS = {"deepseek_v4": 6, "gpt_oss": 7, "minimax_m3_vl_text": 7}


def mlp_tensors(m: ModelShape) -> int:
    """Tensors of the MLP's width a gated MLP (each expert, a dense layer) keeps a token (:data:`EXPERT_TENSORS`)."""
    return EXPERT_TENSORS.get(m.family, 4)


def experts_saved(work: Workload, layout: Degrees) -> int:
    """What an MoE layer keeps, per token: for each of its ``k`` routed rows the gathered input, the down product's
    output (which the routing weight multiplies) and the SwiGLU's tensors of the expert's width (:func:`mlp_tensors`:
    ``2 E + 4 I`` for gate | up, SiLU's input and output, the product); each shared expert's SwiGLU of its own width
    (and, gated as Qwen's, their output); as a rehearsal holds them."""
    m = work.model
    inner = mlp_tensors(m)
    per_token = m.experts_per_token * (2 * m.hidden + inner * m.intermediate)
    per_token += inner * (m.shared_intermediate or m.intermediate) * m.shared_experts
    per_token += m.hidden if m.shared_gate else 0  # the shared experts' output, which their gate multiplies
    return _tokens(work, layout) * per_token * work.act_bytes


def experts_backward_steps(work: Workload, layout: Degrees) -> list[tuple[str, int, int]]:
    """An MoE layer's MLP backward as ``(op, allocated, freed)`` bytes, freeing what :func:`experts_saved` counts: over
    its ``T x k`` routed rows, the weighted output's gradient, then the down product's (freeing the product), the
    SwiGLU's (freeing its tensors), the gate | up product's (freeing the gathered input), then the rows' gradients
    summed into the tokens'; each shared expert as a gated MLP of its width; the router's input gradient added in,
    and the norm's output freed."""
    m, e, t = work.model, work.act_bytes, _tokens(work, layout)
    inner = mlp_tensors(m)
    wide = t * m.hidden * e
    rows, width = t * m.experts_per_token * e, m.intermediate
    steps = [("experts' output backward", rows * m.hidden, rows * m.hidden),  # the down output freed
             ("experts' down backward", rows * width, rows * (m.hidden + width)),
             ("experts' SwiGLU backward", 2 * rows * width, rows * width * inner),
             ("experts' gate/up backward", rows * m.hidden, rows * (2 * width + m.hidden)),
             ("experts' rows into tokens", wide, rows * m.hidden)]
    shared = t * (m.shared_intermediate or width) * m.shared_experts * e
    if shared:
        gate = wide if m.shared_gate else 0  # the gate's product frees the shared output it kept
        steps.append(("shared experts backward", 2 * shared + wide, (inner + 2) * shared + wide + gate))
    return steps + [("router backward", wide, 2 * wide)]


def dense_layer(work: Workload) -> Workload:
    """``work`` with its model's layers as its dense ones: a dense MLP of ``dense_intermediate`` where an MoE model
    has some (DeepSeek's ``first_k_dense_replace``, MiniMax-M3's ``mlp_layer_types``, Qwen-MoE's
    ``mlp_only_layers``); ``work`` itself otherwise."""
    m = work.model
    if not (m.experts and m.dense_layers) or m.hybrid is not None:
        return work
    dense = replace(m, experts=0, experts_per_token=0, shared_experts=0, shared_intermediate=0, shared_gate=False,
                    intermediate=m.dense_intermediate, dense_layers=0, dense_intermediate=0)
    return replace(work, model=dense, ep=1)  # a dense layer has no experts to split


def first_layer(work: Workload) -> Workload:
    """``work`` with its model's layers as its first one: :func:`dense_layer` where that is one of the dense ones;
    an Inkling model's every layer of its first layer's kind (sliding or full), Inkling 2's depth attention as the
    first layer's (no stack before its attention), without Inkling2-Loop's gated calls (its first layer never
    loops)."""
    work = dense_layer(work) if work.model.dense_first else work
    ink = work.model.inkling
    if ink is None:
        return work
    first = replace(ink, kinds=(ink.kinds[0],) * len(ink.kinds), planned_layer=0, passes=1)
    return replace(work, model=replace(work.model, inkling=first))
