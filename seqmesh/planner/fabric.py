"""What a node's GPUs share on the way to other nodes: the ``Fabric`` (its NICs, an oversubscribed leaf
switch), and ``GB``, the decimal unit links and NICs are quoted in. Below both ``hardware`` (a node's
fabric is part of its spec) and ``network`` (which times bytes over it).
"""

from __future__ import annotations

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
