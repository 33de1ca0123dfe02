"""Which layout to recommend among close predictions (:func:`pick`), and the sentence that says why.
The rule and why each step comes in that order: docs/planner.md, "How the recommendation is chosen".
"""

from __future__ import annotations

from .candidate import Candidate
from .hardware import GiB, Cluster

TIE = 0.01  # throughput predictions closer than this are within the model's resolution
HEADROOM = 0.10  # footprints closer than this fraction of one GPU's memory are within the memory model's


def percent(x: float) -> str:
    """A share as the table prints it: one decimal, and ``<0.1%`` rather than a misleading ``0.0%``."""
    return "<0.1%" if 0 < x < 0.0005 else f"{x:.1%}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def gib(n: float) -> str:
    """Bytes as GiB with one decimal, as every table and reason prints them."""
    return f"{n / GiB:.1f}"


def serial_share(c: Candidate) -> float:
    """Communication of the step run end to end, as a share of the predicted step (rounded to 0.1%)."""
    return round(c.time.serial_comm / c.time.total, 3)


def tied(runnable: list[Candidate]) -> list[Candidate]:
    """The candidates whose throughput is within ``TIE`` of the fastest."""
    fastest = max(c.tokens_per_s for c in runnable)
    return [c for c in runnable if c.tokens_per_s >= (1 - TIE) * fastest]


def pick(ranked: list[Candidate], memory_bytes: int) -> Candidate | None:
    """The recommendation (docs/planner.md gives the rule); None when no seqmesh layout fits."""
    runnable = [c for c in ranked if c.feasible and c.layout.runs_on_seqmesh]
    if not runnable:
        return None
    close = tied(runnable)
    least = min(c.memory.total for c in close)
    roomy = [c for c in close if c.memory.total <= least + HEADROOM * memory_bytes]
    return min(roomy, key=lambda c: (serial_share(c), c.memory.total, -c.tokens_per_s))


def _ring_part(best: Candidate, cluster: Cluster) -> str:
    lay, t, link = best.layout, best.time, best.comm_links["ring_p2p"]
    crosses = "crosses nodes over" if cluster.nodes > 1 and link == cluster.hardware.links[-1].name else "over"
    hops = (f"a hop {_ms(t.ring_hop_forward)} forward, {_ms(t.ring_hop_backward)} backward, against "
            f"{_ms(t.ring_block_forward)} and {_ms(t.ring_block_backward)} of block compute per step")
    state = "exposed" if t.ring_exposed else "hidden behind block compute"
    return f"ring {lay.ring} {crosses} {link}, its P2P {state} ({hops})"


def _versus(best: Candidate, runnable: list[Candidate], memory_bytes: int) -> str:
    """How the pick compares with the fastest prediction (or, when it is the fastest, the runner-up)."""
    others = [c for c in runnable if c is not best]
    if not others:
        return ""
    fastest = max(runnable, key=lambda c: c.tokens_per_s)
    if fastest is best:
        nxt = max(others, key=lambda c: c.tokens_per_s)
        margin = best.tokens_per_s / nxt.tokens_per_s - 1
        if margin < TIE:
            return f"the fastest prediction, within 1% of {nxt.layout.label()} (too close for this model to separate)"
        return f"the fastest prediction, {percent(margin)} more tokens/s than {nxt.layout.label()}"
    lead = (f"{fastest.layout.label()} is predicted {percent(fastest.tokens_per_s / best.tokens_per_s - 1)} "
            "faster, inside the model's 1% resolution")
    least = min(c.memory.total for c in tied(runnable))
    if fastest.memory.total > least + HEADROOM * memory_bytes:
        gpu = memory_bytes
        return (f"{lead}, but needs {gib(fastest.memory.total)} GiB per GPU ({fastest.memory.total / gpu:.0%} of "
                f"{gib(gpu)}) against {gib(best.memory.total)} GiB ({best.memory.total / gpu:.0%}): in a tie the "
                "memory headroom wins")
    mine, theirs = serial_share(best), serial_share(fastest)
    if mine < theirs:
        return (f"{lead}; this one is less exposed if overlap fails (its communication end to end is "
                f"{percent(mine)} of the step vs {percent(theirs)})")
    return f"{lead}; this one needs less memory ({gib(best.memory.total)} vs {gib(fastest.memory.total)} GiB per GPU)"


