"""``seqmesh bench families``: each frontier family's training step beside a dense model of the same width.

One process, one device (the CPU over gloo, or one GPU over NCCL in bf16), the ``seqmesh train`` build
with checkpointing: every family's small config (:func:`family_config`, built from its transformers config class
and written as a config.json, as a user gives one) runs ``warmup`` steps, then ``repeats`` timed steps (the median
counts), each a forward, backward and AdamW step of one sequence of ``seq_len`` tokens. Each row gives the step's
seconds, tokens/s, the peak tensor bytes of one more step (the CPU: ``seqmesh.memory.MemoryTracker``, untimed; CUDA:
the allocator's peak over the timed steps) and the step time over its reference's, measured in the same run:

    llama        dense Llama (GQA 8/2): the reference of every mixer family
    transformers the same Llama config as plain transformers trains it (its own SDPA attention, its own
                 full-logits loss, its gradient checkpointing, bf16 autocast on CUDA): its ratio, plain's step
                 over seqmesh's, is seqmesh's dense speed relative to plain transformers'
    mla          dense MLA (DeepSeek-V3: 16 heads, q/k 192, v 128, a latent of width/2, 8 routed experts)
    dsa          DeepSeek Sparse Attention (DeepSeek-V3.2: the same MLA, an indexer of 16 heads of 128, top-k
                 ``dsa_topk``): measured against ``mla``, which attends to every earlier key
    nemotron_h   Mamba2 (heads of 64, state 128) x 3, attention, MoE (Nemotron-H's shape)
    qwen3_5      Gated DeltaNet x 3, then full attention (Qwen3.5)
    kimi_linear  KDA x 3, then MLA (Kimi Linear), MoE after the first layer
    lfm2         gated short convolutions and attention, alternating (LFM2)
    bloom        ALiBi attention (BLOOM: 8 heads, a two-matrix MLP of 4 x the width), its bias added inside the
                 kernel: the CPU flash op in row bands on the CPU, seqmesh's Triton flash kernel on CUDA
                 (``seqmesh.hf.own_attention``)

Issue 46's goal: DSA's step no longer than dense MLA's, each mixer family's at most twice the dense Llama's
(on a GPU: at least half its tokens/s), and seqmesh's dense step at least 0.98x plain transformers' speed (the
``transformers`` row's ratio at least 0.98).

A family that fails (an error, out of memory) or runs past ``family_timeout`` seconds gets a row with its
``error`` and no figures, and the run goes on with a fresh process: one slow family cannot take a GPU's whole
lease. Each row is handed to ``report`` as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# family -> the family its step is compared with (None: a reference itself)
REFERENCE: dict[str, str | None] = {"llama": None, "transformers": "llama", "mla": "llama", "dsa": "mla",
                                    "nemotron_h": "llama", "qwen3_5": "llama", "kimi_linear": "llama", "lfm2": "llama",
                                    "bloom": "llama"}
FAMILIES = tuple(REFERENCE)


@dataclass
class FamiliesBench:
    """One run. The defaults are issue 46's CPU sizes (hidden 256, 4,096 tokens, DSA top-k 512)."""

    width: int = 256
    """hidden size; a multiple of 128 (the mixers' heads are 64 and 128 wide)."""
    seq_len: int = 4096
    layers: int = 4
    """decoder layers of every family but Nemotron-H's shape (its 5: three Mamba2, attention, MoE)."""
    vocab: int = 4096
    """a small vocabulary, so that the LM head (the same in every family) does not hide the mixers' cost."""
    dsa_topk: int = 512
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 3
    """timed steps a family; their median counts (of three, one outlying step is ignored, where two are averaged: one
    step of this CPU moved by up to 15% on a noisy day, docs/benchmarks.md)."""
    families: tuple[str, ...] = FAMILIES
    family_timeout: float = 3600.0
    """seconds one family's build and steps may take before it is reported as not finished."""
    keep_attention: bool = False
    """each seqmesh family measured once more with ``--keep-attention`` (its checkpointed layers keep their attention
    outputs: the recompute skips the attention), in a row ``<family>+keep`` against the same family without."""
    profile: str | None = None
    """a folder: after the timed steps, one more step under ``torch.profiler``, its operator tables written to
    ``<profile>/<family>.txt`` and its counts in the row (``profiled``): where a step's time goes, and whether the
    device or the launches bound it."""

    def __post_init__(self) -> None:
        if self.width < 128 or self.width % 128:
            raise ValueError(f"width={self.width} must be a positive multiple of 128 (heads of 64 and 128).")
        for name in ("seq_len", "layers", "vocab", "dsa_topk", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if not self.family_timeout > 0:
            raise ValueError(f"family_timeout must be positive, got {self.family_timeout}.")
        if self.warmup < 0:
            raise ValueError(f"warmup must be 0 or more, got {self.warmup}.")
        unknown = [f for f in self.families if f not in REFERENCE]
        if unknown:
            raise ValueError(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}.")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: choose cpu or cuda.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device here; use --device cpu.")

    def measured(self) -> list[str]:
        """The families to run, each reference before the families measured against it."""
        chosen: list[str] = []

        def add(name: str) -> None:
            if REFERENCE[name] is not None:
                add(REFERENCE[name])
            if name not in chosen:
                chosen.append(name)

        for name in self.families:
            add(name)
        return chosen


