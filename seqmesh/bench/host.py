"""Host-side cost of one training input and one attention call, without any kernel time.

``seqmesh bench host`` times, on a group of one process and at a long sequence (128K tokens by
default), the Python and torch-op work that surrounds the kernels:

- ``shard_batch`` of a plain row, a right-padded row and a row of packed documents (labels with
  ``ignore_index`` holes): document finding, label shifting, positions, padding, placement;
- one ``seqmesh.attention`` forward with a kernel that does nothing, so what is left is input
  checking, the document bounds, the ring schedule and the kernel choice, with ``validate`` left
  at its default and with ``validate=True``; then the same on two spawned ranks (Ulysses 2), where
  ``validate=True`` adds an exchange with a host sync to every call.

Run it as ``seqmesh bench host``. It uses only the public API, so the same file measures an older
checkout too::

    PYTHONPATH=/path/to/old/checkout python seqmesh/bench/host.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch


def packed_lengths(seq_len: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths, uniform in ``[1, 2 * mean]``, that fill ``seq_len`` tokens exactly."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_len:
        n = min(int(torch.randint(1, 2 * mean + 1, (1,), generator=g)), seq_len - total)
        lengths.append(n)
        total += n
    return lengths


def _timed_ms(fn: Callable[[], object], repeats: int) -> dict:
    """``{ms, best_ms, cpu_ms}``: median and fastest wall time of ``repeats`` calls after two warm-up
    calls, and the median CPU time of this thread (torch runs one thread here), which other work on
    a shared machine disturbs least."""
    fn(), fn()  # warm-up: caches, the allocator's thresholds
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(1e3 * (time.thread_time() - start_cpu))
        wall.append(1e3 * (time.perf_counter() - start))
    return {"ms": statistics.median(wall), "best_ms": min(wall), "cpu_ms": statistics.median(cpu)}


def _chooser_home(attention):
    """The module whose ``kernel_chooser`` seqmesh.attention calls (its planning module where the checkout has
    one, else the module of ``attention`` itself), for the bench to swap in a kernel that computes nothing."""
    api = sys.modules[attention.__module__]
    plan = getattr(api, "plan_attention", None)
    return sys.modules[plan.__module__] if plan is not None else api


def _null_chooser(backend: str = "auto"):
    """A kernel chooser whose kernel returns its queries and a zero log-sum-exp: no kernel time."""
    from seqmesh.kernels.base import AttentionKernel

    class NullKernel(AttentionKernel):
        name = "null"

        def unsupported(self, q, k, mask, v=None):
            return None

        def forward(self, q, k, v, mask, scale):
            return q, q.new_zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)

        def backward(self, dout, q, k, v, out, lse, mask, scale):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    kernel = NullKernel()
    return lambda q, k, mask, v=None: kernel  # the chooser's signature (v: its head dim may differ)


def bench_host(seq_len: int = 131072, mean_doc: int = 512, repeats: int = 20) -> list[dict]:
    """Rows ``{what, ms, best_ms, cpu_ms}``: milliseconds per call on a one-process group."""
    import torch.distributed as dist

    import seqmesh

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host overhead, measured in this thread's CPU time
    own_group = not dist.is_initialized()
    if own_group:
        store = tempfile.mkstemp(prefix="seqmesh-host-")[1]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mesh = seqmesh.init_mesh(1, 1, device_type="cpu")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 32000, (1, seq_len), generator=g)
        labels = ids.clone()
        labels[0, torch.randint(0, seq_len, (seq_len // 10,), generator=g)] = -100
        lengths = packed_lengths(seq_len, mean_doc)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        mask = torch.ones(1, seq_len, dtype=torch.long)
        mask[0, seq_len - 1000 :] = 0
        rows = []
        batches = {
            "shard_batch, one document": {"input_ids": ids, "labels": labels},
            "shard_batch, right padding": {"input_ids": ids, "labels": labels, "attention_mask": mask},
            f"shard_batch, {len(lengths)} packed documents": {"input_ids": ids, "labels": labels,
                                                              "position_ids": positions},
        }
        for what, batch in batches.items():
            rows.append({"what": what, **_timed_ms(lambda: seqmesh.shard_batch(batch, mesh), repeats)})

        api = _chooser_home(seqmesh.attention)
        saved = api.kernel_chooser
        api.kernel_chooser = _null_chooser
        try:
            q = torch.randn(1, seq_len, 2, 16, generator=g)
            cu = tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0))
            for docs, layout in ((None, "zigzag"), (cu, "zigzag"), (cu, "per_document")):
                for validate in (None, True):
                    call = lambda: seqmesh.attention(q, q, q, mesh, cu_seqlens=docs, layout=layout,  # noqa: E731
                                                     validate=validate)
                    try:
                        call()
                    except ValueError:  # a checkout without this layout
                        continue
                    what = (f"attention (no kernel), {'no documents' if docs is None else f'{len(lengths)} documents'}, "
                            f"{layout}, validate={validate}")
                    rows.append({"what": what, **_timed_ms(call, repeats * 4)})
        finally:
            api.kernel_chooser = saved
        rows += _placement_rows(seq_len, cu, len(lengths), repeats)
        return rows
    finally:
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()
            if os.path.exists(store):  # torch 2.9's FileStore removes its file itself
                os.unlink(store)


def _placement_rows(seq_len: int, cu: tuple[int, ...], documents: int, repeats: int) -> list[dict]:
    """What a new batch of documents costs on a ring of 8 before any kernel runs, once per step
    (fresh documents each step, so nothing is cached): the layout's permutation (``shard_batch``)
    and one ring rank's block plans over the whole pass (the first attention layer)."""
    from seqmesh import SequenceLayout  # public in every checkout, wherever its module lives
    from seqmesh.sharded_attention.blocks import document_bounds
    from seqmesh.sharded_attention.schedule import RingSchedule

    rows = []
    for kind in ("zigzag", "per_document"):
        try:
            SequenceLayout(kind, 8, 1, seq_len)
        except ValueError:  # a checkout without this layout
            continue

        def make() -> SequenceLayout:
            try:
                return SequenceLayout(kind, 8, 1, seq_len, cu)  # type: ignore[call-arg]
            except TypeError:  # a checkout whose layouts take no documents
                return SequenceLayout(kind, 8, 1, seq_len)

        def place() -> SequenceLayout:
            caches = (("seqmesh.sequence.runs", "per_document_runs"), ("seqmesh.sequence.layout", "_indices"),
                      ("seqmesh.document_layout", "per_document_runs"), ("seqmesh.layout", "_indices"))  # here, or older
            for module, name in caches:
                cached = getattr(sys.modules.get(module), name, None)
                if cached is not None:
                    cached.cache_clear()
            layout = make()
            layout.indices()
            return layout

        def plan() -> None:
            schedule = RingSchedule(place(), document_bounds(seq_len, seq_len, cu), causal=True)
            for step in range(8):
                schedule.pieces(0, step)

        rows.append({"what": f"{kind} placement, {documents} documents, ring 8", **_timed_ms(place, repeats)})
        rows.append({"what": "  the same + one rank's ring plans (first layer)", **_timed_ms(plan, repeats)})
    return rows


