"""Host bookkeeping per call on the hot paths, with kernels and communication replaced by stand-ins.

What a layer pays on the host before and after its kernels, per call, as this thread's CPU time
(median of ``repeats``, after two warm-up calls), on one process:

- the layout's permutation both ways (``SequenceLayout.indices``) of a 128K zigzag sequence, ring 8;
- one Gated DeltaNet layer's routing on rank 3 of 8 (``sequence_parallel_gated_delta``) with the
  all-to-alls, the conv and the recurrence replaced by shape-correct stand-ins and heads of dim 2,
  so what is left is the deal, the chunks, the index tensors and the permutations;
- a named backend's check over a ring of 8 with 16 packed documents (what ``seqmesh.attention``
  runs before any rank sends).

Run it as ``python -m seqmesh.bench.hot_path``. It is no ``seqmesh bench`` subcommand: it replaces
functions of ``seqmesh.linear_attention`` with stand-ins for the rest of its process, which only a process that
runs nothing else may do. It reaches into seqmesh's modules only by names an older checkout has too,
so this file, run by its path, measures both sides of a change::

    PYTHONPATH=/path/to/other/checkout python seqmesh/bench/hot_path.py
"""

from __future__ import annotations

import statistics
import time
import types
from collections.abc import Callable

import torch


def _cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    fn(), fn()
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        samples.append(1e3 * (time.thread_time() - start))
    return statistics.median(samples)


def _linear_routing(ranks: int = 8, seq_len: int = 8192) -> Callable[[], object]:
    from seqmesh.linear_attention import sequence_parallel as sp

    def to_heads(tensors, group, chunks, sends, mine):  # the all-to-all's output shape, zeros
        x = tensors[0]
        return x.new_zeros(x.shape[0], x.shape[1] * ranks, mine, x.shape[-1])

    stand_ins = dict(seq_to_head=to_heads, head_to_seq=lambda out, group, chunks, counts, mine, shape: out.new_zeros(shape),
                     causal_conv=lambda x, w, b, bounds, act: x, gated_delta_rule=lambda q, k, v, g, beta, bounds: v)
    for name, fn in stand_ins.items():
        setattr(sp, name, fn)  # this process only runs the benchmark
    dims = dict(key_heads=16, value_heads=32, key_dim=2, value_dim=2)
    mesh = types.SimpleNamespace(sp_size=ranks, sp_rank=3, sp_group=None, ring=ranks, ulysses=1)
    heads = sp.LinearHeads(ranks=ranks, **dims)
    packed = torch.zeros(1, seq_len // ranks, heads.channels)
    params = sp.GateParams(torch.zeros(heads.conv_dim, 4), None, torch.zeros(32), torch.zeros(32))
    # a fresh LinearHeads per call, as the transformers layer builds one per forward
    return lambda: sp.sequence_parallel_gated_delta(packed, params, sp.LinearHeads(ranks=ranks, **dims), mesh,
                                                    layout="zigzag", seq_len=seq_len)


def _backend_check(ring: int = 8, seq_len: int = 8192, documents: int = 16) -> Callable[[], object]:
    from seqmesh.kernels import kernel_chooser
    from seqmesh import SequenceLayout  # public in every checkout, wherever its module lives
    from seqmesh.sharded_attention import api
    from seqmesh.sharded_attention.blocks import document_bounds
    from seqmesh.sharded_attention.schedule import ring_schedule

    cu = tuple(range(0, seq_len + 1, seq_len // documents))
    schedule = ring_schedule(SequenceLayout("zigzag", ring, 1, seq_len), document_bounds(seq_len, seq_len, cu), True, None)
    choose, q = kernel_chooser("math"), torch.zeros(1, seq_len // ring, 4, 64)
    check = getattr(api, "check_backend", None)
    if check is None:  # a checkout whose seqmesh.attention loops over every rank, step and piece itself
        def check(schedule, choose, q, k, v):
            for r in range(ring):
                for step in range(ring):
                    for piece in schedule.pieces(r, step):
                        rows = q[:, :1].expand(-1, piece.q1 - piece.q0, -1, -1)
                        keys = k[:, :1].expand(-1, piece.k1 - piece.k0, -1, -1)
                        choose(rows, keys, piece.mask, v)
    return lambda: check(schedule, choose, q, q, q)


def bench_hot_path(repeats: int = 200) -> list[tuple[str, float]]:
    """``(what, CPU ms per call)`` rows."""
    from seqmesh import SequenceLayout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        both_ways = lambda: [SequenceLayout("zigzag", 8, 1, 131072).indices(restore=r) for r in (False, True)]  # noqa: E731
        return [
            ("layout permutation both ways, 128K zigzag, ring 8", _cpu_ms(both_ways, repeats)),
            ("Gated DeltaNet layer routing, rank 3 of 8, 8K tokens (stand-in comm and kernels)",
             _cpu_ms(_linear_routing(), repeats)),
            ("named-backend check, ring 8, 16 documents", _cpu_ms(_backend_check(), repeats)),
        ]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    for what, ms in bench_hot_path():
        print(f"{ms:9.3f} ms  {what}")
