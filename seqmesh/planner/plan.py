"""Enumerate the layouts of a cluster, evaluate each (a :class:`.candidate.Candidate`: memory, traffic,
time, feasibility) and rank them by cluster throughput (tokens/s: a layout with ``dp_shard`` groups
processes ``dp_shard`` micro-batches per step). The recommendation among close predictions is
:mod:`.recommend`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .candidate import Candidate
from .hardware import GiB, Cluster, HardwareSpec
from .memory import MemoryBreakdown, memory_per_gpu
from .experts import exchange_link, exchange_phases, expert_degrees, expert_parallel_refusal, layer_fsdp_traffic, moe_layers
from .recommend import explain, explain_longest, nothing_fits, pick
from .layers import Attention, LayerKind, layer_kinds
from .network import every_group, link_name
from .timing import step_time
from .placement import placement, tp_heads, ulysses_refusal
from .tensor_parallel import pooled_loss_bytes, step_traffic, tensor_parallel_refusal
from .traffic import fsdp_traffic
from .vision import tower_memory, with_tower
from ..rules.degrees import Degrees
from .workload import GlobalBatch, Workload


PHASES = ("forward", "backward", "recompute")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Plan:
    """Every candidate, best first, and the recommendation."""

    work: Workload
    cluster: Cluster
    candidates: tuple[Candidate, ...]
    excluded: tuple[tuple[Degrees, str], ...] = field(default_factory=tuple)  # layouts that cannot run at all
    recommended: Candidate | None = None
    reason: str = ""
    target: GlobalBatch = GlobalBatch()  # the global batch asked for, if any

    def as_dict(self) -> dict:
        best = self.recommended
        rec = None if best is None else {"layout": best.layout.as_dict(), "label": best.layout.label(),
                                         "reason": self.reason}
        return {"mode": "plan", **workload_dict(self.work, self.cluster),
                "global_batch_seqs": self.target.sequences, "one_group": self.target.one_group,
                "candidates": [c.as_dict() for c in self.candidates],
                "excluded": [{"layout": lay.as_dict(), "reason": why} for lay, why in self.excluded],
                "recommended": rec, "reason": self.reason}


def workload_dict(work: Workload, cluster: Cluster) -> dict:
    """The fields every JSON answer starts with: what was planned, on what."""
    return {"model": work.model.as_dict(), "seq_len": work.seq_len, "batch": work.batch, "dtype": work.dtype,
            "checkpointing": work.checkpointing, "chunked_loss": work.chunked_loss, "tiled_mlp": work.tiled_mlp,
            "efficient_norm": work.efficient_norm, "offload_checkpoints": work.offload_checkpoints,
            "keep_attention": work.keep_attention, "fsdp_cpu_offload": work.fsdp_cpu_offload,
            "gpus": cluster.gpus, "nodes": cluster.nodes,
            "hardware": cluster.hardware.as_dict()}


def layouts(work: Workload, cluster: Cluster,
            target: GlobalBatch = GlobalBatch()) -> tuple[list[Degrees], list[tuple[Degrees, str]]]:
    """Every layout of the cluster's GPUs, ``tp x ulysses x ring x dp_shard``, and the ones that cannot run (or
    cannot give ``target``'s global batch) with the reason."""
    m, n = work.model, cluster.gpus
    ok, excluded = [], []
    for tp in divisors(n):
        for sp in divisors(n // tp):
            for u in divisors(sp):
                lay = Degrees(u, sp // u, n // tp // sp, tp)
                if not work.admits(lay):  # a degree given as a number: only its layouts
                    continue
                why = (tensor_parallel_refusal(work, cluster.hardware, lay) if tp > 1 else None) \
                    or ulysses_refusal(m, u, tp)
                if why:
                    excluded.append((lay, why))
                elif m.linear_layers and sp > m.linear_value_heads and work.linear_attention == "all_to_all":
                    excluded.append((lay, f"sequence degree {sp} exceeds the {m.linear_value_heads} Gated DeltaNet "
                                          "value heads the all-to-all design splits; state passing has no limit"))
                elif (m.hybrid is not None and m.hybrid.mamba is not None and sp > m.hybrid.mamba.heads
                      and work.linear_attention == "all_to_all"):
                    excluded.append((lay, f"sequence degree {sp} exceeds the {m.hybrid.mamba.heads} Mamba2 heads the "
                                          "all-to-all design splits; state passing has no limit"))
                elif (m.hybrid is not None and m.hybrid.kda is not None and sp > m.hybrid.kda.heads
                      and work.linear_attention == "all_to_all"):
                    excluded.append((lay, f"sequence degree {sp} exceeds the {m.hybrid.kda.heads} KDA heads the "
                                          "all-to-all design splits; state passing has no limit"))
                elif work.media is not None and u > m.vision.heads:
                    excluded.append((lay, f"ulysses {u} exceeds the vision tower's {m.vision.heads} heads"))
                else:
                    ok.append(lay)
    ok, excluded = _with_experts(work, ok, excluded)
    for lay in list(ok):
        why = target.why_not(lay, work.batch)
        if why:
            ok.remove(lay)
            excluded.append((lay, why))
    return ok, excluded


def _with_experts(work: Workload, ok: list[Degrees],
                  excluded: list[tuple[Degrees, str]]) -> tuple[list[Degrees], list[tuple[Degrees, str]]]:
    """Each runnable layout at every expert-parallel degree ``work.ep`` asks for (``auto``: each one it can take; a
    TP layout none), and those it cannot take with the reason."""
    if work.ep == 1:
        return ok, excluded
    out = []
    for lay in ok:
        asked = 1 if lay.tp > 1 and work.ep == "auto" else work.ep
        for ep in expert_degrees(work.model, lay.fsdp_group, asked):
            with_ep = replace(lay, ep=ep)
            why = expert_parallel_refusal(work.model, with_ep)
            if why:
                excluded.append((with_ep, why))
            else:
                out.append(with_ep)
    return out, excluded


def communication(work: Workload, layout: Degrees, hw: HardwareSpec) -> tuple[dict, dict, dict]:
    """(bytes per layer by phase and collective, link of each collective, bytes per step by collective), all for
    the busiest rank; what each counts is docs/planner.md's "JSON output" (``comm_bytes_per_layer``, ``_per_step``)."""
    m = work.model
    attention = Attention(work, layout)
    shown: list[LayerKind] = []  # one layer of each kind (the first: full attention before sliding, an indexer's;
    # DeepSeek-V4's HCA and CSA each, the larger of their bytes shown)
    for kind, _ in layer_kinds(work, layout):
        if not any(type(k) is type(kind) and getattr(k, "kind", None) == getattr(kind, "kind", None) for k in shown):
            shown.append(kind)
    per_layer = {phase: {} for phase in PHASES}
    fsdp_link = link_name(hw, [[r for group in every_group(layout, "sequence") for r in group]])
    links = {"fsdp_all_gather": fsdp_link, "fsdp_reduce_scatter": fsdp_link}
    for kind in shown:
        for phase, sent in kind.traffic().items():
            per_layer[phase] |= {key: max(n, per_layer[phase].get(key, 0)) for key, n in sent.items()}
        links |= kind.links(hw)
    for phase, sent in with_fsdp(shown[0], work, layout).items():
        per_layer[phase] |= {k: sent[k] for k in ("fsdp_all_gather", "fsdp_reduce_scatter")}
    step = dict.fromkeys(per_layer["forward"], 0)
    for kind, count in layer_kinds(work, layout):
        for sent in with_fsdp(kind, work, layout).values():
            for k, v in sent.items():
                step[k] += count * v
    split = placement(work, layout).split
    units = [(fsdp_traffic(n, layout.fsdp_group, work.torch_dtype, work.reduce_dtype), gathers)
             for n, gathers in ((split["root"], 1), (split["embedding"], 2)) if n]  # root, untied embedding
    for unit, gathers in units:  # the root gathered once, the embedding again for its backward; one reduce-scatter
        step["fsdp_all_gather"] += gathers * unit["all_gather_forward"]
        step["fsdp_reduce_scatter"] += unit["reduce_scatter_backward"]
    # the first seqmesh attention call of a batch checks the inputs (indexed layers do not call it)
    step["input_check_all_gather"] = attention.input_check() if m.seqmesh_attention_layers else 0
    step["loss_all_reduce"] = pooled_loss_bytes(work, layout)
    if layout.ep > 1:  # every MoE layer's dispatch and combine (a balanced router: seqmesh.experts.traffic)
        for phase, sent in exchange_phases(work, layout).items():
            per_layer[phase]["ep_all_to_all"] = sent
        step["ep_all_to_all"] = moe_layers(m) * sum(per_layer[phase]["ep_all_to_all"] for phase in PHASES)
        links["ep_all_to_all"] = exchange_link(layout, hw)
    if layout.tp > 1:  # the embedding's and the loss's TP collectives, the loss tiles' and norm gradients' all-reduces
        for sent in step_traffic(work, layout).values():
            for k, v in sent.items():
                step[k] = step.get(k, 0) + v
    for phase in (*per_layer.values(), step):
        phase["total"] = sum(phase.values())
    return per_layer, links, step


def with_fsdp(kind: LayerKind, work: Workload, layout: Degrees) -> dict[str, dict[str, int]]:
    """``kind``'s traffic per phase with its FSDP unit's: gathered forward and again backward (not in the
    recompute: the layer stays gathered for its backward), reduce-scattered backward."""
    fsdp = layer_fsdp_traffic(kind.params(), work, layout)  # under EP, the rank's experts over their holders
    sent = kind.traffic()
    sent["forward"] |= {"fsdp_all_gather": fsdp["all_gather_forward"], "fsdp_reduce_scatter": 0}
    sent["backward"] |= {"fsdp_all_gather": fsdp["all_gather_backward"],
                         "fsdp_reduce_scatter": fsdp["reduce_scatter_backward"]}
    sent["recompute"] |= {"fsdp_all_gather": 0, "fsdp_reduce_scatter": 0}
    return sent


def peak_memory(work: Workload, layout: Degrees) -> MemoryBreakdown:
    """The step's peak per GPU, with a vision-language workload's tower (:mod:`.vision`)."""
    return memory_per_gpu(work, layout) if work.media is None else tower_memory(work, layout)


def evaluate(work: Workload, layout: Degrees, cluster: Cluster, target: GlobalBatch = GlobalBatch()) -> Candidate:
    why = expert_parallel_refusal(work.model, layout)
    if why:
        raise ValueError(f"{layout.label()}: {why}; choose an ep that fits (seqmesh plan --ep auto lists them).")
    hw = cluster.hardware
    mem = peak_memory(work, layout)
    per_layer, links, per_step = communication(work, layout, hw)
    t = step_time(work, layout, hw)
    if work.media is not None:  # the tower runs before the decoder's forward and after its backward
        t, per_step = with_tower(t, per_step, work, layout, hw)
    m = work.model
    problems, notes = [], []
    if mem.total > hw.memory_bytes:
        problems.append(f"needs {mem.total / GiB:.1f} GiB per GPU, more than the {hw.memory_bytes / GiB:.1f} GiB it "
                        "has")
    place = placement(work, layout)
    heads, kv_heads = tp_heads(m, layout)  # each TP rank's, dealt by its Ulysses group
    each = f" (each TP rank's)" if layout.tp > 1 else ""
    if layout.ulysses > 1 and m.layers > m.compressed_layers:  # Ulysses splits no head of a compressed layer
        if heads % layout.ulysses:
            notes.append(f"uneven heads: {heads} query heads{each} over {layout.ulysses} Ulysses ranks")
        if place.heads.replicated:
            notes.append(f"kv replication: {kv_heads} kv heads{each} over {layout.ulysses} Ulysses ranks")
    padded = place.padded
    if padded != work.seq_len:
        notes.append(f"padded to {padded} tokens")
    tokens = layout.dp_shard * work.batch * work.seq_len
    return Candidate(layout, mem, per_layer, links, per_step, t, tokens / t.total, not problems,
                     tuple(problems), tuple(notes), target.accumulation(layout, work.batch))


def plan(work: Workload, cluster: Cluster, target: GlobalBatch = GlobalBatch()) -> Plan:
    """Evaluate every layout (that gives ``target``'s global batch); the recommendation first, then the
    others by predicted throughput."""
    ok, excluded = layouts(work, cluster, target)
    ranked = sorted((evaluate(work, lay, cluster, target) for lay in ok),  # fitting ones fastest first, then smallest
                    key=lambda c: (not c.feasible, -c.tokens_per_s if c.feasible else c.memory.total))
    best = pick(ranked, cluster.hardware.memory_bytes)
    if best is not None:
        ranked = [best] + [c for c in ranked if c is not best]
    reason = explain(best, ranked, cluster) if best else nothing_fits(ranked, cluster)
    return Plan(work, cluster, tuple(ranked), tuple(excluded), best, reason, target)


def shortest_sequence(work: Workload) -> int:
    """The shortest sequence a workload can have: one token, or its images' placeholder tokens."""
    return 1 if work.media is None else max(1, work.media.tokens(work.model.vision))


def longest_sequence(work: Workload, layout: Degrees, memory_bytes: int, limit: int = 2**34) -> int:
    """The longest sequence whose step fits in ``memory_bytes`` per GPU on ``layout`` (0 if none)."""

    def fits(s: int) -> bool:
        return peak_memory(replace(work, seq_len=s), layout).total <= memory_bytes

    lo = shortest_sequence(work)
    if not fits(lo):
        return 0
    hi = 2 * lo
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def longest_plan(work: Workload, cluster: Cluster, target: GlobalBatch = GlobalBatch()) -> dict:
    """``--max-seq-len``, JSON-ready: for every layout that gives ``target``'s global batch the longest sequence that
    fits and the plan at that length (longest first, then by tokens/s), and the seqmesh layout that fits the longest;
    a row that holds not one token is evaluated at the shortest sequence (docs/planner.md, ``@longest``)."""
    ok, _ = layouts(work, cluster, target)
    rows = []
    for lay in ok:
        n = longest_sequence(work, lay, cluster.hardware.memory_bytes)
        c = evaluate(replace(work, seq_len=max(n, shortest_sequence(work))), lay, cluster)
        rows.append({"layout": lay.as_dict(), "label": lay.label(), "runs_on_seqmesh": lay.runs_on_seqmesh,
                     "max_seq_len": n, "feasible": n > 0, "memory_bytes": c.memory.as_dict(),
                     "memory_peak_at": c.memory.moment, "step_time_s": c.time.total if n else None,
                     "tokens_per_s": c.tokens_per_s if n else 0.0, "comm_bytes_per_layer": c.comm_per_layer,
                     "comm_bytes_per_step": c.comm_per_step})
    rows.sort(key=lambda r: (-r["max_seq_len"], -r["tokens_per_s"]))
    best = next((r for r in rows if r["runs_on_seqmesh"] and r["max_seq_len"] > 0), None)
    reason = explain_longest(best, rows, cluster)
    rec = None if best is None else {"layout": best["layout"], "label": best["label"],
                                     "max_seq_len": best["max_seq_len"], "reason": reason}
    return {"mode": "max_seq_len", **workload_dict(work, cluster), "seq_len": None, "candidates": rows,
            "recommended": rec, "reason": reason}