def _validate_rank(repeats: int) -> list[dict]:
    """On every rank of a 2-rank group: one attention call (Ulysses 2, no kernel) with ``validate``
    at its default and with ``True``; the difference is the agreement exchange and its host sync.
    64 tokens: the exchange carries a few integers whatever the length, and a long sequence would
    bury it under the all-to-all."""
    import seqmesh

    mesh = seqmesh.init_mesh(2, 1, device_type="cpu")
    api = _chooser_home(seqmesh.attention)
    saved, api.kernel_chooser = api.kernel_chooser, _null_chooser
    q = torch.randn(1, 32, 2, 8)
    try:
        return [{"what": f"attention (no kernel), 2 ranks (Ulysses), 64 tokens, validate={validate}",
                 **_timed_ms(lambda: seqmesh.attention(q, q, q, mesh, validate=validate), repeats)}
                for validate in (None, True)]
    finally:
        api.kernel_chooser = saved


def bench_validate(repeats: int = 200) -> list[dict]:
    """Rows of :func:`_validate_rank` from rank 0 of two spawned gloo ranks."""
    from ..comm.launch import WorkerPool

    with WorkerPool(2, threads=1) as pool:
        return pool.run(_validate_rank, repeats, timeout=600)[0]


def format_host_rows(seq_len: int, rows: list[dict]) -> str:
    lines = [f"host overhead per call at {seq_len:,} tokens (batch 1, one process, one torch thread)",
             f"{'call':<72}{'CPU ms':>9}{'wall ms':>10}{'best wall':>11}"]
    lines += [f"{r['what']:<72}{r['cpu_ms']:>9.3f}{r['ms']:>10.3f}{r['best_ms']:>11.3f}" for r in rows]
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench host``."""

    def run(args) -> int:
        import json

        rows = bench_host(args.seq_len, args.mean_doc, args.repeats) + bench_validate(10 * args.repeats)
        print(json.dumps(rows, indent=1) if args.json else format_host_rows(args.seq_len, rows))
        return 0

    p = bench_sub.add_parser("host", help="host overhead of shard_batch and of one attention call (no kernel)")
    p.add_argument("--seq-len", type=int, default=131072, help="tokens (default %(default)s)")
    p.add_argument("--mean-doc", type=int, default=512, help="mean packed document length (default %(default)s)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run)


if __name__ == "__main__":  # measures whichever seqmesh is on the path (an older checkout, say)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
    print(format_host_rows(n, bench_host(n)))
