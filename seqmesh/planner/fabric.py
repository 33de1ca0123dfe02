"""How nodes reach one another: the NICs of a node and the switch fabric above them, and what traffic
between nodes costs when every group of a layout sends at once.

A link level (``hardware.LinkLevel``) says what *one* GPU can send; it cannot see that the GPUs of a
node share the node's NICs, nor that a leaf switch with fewer uplinks than downlinks (oversubscribed)
shares them again between its nodes. Every Ulysses group of a layout runs its all-to-all at the same
moment, and every ring group its hop, so the bytes that leave a node are the sum over its GPUs. Two
bounds follow, for the busiest node:

- uplinks: the bytes leaving the node over ``nics_per_node x nic_bandwidth``;
- bisection: the bytes leaving its leaf switch over that bandwidth divided by ``oversubscription``
  (a leaf of N nodes has N node-bandwidths down and N / oversubscription up; every node under it sends
  alike, so each gets 1 / oversubscription of its own bandwidth through the spine).

Nodes are aligned blocks of ``gpus_per_node`` ranks and leaf switches aligned blocks of
``nodes_per_switch`` nodes, following the rank placement of ``hardware``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class Fabric:
    """The network side of a node."""

    nics_per_node: int  # NICs of the compute fabric in one node
    nic_bandwidth: float  # achievable bytes/s one NIC sends
    oversubscription: float = 1.0  # leaf switch downlink / uplink bandwidth; 1 = non-blocking (full bisection)
    nodes_per_switch: int = 0  # nodes under one leaf switch; 0 = every node under one (no spine crossed)
    source: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        if self.nics_per_node < 1 or self.nic_bandwidth <= 0:
            raise ValueError(f"fabric: {self.nics_per_node} NICs per node of {self.nic_bandwidth / GB:g} GB/s; "
                             "need at least 1 NIC with a positive bandwidth, e.g. --fabric 8:40.")
        if self.oversubscription < 1:
            raise ValueError(f"fabric: oversubscription {self.oversubscription:g} must be >= 1 (1 is non-blocking; "
                             "2 means a leaf switch has half as much bandwidth up as down).")
        if self.nodes_per_switch < 0:
            raise ValueError(f"fabric: {self.nodes_per_switch} nodes per switch must be >= 1, or 0 for 'all'.")

    @property
    def node_bandwidth(self) -> float:
        """Bytes/s one node can send to other nodes, all its NICs together."""
        return self.nics_per_node * self.nic_bandwidth

    def as_dict(self) -> dict:
        return {"nics_per_node": self.nics_per_node, "nic_bandwidth": self.nic_bandwidth,
                "oversubscription": self.oversubscription, "nodes_per_switch": self.nodes_per_switch,
                "source": self.source}


def _busiest_node_load(off_node: Counter, off_switch: Counter, fabric: Fabric) -> float:
    """Bytes the busiest node must push per byte of its uplinks' bandwidth: its own off-node bytes, or
    its off-switch bytes times the oversubscription, whichever is larger."""
    return max(max(off_node.values(), default=0.0),
               max(off_switch.values(), default=0.0) * fabric.oversubscription)


def all_to_all_load(groups: Sequence[Sequence[int]], fabric: Fabric, gpus_per_node: int) -> float:
    """Bytes the busiest node sends off-node (or, scaled by the oversubscription, off its switch) per byte
    each rank sends, when every rank of every group in ``groups`` (all at once) spreads its bytes evenly
    over the other ranks of its group: a rank whose group has ``n`` ranks, ``m`` of them on its own node,
    sends ``(n - m) / (n - 1)`` of its bytes off the node."""
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


def ring_load(groups: Sequence[Sequence[int]], fabric: Fabric, gpus_per_node: int, shifts: Iterable[int] = (1,)) -> float:
    """The same for ring messages: every rank of every group sends one message to the rank ``shift``
    places after it in its group, all at once; the busiest node at the worst of ``shifts``. Counted per
    stretch of a group on one node, so a shift costs the stretches, not the ranks; groups on the same
    nodes in the same order are counted once, times their number."""
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


def all_to_all_uplink_seconds(nbytes: float, groups: Sequence[Sequence[int]], fabric: Fabric,
                              gpus_per_node: int) -> float:
    """Seconds the busiest node's uplinks need for all-to-alls of ``nbytes`` per rank over ``groups`` at once."""
    return nbytes * all_to_all_load(groups, fabric, gpus_per_node) / fabric.node_bandwidth


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
