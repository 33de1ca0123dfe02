"""``seqmesh bench experts``: what expert parallelism saves and what it sends, per rank, with and without it.

Each ``ep`` degree (1 first: every rank holds every expert, FSDP2 shards them) runs the same model on the same
batch through ``seqmesh train``'s build on ``world`` spawned gloo ranks (a ring of ``world`` ranks and no Ulysses
axis, so every all-to-all counted is an MoE layer's). Per degree and rank:

- the tracked peak tensor bytes of a training step (``seqmesh.memory.MemoryTracker``, the step after the first,
  once AdamW's state exists), and its ratio to ep 1's;
- each MoE layer's expert parameters one rank gathers (FSDP2's all-gather of its experts unit, from the shapes:
  ``E / ep`` experts' weights; FSDP2's own all-gathers are not counted by ``seqmesh.comm.stats``);
- the all-to-all bytes counted (``seqmesh.comm.stats.comm_stats``) in the first step, forward and backward, next to
  ``seqmesh.experts.traffic.exchange_bytes`` of the routes the routers took (every rank's token-expert pairs per
  expert, read by a forward pre-hook on each experts module): the two must be equal.

No times: the ranks share the host's cores.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch


@dataclass
class ExpertsBench:
    """One model and batch on ``world`` ranks, at each degree of ``eps``."""

    model: str = "gpt-oss-tiny"
    """A preset or a config.json with routed experts (``seqmesh train --model``)."""
    seq_len: int = 256
    world: int = 4
    eps: list[int] = field(default_factory=lambda: [2, 4])
    """The expert-parallel degrees compared with ep 1 (each must divide the experts and ``world``)."""


def _config(bench: ExpertsBench, ep: int):
    from ..training.config import TrainConfig

    return TrainConfig(model=bench.model, seq_len=bench.seq_len, ulysses=1, ring=bench.world, dp=1, ep=ep, fsdp=True,
                       steps=2, symbols=8)


def _record_pairs(lm, pairs: list[list[int]]) -> list:
    """A forward pre-hook on every experts module appending this rank's token-expert pairs per expert (E,)."""
    from ..experts.dispatch import pair_counts
    from ..experts.layers import experts_modules

    def hook(module, args):
        pairs.append(pair_counts(args[1], module.num_experts)[1].tolist())

    return [m.register_forward_pre_hook(hook) for m in experts_modules(lm)]


def measure_rank(bench: ExpertsBench, ep: int) -> dict:
    """On every rank: two training steps; the first's all-to-all bytes and pairs per expert of each MoE layer, the
    second's tracked peak."""
    import gc

    import torch.distributed as dist

    from ..comm.stats import comm_stats
    from ..experts.layers import experts_modules
    from ..memory import MemoryTracker
    from ..sequence.batch import shard_batch
    from ..training.step import make_optimizer, to_device
    from ..training.train import build
    from ..training.run_data import make_dataset

    gc.collect()  # the previous degree's model and optimizer, before this one is built
    cfg = _config(bench, ep)
    data = make_dataset(cfg)
    mesh, module, device = build(cfg)
    optimizer = make_optimizer(module, lr=1e-4)
    module.train()
    experts = experts_modules(module.lm)
    weights = [p for p in experts[0].parameters(recurse=False)]
    group = weights[0].device_mesh["ep"].mesh.tolist() if ep > 1 else [dist.get_rank()]
    pairs: list[list[int]] = []
    for step in range(2):
        local = to_device(shard_batch(data.batch(step, mesh.dp_rank, 1, mesh.dp_size), mesh), device)
        if step == 0:
            hooks = _record_pairs(module.lm, pairs)
            with comm_stats() as stats:
                module(**local).backward()
            for h in hooks:
                h.remove()
        else:
            with MemoryTracker(module, optimizer, device=device) as tracker:
                module(**local).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if step == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    gathered = sum(p.numel() * p.element_size() for p in weights) // ep  # one rank's experts, whole over FSDP2
    return {"rank": dist.get_rank(), "group": group, "pairs": pairs, "hidden": module.lm.config.hidden_size,
            "element_bytes": weights[0].element_size(), "experts": experts[0].num_experts,
            "counted": {phase: stats.sent("all_to_all", phase) for phase in ("forward", "backward")},
            "p2p_bytes": stats.sent("p2p"), "gathered_bytes": gathered, **tracker.report().as_dict()}


