"""``seqmesh plan``: memory, traffic and step time of every layout of a cluster, and a recommendation.

- :mod:`.workload`  what is planned: the layout, the training step, a fixed global batch
- :mod:`.hardware`  GPUs, their link hierarchy (presets, custom links) and ring kernel efficiency
- :mod:`.network`   collective time over link levels and a node's shared NICs and switches (the fabric)
- :mod:`.traffic`   exact per-rank bytes of seqmesh's collectives; FSDP and tensor-parallel references
- :mod:`.layers`    one decoder layer's cost by kind: full, sliding-window, Gated DeltaNet, tensor-parallel
- :mod:`.memory`    per-GPU memory by purpose
- :mod:`.timing`    compute and communication time, with what overlaps
- :mod:`.plan`      candidates (one evaluated layout each), ranking, per-layer and per-step traffic, longest sequence
- :mod:`.recommend` the pick among close predictions and the sentence that says why
- :mod:`.report`    the table and the text around it
- :mod:`.calibrate` this machine's measured throughput and bandwidth
"""

from .network import Fabric
from .hardware import PRESETS, Cluster, HardwareSpec, LinkLevel, RingEfficiency, make_cluster
from .memory import MemoryBreakdown, memory_per_gpu
from .plan import Candidate, Plan, longest_plan, longest_sequence, plan
from .timing import StepTime, step_time
from ..padding import padded_length
from ..heads import HeadDeal
from .traffic import attention_traffic
from ..degrees import Degrees
from .workload import GlobalBatch, Workload

__all__ = [
    "attention_traffic", "Candidate", "Cluster", "Fabric", "GlobalBatch", "HardwareSpec", "HeadDeal", "Degrees",
    "LinkLevel",
    "longest_plan", "longest_sequence", "make_cluster", "memory_per_gpu", "MemoryBreakdown", "padded_length",
    "Plan", "plan", "PRESETS", "RingEfficiency", "step_time", "StepTime", "Workload",
]
