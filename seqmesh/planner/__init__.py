"""``seqmesh plan``: memory, traffic and step time of every layout of a cluster, and a recommendation.

- :mod:`.hardware`  GPUs and their link hierarchy (presets, custom links, rank placement)
- :mod:`.fabric`    a node's NICs and the switches above: uplinks and bisection shared by concurrent traffic
- :mod:`.ring_efficiency` ring attention's split-and-merge efficiency by block size (published or measured)
- :mod:`.global_batch` a fixed global batch: which layouts give it, with how much gradient accumulation
- :mod:`.traffic`   exact per-rank bytes of seqmesh's collectives; FSDP and tensor-parallel references
- :mod:`.memory`    per-GPU memory by purpose
- :mod:`.timing`    compute and communication time, with what overlaps
- :mod:`.candidate` one evaluated layout (memory, traffic, time, feasibility)
- :mod:`.plan`      candidates, feasibility, ranking, per-layer and per-step traffic, the longest sequence
- :mod:`.recommend` the pick among close predictions and the sentence that says why
- :mod:`.report`    the table and the text around it
- :mod:`.calibrate` this machine's measured throughput and bandwidth
"""

from .candidate import Candidate
from .fabric import Fabric
from .global_batch import GlobalBatch
from .hardware import PRESETS, Cluster, HardwareSpec, LinkLevel, make_cluster
from .memory import MemoryBreakdown, memory_per_gpu
from .plan import Plan, longest_plan, longest_sequence, plan
from .ring_efficiency import RingEfficiency
from .timing import StepTime, step_time
from ..padding import padded_length
from .traffic import HeadDeal, attention_traffic
from .workload import Layout, Workload

__all__ = [
    "attention_traffic", "Candidate", "Cluster", "Fabric", "GlobalBatch", "HardwareSpec", "HeadDeal", "Layout",
    "LinkLevel",
    "longest_plan", "longest_sequence", "make_cluster", "memory_per_gpu", "MemoryBreakdown", "padded_length",
    "Plan", "plan", "PRESETS", "RingEfficiency", "step_time", "StepTime", "Workload",
]