def explain(best: Candidate, ranked: list[Candidate], cluster: Cluster) -> str:
    """A short reason for the recommendation: where each axis runs, and why it beats the others."""
    lay, links = best.layout, best.comm_links
    parts = []
    if lay.tp > 1:
        parts.append(f"tensor parallelism {lay.tp} inside {links['tp_all_gather']}, its gathers and reduce-scatters "
                     "on the critical path")
    if lay.ulysses > 1 and "ulysses_all_to_all" in links:
        inner = links["ulysses_all_to_all"] == cluster.hardware.links[0].name
        parts.append(f"Ulysses {lay.ulysses} {'inside' if inner else 'over'} {links['ulysses_all_to_all']}")
    if lay.ring > 1 and "ring_p2p" in links:
        parts.append(_ring_part(best, cluster))
    rows = next((k for k in ("indexed_row_gather", "block_sparse_row_gather", "qsa_row_gather") if k in links), None)
    if lay.sp > 1 and rows:  # DeepSeek Sparse Attention, MiniMax-M3's block-sparse, Qwen4-Exp's QSA: one flat group
        parts.append(f"the sparse attention's rows gathered over the {lay.sp} GPUs of the sequence group, over "
                     f"{links[rows]} (the same bytes for every Ulysses x ring split of them)")
    if lay.ep > 1:
        inner = links["ep_all_to_all"] == cluster.hardware.links[0].name
        parts.append(f"expert parallelism {lay.ep} {'inside' if inner else 'over'} {links['ep_all_to_all']}: each "
                     f"rank gathers 1/{lay.ep} of an MoE layer's routed experts")
    if lay.dp_shard > 1:
        sp = lay.sp
        parts.append(f"the sequence fits on {sp} GPU{'s' if sp > 1 else ''}, so {lay.dp_shard} data-parallel "
                     "groups add throughput without attention traffic")
    if lay.sp == 1 and lay.dp_shard == 1:
        parts.append("one GPU holds the sequence")
    runnable = [c for c in ranked if c.feasible and c.layout.runs_on_seqmesh]
    parts.append(_versus(best, runnable, cluster.hardware.memory_bytes))  # "" when nothing else runs
    parts.append(f"{percent(best.time.exposed_comm / best.time.total)} of the step waits on communication")
    return "; ".join(part for part in parts if part)


def peak_parts(memory: dict[str, int], moment: str) -> str:
    """"at the optimizer step: optimizer 32.8, grads 16.4, weights 16.4 GiB": the moment of the peak and its
    three largest parts (``memory`` as :meth:`.memory.MemoryBreakdown.as_dict` gives it)."""
    parts = sorted(((v, k) for k, v in memory.items() if k != "total" and v > 0), reverse=True)[:3]
    return f"at the {moment}: " + ", ".join(f"{k} {gib(v)}" for v, k in parts) + " GiB"


def nothing_fits(ranked: list[Candidate], cluster: Cluster) -> str:
    """Why there is no recommendation, and what to change."""
    runnable = [c for c in ranked if c.layout.runs_on_seqmesh]
    if not runnable:
        return "no seqmesh layout can run this model on these GPUs"
    least = min(runnable, key=lambda c: c.memory.total)
    text = (f"the smallest seqmesh footprint, {least.layout.label()}, needs {gib(least.memory.total)} GiB per "
            f"GPU of {gib(cluster.hardware.memory_bytes)} ({peak_parts(least.memory.as_dict(), least.memory.moment)})")
    if least.memory.moment in ("end of backward", "optimizer step"):
        text += "; that moment holds no activations, so no sequence length changes it: use more GPUs"
    else:
        text += ("; use more GPUs or a shorter sequence, keep checkpointing and the chunked loss on "
                 "(--max-seq-len finds the longest that fits)")
    return text


def explain_longest(best: dict | None, rows: list[dict], cluster: Cluster) -> str:
    """The reason for ``--max-seq-len``'s pick (rows as :func:`.plan.longest_plan` builds them)."""
    gpu = cluster.hardware.memory_bytes
    if best is None:
        seqmesh_rows = [r for r in rows if r["runs_on_seqmesh"]]
        if not seqmesh_rows:
            return "no seqmesh layout can run this model on these GPUs"
        least = min(seqmesh_rows, key=lambda r: r["memory_bytes"]["total"])
        return (f"no seqmesh layout holds even one token: the smallest footprint is "
                f"{gib(least['memory_bytes']['total'])} GiB per GPU of {gib(gpu)} "
                f"({peak_parts(least['memory_bytes'], least['memory_peak_at'])}); use more GPUs")
    text = (f"the longest sequence of any seqmesh layout, {best['max_seq_len']:,} tokens "
            f"({gib(best['memory_bytes']['total'])} GiB per GPU of {gib(gpu)}); among layouts that fit as much, "
            "the most tokens/s")
    return text
