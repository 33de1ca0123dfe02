"""``seqmesh bench indexer``: DeepSeek Sparse Attention's selection in float32 against ``--indexer-precision
bfloat16``, on the families bench's DSA config (``seqmesh bench families``' ``dsa`` row), one process.

The model is transformers' DeepSeek-V3.2 in float32 with random weights (SDPA attention), run on random tokens. Each
indexer's forward is replaced for the run: it takes its inputs as transformers hands them over (hidden states, the
query's residual, the rotary embeddings), makes the indexer's queries, keys and head weights as seqmesh does
(:mod:`seqmesh.hf.indexed_layouts`), and scores the whole row twice with seqmesh's own scoring
(:func:`seqmesh.hf.indexed_attention.index_rows`: the Triton kernel on a GPU, the torch form on a CPU): once in
float32, once rounded to bfloat16. Each query then picks
its top k of its earlier keys both ways, and the layer attends with the float32 picks. The row reports, per layer:

- ``same_picks``: the share of the picks both precisions make (over the queries that see more keys than k; the
  others pick every key they see, either way);
- ``same_queries``: the share of those queries whose picks are all the same;
- ``worst``: the smallest share of one query's picks kept;
- ``float32_s`` and ``bfloat16_s``: the scoring's seconds, each precision (one warm-up call first).

Random weights are not a trained model's: a trained indexer's scores spread differently, so these shares are what
this config shows, not a promise for a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import time
import types
from dataclasses import asdict, dataclass

import torch

from .common import sync


@dataclass
class IndexerBench:
    """One run: the families bench's DSA sizes (hidden 256, 4,096 tokens, top-k 512, 16 indexer heads of 128)."""

    width: int = 256
    seq_len: int = 4096
    layers: int = 4
    dsa_topk: int = 512
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        from .families import FamiliesBench

        FamiliesBench(width=self.width, seq_len=self.seq_len, layers=self.layers, dsa_topk=self.dsa_topk,
                      device=self.device)  # the same checks, the same messages
        if self.seq_len <= self.dsa_topk:
            raise ValueError(f"seq_len={self.seq_len} is not above dsa_topk={self.dsa_topk}: every query would pick "
                             "every key it sees, in either precision; give a longer --seq-len.")


def _scores(indexer, rule, q, keys, weights, precision: str) -> torch.Tensor:
    """(B, L, T) the whole row's indexer scores by seqmesh's scoring, the later keys -inf."""
    from ..hf.indexed_attention import index_rows

    length = q.shape[1]
    blocks = index_rows(indexer, rule, q, keys, weights, list(range(length)), length, precision)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    return torch.cat([s.masked_fill_(~causal[block], float("-inf")) for block, s in blocks], dim=1)


def _timed(fn, device: torch.device) -> tuple[torch.Tensor, float]:
    fn()  # warm-up: the kernel's compile and probe
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def _agreement(a: torch.Tensor, b: torch.Tensor, length: int, top: int) -> dict:
    """a, b (B, L, k) picks of the same queries; over the queries that see more than k keys."""
    first = top  # query i sees i + 1 keys: from query k on it leaves some out
    a, b = a[:, first:], b[:, first:]
    kept = []
    for start in range(0, a.shape[1], 1024):  # (B, 1024, T) marks at a time
        marks = torch.zeros(*a[:, start:start + 1024].shape[:2], length, dtype=torch.bool, device=a.device)
        marks.scatter_(-1, a[:, start:start + 1024], True)
        kept.append(marks.gather(-1, b[:, start:start + 1024]).sum(-1))
    shared = torch.cat(kept, dim=1).double() / top  # (B, L - k) each query's share of picks kept
    return {"queries": int(shared.numel()), "same_picks": float(shared.mean()),
            "same_queries": float((shared == 1).double().mean()), "worst": float(shared.min())}


def bench_indexer(bench: IndexerBench) -> list[dict]:
    """One row per indexed layer (the module docstring's figures)."""
    import transformers as tf

    from ..hf import indexed_layouts as layouts
    from .families import FamiliesBench, family_config

    device = torch.device("cuda", torch.cuda.current_device()) if bench.device == "cuda" else torch.device("cpu")
    config = family_config("dsa", FamiliesBench(width=bench.width, seq_len=bench.seq_len, layers=bench.layers,
                                                dsa_topk=bench.dsa_topk, device=bench.device))
    torch.manual_seed(bench.seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()
    rows: list[dict] = []

    def measured(indexer, hidden, q_resid, position_embeddings, *rest, **kwargs) -> torch.Tensor:
        # in place of transformers' indexer forward (its (B, S, H, T) scores at once would not fit a long row): both
        # precisions' picks compared, the float32 ones returned for the layer to attend with
        rule = layouts.indexer_rule(indexer)
        q, k = layouts.indexer_keys(indexer, rule, hidden, q_resid, position_embeddings)
        weights = layouts.head_weights(indexer, rule, hidden)
        top = min(indexer.index_topk, hidden.shape[1])
        picks, seconds = {}, {}
        for precision in ("float32", "bfloat16"):
            scores, seconds[precision] = _timed(lambda: _scores(indexer, rule, q, k, weights, precision), device)
            picks[precision] = scores.topk(top, dim=-1).indices
            del scores
        rows.append({"layer": len(rows), **_agreement(picks["float32"], picks["bfloat16"], hidden.shape[1], top),
                     "float32_s": seconds["float32"], "bfloat16_s": seconds["bfloat16"]})
        return picks["float32"].to(torch.int32)

    for module in model.modules():
        if type(module).__name__ == "DeepseekV32Indexer":
            module.forward = types.MethodType(measured, module)
    tokens = torch.randint(3, config.vocab_size, (1, bench.seq_len), device=device)
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
    return rows


def format_indexer_rows(bench: IndexerBench, rows: list[dict]) -> str:
    lines = [f"DSA indexer picks, float32 vs bfloat16 (width {bench.width}, {bench.seq_len} tokens, top-k "
             f"{bench.dsa_topk}, random weights, {bench.device})",
             f"{'layer':>5}{'queries':>9}{'same picks':>12}{'same queries':>14}{'worst':>8}{'float32 s':>11}"
             f"{'bfloat16 s':>12}"]
    for r in rows:
        lines.append(f"{r['layer']:>5}{r['queries']:>9}{r['same_picks']:>12.4f}{r['same_queries']:>14.4f}"
                     f"{r['worst']:>8.3f}{r['float32_s']:>11.4f}{r['bfloat16_s']:>12.4f}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench indexer``."""

    def run(args: argparse.Namespace) -> int:
        try:
            bench = IndexerBench(width=args.width, seq_len=args.seq_len, layers=args.layers, dsa_topk=args.dsa_topk,
                                 device=args.device, seed=args.seed)
        except ValueError as err:
            raise SystemExit(f"seqmesh bench indexer: {err}") from None
        rows = bench_indexer(bench)
        print(json.dumps({"bench": asdict(bench), "rows": rows}) if args.json else format_indexer_rows(bench, rows))
        return 0

    defaults = IndexerBench()
    p = bench_sub.add_parser("indexer", help="DSA's picks with --indexer-precision bfloat16 against float32's")
    p.add_argument("--device", default=defaults.device, choices=("cpu", "cuda"))
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--width", type=int, default=defaults.width, help="hidden size, a multiple of 128")
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--dsa-topk", type=int, default=defaults.dsa_topk, help="DeepSeek-V3.2's index_topk")
    p.add_argument("--seed", type=int, default=defaults.seed, help="the weights' and tokens' seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)
