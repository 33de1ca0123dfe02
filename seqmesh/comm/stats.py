"""Counting what each collective moves, per rank.

``with comm_stats() as stats:`` records every collective that seqmesh issues on this process while
the block runs (forward and backward), keyed by kind and phase. The counters are an observer: they
never change what is computed. Byte counts are what this rank sends to *other* ranks (its own chunk
of an all-to-all stays local and is not counted), in the element size of the tensor moved.

Algorithm-level accounting: an all-gather or reduce-scatter over G ranks is counted as
``(G - 1) x chunk`` bytes sent, which is what the ring and tree algorithms of NCCL and gloo send per
rank for large messages.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("all_to_all", "p2p", "all_gather", "reduce_scatter", "all_reduce", "control")  # control: input checks
PHASES = ("forward", "backward")


@dataclass
class CommStats:
    """Per-kind, per-phase call and byte counters of one rank."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes_sent: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes_received: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, phase: str, sent: int, received: int) -> None:
        key = (kind, phase)
        self.calls[key] += 1
        self.bytes_sent[key] += int(sent)
        self.bytes_received[key] += int(received)

    def count(self, kind: str, phase: str | None = None) -> int:
        """Number of calls of ``kind`` (all phases unless one is named)."""
        return sum(n for (k, p), n in self.calls.items() if k == kind and phase in (None, p))

    def sent(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes this rank sent to other ranks, filtered by kind and/or phase."""
        return sum(n for (k, p), n in self.bytes_sent.items() if kind in (None, k) and phase in (None, p))

    def received(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum(n for (k, p), n in self.bytes_received.items() if kind in (None, k) and phase in (None, p))

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{kind: {phase: {"calls": n, "bytes_sent": b, "bytes_received": r}}}`` for JSON output."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (kind, phase), n in sorted(self.calls.items()):
            out.setdefault(kind, {})[phase] = {
                "calls": n,
                "bytes_sent": self.bytes_sent[(kind, phase)],
                "bytes_received": self.bytes_received[(kind, phase)],
            }
        return out

    def table(self) -> str:
        """A small text table: kind, phase, calls, MiB sent."""
        lines = [f"{'collective':<15}{'phase':<10}{'calls':>7}{'MiB sent':>12}"]
        for (kind, phase), n in sorted(self.calls.items()):
            lines.append(f"{kind:<15}{phase:<10}{n:>7}{self.bytes_sent[(kind, phase)] / 2**20:>12.3f}")
        return "\n".join(lines)


_active: list[CommStats] = []
_lock = threading.Lock()


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Count the collectives seqmesh issues on this process inside the ``with`` block.

    Autograd may run backward on another thread, so the recorders are process-wide, not per thread.
    Nested blocks each see everything issued while they are open.
    """
    stats = CommStats()
    with _lock:
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)


def record(kind: str, phase: str, sent: int, received: int) -> None:
    """Called by seqmesh's collectives; a no-op when no ``comm_stats()`` block is open."""
    if not _active:
        return
    with _lock:
        for stats in _active:
            stats.record(kind, phase, sent, received)
