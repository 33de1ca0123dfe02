"""Whether a tensor has values to read: the one question seqmesh's data-dependent checks ask before they read one.

Under ``seqmesh rehearse`` tensors are torch's fake tensors (shapes, dtypes and devices, no data): a check that
reads values (that the ranks agree on a call, that no label is out of range) has nothing to check there, and
reading one would raise torch's ``DataDependentOutputException``. Each such check asks :func:`has_values` first.
A probe that computes on its own tensors (random inputs, nothing of the step's) runs inside :func:`real_tensors`.
A read the step cannot do without (the expert-parallel exchange's sizes) goes through :func:`host_ints`, which
takes the rehearsal's assumption where there are no values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor (torch's ``FakeTensor``, or a wrapper such as a DTensor around one)."""
    return not is_fake(t)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made inside are real even under a rehearsal's fake mode (torch's ``unset_fake_temporarily``; a
    no-op without one): for probes on their own data and the layout's host arithmetic, never for the step's tensors.
    While torch.compile traces it does nothing (dynamo cannot trace the mode switch; its fake tensors are its own)."""
    if torch.compiler.is_compiling():
        yield
        return
    with unset_fake_temporarily():
        yield


def host_ints(t: torch.Tensor, assumed: Callable[[], list[int]]) -> list[int]:
    """``t``'s values on the host (one device-to-host read), or, for a fake tensor, ``assumed()``: what a rehearsal
    takes them to be (its documented assumption, e.g. tokens routed evenly over the experts)."""
    return t.tolist() if has_values(t) else assumed()
