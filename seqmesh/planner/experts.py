"""Expert parallelism as the planner counts it: which ``ep`` degrees a layout can take, each rank's share of the routed
experts (held, gathered and sharded), the dispatch and combine all-to-alls of one MoE layer and their time.

A layout's ``ep`` ranks are the innermost ``ep`` of its ``dp_shard x ring x ulysses`` batch ranks (those that hold
different tokens; TP is refused beside EP). Each holds ``E / ep`` of the ``E`` routed experts of every MoE layer,
sharded by FSDP2 over the ``fsdp_group / ep`` ranks that hold the same experts; everything else of the layer (attention,
router, shared experts, norms) stays one FSDP unit over the whole ``fsdp_group``, as without EP. The bytes of one
layer's exchange are :func:`seqmesh.experts.traffic.expected_exchange_bytes`'s (a balanced router), the formula the
runtime's counters are tested against. docs/planner.md, "Expert parallelism", lists what is modelled and what not.
"""

from __future__ import annotations

from ..rules.degrees import Degrees
from ..experts.layers import family_refusal
from ..experts.rules import check_expert_parallel as runtime_rule
from ..experts.traffic import ExchangeBytes, expected_exchange_bytes
from ..model.shapes import ModelShape
from .activations import tokens
from .hardware import HardwareSpec
from .network import concurrent_all_to_all_seconds, fsdp_seconds, link_name
from .traffic import dtype_bytes, fsdp_traffic
from .workload import Workload, check_expert_parallel

__all__ = ["check_expert_parallel", "exchange", "exchange_phases", "exchange_seconds",
           "expert_degrees", "expert_groups", "expert_parallel_refusal", "layer_fsdp_seconds", "layer_fsdp_traffic",
           "local_layer_params", "moe_layers", "remote_expert_params", "routed_expert_params", "sharded_params",
           "unit_shard"]


def moe_layers(m: ModelShape) -> int:
    """Layers with routed experts: every layer of an MoE model but its first ``dense_layers`` (0 for a dense model)."""
    return m.layers - m.dense_layers if m.experts else 0


def routed_expert_params(m: ModelShape) -> int:
    """One MoE layer's routed experts: ``E`` gated MLPs of ``intermediate`` (gate, up, down)."""
    return m.experts * 3 * m.hidden * m.intermediate


def remote_expert_params(m: ModelShape, layout: Degrees) -> int:
    """The routed experts of one MoE layer a rank does not hold under ``layout``: ``(ep - 1) / ep`` of them."""
    return routed_expert_params(m) - routed_expert_params(m) // layout.ep


def local_layer_params(params: int, m: ModelShape, layout: Degrees) -> int:
    """What one rank gathers of a layer unit of ``params`` that holds the routed experts: all but the others'."""
    return params - remote_expert_params(m, layout)


def expert_parallel_refusal(m: ModelShape, layout: Degrees) -> str | None:
    """Why ``layout``'s ``ep`` cannot run on ``m`` (the runtime's rule, with the layout's ranks), or None. The expert
    groups are cut from the ``dp_shard x ring x ulysses`` ranks (also under HSDP, inside a replica)."""
    if layout.ep == 1:
        return None
    family = family_refusal(m.family, layout.ep)  # the runtime's rule: the families whose experts it splits
    if family is not None:
        return family
    try:
        check_expert_parallel(m, layout.ep)
        runtime_rule(layout.ep, experts=m.experts, token_ranks=layout.fsdp_group, tp=layout.tp, model=m.name)
    except ValueError as err:
        return str(err)
    return None


def expert_degrees(m: ModelShape, batch_ranks: int, asked: int | str) -> list[int]:
    """The ``ep`` degrees to plan for a layout of ``batch_ranks`` ranks holding different tokens: ``asked`` itself, or
    for ``"auto"`` every degree dividing both the routed experts and the batch ranks (1 for a dense model)."""
    if asked != "auto":
        return [int(asked)]
    if not m.experts or m.hybrid is not None:
        return [1]
    return [d for d in range(1, batch_ranks + 1) if batch_ranks % d == 0 and m.experts % d == 0]


