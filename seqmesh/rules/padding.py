"""How long a sequence becomes once padded for a layout: the one rule the runtime (``SequenceLayout``)
and the planner (``seqmesh plan``) share. Torch-free, so the planner starts without torch."""

from __future__ import annotations

import math


def padding_multiple(layout: str, ring: int, ulysses: int) -> int:
    """A padded length must be a multiple of this for ``layout`` on a ``ring x ulysses`` group: a ring
    rank of a balanced layout (zigzag, per_document) holds two equal chunks that its Ulysses ranks split
    evenly, so ``ring * lcm(2, ulysses)``; a contiguous layout (or no ring) needs ``ring * ulysses``."""
    if layout != "contiguous" and ring > 1:
        return ring * math.lcm(2, ulysses)
    return ring * ulysses


def padded_length(seq_len: int, ulysses: int, ring: int, layout: str = "zigzag", tp: int = 1) -> int:
    """``seq_len`` rounded up to the next multiple of :func:`padding_multiple`, times ``tp``: with tensor
    parallelism each rank's share is cut into ``tp`` equal slices between the tensor-parallel regions."""
    if seq_len < 1:
        raise ValueError(f"sequence length must be at least 1, got {seq_len}.")
    multiple = padding_multiple(layout, ring, ulysses) * tp
    return -(-seq_len // multiple) * multiple
