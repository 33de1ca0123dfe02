"""The CUDA caching allocator's setting for long sequences.

At long lengths a step allocates and frees activations of many sizes; the caching allocator's fixed
segments then fragment, and a run can fail with gigabytes "reserved but unallocated".
``expandable_segments:True`` lets a segment grow in place instead, which is what DeepSpeed's ALST and
torchtitan run with. torch reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA first allocates, so it
must be set before that; ``seqmesh train`` calls :func:`configure_cuda_allocator` before creating its
process group. A value the user already set is left alone.
"""

from __future__ import annotations

import os

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
LONG_SEQUENCE_SETTING = "expandable_segments:True"


def configure_cuda_allocator(environ: dict | None = None) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when CUDA is available and the variable is
    unset; returns the value in effect (None without CUDA)."""
    import torch

    environ = os.environ if environ is None else environ
    if not torch.cuda.is_available():
        return None
    return environ.setdefault(ALLOC_CONF, LONG_SEQUENCE_SETTING)
