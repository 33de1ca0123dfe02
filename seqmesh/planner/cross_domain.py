"""What Doge's cross-domain experts (``is_moe``; the model's shape: :class:`seqmesh.model.doge.CrossDomainExperts`) add
to its attention layer on the busiest rank, as ``seqmesh.hf.doge_moe`` runs them: the all-gather of every rank's router
logits forward (its reduce-scatter backward, the same bytes), which nothing overlaps, and the bytes its gathered
rows move (:func:`rows_seconds`: a token's rows are read once, by memory, not by arithmetic). Their products are
counted with the layer's matmuls (:func:`.workload.mlp_matmul_params`), what they keep with the MLP's
(:func:`.activations.mlp_saved_bytes`) and their backward's row gradients in the layer's
(:func:`.activations.layer_backward_timeline`). The
attention itself is the layer's :class:`.attention_layer.Attention`, which adds these where the model has the experts.
"""

from __future__ import annotations

from ..rules.degrees import Degrees
from .activations import local_tokens
from .hardware import HardwareSpec
from .network import axis_groups, gather_seconds
from .traffic import Collective, RankTraffic, dtype_bytes, worst_rank
from .workload import Workload

KEY = "router_logits_gather"


def _sent(work: Workload, layout: Degrees) -> int:
    """Bytes each rank sends in the logits' all-gather: its ``B x L`` tokens' ``2 x keys`` logits to the other ranks of
    the sequence group."""
    p = layout.ulysses * layout.ring
    experts = work.model.cross_domain
    return (p - 1) * work.batch * local_tokens(work, layout) * experts.logits_bytes(dtype_bytes(work.torch_dtype))


def router_ranks(work: Workload, layout: Degrees) -> list[RankTraffic]:
    """Each sequence rank's router traffic in one layer: the all-gather forward, its reduce-scatter backward (none on
    one rank)."""
    sent = _sent(work, layout)
    calls = () if not sent else tuple(Collective(kind, phase, 1, sent) for kind, phase in
                                      (("all_gather", "forward"), ("reduce_scatter", "backward")))
    return [RankTraffic(r % layout.ulysses, r // layout.ulysses, calls) for r in range(layout.ulysses * layout.ring)]


def router_traffic(work: Workload, layout: Degrees) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) bytes the busiest rank sends in one layer's router collectives."""
    ranks = router_ranks(work, layout)
    return ({KEY: worst_rank(ranks, "all_gather", "forward")}, {KEY: worst_rank(ranks, "reduce_scatter", "backward")})


def router_seconds(work: Workload, layout: Degrees, hw: HardwareSpec) -> float:
    """Seconds of one phase's router collective (forward's all-gather, backward's reduce-scatter: the same bytes), end
    to end: the routing waits for it."""
    return gather_seconds(_sent(work, layout), hw, axis_groups(layout, "sequence")[0])


def rows_seconds(work: Workload, layout: Degrees, hw: HardwareSpec) -> tuple[float, float]:
    """(forward, backward) GPU-memory seconds of the experts' rows, which no weight is reused across: forward each
    token's picked down and up rows gathered (written) and read by their products; backward their gradients written
    and read into the two embeddings' float32 gradients, each of which is zeroed and written whole."""
    m = work.model
    rows = work.batch * local_tokens(work, layout) * m.cross_domain.row_bytes(m.hidden, work.act_bytes)
    forward = 2 * 2 * rows / hw.memory_bandwidth
    return forward, forward + 2 * 2 * m.cross_domain.experts * m.hidden * 4 / hw.memory_bandwidth
