"""Causal work per rank for packed documents: zigzag against per_document (and contiguous).

A query token at position i of its document sees i + 1 keys under the causal mask, so a ring
rank's work is the sum of that over the tokens it holds (its Ulysses ranks split the heads, not
the tokens, so only the ring degree matters). ``seqmesh bench balance`` prints max / mean work
across ring ranks (1.0 is perfect balance) for a few document-length mixes, and how many kernel
calls one ring pass costs the busiest rank.
"""

from __future__ import annotations

import torch

from ..sequence.layout import SequenceLayout, causal_work_per_ring_rank
from ..sequence.runs import DEFAULT_MIN_CHUNK
from ..sharded_attention.blocks import document_bounds
from ..sharded_attention.schedule import RingSchedule


def _boundaries(lengths: list[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0).tolist())


def _layout(lengths: list[int], ring: int, kind: str, min_chunk: int = DEFAULT_MIN_CHUNK) -> SequenceLayout:
    cu = _boundaries(lengths)
    return SequenceLayout.for_length(kind, ring, 1, cu[-1], cu, min_chunk)


def causal_work_per_rank(lengths: list[int], ring: int, kind: str, min_chunk: int = DEFAULT_MIN_CHUNK) -> list[int]:
    """(query, key) pairs each ring rank computes for packed documents of ``lengths`` (the padding
    to the layout's multiple is a document of its own, as in attention)."""
    layout = _layout(lengths, ring, kind, min_chunk)
    cu = _boundaries(lengths)
    return causal_work_per_ring_rank(layout, cu + ((layout.padded_len,) if cu[-1] < layout.padded_len else ()))


def kernel_calls(lengths: list[int], ring: int, kind: str) -> int:
    """Kernel calls of the busiest ring rank over one ring pass (causal)."""
    layout, cu = _layout(lengths, ring, kind), _boundaries(lengths)
    schedule = RingSchedule(layout, document_bounds(layout.padded_len, sum(lengths), cu), causal=True)
    return max(sum(len(schedule.pieces(r, step)) for step in range(ring)) for r in range(ring))


def document_mixes(seq_len: int = 131072, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths filling ``seq_len`` tokens: realistic packings and the two extremes."""
    g = torch.Generator().manual_seed(seed)

    def fill(total: int, low: int, high: int) -> list[int]:
        out = []
        while total > 0:
            n = min(int(torch.randint(low, high + 1, (1,), generator=g)), total)
            out.append(n)
            total -= n
        return out

    half = seq_len // 2
    short = fill(seq_len - half, 64, 2048)
    return {
        "many short (64..2048)": fill(seq_len, 64, 2048),
        "many tiny (16..128)": fill(seq_len, 16, 128),
        "one long first + short": [half, *short],
        "one long in the middle": [*short[: len(short) // 2], half, *short[len(short) // 2 :]],
        "uniform (16 x S/16)": [seq_len // 16] * 16,
        "one document": [seq_len],
    }


def bench_balance(seq_len: int = 131072, rings: tuple[int, ...] = (4, 8)) -> list[dict]:
    """Rows ``{mix, documents, ring, <kind>: max/mean, calls_<kind>}``."""
    rows = []
    for mix, lengths in document_mixes(seq_len).items():
        for ring in rings:
            row: dict = {"mix": mix, "documents": len(lengths), "ring": ring}
            for kind in ("contiguous", "zigzag", "per_document"):
                works = causal_work_per_rank(lengths, ring, kind)
                row[kind] = max(works) * ring / sum(works)
            for kind in ("zigzag", "per_document"):
                row[f"calls_{kind}"] = kernel_calls(lengths, ring, kind)
            rows.append(row)
    return rows


def format_balance_rows(seq_len: int, rows: list[dict]) -> str:
    lines = [f"causal work max/mean over ring ranks (1.00 = balanced), {seq_len:,} tokens of packed documents; "
             "kernel calls per ring pass of the busiest rank",
             f"{'mix':<26}{'docs':>6}{'P':>3}{'contiguous':>12}{'zigzag':>9}{'per_doc':>9}{'calls zz':>10}{'calls pd':>10}"]
    for r in rows:
        lines.append(f"{r['mix']:<26}{r['documents']:>6}{r['ring']:>3}{r['contiguous']:>12.3f}{r['zigzag']:>9.3f}"
                     f"{r['per_document']:>9.3f}{r['calls_zigzag']:>10}{r['calls_per_document']:>10}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench balance``."""

    def run(args) -> int:
        import json

        rows = bench_balance(args.seq_len, tuple(args.rings))
        print(json.dumps(rows, indent=1) if args.json else format_balance_rows(args.seq_len, rows))
        return 0

    p = bench_sub.add_parser("balance", help="causal work per rank for packed documents: zigzag vs per_document")
    p.add_argument("--seq-len", type=int, default=131072, help="tokens (default %(default)s)")
    p.add_argument("--rings", type=int, nargs="+", default=[4, 8], help="ring degrees (default 4 8)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run)
