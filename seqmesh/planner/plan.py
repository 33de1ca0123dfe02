"""Enumerate the layouts of a cluster, evaluate each (a ``Candidate``: memory, traffic, time,
feasibility) and rank them by cluster throughput (tokens/s: a layout with ``dp_shard`` groups processes
``dp_shard`` micro-batches per step). The recommendation among close predictions is :mod:`.recommend`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .hardware import GiB, Cluster, HardwareSpec
from .memory import MemoryBreakdown, memory_per_gpu
from .recommend import explain, explain_longest, nothing_fits, pick
from .network import axis_groups, world_rank
from .timing import StepTime, step_time
from ..padding import padded_length
from .traffic import (HeadDeal, attention_traffic, fsdp_traffic, linear_attention_traffic,
                      tensor_parallel_traffic, worst_rank)
from .workload import GlobalBatch, Layout, Workload, embedding_unit_params, layer_params, linear_layer_params, root_params


PHASES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class Candidate:
    """One layout, evaluated."""

    layout: Layout
    memory: MemoryBreakdown
    comm_per_layer: dict[str, dict[str, int]]  # phase -> collective -> bytes the busiest rank sends in one layer
    comm_links: dict[str, str]  # collective -> the link level it crosses
    comm_per_step: dict[str, int]  # collective -> bytes the busiest rank sends in one step (all phases, every unit)
    time: StepTime
    tokens_per_s: float
    feasible: bool
    problems: tuple[str, ...] = ()  # why it is infeasible
    notes: tuple[str, ...] = ()  # uneven heads, kv replication, reference only
    accumulation: int = 1  # micro-steps (gradient accumulation) per optimizer step for the global batch

    @property
    def optimizer_step_s(self) -> float:
        """One optimizer step: ``accumulation`` micro-steps (see :mod:`.global_batch`)."""
        return self.accumulation * self.time.total

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.as_dict(),
            "label": self.layout.label(),
            "runs_on_seqmesh": self.layout.runs_on_seqmesh,
            "memory_bytes": self.memory.as_dict(),
            "memory_peak_at": self.memory.moment,
            "comm_bytes_per_layer": self.comm_per_layer,
            "comm_bytes_per_step": self.comm_per_step,
            "comm_links": self.comm_links,
            "step_time_s": self.time.total,
            "time_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "grad_accumulation": self.accumulation,
            "optimizer_step_s": self.optimizer_step_s,
            "feasible": self.feasible,
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Plan:
    """Every candidate, best first, and the recommendation."""

    work: Workload
    cluster: Cluster
    candidates: tuple[Candidate, ...]
    excluded: tuple[tuple[Layout, str], ...] = field(default_factory=tuple)  # layouts that cannot run at all
    recommended: Candidate | None = None
    reason: str = ""
    target: GlobalBatch = GlobalBatch()  # the global batch asked for, if any

    def as_dict(self) -> dict:
        rec = None
        if self.recommended is not None:
            rec = {"layout": self.recommended.layout.as_dict(), "label": self.recommended.layout.label(),
                   "reason": self.reason}
        return {
            "mode": "plan",
            **workload_dict(self.work, self.cluster),
            "global_batch_seqs": self.target.sequences, "one_group": self.target.one_group,
            "candidates": [c.as_dict() for c in self.candidates],
            "excluded": [{"layout": lay.as_dict(), "reason": why} for lay, why in self.excluded],
            "recommended": rec,
            "reason": self.reason,
        }


def workload_dict(work: Workload, cluster: Cluster) -> dict:
    """The fields every JSON answer starts with: what was planned, on what."""
    return {
        "model": work.model.as_dict(),
        "seq_len": work.seq_len, "batch": work.batch, "dtype": work.dtype,
        "checkpointing": work.checkpointing, "chunked_loss": work.chunked_loss, "tiled_mlp": work.tiled_mlp,
        "efficient_norm": work.efficient_norm,
        "offload_checkpoints": work.offload_checkpoints, "fsdp_cpu_offload": work.fsdp_cpu_offload,
        "gpus": cluster.gpus, "nodes": cluster.nodes, "hardware": cluster.hardware.as_dict(),
    }


def layouts(work: Workload, cluster: Cluster,
            target: GlobalBatch = GlobalBatch()) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Every layout of the cluster's GPUs, and the ones that cannot run (or cannot give ``target``'s
    global batch) with the reason."""
    ok, excluded = _all_layouts(work, cluster)
    for lay in list(ok):
        why = target.why_not(lay, work.batch)
        if why:
            ok.remove(lay)
            excluded.append((lay, why))
    return ok, excluded