def unit_shard(params: int, m: ModelShape, layout: Degrees, experts: bool = True) -> int:
    """Parameters one rank holds of an FSDP unit of ``params`` (``experts``: it holds one MoE layer's routed
    experts): ``params / fsdp_group`` without EP; with it the rest over ``fsdp_group`` and the rank's ``E / ep``
    experts over the ``fsdp_group / ep`` ranks that hold them."""
    if layout.ep == 1 or not experts:
        return -(-params // layout.fsdp_group)
    own = routed_expert_params(m) // layout.ep
    return -(-(params - routed_expert_params(m)) // layout.fsdp_group) + -(-own // (layout.fsdp_group // layout.ep))


def sharded_params(m: ModelShape, layout: Degrees, total: int) -> int:
    """Parameters one rank holds of the model's ``total``: its share of every MoE layer's experts (``E / N`` of them
    for any ``ep``: ``E / ep`` over ``N / ep`` ranks) and ``1 / N`` of the rest (``N``: ``fsdp_group``)."""
    if layout.ep == 1:
        return -(-total // layout.fsdp_group)
    routed = moe_layers(m) * routed_expert_params(m)
    return unit_shard(total - routed, m, layout, experts=False) + moe_layers(m) * unit_shard(routed_expert_params(m), m, layout)


def _units(params: int, m: ModelShape, layout: Degrees) -> list[tuple[int, int]]:
    """``(parameters, ranks)`` of the FSDP units a layer of ``params`` holding routed experts is under ``layout``."""
    if layout.ep == 1:
        return [(params, layout.fsdp_group)]
    return [(params - routed_expert_params(m), layout.fsdp_group),
            (routed_expert_params(m) // layout.ep, layout.fsdp_group // layout.ep)]


def layer_fsdp_traffic(params: int, work: Workload, layout: Degrees) -> dict[str, int]:
    """:func:`.traffic.fsdp_traffic` of a layer of ``params`` holding the routed experts: one unit without EP; with
    it the rest's unit and the rank's experts' (gathered over ``fsdp_group / ep`` ranks), added."""
    out: dict[str, int] = {}
    for n, group in _units(params, work.model, layout):
        for k, v in fsdp_traffic(n, group, work.torch_dtype, work.reduce_dtype).items():
            out[k] = out.get(k, 0) + v
    return out


def expert_groups(layout: Degrees) -> tuple[list[list[int]], list[int]]:
    """Every EP group of ``layout`` (``ep`` consecutive batch ranks; tp is 1) and the ranks of one expert FSDP group
    (those holding the same experts: every ``ep``-th)."""
    n, ep = layout.gpus, layout.ep
    return [list(range(s, s + ep)) for s in range(0, n, ep)], list(range(0, n, ep))


def layer_fsdp_seconds(params: int, work: Workload, layout: Degrees, hw: HardwareSpec,
                       fsdp_ranks: list[int]) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds of a layer of ``params`` holding the routed experts: its units one after
    the other, the rest's over ``fsdp_ranks``, the experts' over the ranks holding the same ones."""
    ag = rs = 0.0
    for (n, group), ranks in zip(_units(params, work.model, layout), (fsdp_ranks, expert_groups(layout)[1])):
        a, r = fsdp_seconds(fsdp_traffic(n, group, work.torch_dtype, work.reduce_dtype), hw, ranks)
        ag, rs = ag + a, rs + r
    return ag, rs


def exchange(work: Workload, layout: Degrees) -> ExchangeBytes:
    """One MoE layer's dispatch and combine on a rank of ``layout`` (its ``batch x local`` tokens, a balanced router)."""
    m = work.model
    return expected_exchange_bytes(tokens(work, layout), m.experts_per_token, layout.ep, m.hidden,
                                   dtype_bytes(work.torch_dtype), m.experts // layout.ep)


def exchange_phases(work: Workload, layout: Degrees) -> dict[str, int]:
    """One MoE layer's exchange bytes by phase: forward (counts, dispatch, combine), backward (their adjoints, the
    counts not repeated), recompute (the whole forward again under checkpointing)."""
    sent = exchange(work, layout)
    return {"forward": sent.forward, "backward": sent.backward,
            "recompute": sent.forward if work.checkpointing else 0}


def exchange_seconds(work: Workload, layout: Degrees, hw: HardwareSpec) -> dict[str, float]:
    """Seconds of one MoE layer's all-to-alls by phase, every EP group at once over its links (the cluster's
    network model); nothing hides them: the experts wait for their rows, the layer's output for the combine."""
    if layout.ep == 1:
        return {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    sent, groups = exchange(work, layout), expert_groups(layout)[0]
    calls = {"forward": (sent.counts, sent.dispatch, sent.combine), "backward": (sent.dispatch, sent.combine)}
    out = {ph: sum(concurrent_all_to_all_seconds(n, hw, groups) for n in c) for ph, c in calls.items()}
    return out | {"recompute": out["forward"] if work.checkpointing else 0.0}


def exchange_link(layout: Degrees, hw: HardwareSpec) -> str:
    """The slowest link an EP group's all-to-alls cross."""
    return link_name(hw, expert_groups(layout)[0][:1])
