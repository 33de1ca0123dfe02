"""``seqmesh bench compile``: what ``torch.compile`` (per decoder layer, as ``seqmesh train --compile``)
gains, for seqmesh and for plain transformers, measured side by side in the same processes.

Four methods train the same Llama-shaped model (the same weights) on the same tokens, one
forward + backward step each, the loss taken from the logits the same way for all:

    transformers           the model with its own SDPA attention on the whole sequence
    transformers_compiled  the same, each decoder layer compiled (``nn.Module.compile``)
    seqmesh                ``seqmesh.hf.parallelize``: attention through ``seqmesh.attention``
    seqmesh_compiled       the same, each decoder layer compiled: attention is one op in each layer's graph

On one process (``--world 1``, the default) all four run and the ratios are compiled / eager for each
framework and compiled seqmesh / compiled transformers. On ``--world`` > 1 spawned ranks only the
seqmesh methods run (transformers would hold the whole sequence on every rank), over ``--mesh``.
Each method's time is the fastest of ``--repeats`` steps after two warm-up steps (the compile
happens in the first; its wall time is reported as ``compile_s``); the methods take turns within
each repeat, so a slow moment of a shared machine falls on all of them alike. ``logits_diff`` is the
largest difference of the compiled model's logits from its eager twin's on the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import parse_mesh, sync

METHODS = ("transformers", "transformers_compiled", "seqmesh", "seqmesh_compiled")


@dataclass
class CompileBench:
    seq_len: int = 2048
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 1024
    documents: int = 1  # packed documents of equal length in the sequence
    repeats: int = 5
    world: int = 1
    mesh: tuple[int, int] = (1, 1)  # (ulysses, ring)


def _config(cfg: CompileBench):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                       num_key_value_heads=cfg.kv_heads, head_dim=cfg.hidden // cfg.heads,
                       intermediate_size=2 * cfg.hidden, vocab_size=cfg.vocab, attention_dropout=0.0)


def _batch(cfg: CompileBench) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (1, cfg.seq_len), generator=g)
    if cfg.documents <= 1:
        return {"input_ids": ids}
    cuts = [round(i * cfg.seq_len / cfg.documents) for i in range(cfg.documents + 1)]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]
    return {"input_ids": ids, "position_ids": positions}


def _model(cfg: CompileBench, compiled: bool):
    from transformers import AutoModelForCausalLM

    from ..compose import compile_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(cfg), attn_implementation="sdpa")
    if compiled:
        compile_layers(model)
    return model


def _step(model, inputs: dict, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward + backward; its wall time and the logits."""
    sync(targets.device)
    start = time.perf_counter()
    logits = model(**inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    sync(targets.device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, logits.detach()


def compile_rows(cfg: CompileBench) -> dict:
    """On every rank: each method's fastest step and compile time; run inside a process group."""
    import seqmesh
    from seqmesh.hf import parallelize

    mesh = seqmesh.init_mesh(*cfg.mesh)
    batch = _batch(cfg)
    local = seqmesh.shard_batch(batch, mesh)
    plain_inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids")}
    plain_targets = torch.cat([batch["input_ids"][:, 1:], torch.full((1, 1), -100)], dim=1)
    if "position_ids" in batch:  # a document's last token predicts nothing, as shard_batch's targets say
        plain_targets[:, :-1][batch["position_ids"][:, 1:] == 0] = -100
    methods = {}
    for name in METHODS if cfg.world == 1 else METHODS[2:]:
        model = _model(cfg, compiled=name.endswith("compiled"))
        if name.startswith("seqmesh"):
            inputs = {k: local[k] for k in ("input_ids", "position_ids", "seqmesh")}
            methods[name] = (parallelize(model, mesh), inputs, local["shift_labels"])
        else:
            methods[name] = (model, plain_inputs, plain_targets)
    rows = {name: {"step_s": float("inf")} for name in methods}
    logits = {}
    for name, (model, inputs, targets) in methods.items():
        start = time.perf_counter()
        _, logits[name] = _step(model, inputs, targets)  # compiles (compiled methods)
        _step(model, inputs, targets)
        rows[name]["compile_s"] = time.perf_counter() - start
    for _ in range(cfg.repeats):
        for name, (model, inputs, targets) in methods.items():
            rows[name]["step_s"] = min(rows[name]["step_s"], _step(model, inputs, targets)[0])
    for name in methods:
        if name.endswith("compiled"):
            rows[name]["logits_diff"] = float((logits[name] - logits[name.removesuffix("_compiled")]).abs().max())
    return rows


def ratios(rows: dict) -> dict:
    """compiled / eager per framework, and compiled seqmesh / compiled transformers (times: below 1 is faster)."""
    out = {"seqmesh compiled / eager": rows["seqmesh_compiled"]["step_s"] / rows["seqmesh"]["step_s"]}
    if "transformers" in rows:
        out["transformers compiled / eager"] = rows["transformers_compiled"]["step_s"] / rows["transformers"]["step_s"]
        out["seqmesh compiled / transformers compiled"] = (rows["seqmesh_compiled"]["step_s"]
                                                          / rows["transformers_compiled"]["step_s"])
        out["seqmesh eager / transformers eager"] = rows["seqmesh"]["step_s"] / rows["transformers"]["step_s"]
    return out


def run_compile_bench(cfg: CompileBench) -> dict:
    """Spawn ``cfg.world`` ranks (threads: the cores shared out) and return rank 0's rows and the ratios."""
    from ..comm.launch import WorkerPool

    if cfg.mesh[0] * cfg.mesh[1] != cfg.world:
        raise ValueError(f"mesh {cfg.mesh[0]}x{cfg.mesh[1]} has {cfg.mesh[0] * cfg.mesh[1]} ranks but world is "
                         f"{cfg.world}; pass --mesh ULYSSESxRING with ULYSSES x RING = --world.")
    threads = max(1, (os.cpu_count() or 1) // cfg.world)
    with WorkerPool(cfg.world, threads=threads) as pool:
        rows = pool.run(compile_rows, cfg, timeout=3600)[0]
    return {"rows": rows, "ratios": ratios(rows), "threads_per_rank": threads}


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench compile``."""

    def run(args: argparse.Namespace) -> int:
        cfg = CompileBench(seq_len=args.seq_len, layers=args.layers, hidden=args.hidden, heads=args.heads,
                           kv_heads=args.kv_heads, documents=args.documents, repeats=args.repeats, world=args.world,
                           mesh=args.mesh or (1, args.world))
        result = run_compile_bench(cfg)
        if args.json:
            print(json.dumps(result, indent=1))
            return 0
        for name, row in result["rows"].items():
            extra = f"  logits diff {row['logits_diff']:.1e}" if "logits_diff" in row else ""
            print(f"{name:24s} step {row['step_s'] * 1e3:9.1f} ms  (first two steps {row['compile_s']:.1f} s){extra}")
        for name, value in result["ratios"].items():
            print(f"{name:42s} {value:.3f}")
        return 0

    p = bench_sub.add_parser("compile", help="torch.compile per decoder layer: seqmesh and transformers, compiled vs eager")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--documents", type=int, default=1, help="packed documents of equal length (1: one sequence)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=1, help="spawned CPU processes (above 1: the seqmesh methods only)")
    p.add_argument("--mesh", type=parse_mesh, default=None, help="ULYSSESxRING over --world (default 1xWORLD)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
