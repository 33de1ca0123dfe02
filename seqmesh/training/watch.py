"""Guards around each training step: non-finite losses and gradients, and ranks that stall.

A NaN or inf loss or gradient norm is caught before the optimizer step, so the weights, and every
checkpoint written from them, stay finite. The loss and the global gradient norm are the same on
every rank (both are reduced over all ranks), so every rank reaches the same verdict without an
extra collective; reading them costs one host sync per step.

A rank that stops responding without dying is named by the heartbeat (:mod:`.heartbeat`), and the
collective timeout every process group has (``--timeout``) ends a job whose rank is alive but never
joins. Rank 0's :class:`StallWatch` warns when steps stop finishing, long before that default of 300 s
runs out, so a slow or stuck job is visible while it is so. The first step of a run is not timed: under
``--compile`` it compiles every layer (minutes on a large model), and it warms up kernels and caches.
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
    slowest step so far, whichever is longer; silent until the run's first step has finished, which is
    neither a stall nor the slowest step (compilation, warm-up)."""

    def __init__(self, after: float, timeout: float, stream=sys.stderr, poll: float = 5.0):
        self.after, self.timeout, self.stream, self.poll = after, timeout, stream, poll
        self.last = time.monotonic()
        self.slowest = 0.0
        self.step = 0
        self.beats = 0  # steps finished in this run
        self.warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """Step ``step`` finished."""
        now = time.monotonic()
        if self.beats:  # the first step's time is compilation and warm-up, not a measure of a step
            self.slowest = max(self.slowest, now - self.last)
        self.beats += 1
        self.last, self.step, self.warned = now, step, False

    def limit(self) -> float:
        return max(self.after, 10 * self.slowest)

    def check(self, now: float | None = None) -> str | None:
        """The warning to print now, if the run has stalled and it was not yet printed."""
        waited = (time.monotonic() if now is None else now) - self.last
        if self.warned or not self.beats or waited < self.limit():
            return None
        self.warned = True
        return (f"warning: no step has finished for {waited:.0f} s (after step {self.step}; the slowest step took "
                f"{self.slowest:.1f} s). A rank may be slow or stuck; one that stops answering ends the job within "
                f"--timeout ({self.timeout:.0f} s).")

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
