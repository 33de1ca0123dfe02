"""How much of one attention call's speed ring attention keeps as its blocks shrink.

Ring attention runs one kernel call per ring step on a block of ``padded_len / ring`` query tokens
against as many keys, and merges each step's output into float32 accumulators. The *split-and-merge
efficiency* is one attention call over the whole work divided by the time of those block calls and
merges: exactly the ratio ``seqmesh bench merge`` measures on one device. The timing model divides a
ring's attention compute by it, so it covers both the smaller kernels and the merges.

Two shapes:

- measured: points ``(block tokens, efficiency)`` from ``seqmesh bench merge --json``, interpolated
  linearly in ``log2(block tokens)`` and held flat beyond the first and last point;
- the default, from a published figure: a fixed overhead of ``t0`` tokens per block,
  ``efficiency = b / (b + t0)``. Per ring step the kernel's work grows as ``b^2`` (pairs) while the
  merges reread and rewrite the accumulators of ``b`` tokens, so their ratio falls as ``1 / b``.
  ``t0`` is set so that a block of 8192 tokens keeps 90.2%: ring-flash-attention's zigzag ring,
  forward + backward on 8 x H800 with Llama-3.1-8B's attention shape and 8K tokens per GPU
  (https://github.com/zhuzilin/ring-flash-attention, README table; 89.8% on 8 x A100).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

PUBLISHED_BLOCK_TOKENS = 8192
PUBLISHED_EFFICIENCY = 0.902
PUBLISHED_SOURCE = ("ring-flash-attention README: zigzag ring fwd+bwd 90.2% of ideal on 8 x H800 (89.8% on "
                    "8 x A100), Llama-3.1-8B attention, 8K tokens per GPU; efficiency = b / (b + t0) through it")


@dataclass(frozen=True)
class RingEfficiency:
    """Split-and-merge efficiency as a function of ring block tokens: measured ``points``, or, without
    points, the fixed-overhead form ``b / (b + overhead_tokens)``."""

    points: tuple[tuple[int, float], ...] = ()  # (block tokens, efficiency), ascending tokens
    overhead_tokens: float = 0.0  # t0 of the fixed-overhead form; used when there are no points
    source: str = ""

    def __post_init__(self) -> None:
        tokens = [b for b, _ in self.points]
        if tokens != sorted(set(tokens)) or any(b < 1 for b in tokens):
            raise ValueError(f"ring efficiency points {self.points}: block tokens must be positive, distinct and "
                             "ascending.")
        for b, eff in self.points:  # above 1 is possible: smaller blocks can fit caches better (CPU: up to 1.04)
            if not eff > 0:
                raise ValueError(f"ring efficiency {eff} at {b} block tokens must be positive (one call's time over "
                                 "the split-and-merge time); check the bench output.")
        if self.overhead_tokens < 0:
            raise ValueError(f"ring efficiency overhead {self.overhead_tokens} tokens cannot be negative.")

    @classmethod
    def through(cls, block_tokens: int, efficiency: float, source: str = "") -> RingEfficiency:
        """The fixed-overhead form that keeps ``efficiency`` at ``block_tokens``."""
        if not 0 < efficiency <= 1:
            raise ValueError(f"ring efficiency {efficiency} must be in (0, 1] for the fixed-overhead form.")
        return cls(overhead_tokens=block_tokens * (1 / efficiency - 1), source=source)

    def at(self, block_tokens: float) -> float:
        """Efficiency of a ring whose blocks hold ``block_tokens`` query tokens."""
        if not self.points:
            return block_tokens / (block_tokens + self.overhead_tokens)
        if block_tokens <= self.points[0][0]:
            return self.points[0][1]
        for (b0, e0), (b1, e1) in zip(self.points, self.points[1:]):
            if block_tokens <= b1:
                w = (math.log2(block_tokens) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return e0 + w * (e1 - e0)
        return self.points[-1][1]

    def as_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "overhead_tokens": self.overhead_tokens,
                "source": self.source}


DEFAULT_RING_EFFICIENCY = RingEfficiency.through(PUBLISHED_BLOCK_TOKENS, PUBLISHED_EFFICIENCY, PUBLISHED_SOURCE)
IDEAL_RING = RingEfficiency(points=((1, 1.0),), source="ideal: no loss on smaller blocks")


def from_merge_bench(rows: Iterable[dict], source: str = "seqmesh bench merge") -> RingEfficiency:
    """The measured curve from ``seqmesh bench merge --json`` rows (``block_tokens`` and ``efficiency``;
    rows of one block size are averaged)."""
    by_block: dict[int, list[float]] = {}
    for i, row in enumerate(rows):
        if "block_tokens" not in row or "efficiency" not in row:
            raise ValueError(f"ring efficiency row {i} {row} lacks block_tokens or efficiency; give the output of "
                             "`seqmesh bench merge --json`.")
        by_block.setdefault(int(row["block_tokens"]), []).append(float(row["efficiency"]))
    if not by_block:
        raise ValueError("ring efficiency: the bench output has no rows; run `seqmesh bench merge --json` with "
                         "--rings.")
    points = tuple((b, sum(e) / len(e)) for b, e in sorted(by_block.items()))
    return RingEfficiency(points=points, source=source)


def load_ring_efficiency(path: str) -> RingEfficiency:
    """Read ``seqmesh bench merge --json``'s output from ``path``."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--ring-efficiency {path}: cannot read it as JSON ({err}); save `seqmesh bench merge "
                         "--json > FILE` and pass FILE.") from None
    if not isinstance(rows, list):
        raise ValueError(f"--ring-efficiency {path}: expected a list of rows as `seqmesh bench merge --json` prints.")
    return from_merge_bench(rows, source=f"seqmesh bench merge ({path})")