def _all_layouts(work: Workload, cluster: Cluster) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    m, n = work.model, cluster.gpus
    ok, excluded = [], []
    for sp in divisors(n):
        for u in divisors(sp):
            lay = Layout(u, sp // u, n // sp)
            if u > m.heads:
                excluded.append((lay, f"ulysses {u} exceeds the {m.heads} query heads; put the rest on the ring"))
            elif m.linear_layers and sp > m.linear_value_heads:
                excluded.append((lay, f"sequence degree {sp} exceeds the {m.linear_value_heads} Gated DeltaNet value heads"))
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


def communication(work: Workload, layout: Layout, hw: HardwareSpec) -> tuple[dict, dict, dict]:
    """(bytes per layer by phase and collective, link of each collective, bytes per step by collective),
    all for the busiest rank. Phases: ``forward``; ``backward`` (the backward pass proper); ``recompute``
    (activation checkpointing re-running the layer's forward inside backward: its all-to-alls and ring hops
    again; zeros without checkpointing). Per step adds the FSDP traffic of the root unit (gathered once and
    kept for backward) and of an untied embedding's own unit (gathered twice), each reduce-scattered once, and seqmesh's input check (one tiny
    all-gather per step: ``seqmesh.hf`` validates the first attention call of a batch)."""
    m = work.model
    fsdp = fsdp_traffic(-(-layer_params(m) // layout.tp), layout.fsdp_group, work.torch_dtype, work.reduce_dtype)
    units = [(fsdp_traffic(-(-n // layout.tp), layout.fsdp_group, work.torch_dtype, work.reduce_dtype), gathers)
             for n, gathers in ((root_params(m), 1), (embedding_unit_params(m), 2)) if n]  # root, untied embedding
    all_ranks = [world_rank(layout, u, r, d) for d in range(layout.dp_shard)
                 for r in range(layout.ring) for u in range(layout.ulysses)]
    links = {"fsdp_all_gather": _link_name(hw, [all_ranks]), "fsdp_reduce_scatter": _link_name(hw, [all_ranks])}
    check = 0
    if layout.tp > 1:
        tp = tensor_parallel_traffic(work.batch * work.seq_len, m.hidden, layout.tp, work.torch_dtype)
        fwd = {"tp_all_gather": tp["all_gather"], "tp_reduce_scatter": tp["reduce_scatter"]}
        bwd = dict(fwd)
        links["tp_all_gather"] = links["tp_reduce_scatter"] = _link_name(hw, [list(range(layout.tp))])
    else:
        att = attention_traffic(m.heads, m.kv_heads, m.head_dim, seq_len=work.seq_len, batch=work.batch,
                                ulysses=layout.ulysses, ring=layout.ring, dtype=work.torch_dtype,
                                layout=work.layout, validate=work.validate)
        if m.sliding_window and m.sliding_layers:  # sliding layers skip the ring steps their window never reaches
            windowed = attention_traffic(m.heads, m.kv_heads, m.head_dim, seq_len=work.seq_len, batch=work.batch,
                                         ulysses=layout.ulysses, ring=layout.ring, dtype=work.torch_dtype,
                                         layout=work.layout, validate=False, window=m.sliding_window)
            sliding_p2p = {ph: worst_rank(windowed, "p2p", ph) for ph in ("forward", "backward")}
        fwd = {"ulysses_all_to_all": worst_rank(att, "all_to_all", "forward"),
               "ring_p2p": worst_rank(att, "p2p", "forward")}
        bwd = {"ulysses_all_to_all": worst_rank(att, "all_to_all", "backward"),
               "ring_p2p": worst_rank(att, "p2p", "backward")}
        links.update(ulysses_all_to_all=_link_name(hw, axis_groups(layout, "ulysses")),
                     ring_p2p=_link_name(hw, axis_groups(layout, "ring")))
        sp_group = [world_rank(layout, u, r, 0) for r in range(layout.ring) for u in range(layout.ulysses)]
        links["input_check_all_gather"] = _link_name(hw, [sp_group])
        check = worst_rank(att, "control", "forward")  # once per step, not per layer
        if m.linear_layers:  # Gated DeltaNet layers: their own all-to-all over the whole sequence group
            lin = linear_attention_traffic(m.linear_key_heads, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim,
                                           seq_len=work.seq_len, batch=work.batch, ulysses=layout.ulysses,
                                           ring=layout.ring, dtype=work.torch_dtype, layout=work.layout)
            fwd["linear_all_to_all"] = worst_rank(lin, "all_to_all", "forward")
            bwd["linear_all_to_all"] = worst_rank(lin, "all_to_all", "backward")
            links["linear_all_to_all"] = _link_name(hw, [sp_group])
    recompute = {k: v if work.checkpointing else 0 for k, v in fwd.items()}
    fwd |= {"fsdp_all_gather": fsdp["all_gather_forward"], "fsdp_reduce_scatter": 0}
    bwd |= {"fsdp_all_gather": fsdp["all_gather_backward"], "fsdp_reduce_scatter": fsdp["reduce_scatter_backward"]}
    recompute |= {"fsdp_all_gather": 0, "fsdp_reduce_scatter": 0}  # the layer stays gathered for its backward
    per_layer = {"forward": fwd, "backward": bwd, "recompute": recompute}
    # per layer: a full-attention layer's figures, plus a Gated DeltaNet layer's all-to-all for hybrids
    count = {k: m.layers - m.linear_layers for k in ("ulysses_all_to_all", "ring_p2p")} | {"linear_all_to_all": m.linear_layers}
    step = {k: count.get(k, m.layers) * sum(phase[k] for phase in per_layer.values()) for k in fwd}
    if m.linear_layers:  # their FSDP units hold other parameters than a full-attention layer's
        lin_fsdp = fsdp_traffic(linear_layer_params(m), layout.fsdp_group, work.torch_dtype, work.reduce_dtype)
        step["fsdp_all_gather"] += m.linear_layers * (lin_fsdp["all_gather_forward"] + lin_fsdp["all_gather_backward"]
                                                      - fsdp["all_gather_forward"] - fsdp["all_gather_backward"])
        step["fsdp_reduce_scatter"] += m.linear_layers * (lin_fsdp["reduce_scatter_backward"] - fsdp["reduce_scatter_backward"])
    if layout.tp == 1 and m.sliding_window and m.sliding_layers:  # per_layer shows a full-attention layer
        per_sliding = sliding_p2p["forward"] * (2 if work.checkpointing else 1) + sliding_p2p["backward"]
        per_full = sum(phase["ring_p2p"] for phase in per_layer.values())
        attention_layers = m.layers - m.linear_layers
        step["ring_p2p"] = (attention_layers - m.sliding_layers) * per_full + m.sliding_layers * per_sliding
    for unit, gathers in units:  # the root gathered once, the embedding again for its backward; one reduce-scatter
        step["fsdp_all_gather"] += gathers * unit["all_gather_forward"]
        step["fsdp_reduce_scatter"] += unit["reduce_scatter_backward"]
    if layout.tp == 1:
        step["input_check_all_gather"] = check
    for phase in (*per_layer.values(), step):
        phase["total"] = sum(phase.values())
    return per_layer, links, step


def evaluate(work: Workload, layout: Layout, cluster: Cluster, target: GlobalBatch = GlobalBatch()) -> Candidate:
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
                     tuple(problems), tuple(notes), target.accumulation(layout, work.batch))


def _rank_key(c: Candidate) -> tuple:
    return (not c.feasible, -c.tokens_per_s if c.feasible else c.memory.total)


def plan(work: Workload, cluster: Cluster, target: GlobalBatch = GlobalBatch()) -> Plan:
    """Evaluate every layout (that gives ``target``'s global batch); the recommendation first, then the
    others by predicted throughput."""
    ok, excluded = layouts(work, cluster, target)
    ranked = sorted((evaluate(work, lay, cluster, target) for lay in ok), key=_rank_key)
    best = pick(ranked, cluster.hardware.memory_bytes)
    if best is not None:
        ranked = [best] + [c for c in ranked if c is not best]
    reason = explain(best, ranked, cluster) if best else nothing_fits(ranked, cluster)
    return Plan(work, cluster, tuple(ranked), tuple(excluded), best, reason, target)


def longest_sequence(work: Workload, layout: Layout, memory_bytes: int, limit: int = 2**34) -> int:
    """The longest sequence whose step fits in ``memory_bytes`` per GPU on ``layout`` (0 if none)."""

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


def longest_plan(work: Workload, cluster: Cluster, target: GlobalBatch = GlobalBatch()) -> dict:
    """``--max-seq-len``: for every layout the longest sequence that fits and the plan at that length
    (rows longest first, then by tokens/s), and the seqmesh layout that fits the longest. A layout that
    cannot hold even one token has ``max_seq_len`` 0, ``step_time_s`` None, ``tokens_per_s`` 0, and its
    memory and traffic evaluated at one token (to show what does not fit). Only layouts that give
    ``target``'s global batch (in sequences) are tried. JSON-ready."""
    ok, _ = layouts(work, cluster, target)
    rows = []
    for lay in ok:
        n = longest_sequence(work, lay, cluster.hardware.memory_bytes)
        c = evaluate(replace(work, seq_len=max(n, 1)), lay, cluster)
        rows.append({
            "layout": lay.as_dict(), "label": lay.label(), "runs_on_seqmesh": lay.runs_on_seqmesh,
            "max_seq_len": n, "feasible": n > 0, "memory_bytes": c.memory.as_dict(), "memory_peak_at": c.memory.moment,
            "step_time_s": c.time.total if n else None, "tokens_per_s": c.tokens_per_s if n else 0.0,
            "comm_bytes_per_layer": c.comm_per_layer, "comm_bytes_per_step": c.comm_per_step,
        })
    rows.sort(key=lambda r: (-r["max_seq_len"], -r["tokens_per_s"]))
    best = next((r for r in rows if r["runs_on_seqmesh"] and r["max_seq_len"] > 0), None)
    reason = explain_longest(best, rows, cluster)
    rec = None if best is None else {"layout": best["layout"], "label": best["label"],
                                     "max_seq_len": best["max_seq_len"], "reason": reason}
    return {"mode": "max_seq_len", **workload_dict(work, cluster), "seq_len": None, "candidates": rows,
            "recommended": rec, "reason": reason}
