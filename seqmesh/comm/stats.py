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
    """Count the collectives seqmesh issues on this process inside the ``with`` block, and those DTensor
    issues for tensor parallelism (its gathers and reductions between the sharded layers).

    Autograd may run backward on another thread, so the recorders are process-wide, not per thread.
    Nested blocks each see everything issued while they are open.
    """
    stats = CommStats()
    with _lock:
        _active.append(stats)
    try:
        with _dtensor_collectives():
            yield stats
    finally:
        with _lock:
            _active.remove(stats)


def _phase() -> str:
    import torch

    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"  # inside autograd's engine


def _group_size(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _record_functional(name: str, args: tuple) -> None:
    """What one of torch's functional collectives (``_c10d_functional``, which DTensor issues) sends, counted
    as seqmesh's own collectives are (see the module docstring)."""
    t = args[0]
    nbytes = t.numel() * t.element_size()
    if name == "all_gather_into_tensor":  # (input, group_size, group_name): each rank's chunk to the others
        g = int(args[1])
        record("all_gather", _phase(), (g - 1) * nbytes, (g - 1) * nbytes)
    elif name == "reduce_scatter_tensor":  # (input, op, group_size, group_name): all but one chunk sent
        g = int(args[2])
        record("reduce_scatter", _phase(), (g - 1) * nbytes // g, (g - 1) * nbytes // g)
    elif name == "all_reduce":  # (input, op, group_name)
        g = _group_size(args[2])
        record("all_reduce", _phase(), 2 * (g - 1) * nbytes // g, 2 * (g - 1) * nbytes // g)
    elif name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
        g = _group_size(args[3])
        record("all_to_all", _phase(), (g - 1) * nbytes // g, (g - 1) * nbytes // g)


@contextlib.contextmanager
def _dtensor_collectives() -> Iterator[None]:
    """A dispatch mode that sees the functional collectives DTensor lowers its redistributions to. A DTensor
    operator is first handed back (``NotImplemented``) so DTensor runs and its collectives come through here
    as plain operators; nothing is changed. Without DTensor (torch without distributed) it does nothing."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        yield
        return

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if func.namespace == "_c10d_functional":
                _record_functional(func._opname, args)
            return out

    with Collectives():
        yield


def record(kind: str, phase: str, sent: int, received: int) -> None:
    """Called by seqmesh's collectives; a no-op when no ``comm_stats()`` block is open."""
    if not _active:
        return
    with _lock:
        for stats in _active:
            stats.record(kind, phase, sent, received)
