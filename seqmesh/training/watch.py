"""Guards around each training step: non-finite losses and gradients, and ranks that stall.

A NaN or inf loss or gradient norm is caught before the optimizer step, so the weights, and every
checkpoint written from them, stay finite. The loss and the global gradient norm are the same on
every rank (both are reduced over all ranks), so every rank reaches the same verdict without an
extra collective; reading them costs one host sync per step.

A rank that stops responding without dying leaves the others waiting in a collective until the
process group's timeout (``--timeout``) ends the job. Rank 0's :class:`StallWatch` prints a warning
long before that, so a stuck job is visible while it is stuck.
"""

from __future__ import annotations

import sys
import threading
import time


NONFINITE_POLICIES = ("stop", "skip")


def nonfinite_message(step: int, loss: float, norm: float, lr: float) -> str:
    return (f"step {step}: the loss is {loss} and the gradient norm {norm}; stopped before the optimizer step, so the "
            f"weights and every checkpoint are finite. Lower --lr (now {lr:g} at this step), check the data, or pass "
            "--on-nonfinite skip to skip such steps.")


class StallWatch:
    """Warns (once per stall) when no step has finished for ``after`` seconds, or for 10 times the
    slowest step so far, whichever is longer. ``compiling``: the first step compiles (``--compile``), which is
    not a stall: it is not watched, and its time is no step's (only the process-group timeout bounds it)."""

    def __init__(self, after: float, timeout: float, stream=sys.stderr, poll: float = 5.0, compiling: bool = False):
        self.after, self.timeout, self.stream, self.poll = after, timeout, stream, poll
        self.last = time.monotonic()
        self.slowest = 0.0
        self.step = 0
        self.warned = False
        self.compiling = compiling
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """Step ``step`` finished."""
        now = time.monotonic()
        if not self.compiling:
            self.slowest = max(self.slowest, now - self.last)
        self.last, self.step, self.warned, self.compiling = now, step, False, False

    def limit(self) -> float:
        return max(self.after, 10 * self.slowest)

    def check(self, now: float | None = None) -> str | None:
        """The warning to print now, if the run has stalled and it was not yet printed."""
        waited = (time.monotonic() if now is None else now) - self.last
        if self.compiling or self.warned or waited < self.limit():
            return None
        self.warned = True
        return (f"warning: no step has finished for {waited:.0f} s (after step {self.step}; the slowest step took "
                f"{self.slowest:.1f} s). A rank may be stopped or stuck; the job ends when the process-group timeout "
                f"({self.timeout:.0f} s, --timeout) runs out.")

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            message = self.check()
            if message:
                print(message, file=self.stream, flush=True)

    def __enter__(self) -> "StallWatch":
        self.last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="seqmesh-stall-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
