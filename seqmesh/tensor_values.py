"""Whether a tensor has values to read: the one question seqmesh's data-dependent checks ask before they read one.

Under ``seqmesh rehearse`` tensors are torch's fake tensors (shapes, dtypes and devices, no data): a check that
reads values (that the ranks agree on a call, that no label is out of range) has nothing to check there, and
reading one would raise torch's ``DataDependentOutputException``. Each such check asks :func:`has_values` first.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor (torch's ``FakeTensor``, or a wrapper such as a DTensor around one)."""
    return not is_fake(t)
