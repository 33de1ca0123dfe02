"""``seqmesh plan``: memory, traffic and step time of every layout of a cluster, and a recommendation. Its modules,
one idea each, are listed in docs/planner.md ("What the code counts, module by module").
"""

from .fabric import Fabric
from .hardware import PRESETS, Cluster, HardwareSpec, LinkLevel, RingEfficiency, make_cluster
from .memory import MemoryBreakdown, memory_per_gpu
from .plan import Candidate, Plan, longest_plan, longest_sequence, plan
from .timing import StepTime, step_time
from ..rules.padding import padded_length
from ..rules.heads import HeadDeal
from .traffic import attention_traffic
from ..rules.degrees import Degrees
from .workload import GlobalBatch, Workload

__all__ = ["attention_traffic", "Candidate", "Cluster", "Fabric", "GlobalBatch", "HardwareSpec", "HeadDeal", "Degrees",
           "LinkLevel", "longest_plan", "longest_sequence", "make_cluster", "memory_per_gpu", "MemoryBreakdown",
           "padded_length", "Plan", "plan", "PRESETS", "RingEfficiency", "step_time", "StepTime", "Workload"]
