"""Enumerate the layouts of a cluster, predict memory, traffic and time for each, and pick one.

Candidates are every ``ulysses x ring x dp_shard`` factorisation of the GPUs that seqmesh can run
(FSDP shards over all of them), plus Megatron tensor parallelism inside a node as a reference point.
Ranking is by predicted throughput (tokens per second over the whole cluster): a layout with
``dp_shard`` data-parallel groups processes ``dp_shard`` micro-batches per step, so its step time is
compared per sequence, not per step. Predictions within 1% of the fastest are treated as a tie, broken
in favour of the layout whose communication, run end to end without overlap, is the smallest share of
its step (then the least memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import GiB, Cluster, HardwareSpec
from .memory import MemoryBreakdown, memory_per_gpu
from .timing import StepTime, axis_groups, step_time, world_rank
from .traffic import HeadDeal, attention_traffic, fsdp_traffic, padded_length, tensor_parallel_traffic, worst_rank
from .workload import Layout, Workload, embedding_params, head_params, layer_params


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Candidate:
    """One layout, evaluated."""

    layout: Layout
    memory: MemoryBreakdown
    comm_per_layer: dict[str, dict[str, int]]  # phase -> collective -> bytes the busiest rank sends
    comm_links: dict[str, str]  # collective -> the link level it crosses
    comm_per_step: int  # bytes the busiest rank sends in one step (recompute and FSDP ends included)
    time: StepTime
    tokens_per_s: float
    feasible: bool
    problems: tuple[str, ...] = ()  # why it is infeasible
    notes: tuple[str, ...] = ()  # uneven heads, kv replication, reference only

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.as_dict(),
            "label": self.layout.label(),
            "runs_on_seqmesh": self.layout.runs_on_seqmesh,
            "memory_bytes": self.memory.as_dict(),
            "comm_bytes_per_layer": self.comm_per_layer,
            "comm_links": self.comm_links,
            "comm_bytes_per_step": self.comm_per_step,
            "step_time_s": self.time.total,
            "time_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "feasible": self.feasible,
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Plan:
    """Every candidate, best first, and the recommendation."""

    work: Workload
    cluster: Cluster
    candidates: tuple[Candidate, ...]
    excluded: tuple[tuple[Layout, str], ...] = field(default_factory=tuple)  # layouts that cannot run at all
    recommended: Candidate | None = None
    reason: str = ""

    def as_dict(self) -> dict:
        rec = None
        if self.recommended is not None:
            rec = {"layout": self.recommended.layout.as_dict(), "label": self.recommended.layout.label(),
                   "reason": self.reason}
        return {
            "model": self.work.model.as_dict(),
            "seq_len": self.work.seq_len, "batch": self.work.batch, "dtype": self.work.dtype,
            "checkpointing": self.work.checkpointing, "chunked_loss": self.work.chunked_loss,
            "gpus": self.cluster.gpus, "nodes": self.cluster.nodes, "hardware": self.cluster.hardware.as_dict(),
            "candidates": [c.as_dict() for c in self.candidates],
            "excluded": [{"layout": lay.as_dict(), "reason": why} for lay, why in self.excluded],
            "recommended": rec,
            "reason": self.reason,
        }


def layouts(work: Workload, cluster: Cluster) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Every layout of the cluster's GPUs, and the ones that cannot run with the reason."""
    m, n = work.model, cluster.gpus
    ok, excluded = [], []
    for sp in divisors(n):
        for u in divisors(sp):
            lay = Layout(u, sp // u, n // sp)
            if u > m.heads:
                excluded.append((lay, f"ulysses {u} exceeds the {m.heads} query heads; put the rest on the ring"))
            else:
                ok.append(lay)
    for tp in divisors(n)[1:]:
        lay = Layout(1, 1, n // tp, tp)
        if tp > cluster.hardware.gpus_per_node:
            excluded.append((lay, f"tensor parallelism beyond one node ({tp} > {cluster.hardware.gpus_per_node})"))
        elif m.heads % tp or (m.kv_heads % tp and tp % m.kv_heads):
            excluded.append((lay, f"TP {tp} does not divide {m.heads} query / {m.kv_heads} kv heads"))
        else:
            ok.append(lay)
    return ok, excluded


def _link_name(hw: HardwareSpec, groups: list[list[int]]) -> str:
    groups = [g for g in groups if len(g) > 1]
    if not groups:
        return "-"
    return hw.links[max(hw.level_of_group(g) for g in groups)].name


def communication(work: Workload, layout: Layout, hw: HardwareSpec) -> tuple[dict, dict, int]:
    """(bytes per layer by phase and collective, link of each collective, bytes per step) of the busiest rank."""
    m = work.model
    fsdp = fsdp_traffic(-(-layer_params(m) // layout.tp), layout.fsdp_group, work.torch_dtype, work.reduce_dtype)
    all_ranks = [world_rank(layout, u, r, d) for d in range(layout.dp_shard)
                 for r in range(layout.ring) for u in range(layout.ulysses)]
    links = {"fsdp_all_gather": _link_name(hw, [all_ranks]), "fsdp_reduce_scatter": _link_name(hw, [all_ranks])}
    if layout.tp > 1:
        tp = tensor_parallel_traffic(work.batch * work.seq_len, m.hidden, layout.tp, work.torch_dtype)
        fwd = {"tp_all_gather": tp["all_gather"], "tp_reduce_scatter": tp["reduce_scatter"]}
        bwd = dict(fwd)
        recompute = sum(fwd.values())
        links.update(tp_all_gather=_link_name(hw, [list(range(layout.tp))]))
        links.update(tp_reduce_scatter=links["tp_all_gather"])
    else:
        att = attention_traffic(m.heads, m.kv_heads, m.head_dim, seq_len=work.seq_len, batch=work.batch,
                                ulysses=layout.ulysses, ring=layout.ring, dtype=work.torch_dtype,
                                layout=work.layout, validate=work.validate)
        fwd = {"ulysses_all_to_all": worst_rank(att, "all_to_all", "forward"),
               "ring_p2p": worst_rank(att, "p2p", "forward"),
               "input_check_all_gather": worst_rank(att, "control", "forward")}
        bwd = {"ulysses_all_to_all": worst_rank(att, "all_to_all", "backward"),
               "ring_p2p": worst_rank(att, "p2p", "backward")}
        recompute = sum(fwd.values())
        links.update(ulysses_all_to_all=_link_name(hw, axis_groups(layout, "ulysses")),
                     ring_p2p=_link_name(hw, axis_groups(layout, "ring")))
        sp_group = [world_rank(layout, u, r, 0) for r in range(layout.ring) for u in range(layout.ulysses)]
        links["input_check_all_gather"] = _link_name(hw, [sp_group])
    fwd["fsdp_all_gather"] = fsdp["all_gather_forward"]
    bwd["fsdp_all_gather"] = fsdp["all_gather_backward"]
    bwd["fsdp_reduce_scatter"] = fsdp["reduce_scatter_backward"]
    fwd["total"], bwd["total"] = sum(fwd.values()), sum(bwd.values())
    step = m.layers * (fwd["total"] + bwd["total"] + (recompute if work.checkpointing else 0))
    for unit in (embedding_params(m), head_params(m)):
        ends = fsdp_traffic(-(-unit // layout.tp), layout.fsdp_group, work.torch_dtype, work.reduce_dtype)
        step += sum(ends.values())
    return {"forward": fwd, "backward": bwd}, links, step


def evaluate(work: Workload, layout: Layout, cluster: Cluster) -> Candidate:
    hw = cluster.hardware
    mem = memory_per_gpu(work, layout)
    per_layer, links, per_step = communication(work, layout, hw)
    t = step_time(work, layout, hw)
    m = work.model
    problems, notes = [], []
    if mem.total > hw.memory_bytes:
        problems.append(f"needs {mem.total / GiB:.1f} GiB per GPU, more than the {hw.memory_bytes / GiB:.1f} GiB it has")
    if layout.tp > 1:
        notes.append("reference: seqmesh does not run tensor parallelism")
    elif layout.ulysses > 1:
        if m.heads % layout.ulysses:
            notes.append(f"uneven heads: {m.heads} query heads over {layout.ulysses} Ulysses ranks")
        if HeadDeal(m.heads, m.kv_heads, layout.ulysses).replicated:
            notes.append(f"kv replication: {m.kv_heads} kv heads over {layout.ulysses} Ulysses ranks")
    if padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout) != work.seq_len and layout.tp == 1:
        notes.append(f"padded to {padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout)} tokens")
    tokens = layout.dp_shard * work.batch * work.seq_len
    return Candidate(layout, mem, per_layer, links, per_step, t, tokens / t.total, not problems,
                     tuple(problems), tuple(notes))


def _rank_key(c: Candidate) -> tuple:
    return (not c.feasible, -c.tokens_per_s if c.feasible else c.memory.total)


TIE = 0.01  # predictions closer than this are within the model's resolution


def pick(ranked: list[Candidate]) -> Candidate | None:
    """The recommendation: the fastest seqmesh layout that fits, except that predictions within 1% of
    the fastest are a tie, which goes to the layout whose communication would cost least if none of it
    overlapped (overlap is the least certain part of the model), then to the least memory."""
    runnable = [c for c in ranked if c.feasible and c.layout.runs_on_seqmesh]
    if not runnable:
        return None
    fastest = max(c.tokens_per_s for c in runnable)
    close = [c for c in runnable if c.tokens_per_s >= (1 - TIE) * fastest]
    return min(close, key=lambda c: (round(c.time.serial_comm / c.time.total, 3), c.memory.total))


def plan(work: Workload, cluster: Cluster) -> Plan:
    """Evaluate every layout; the recommendation first, then the others by predicted throughput."""
    ok, excluded = layouts(work, cluster)
    ranked = sorted((evaluate(work, lay, cluster) for lay in ok), key=_rank_key)
    best = pick(ranked)
    if best is not None:
        ranked = [best] + [c for c in ranked if c is not best]
    reason = explain(best, ranked, cluster) if best else _nothing_fits(ranked, cluster)
    return Plan(work, cluster, tuple(ranked), tuple(excluded), best, reason)


def _percent(x: float) -> str:
    return "<0.1%" if x < 0.0005 else f"{x:.1%}"


def explain(best: Candidate, ranked: list[Candidate], cluster: Cluster) -> str:
    """A short reason for the recommendation: where each axis runs and what it beats."""
    lay, links = best.layout, best.comm_links
    parts = []
    if lay.ulysses > 1:
        inner = links["ulysses_all_to_all"] == cluster.hardware.links[0].name
        parts.append(f"Ulysses {lay.ulysses} {'inside' if inner else 'over'} {links['ulysses_all_to_all']}")
    if lay.ring > 1:
        crosses = "crosses nodes over" if cluster.nodes > 1 and links["ring_p2p"] == cluster.hardware.links[-1].name else "over"
        parts.append(f"ring {lay.ring} {crosses} {links['ring_p2p']}, its P2P hidden behind block compute")
    if lay.dp_shard > 1:
        sp = lay.ulysses * lay.ring
        parts.append(f"the sequence fits on {sp} GPU{'s' if sp > 1 else ''}, so {lay.dp_shard} data-parallel "
                     "groups add throughput without attention traffic")
    if lay.ulysses == lay.ring == 1 and lay.dp_shard == 1:
        parts.append("one GPU holds the sequence")
    others = [c for c in ranked if c.feasible and c is not best and c.layout.runs_on_seqmesh]
    if others:
        fastest = max(others, key=lambda c: c.tokens_per_s)
        if fastest.tokens_per_s > best.tokens_per_s:
            gap = f"within {_percent(1 - best.tokens_per_s / fastest.tokens_per_s)} of the fastest prediction, {fastest.layout.label()}"
            mine, theirs = (round(c.time.serial_comm / c.time.total, 3) for c in (best, fastest))
            if mine < theirs:
                parts.append(f"{gap}, and less exposed if overlap fails (its communication end to end is "
                             f"{mine:.1%} of the step vs {theirs:.1%})")
            else:
                parts.append(f"{gap}, with less memory ({best.memory.total / GiB:.1f} vs "
                             f"{fastest.memory.total / GiB:.1f} GiB per GPU)")
        else:
            nxt = fastest
            margin = best.tokens_per_s / nxt.tokens_per_s - 1
            if margin < TIE:
                parts.append(f"within 1% of {nxt.layout.label()} (too close for this model to separate)")
            else:
                parts.append(f"{margin:.0%} more tokens/s than {nxt.layout.label()}")
    tp = [c for c in ranked if c.feasible and not c.layout.runs_on_seqmesh]
    if tp:
        parts.append(f"tensor-parallel reference {tp[0].layout.label()[:-6]}: {tp[0].tokens_per_s / best.tokens_per_s:.0%} "
                     "of this throughput")
    comm = best.time.exposed_comm / best.time.total
    parts.append(f"{comm:.0%} of the step waits on communication")
    return "; ".join(parts)


def _nothing_fits(ranked: list[Candidate], cluster: Cluster) -> str:
    runnable = [c for c in ranked if c.layout.runs_on_seqmesh]
    if not runnable:
        return "no seqmesh layout can run this model on these GPUs"
    least = min(runnable, key=lambda c: c.memory.total)
    text = (f"the smallest seqmesh footprint, {least.layout.label()}, needs {least.memory.total / GiB:.1f} GiB per "
            f"GPU of {cluster.hardware.memory_bytes / GiB:.1f}; use more GPUs or a shorter sequence, keep "
            "checkpointing and the chunked loss on (--max-seq-len finds the longest that fits)")
    tp = [c for c in ranked if c.feasible and not c.layout.runs_on_seqmesh]
    if tp:
        text += f"; the tensor-parallel reference {tp[0].layout.label()[:-6]} would fit"
    return text


def longest_sequence(work: Workload, layout: Layout, memory_bytes: int, limit: int = 2**34) -> int:
    """The longest sequence whose step fits in ``memory_bytes`` per GPU on ``layout`` (0 if none)."""
    from dataclasses import replace

    def fits(s: int) -> bool:
        return memory_per_gpu(replace(work, seq_len=s), layout).total <= memory_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def longest_plan(work: Workload, cluster: Cluster) -> list[dict]:
    """For every layout, the longest sequence that fits, with the plan at that length (JSON-ready rows,
    longest first)."""
    from dataclasses import replace

    ok, _ = layouts(work, cluster)
    rows = []
    for lay in ok:
        n = longest_sequence(work, lay, cluster.hardware.memory_bytes)
        c = evaluate(replace(work, seq_len=max(n, 1)), lay, cluster)
        rows.append({
            "layout": lay.as_dict(), "label": lay.label(), "runs_on_seqmesh": lay.runs_on_seqmesh,
            "max_seq_len": n, "feasible": n > 0, "memory_bytes": c.memory.as_dict(),
            "step_time_s": c.time.total if n else None, "tokens_per_s": c.tokens_per_s if n else 0.0,
            "comm_bytes_per_layer": c.comm_per_layer,
        })
    rows.sort(key=lambda r: (-r["max_seq_len"], -r["tokens_per_s"]))
    return rows