def family_config(name: str, bench: FamiliesBench):
    """The transformers config of ``name`` at the bench's sizes."""
    import transformers as tf

    w, layers = bench.width, bench.layers
    common = dict(hidden_size=w, vocab_size=bench.vocab, max_position_embeddings=max(bench.seq_len, 4096),
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # ids in any vocab
    attention = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=w // 8)
    mixers = ["linear_attention"] * (layers - 1) + ["full_attention"]  # three mixers to one attention, as released
    mla = dict(num_attention_heads=16, num_key_value_heads=16, q_lora_rank=w // 2, kv_lora_rank=w // 2,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    experts = dict(moe_intermediate_size=w // 2, num_experts_per_tok=2)
    if name in ("llama", "transformers"):
        return tf.LlamaConfig(**common, **attention, intermediate_size=3 * w, num_hidden_layers=layers)
    if name in ("mla", "dsa"):
        deepseek = dict(**common, **mla, **experts, intermediate_size=3 * w, num_hidden_layers=layers,
                        n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
        if name == "mla":
            return tf.DeepseekV3Config(**deepseek)
        return tf.DeepseekV32Config(**deepseek, index_n_heads=16, index_head_dim=128, index_topk=bench.dsa_topk)
    if name == "nemotron_h":
        return tf.NemotronHConfig(**common, **attention, **experts, intermediate_size=3 * w, num_hidden_layers=5,
                                  layer_types=["linear_attention"] * 3 + ["full_attention", "moe"],
                                  mamba_num_heads=2 * w // 64, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
                                  n_routed_experts=8, moe_shared_expert_intermediate_size=w // 2)
    if name == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, **attention, intermediate_size=3 * w, num_hidden_layers=layers,
                                    layer_types=mixers, linear_key_head_dim=128, linear_value_head_dim=128,
                                    linear_num_key_heads=w // 128, linear_num_value_heads=2 * w // 128)
    if name == "kimi_linear":
        return tf.KimiLinearConfig(**common, **mla, **experts, intermediate_size=3 * w, num_hidden_layers=layers,
                                   num_local_experts=8, n_shared_experts=1, linear_head_dim=128,
                                   linear_num_heads=w // 128, linear_conv_kernel_dim=4, layer_types=mixers,
                                   mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    if name == "lfm2":
        return tf.Lfm2Config(**common, num_attention_heads=8, num_key_value_heads=2, intermediate_size=3 * w,
                             num_hidden_layers=layers, block_auto_adjust_ff_dim=False,
                             layer_types=["conv", "full_attention"] * (layers // 2) + ["conv"] * (layers % 2))
    if name == "bloom":
        return tf.BloomConfig(hidden_size=w, n_layer=layers, n_head=8, vocab_size=bench.vocab, tie_word_embeddings=False,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}.")


def _plain_build(folder: str, bench: FamiliesBench):
    """Plain transformers on the one rank (``seqmesh bench baseline``'s build): the model with its own attention and
    loss, its gradient checkpointing, bf16 autocast on CUDA. Returns (module, loss_of, autocast, tokens a step)."""
    from .baseline import BaselineBench, transformers_build

    device = torch.device("cuda", torch.cuda.current_device()) if bench.device == "cuda" else torch.device("cpu")
    module, _, loss_of, _, tokens = transformers_build(BaselineBench(model=folder, world=1), {"checkpointing": True},
                                                        bench.seq_len, device)
    return module, loss_of, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bench.device == "cuda"), tokens


def _seqmesh_build(folder: str, bench: FamiliesBench, keep: bool = False):
    """The ``seqmesh train`` build of the config.json in ``folder``, with checkpointing (bf16 on CUDA, under FSDP2's
    mixed precision as seqmesh train runs it; ``keep``: keeping the attention outputs). Returns (module, loss_of,
    autocast, tokens a step)."""
    from ..training.step import step_autocast
    from ..training.train import uses_fsdp
    from .baseline import BUILDERS, BaselineBench, seqmesh_config

    options = {"checkpointing": True, "keep_attention": keep, "bf16": bench.device == "cuda"}
    runs = BaselineBench(model=folder, world=1)
    module, offload, loss_of, _, tokens = BUILDERS["seqmesh"](runs, options, bench.seq_len)
    assert offload is None  # no offloaded checkpoints among the options
    # bf16 as seqmesh train steps: autocast, unless FSDP2's mixed precision casts the weights (the builder's config)
    cfg = seqmesh_config(runs, options, bench.seq_len)
    autocast = step_autocast(cfg, next(module.parameters()).device, uses_fsdp(cfg))
    return module, loss_of, autocast, tokens


def _measure(folder: str, bench: FamiliesBench, plain: bool = False, keep: bool = False) -> dict:
    """On the one rank: the build of the config.json in ``folder`` (plain transformers' where ``plain``, else
    seqmesh's, keeping the attention outputs where ``keep``); its steps' seconds and peak tensor bytes."""
    from ..memory import MemoryTracker
    from ..training.step import make_optimizer
    from .common import sync

    cuda = bench.device == "cuda"
    module, loss_of, autocast, tokens = (_plain_build(folder, bench) if plain else
                                         _seqmesh_build(folder, bench, keep))
    optimizer = make_optimizer(module, lr=1e-4)
    device = next(module.parameters()).device

    def step(i: int) -> None:
        with autocast:
            loss = loss_of(i)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(bench.warmup):
        step(i)
    peak = None
    if not cuda:  # the tracker's Python work per operator would count in the timed steps
        with MemoryTracker(module, optimizer) as tracker:
            step(bench.warmup)
        peak = tracker.report().peak_bytes
    else:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for i in range(bench.repeats):
        sync(device)
        start = time.perf_counter()
        step(bench.warmup + 1 + i)
        sync(device)
        seconds.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    result = {"seconds": seconds, "tokens": tokens, "peak_bytes": peak,
              "parameters": sum(p.numel() for p in module.parameters())}
    if bench.profile is not None:
        name = os.path.basename(folder) + ("+keep" if keep else "")
        result["profiled"] = _profiled_step(lambda: step(bench.warmup + 1 + bench.repeats), device,
                                            os.path.join(bench.profile, f"{name}.txt"))
    return result


# the runtime calls that launch a CUDA kernel, as the profiler names them
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _profiled_step(step: Callable[[], None], device: torch.device, path: str) -> dict:
    """``step()`` under ``torch.profiler``: its seconds, the device's kernel seconds (CUDA), the kernels launched and
    the aten operators called; the tables (by device or CPU time, and by calls) written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    from .common import sync

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        seconds = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 if cuda else None
    counts = {"seconds": seconds, "device_seconds": kernels,
              "launches": sum(e.count for e in events if e.key in LAUNCHES),
              "operators": sum(e.count for e in events if e.key.startswith("aten::"))}
    with open(path, "w") as f:
        f.write(f"{counts}\n")
        f.write(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30,
                             max_name_column_width=80))
        f.write(events.table(sort_by="count", row_limit=30, max_name_column_width=80))
    return counts


def bench_families(bench: FamiliesBench, report: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """One row per family (references first), each with its ratio to its reference's step time; handed to
    ``report`` as each finishes. A family that fails or runs past ``bench.family_timeout`` gets a row with its
    ``error`` (and so does every family compared with it), and the next runs in a fresh process."""
    from ..comm.launch import WorkerPool

    rows: dict[str, dict] = {}
    runs = _runs(bench)
    backend = "nccl" if bench.device == "cuda" else "gloo"

    def start() -> WorkerPool:
        return WorkerPool(1, threads=max(1, os.cpu_count() or 1), backend=backend, collective_timeout=3600.0)

    with tempfile.TemporaryDirectory() as root:
        pool = None
        try:
            for label, name, reference, keep in runs:
                row = {"family": label, "reference": reference, "seq_len": bench.seq_len, "width": bench.width}
                folder = os.path.join(root, name)
                if not keep:
                    family_config(name, bench).save_pretrained(folder)
                try:
                    if pool is None or not pool.alive:
                        pool = start()
                    result = pool.run(_measure, folder, bench, name == "transformers", keep,
                                      timeout=bench.family_timeout)[0]
                except RuntimeError as err:  # the pool closed itself (this family's error, or its time ran out), or
                    row["error"] = _first_lines(str(err), bench.family_timeout)  # a fresh one did not start
                else:
                    median = statistics.median(result["seconds"])
                    row.update(step_seconds=median, tokens_per_second=result["tokens"] / median,
                               peak_bytes=result["peak_bytes"], parameters=result["parameters"],
                               seconds=result["seconds"])
                    if "profiled" in result:
                        row["profiled"] = result["profiled"]
                    if reference is not None:
                        if "step_seconds" in rows[reference]:
                            row["over_reference"] = median / rows[reference]["step_seconds"]
                        else:
                            row["error"] = f"its reference {reference} has no step time"
                rows[label] = row
                report(row)
        finally:
            if pool is not None:
                pool.close()
    return [rows[label] for label, *_ in runs]


def _runs(bench: FamiliesBench) -> list[tuple[str, str, str | None, bool]]:
    """(row, family, reference row, keeping the attention outputs) of every row in order, references first; with
    ``keep_attention`` each seqmesh family's ``<family>+keep`` right after it, against it."""
    runs = []
    for name in bench.measured():
        runs.append((name, name, REFERENCE[name], False))
        if bench.keep_attention and name != "transformers":
            runs.append((f"{name}+keep", name, name, True))
    return runs


def _first_lines(text: str, timeout: float) -> str:
    """A failed family's error for its row: the pool's head line and the rank's last traceback line."""
    lines = [line for line in text.splitlines() if line.strip()]
    if "ran past its" in lines[0] and not lines[0].startswith("start-up"):
        return f"did not finish in {timeout:g} s"
    return lines[0] if len(lines) == 1 else f"{lines[0]}: {lines[-1].strip()}"


def family_header(bench: FamiliesBench) -> str:
    """The table's title and column names."""
    return "\n".join([
        f"seqmesh bench families: one {bench.device} process, {bench.seq_len:,} tokens, hidden {bench.width}, "
        f"checkpointing{', bf16' if bench.device == 'cuda' else ''}; median of {bench.repeats} steps",
        f"{'family':<17} {'step s':>8} {'tokens/s':>10} {'peak MiB':>9} {'params':>10}  vs reference"])


def family_line(r: dict) -> str:
    """One row of the table: its figures and its step over its reference's, or its error."""
    if "step_seconds" not in r:
        return f"{r['family']:<17} {r['error']}"
    if r["reference"] is None:
        against = "(reference)"
    elif "over_reference" not in r:
        against = r["error"]
    elif r["family"] == "transformers":  # plain's step over seqmesh's: seqmesh's speed relative to plain's
        against = f"seqmesh's llama at {r['over_reference']:.2f}x this speed"
    else:
        against = f"{r['over_reference']:.2f}x {r['reference']}"
    peak = f"{r['peak_bytes'] / 2**20:9.1f}" if r["peak_bytes"] is not None else f"{'-':>9}"
    line = (f"{r['family']:<17} {r['step_seconds']:8.3f} {r['tokens_per_second']:10.0f} {peak} "
            f"{r['parameters']:10,}  {against}")
    if "profiled" in r:
        p = r["profiled"]
        kernels = "" if p["device_seconds"] is None else f", kernels {p['device_seconds']:.3f} s"
        line += f"  [profiled: {p['operators']:,} operators, {p['launches']:,} launches{kernels}]"
    return line


def format_family_rows(bench: FamiliesBench, rows: list[dict]) -> str:
    return "\n".join([family_header(bench)] + [family_line(r) for r in rows])


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench families``."""

    def run(args: argparse.Namespace) -> int:
        try:
            bench = FamiliesBench(width=args.width, seq_len=args.seq_len, layers=args.layers, vocab=args.vocab,
                                  dsa_topk=args.dsa_topk, device=args.device, warmup=args.warmup,
                                  repeats=args.repeats, families=tuple(args.family or FAMILIES),
                                  family_timeout=args.family_timeout, profile=args.profile,
                                  keep_attention=args.keep_attention)
        except ValueError as err:
            raise SystemExit(f"seqmesh bench families: {err}") from None
        if args.profile:
            bench.profile = os.path.abspath(args.profile)  # the ranks' working folder may differ
            os.makedirs(args.profile, exist_ok=True)
            taken = [f for f, *_ in _runs(bench) if os.path.exists(os.path.join(args.profile, f"{f}.txt"))]
            if taken and not args.overwrite:
                raise SystemExit(f"seqmesh bench families: --profile {args.profile} already holds "
                                 f"{', '.join(f + '.txt' for f in taken)}; pass --overwrite to replace them, or name "
                                 "another folder.")
        if args.out and os.path.exists(args.out) and not args.overwrite:
            raise SystemExit(f"seqmesh bench families: --out {args.out} exists; pass --overwrite to replace it, "
                             "or name another file.")
        done: list[dict] = []

        def report(row: dict) -> None:  # each row as it finishes: a run cut short keeps what it measured
            done.append(row)
            if not args.json:
                print(family_line(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"bench": asdict(bench), "rows": done}, f, indent=1)

        if not args.json:
            print(family_header(bench), flush=True)
        rows = bench_families(bench, report)
        if args.json:
            print(json.dumps({"bench": asdict(bench), "rows": rows}))
        return 1 if any("error" in r for r in rows) else 0

    defaults = FamiliesBench()
    p = bench_sub.add_parser("families", help="each frontier family's training step beside the dense one's")
    p.add_argument("--family", action="append", choices=FAMILIES,
                   help="a family to run (repeatable; its reference runs too); default: all")
    p.add_argument("--device", default=defaults.device, choices=("cpu", "cuda"))
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--width", type=int, default=defaults.width, help="hidden size, a multiple of 128")
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--vocab", type=int, default=defaults.vocab)
    p.add_argument("--dsa-topk", type=int, default=defaults.dsa_topk, help="DeepSeek-V3.2's index_topk")
    p.add_argument("--warmup", type=int, default=defaults.warmup)
    p.add_argument("--repeats", type=int, default=defaults.repeats)
    p.add_argument("--family-timeout", type=float, default=defaults.family_timeout,
                   help="seconds one family may take; past it the family's row says so and the next one runs")
    p.add_argument("--keep-attention", action="store_true",
                   help="each family once more keeping its attention outputs (the recompute skips the attention), "
                        "in a row <family>+keep against it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", help="a JSON file of the rows so far, rewritten as each family finishes")
    p.add_argument("--profile", help="a folder: one more step of each family under torch.profiler, its tables "
                   "written there (FAMILY.txt) and its kernel time, launches and operators in the row")
    p.add_argument("--overwrite", action="store_true", help="replace --out, and --profile's tables, where they exist")
    p.set_defaults(func=run)