def formula_bytes(ranks: list[dict], me: dict, ep: int) -> dict[str, int]:
    """``exchange_bytes`` of the routes rank ``me`` took, summed over its MoE layers: what it sends to each rank of
    its group (its pairs for that rank's experts) and receives from each (their pairs for its own)."""
    from ..experts.traffic import exchange_bytes

    by_rank = {r["rank"]: r for r in ranks}
    n = me["experts"] // ep
    mine = me["group"].index(me["rank"])
    total = {"forward": 0, "backward": 0}
    for layer, pairs in enumerate(me["pairs"]):
        sent = [sum(pairs[r * n:(r + 1) * n]) for r in range(ep)]
        received = [sum(by_rank[other]["pairs"][layer][mine * n:(mine + 1) * n]) for other in me["group"]]
        moved = exchange_bytes(sent, received, mine, me["hidden"], me["element_bytes"], n)
        total["forward"] += moved.forward
        total["backward"] += moved.backward
    return total


def bench_experts(bench: ExpertsBench) -> list[dict]:
    """One row per degree (ep 1 first): the busiest rank's peak and its ratio to ep 1's, the expert bytes gathered
    per MoE layer, and every rank's counted all-to-all bytes against the formula (``exact``: equal on all)."""
    from ..comm.launch import WorkerPool

    rows = []
    with WorkerPool(bench.world, threads=max(1, (os.cpu_count() or 1) // bench.world)) as pool:
        for ep in [1] + [e for e in bench.eps if e != 1]:
            ranks = pool.run(measure_rank, bench, ep, timeout=3600)
            formulas = [formula_bytes(ranks, r, ep) for r in ranks] if ep > 1 else [
                {"forward": 0, "backward": 0} for _ in ranks]
            top = max(ranks, key=lambda r: r["peak_bytes"])
            rows.append({"ep": ep, "peak_bytes": top["peak_bytes"], "parameters_bytes": top["parameters_bytes"],
                         "gathered_bytes": top["gathered_bytes"], "layers": len(top["pairs"]),
                         "counted": [r["counted"] for r in ranks], "formula": formulas,
                         "exact": all(r["counted"] == f for r, f in zip(ranks, formulas))})
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / rows[0]["peak_bytes"]
        row["gathered_ratio"] = row["gathered_bytes"] / rows[0]["gathered_bytes"]
    return rows


def format_rows(bench: ExpertsBench, rows: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:10.3f}"  # noqa: E731
    lines = [f"expert parallelism: {bench.model}, {bench.world} gloo ranks (ring {bench.world}), seq_len "
             f"{bench.seq_len}, {rows[0]['layers']} MoE layers; peak: busiest rank, MiB; all-to-all: KiB per rank, "
             "forward + backward, counted / formula",
             f"{'ep':>3}{'peak':>10}{'x ep1':>7}{'params':>10}{'gather/layer':>13}{'x ep1':>7}  all-to-all per rank"
             f"{'':>4}exact"]
    for r in rows:
        moved = " ".join(f"{(c['forward'] + c['backward']) / 1024:.1f}/{(f['forward'] + f['backward']) / 1024:.1f}"
                         for c, f in zip(r["counted"], r["formula"]))
        lines.append(f"{r['ep']:>3}{mib(r['peak_bytes'])}{r['peak_ratio']:>7.3f}{mib(r['parameters_bytes'])}"
                     f"{mib(r['gathered_bytes'])}   {r['gathered_ratio']:>7.3f}  {moved}  {'yes' if r['exact'] else 'NO'}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench experts``."""

    def run(args) -> int:
        bench = ExpertsBench(model=args.model, seq_len=args.seq_len, world=args.world, eps=args.ep)
        rows = bench_experts(bench)
        print(json.dumps(rows, indent=1) if args.json else format_rows(bench, rows))
        return 0 if all(r["exact"] for r in rows) else 1

    p = bench_sub.add_parser("experts", help="per-rank peak memory and all-to-all bytes with and without expert "
                             "parallelism (counted against the formula)")
    p.add_argument("--model", default="gpt-oss-tiny", help="a preset or config.json with routed experts")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn (gloo, CPU)")
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="degrees compared with ep 1")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run)
