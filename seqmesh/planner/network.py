"""How long bytes take on a cluster: every group of a layout that runs a collective at once (ranks placed TP
innermost, then Ulysses, ring, data parallel), the link levels each crosses, and what a node's GPUs share (the
``Fabric`` of :mod:`.fabric`: its NICs, an oversubscribed leaf switch). The bounds: docs/planner.md ("Between nodes").
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from .fabric import GB, Fabric

if TYPE_CHECKING:
    from .hardware import HardwareSpec
    from ..rules.degrees import Degrees

MAX_GROUPS_CHECKED = 64


def _busiest_node_load(off_node: Counter, off_switch: Counter, fabric: Fabric) -> float:
    """Bytes the busiest node must push per byte of its uplinks' bandwidth: its own off-node bytes, or
    its off-switch bytes times the oversubscription, whichever is larger."""
    return max(max(off_node.values(), default=0.0), max(off_switch.values(), default=0.0) * fabric.oversubscription)


def all_to_all_load(groups: Sequence[Sequence[int]], fabric: Fabric, gpus_per_node: int) -> float:
    """Bytes the busiest node sends off-node (or, times the oversubscription, off its switch) per byte each rank
    sends, when every group in ``groups`` runs an all-to-all at once: ``(n - m) / (n - 1)`` of each rank's bytes."""
    off_node, off_switch = Counter(), Counter()
    per_switch = fabric.nodes_per_switch
    for ranks in groups:
        if len(ranks) < 2:
            continue
        nodes = Counter(r // gpus_per_node for r in ranks)
        switches = Counter(r // gpus_per_node // per_switch for r in ranks) if per_switch else None
        for r in ranks:
            node = r // gpus_per_node
            off_node[node] += (len(ranks) - nodes[node]) / (len(ranks) - 1)
            if switches is not None:
                off_switch[node] += (len(ranks) - switches[node // per_switch]) / (len(ranks) - 1)
    return _busiest_node_load(off_node, off_switch, fabric)


def _runs(keys: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(key, start, length)`` of each stretch of equal consecutive ``keys``."""
    runs: list[tuple[int, int, int]] = []
    for i, k in enumerate(keys):
        if runs and runs[-1][0] == k:
            runs[-1] = (k, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((k, i, 1))
    return runs


def _leaving(run: tuple[int, int, int], same_key: list[tuple[int, int, int]], shift: int, size: int) -> int:
    """How many members of ``run`` send, ``shift`` places on in a group of ``size``, to a member outside
    every run of ``same_key``: the run's length less its shifted copy's overlap with them (mod ``size``)."""
    _, start, length = run
    lo, hi = start + shift, start + shift + length  # below 2 * size
    staying = 0
    for _, s, n in same_key:
        staying += max(0, min(hi, s + n) - max(lo, s)) + max(0, min(hi, s + size + n) - max(lo, s + size))
    return length - staying


def _deciding_shifts(shifts: Iterable[int], terms: list) -> Iterable[int]:
    """The shifts worth evaluating. Each count of leaving members is piecewise linear in the shift, with
    corners where the shifted run starts or stops overlapping a run it stays in (mod the group's size), so
    over a range of shifts the busiest node's count peaks at a corner or at an end of the range."""
    if not isinstance(shifts, range) or shifts.step != 1 or len(shifts) < 3:
        return shifts
    corners = {shifts.start, shifts.stop - 1}
    for size, _, _, (_, start, length), node_same, switch_same in terms:
        for _, s, n in (*node_same, *switch_same):
            for d in (s - start, s - start + size):
                corners.update((d - length, d + n - length, d, d + n))
    return sorted(t for t in corners if t in shifts)


def ring_load(groups: Sequence[Sequence[int]], fabric: Fabric, gpus_per_node: int,
              shifts: Iterable[int] = (1,)) -> float:
    """The same for ring messages, each rank's to the rank ``shift`` places on, at the worst of ``shifts``: counted
    per stretch of a group on one node (a shift costs the stretches, not the ranks), alike groups once."""
    per_switch = fabric.nodes_per_switch
    distinct = Counter(tuple(r // gpus_per_node for r in ranks) for ranks in groups if len(ranks) > 1)
    terms = []  # (group size, copies, node, the node's run, runs of the same node, runs of the same switch)
    for nodes, copies in distinct.items():
        node_runs = _runs(nodes)
        switch_runs = _runs([n // per_switch for n in nodes]) if per_switch else []
        for run in node_runs:
            node = run[0]
            same_switch = [r for r in switch_runs if r[0] == node // per_switch] if per_switch else []
            terms.append((len(nodes), copies, node, run, [r for r in node_runs if r[0] == node], same_switch))
    worst = 0.0
    for shift in _deciding_shifts(shifts, terms):
        off_node, off_switch = Counter(), Counter()
        for size, copies, node, run, node_same, switch_same in terms:
            off_node[node] += copies * _leaving(run, node_same, shift, size)
            if per_switch:  # the node's own members whose message leaves its leaf switch
                off_switch[node] += copies * _leaving(run, switch_same, shift, size)
        worst = max(worst, _busiest_node_load(off_node, off_switch, fabric))
    return worst


def parse_fabric(text: str) -> Fabric:
    """``NICS:GBS[:OVERSUB[:NODES_PER_SWITCH]]``, e.g. ``8:40`` (8 NICs of 40 GB/s achievable, non-blocking)
    or ``8:40:2:16`` (2:1 oversubscribed above leaf switches of 16 nodes)."""
    parts = text.split(":")
    try:
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"{len(parts)} fields")
        nics, gbs = int(parts[0]), float(parts[1])
        oversub = float(parts[2]) if len(parts) > 2 else 1.0
        per_switch = int(parts[3]) if len(parts) > 3 else 0
    except ValueError as err:
        raise ValueError(f"--fabric {text!r} must look like NICS:GBS[:OVERSUBSCRIPTION[:NODES_PER_SWITCH]], e.g. "
                         f"8:40 or 8:40:2:16 ({err}).") from None
    return Fabric(nics, gbs * GB, oversub, per_switch, source=f"--fabric {text}")


def world_rank(layout: Degrees, ulysses_rank: int, ring_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
    return tp_rank + layout.tp * (ulysses_rank + layout.ulysses * (ring_rank + layout.ring * dp_rank))


@lru_cache(maxsize=256)
def every_group(layout: Degrees, kind: str) -> tuple[tuple[int, ...], ...]:
    """Every Ulysses, ring, sequence (ulysses x ring) or tensor-parallel group of ``layout``: the groups that run
    a collective at the same moment (one set per TP rank: each TP rank's heads have their own Ulysses and ring
    groups, all busy at once)."""
    u, r, d, t = range(layout.ulysses), range(layout.ring), range(layout.dp_shard), range(layout.tp)
    if kind == "tp":
        return tuple(tuple(world_rank(layout, i, j, k, x) for x in t) for k in d for j in r for i in u)
    if kind == "ulysses":
        return tuple(tuple(world_rank(layout, i, j, k, x) for i in u) for k in d for j in r for x in t)
    if kind == "ring":
        return tuple(tuple(world_rank(layout, i, j, k, x) for j in r) for k in d for i in u for x in t)
    return tuple(tuple(world_rank(layout, i, j, k, x) for j in r for i in u) for k in d for x in t)


def axis_groups(layout: Degrees, kind: str) -> list[list[int]]:
    """A sample (every one, up to 64) of the Ulysses, ring or sequence groups of ``layout``."""
    groups = [list(g) for g in every_group(layout, kind)]
    return groups[:: max(1, len(groups) // MAX_GROUPS_CHECKED)]


def peer_patterns(hw: HardwareSpec, groups: list[list[int]]) -> set[tuple[int, ...]]:
    """Distinct ``peers per level`` tuples seen by the ranks of ``groups`` (an all-to-all's cost
    depends only on these)."""
    patterns = set()
    for ranks in groups:
        blocks = [Counter(r // lv.group if lv.group else 0 for r in ranks) for lv in hw.links]
        for me in ranks:
            same = [blocks[i][me // lv.group if lv.group else 0] for i, lv in enumerate(hw.links)]
            patterns.add(tuple(n - (same[i - 1] if i else 1) for i, n in enumerate(same)))
    return patterns


def all_to_all_from_patterns(nbytes: int, hw: HardwareSpec, patterns: set[tuple[int, ...]]) -> float:
    worst = 0.0
    for peers in patterns:
        others = sum(peers)
        if not others or not nbytes:
            continue
        top = max(i for i, n in enumerate(peers) if n)
        transfer = max(n * nbytes / others / hw.links[i].bandwidth for i, n in enumerate(peers) if n)
        worst = max(worst, hw.links[top].latency + transfer)
    return worst


@lru_cache(maxsize=1024)
def _uplink_load(layout: Degrees, kind: str, fabric: Fabric, gpus_per_node: int) -> float:
    groups = every_group(layout, kind)
    if kind == "ring":
        return ring_load(groups, fabric, gpus_per_node, ring_shifts(layout))
    return all_to_all_load(groups, fabric, gpus_per_node)


def ring_shifts(layout: Degrees) -> range:
    """How far ring messages travel: one rank (docs/planner.md, "Between nodes", says why)."""
    return range(1, min(2, layout.ring))


def uplink_seconds(nbytes: int, hw: HardwareSpec, layout: Degrees, kind: str) -> float:
    """The network's latency plus the busiest node's uplink time when every ``kind`` group of ``layout`` sends
    ``nbytes`` per rank at once (an all-to-all, or a ring hop); 0 without a fabric or when nothing leaves a node."""
    if hw.fabric is None or not nbytes:
        return 0.0
    load = _uplink_load(layout, kind, hw.fabric, hw.gpus_per_node)
    return hw.links[-1].latency + nbytes * load / hw.fabric.node_bandwidth if load else 0.0


def shared_links_load(hw: HardwareSpec, groups: Sequence[Sequence[int]], ring: bool = False) -> dict[int, float]:
    """Per link level shared by several GPUs (``LinkLevel.shared_by``): the busiest shared link's load, in
    multiples of the bytes one rank sends, when every group of ``groups`` runs at once. An all-to-all rank
    sends ``1 / (n - 1)`` of its bytes to each of its group's other ranks; a ring rank sends all of them to the
    next rank of its group. What crosses the level from a block of ``shared_by`` GPUs goes through its one
    link. Blocks of the first node stand for every node (they are alike)."""
    loads: dict[int, float] = {}
    first = hw.gpus_per_node
    for i, lv in enumerate(hw.links):
        if lv.shared_by <= 1:
            continue
        load: Counter = Counter()
        for ranks in groups:
            n = len(ranks)
            if n < 2 or min(ranks) >= first:
                continue
            for k, r in enumerate(ranks):
                if r >= first:
                    continue
                peers = [ranks[(k + 1) % n]] if ring else [p for p in ranks if p != r]
                share = 1.0 if ring else 1.0 / (n - 1)
                load[r // lv.shared_by] += share * sum(hw.level_of_pair(r, p) == i for p in peers)
        if load and max(load.values()) > 0:
            loads[i] = max(load.values())
    return loads


def shared_links_seconds(nbytes: int, hw: HardwareSpec, groups: Sequence[Sequence[int]], ring: bool = False) -> float:
    """The slowest shared link's time for ``nbytes`` per rank (:func:`shared_links_load`); 0 without one."""
    loads = shared_links_load(hw, tuple(tuple(g) for g in groups), ring) if nbytes else {}
    return max((hw.links[i].latency + nbytes * load / hw.links[i].bandwidth for i, load in loads.items() if load),
               default=0.0)


def axis_all_to_all_seconds(calls: Iterable[int], hw: HardwareSpec, layout: Degrees, kind: str) -> float:
    """All-to-alls of ``calls`` bytes per rank, one after another, run by every ``kind`` group of ``layout`` at once:
    each takes the longest of its levels, the busiest shared link within a node and the busiest node's uplinks."""
    patterns = peer_patterns(hw, axis_groups(layout, kind))
    groups = every_group(layout, kind)
    return sum(max(all_to_all_from_patterns(n, hw, patterns), shared_links_seconds(n, hw, groups),
                   uplink_seconds(n, hw, layout, kind)) for n in calls)


def concurrent_all_to_all_seconds(nbytes: int, hw: HardwareSpec, groups: Sequence[Sequence[int]]) -> float:
    """All-to-alls of ``nbytes`` per rank over every group of ``groups`` at once: the slowest rank's levels or the
    busiest node's uplinks, whichever is longer."""
    sample = [list(g) for g in groups][:: max(1, len(groups) // MAX_GROUPS_CHECKED)]
    levels = max(all_to_all_from_patterns(nbytes, hw, peer_patterns(hw, sample)), shared_links_seconds(nbytes, hw, groups))
    if hw.fabric is None or not nbytes:
        return levels
    shared = nbytes * all_to_all_load(groups, hw.fabric, hw.gpus_per_node) / hw.fabric.node_bandwidth
    return max(levels, hw.links[-1].latency + shared if shared else 0.0)


def gather_seconds(nbytes: int, hw: HardwareSpec, ranks: list[int]) -> float:
    """An all-gather or reduce-scatter in which each rank sends ``nbytes``."""
    if len(ranks) < 2 or nbytes == 0:
        return 0.0
    level = hw.links[hw.level_of_group(ranks)]
    return level.latency * math.ceil(math.log2(len(ranks))) + nbytes / level.bandwidth


def fsdp_seconds(sent: dict[str, int], hw: HardwareSpec, ranks: list[int]) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds of an FSDP unit over ``ranks`` sending ``sent`` (``fsdp_traffic``'s)."""
    return tuple(gather_seconds(sent[k], hw, ranks) for k in ("all_gather_forward", "reduce_scatter_backward"))


def ring_hop_seconds(nbytes: int, hw: HardwareSpec, layout: Degrees) -> float:
    """One ring hop of ``nbytes``: the slowest neighbour pair of any ring group, or the busiest node's uplinks
    shared by every message that leaves it at once, whichever is longer."""
    worst = 0.0
    for g in axis_groups(layout, "ring"):
        for i, a in enumerate(g):
            lv = hw.links[hw.level_of_pair(a, g[(i + 1) % len(g)])]
            worst = max(worst, lv.latency + nbytes / lv.bandwidth)
    shared = shared_links_seconds(nbytes, hw, every_group(layout, "ring"), ring=True)
    return max(worst, shared, uplink_seconds(nbytes, hw, layout, "ring"))


def link_name(hw: HardwareSpec, groups: list[list[int]]) -> str:
    """The slowest link level any of ``groups`` crosses ("-" when no group has two ranks)."""
    levels = [hw.level_of_group(g) for g in groups if len(g) > 1]
    return hw.links[max(levels)].name if levels else "-"
