"""What every decoder layer kind of :mod:`.layers` and the hybrid kinds (:mod:`.mamba2`, :mod:`.kda`,
:mod:`.lightning`, :mod:`.short_conv`) count the same way: a layer's traffic by phase, the time of a layer whose
communication overlaps nothing, and what an attention layer saves for backward. Below all of them, so none
imports another's module for these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .experts import layer_fsdp_seconds
from .network import axis_groups, gather_seconds, link_name
from .traffic import worst_rank

if TYPE_CHECKING:
    from ..rules.degrees import Degrees
    from .hardware import HardwareSpec
    from .traffic import RankTraffic
    from .workload import Workload

Phases = dict[str, dict[str, int]]  # phase -> collective -> bytes the busiest rank sends in one layer


class CostedLayer(Protocol):
    """A layer kind as :func:`serial_layer_seconds` reads it: its workload, layout and FSDP unit's parameters."""

    work: Workload
    layout: Degrees

    def params(self) -> int: ...


def phases(forward: dict[str, int], backward: dict[str, int], checkpointing: bool) -> Phases:
    """A layer's three phases: checkpointing re-runs the forward's collectives inside backward."""
    return {"forward": forward, "backward": backward,
            "recompute": {k: v if checkpointing else 0 for k, v in forward.items()}}


# A layer kind whose sequence collectives are all-gathers forward and their reduce-scatters backward over the whole
# sequence group (a halo, states, entries: lightning attention, short convolutions, DeepSeek-V4's compressed layers)

def gather_phases(ranks: list[RankTraffic], key: str, checkpointing: bool) -> Phases:
    """Its traffic by phase under ``key``: the busiest rank's all-gathers forward, reduce-scatters backward."""
    return phases({key: worst_rank(ranks, "all_gather", "forward")},
                  {key: worst_rank(ranks, "reduce_scatter", "backward")}, checkpointing)


def gather_links(key: str, hw: HardwareSpec, layout: Degrees) -> dict[str, str]:
    """The link its collectives cross: the whole sequence group's."""
    return {key: link_name(hw, axis_groups(layout, "sequence")[:1])}


def gather_comm_seconds(ranks: list[RankTraffic], hw: HardwareSpec, layout: Degrees) -> tuple[float, float]:
    """(forward, backward) seconds of its collectives on the busiest rank, end to end."""
    group = axis_groups(layout, "sequence")[0]
    return tuple(gather_seconds(worst_rank(ranks, kind, phase), hw, group)
                 for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")))


def serial_layer_seconds(layer: CostedLayer, hw: HardwareSpec, fsdp_ranks: list[int],
                          compute: tuple[float, float], comm: tuple[float, float],
                          kept: tuple[float, float] = (0.0, 0.0)) -> dict[str, float]:
    """``total``, ``compute``, ``serial`` and ``forward`` (with its FSDP gather beside it) seconds of a layer whose
    sequence communication overlaps nothing:
    ``compute`` and ``comm`` its (forward, backward) seconds of each, the forward run again in backward under
    checkpointing but for ``kept`` (the forward's compute and comm seconds the recompute skips: a sparse layer's
    selection under ``keep_attention``); its FSDP gathers prefetched beside its forward and backward, the
    reduce-scatter beside backward."""
    work, layout = layer.work, layer.layout
    fwd, bwd = compute[0] + comm[0], compute[1] + comm[1]
    again = (compute[0] - kept[0], comm[0] - kept[1]) if work.checkpointing else (0.0, 0.0)
    bwd += sum(again)
    ag, rs = layer_fsdp_seconds(layer.params(), work, layout, hw, fsdp_ranks)
    return {"total": max(fwd, ag) + max(bwd, ag + rs), "compute": compute[0] + again[0] + compute[1],
            "serial": comm[0] + again[1] + comm[1] + 2 * ag + rs, "forward": max(fwd, ag)}
