"""One layout, evaluated: a ``Candidate`` (memory, traffic, time, feasibility), made by :mod:`.plan` and
chosen among by :mod:`.recommend`, so it lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..rules.degrees import Degrees
    from .memory import MemoryBreakdown
    from .timing import StepTime


@dataclass(frozen=True)
class Candidate:
    """One layout, evaluated."""

    layout: Degrees
    memory: MemoryBreakdown
    comm_per_layer: dict[str, dict[str, int]]  # phase -> collective -> bytes the busiest rank sends in one layer
    comm_links: dict[str, str]  # collective -> the link level it crosses
    comm_per_step: dict[str, int]  # collective -> bytes the busiest rank sends in one step (all phases, every unit)
    time: StepTime
    tokens_per_s: float
    feasible: bool
    problems: tuple[str, ...] = ()  # why it is infeasible
    notes: tuple[str, ...] = ()  # uneven heads, kv replication, padding
    accumulation: int = 1  # micro-steps (gradient accumulation) per optimizer step for the global batch

    @property
    def optimizer_step_s(self) -> float:
        """One optimizer step: ``accumulation`` micro-steps (see :class:`.workload.GlobalBatch`)."""
        return self.accumulation * self.time.total

    def as_dict(self) -> dict:
        lay = self.layout
        return {"layout": lay.as_dict(), "label": lay.label(), "runs_on_seqmesh": lay.runs_on_seqmesh,
                "memory_bytes": self.memory.as_dict(), "memory_peak_at": self.memory.moment,
                "comm_bytes_per_layer": self.comm_per_layer, "comm_bytes_per_step": self.comm_per_step,
                "comm_links": self.comm_links, "step_time_s": self.time.total, "time_s": self.time.as_dict(),
                "tokens_per_s": self.tokens_per_s, "grad_accumulation": self.accumulation,
                "optimizer_step_s": self.optimizer_step_s, "feasible": self.feasible,
                "problems": list(self.problems), "notes": list(self.notes)}
