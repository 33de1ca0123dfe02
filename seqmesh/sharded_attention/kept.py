"""Checkpointed layers that keep their attention's output: the recompute in backward skips the attention.

Full activation checkpointing runs each decoder layer's forward twice, the second time in backward to rebuild what
the layer's backward reads. At long context the attention is most of that forward (its cost grows with the square
of the sequence; ring attention passes every K/V block round the ring again). With ``keep_attention`` each
checkpointed layer also keeps, from its forward, what seqmesh's attention returned: the output ``(B, n, h, Dv)`` in
the inputs' dtype and the log-sum-exp ``(B, h, n)`` in float32, over this rank's ``n`` query tokens and ``h`` heads
of each call (after Ulysses' exchange: the rank's share, the size of one ``(B, L, Hq, Dv)`` shard). The recompute
rebuilds everything else (the projections, Ulysses' exchanges) and hands the attention's backward the kept output:
its kernel and its ring passes run once forward and once backward, as without checkpointing.

The mechanism is the pair of contexts ``torch.utils.checkpoint`` takes (``context_fn``): while a layer's forward
runs under :func:`kept_attention_contexts`' first, every :class:`seqmesh.sharded_attention.ring.LocalAttention` or
``RingAttention`` call records its result (:func:`computed_or_kept`); while its recompute runs under the second,
each call takes the next one recorded instead of computing it, from the first each time torch recomputes (a graph
kept with ``retain_graph`` recomputes once a backward). The calls come in the same order both times (the recompute
runs the same code on the same inputs), and a kept output changed in place since, or a recompute that makes a call
the forward did not, is refused by name. A DeepSeek Sparse Attention layer records its indexer's selection the same
way (``seqmesh.hf.indexed_attention``): its recompute neither scores nor gathers the keys again.

Memory: a layer keeps its input (as under checkpointing) and these outputs until its backward
(``seqmesh.planner.activations.kept_attention_bytes``). They stay on the device with ``--offload-checkpoints``.
The gradients are those of plain checkpointing, bit for bit: the kept output is the one the forward computed, and
the backward reads the output and log-sum-exp either way.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

# (replaying, the record) of the checkpointed forward (False) or recompute (True) running in this thread; None elsewhere
_ACTIVE: contextvars.ContextVar[tuple[bool, _Record] | None] = contextvars.ContextVar("seqmesh_kept_attention",
                                                                                        default=None)
# (pack, unpack) a kept tensor is held through, as autograd's saved-tensor hooks: the memory tracker's, which counts
# it as an activation while it is kept; None: held as it is
_KEEPER: contextvars.ContextVar[tuple[Callable, Callable] | None] = contextvars.ContextVar("seqmesh_attention_keeper",
                                                                                           default=None)


class _Record:
    """One checkpointed forward's attention results, in call order (each: the held tensors, how to read them back,
    their version counters), and the next one a recompute reads."""

    __slots__ = ("entries", "cursor")

    def __init__(self) -> None:
        self.entries: list[tuple[tuple, Callable, tuple[int, ...]]] = []
        self.cursor = 0


class _Mode:
    """The forward's (``replay`` False) or the recompute's context over ``record``; enterable again, as torch enters the
    recompute's once for each backward through a graph kept with ``retain_graph``."""

    def __init__(self, replay: bool, record: _Record) -> None:
        self.replay, self.record, self._tokens = replay, record, []

    def __enter__(self) -> None:
        if self.replay:
            self.record.cursor = 0
        self._tokens.append(_ACTIVE.set((self.replay, self.record)))

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._tokens.pop())


def kept_attention_contexts() -> tuple[_Mode, _Mode]:
    """``torch.utils.checkpoint``'s ``context_fn``: one call per checkpointed forward, a fresh record shared by the
    forward's context (which fills it) and the recompute's (which reads it, from the start each time). The record
    lives as long as torch keeps the two contexts: until the layer's graph is freed by its backward."""
    record = _Record()
    return _Mode(False, record), _Mode(True, record)


@contextlib.contextmanager
def kept_through(pack: Callable, unpack: Callable) -> Iterator[None]:
    """Attention outputs recorded inside are held as ``pack(tensor)`` and read back with ``unpack`` (as autograd's
    ``saved_tensors_hooks``: :class:`seqmesh.memory.MemoryTracker` counts them as activations this way)."""
    token = _KEEPER.set((pack, unpack))
    try:
        yield
    finally:
        _KEEPER.reset(token)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def computed_or_kept(compute: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``compute()`` (an attention's ``(out, lse)``; a sparse layer's ``(selection,)``), recorded under a checkpointed
    forward that keeps attention, or the next recorded result under its recompute."""
    active = _ACTIVE.get()
    if active is None:
        return compute()
    replay, record = active
    if not replay:
        result = compute()
        pack, unpack = _KEEPER.get() or (_as_is, _as_is)
        record.entries.append((tuple(pack(t.detach()) for t in result), unpack, tuple(t._version for t in result)))
        return result
    if record.cursor == len(record.entries):
        raise RuntimeError("keep_attention: the recompute of a checkpointed layer called seqmesh's attention more "
                           "often than its forward did (the layer took another path the second time); train it without "
                           "--keep-attention.")
    held, unpack, versions = record.entries[record.cursor]
    record.cursor += 1
    result = tuple(unpack(t) for t in held)
    if tuple(t._version for t in result) != versions:
        raise RuntimeError("keep_attention: the attention output a checkpointed layer kept was changed in place after "
                           "its forward, so its backward would read another value; train this model without "
                           "--keep-attention.")
    return result
