"""Rank functions for the planner's agreement tests: run seqmesh.attention forward and backward and
return what the communication counters saw (plain data for the main process)."""

from __future__ import annotations

import contextlib
import io
import subprocess
from dataclasses import asdict, dataclass

import torch

import seqmesh
from dist_cases import get_mesh


@dataclass(frozen=True)
class TrafficCase:
    seq_len: int
    q_heads: int
    kv_heads: int
    dtype: str = "float64"
    layout: str = "zigzag"
    batch: int = 1
    head_dim: int = 8
    causal: bool = True


def measured_traffic(ulysses: int, ring: int, cases: list[TrafficCase]) -> list[dict]:
    """Per case: this rank's coordinates and the counters of one attention forward + backward.

    Inputs are sharded *outside* the counted block, so only ``seqmesh.attention`` is measured."""
    mesh = get_mesh(ulysses, ring)
    out = []
    for i, case in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)
        dt = getattr(torch, case.dtype)
        b, s, d = case.batch, case.seq_len, case.head_dim
        full = [torch.randn(b, s, h, d, generator=g).to(dt) for h in (case.q_heads, case.kv_heads, case.kv_heads, case.q_heads)]
        q, k, v, dout = (seqmesh.shard_sequence(t, mesh, layout=case.layout) for t in full)
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with seqmesh.comm_stats() as stats:
            o = seqmesh.attention(q, k, v, mesh, causal=case.causal, layout=case.layout, seq_len=case.seq_len)
            o.backward(dout)
        out.append({"case": asdict(case), "ulysses_rank": mesh.ulysses_rank, "ring_rank": mesh.ring_rank,
                    "stats": stats.as_dict()})
    return out


@dataclass(frozen=True)
class ModelTrafficCase:
    """One forward and backward of a tiny transformers model composed on a ``ring x ulysses x tp`` mesh."""

    family: str
    seq_len: int
    batch: int = 1
    dtype: str = "float64"
    checkpointing: bool = False
    loss_chunk: int = 16
    fsdp: bool = False
    bf16: bool = False  # FSDP2's mixed precision (float32 weights and reductions, bf16 compute); needs fsdp
    kv_heads: int | None = None  # the family's kv heads replaced (tp 4 needs 4)
    mlp_tiles: int = 0  # the MLP in this many sequence tiles (seqmesh.memory.tiled_mlp); 0: untiled


def measured_model_traffic(ulysses: int, ring: int, tp: int, cases: list[ModelTrafficCase]) -> list[dict]:
    """Per case: what ``comm_stats`` counted on this rank for one training step's forward and backward, with the
    model's shape for the planner. The batch is sharded outside the counted block."""
    from family_cases import build, family_config
    from seqmesh.compose import ParallelPlan, parallelize_model

    mesh = get_mesh(ulysses, ring, 1, 1, tp)
    out = []
    for case in cases:
        config = family_config(case.family)
        if case.kv_heads is not None:
            config.num_key_value_heads = case.kv_heads
        model = build(config).to(getattr(torch, case.dtype))
        plan = ParallelPlan(fsdp=case.fsdp, loss_chunk=case.loss_chunk, checkpointing=case.checkpointing,
                            bf16=case.bf16, tiled_mlp=case.mlp_tiles > 0,
                            mlp_tiles=case.mlp_tiles or None)
        module = parallelize_model(model, mesh, plan)
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, config.vocab_size, (case.batch, case.seq_len), generator=g)
        local = seqmesh.shard_batch({"input_ids": ids}, mesh)
        with seqmesh.comm_stats() as stats:
            module(**local).backward()
        out.append({"case": asdict(case), "ulysses_rank": mesh.ulysses_rank, "ring_rank": mesh.ring_rank,
                    "stats": stats.as_dict(), "config": config.to_dict()})
    return out


def in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """``seqmesh.tools.cli.main(argv)`` with what it prints captured, as a finished process (argparse's errors
    exit 2)."""
    from seqmesh.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    return subprocess.CompletedProcess(["seqmesh", *argv], code, out.getvalue(), err.getvalue())


def compressed_slots(ulysses: int, ring: int, seq_len: int, block_elements: int) -> dict:
    """On every rank: the (query, key) slots each DeepSeek-V4 compressed layer hands the sparse kernel in one
    forward, as on a GPU (the kernel's path taken; the kernel replaced by one that counts its picks and returns
    zeros), its attention blocks within ``block_elements``; per layer kind, with the model's config."""
    from family_cases import build, family_config
    from seqmesh.compose import ParallelPlan, parallelize_model
    from seqmesh.hf import compressed_attention, indexed_attention

    mesh = get_mesh(ulysses, ring)
    config = family_config("deepseek-v4")
    built = build(config).float()
    model = parallelize_model(built, mesh, ParallelPlan(fsdp=False))
    counted: list[int] = []

    def counting(query, row, picks, scale, rank, sinks=None):
        counted.append(picks.shape[0] * picks.shape[1] * picks.shape[2])
        return query.new_zeros(*query.shape[:-1], rank)

    saved = (compressed_attention.uses_kernel, compressed_attention.sparse_latent_attention,
             indexed_attention.BLOCK_ELEMENTS)
    compressed_attention.uses_kernel = lambda x, name="sparse_latent": True
    compressed_attention.sparse_latent_attention = counting
    indexed_attention.BLOCK_ELEMENTS = block_elements
    slots = {}
    try:
        ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(3))
        local = seqmesh.shard_batch({"input_ids": ids}, mesh)
        for kind, layer in zip(config.layer_types, built.model.layers):
            layer.self_attn.register_forward_pre_hook(lambda *_: counted.clear())
            layer.self_attn.register_forward_hook(lambda m, *_, k=kind: slots.__setitem__(k, sum(counted)))
        with torch.no_grad():
            model(**local)
    finally:
        (compressed_attention.uses_kernel, compressed_attention.sparse_latent_attention,
         indexed_attention.BLOCK_ELEMENTS) = saved
    return {"slots": slots, "config": config.to_dict()}


def config_shape(config_class: str, sizes: dict, folder, count: bool = True) -> tuple[object, object, int | None]:
    """transformers' ``config_class(**sizes)`` written as ``folder``'s config.json, the planner's shape read from it,
    and with ``count`` the parameters of the model transformers builds from it (on the meta device: no memory)."""
    import transformers as tf

    from seqmesh.model.presets import model_shape

    config = getattr(tf, config_class)(**sizes)
    config.save_pretrained(folder)
    if not count:
        return config, model_shape(str(folder)), None
    with torch.device("meta"):
        built = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
    return config, model_shape(str(folder)), built


MOE_CONFIGS = {  # tiny MoE models whose experts are most of a layer's saved tensors: 8 experts, 2 a token
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, vocab_size=64, moe_intermediate_size=48,
                                         num_experts=8, num_experts_per_tok=2, intermediate_size=128)),
    "gpt_oss": ("GptOssConfig", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, vocab_size=64, intermediate_size=48, num_local_experts=8,
                                     num_experts_per_tok=2)),
}


def moe_mlp_saved_bytes(family: str, seq_len: int = 96) -> dict:
    """Bytes the MoE layer of :data:`MOE_CONFIGS` ``family`` keeps for backward on this rank of Ulysses 2, in
    bfloat16 as FSDP2's mixed precision runs it (:func:`mlp_saved_bytes`), this rank's tokens, and the config."""
    import transformers as tf

    name, sizes = MOE_CONFIGS[family]
    config = getattr(tf, name)(**sizes)
    torch.manual_seed(0)
    return mlp_saved_bytes(tf.AutoModelForCausalLM.from_config(config), seq_len)


def mlp_saved_bytes(model: torch.nn.Module, seq_len: int) -> dict:
    """Bytes ``model``'s first decoder layer's MLP keeps for backward on this rank of Ulysses 2, in bfloat16 as FSDP2's
    mixed precision runs it (its saved tensors' storages, each once; its weights and its input, which the layer's
    norm made, left out), this rank's tokens, and the model's config."""
    from seqmesh.hf import parallelize, unparallelize

    mesh = get_mesh(2, 1)
    model = parallelize(model.to(torch.bfloat16), mesh)
    layer = model.model.layers[0].mlp
    outside = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.untyped_storage().data_ptr() not in outside:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def enter(module, args):
        outside.add(args[0].untyped_storage().data_ptr())
        inside[0] = True

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(2))
    local = seqmesh.shard_batch({"input_ids": ids}, mesh)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**local, use_cache=False)
    unparallelize(model)
    return {"saved": sum(seen.values()), "tokens": local["input_ids"].numel(), "config": model.config.to_dict()}


def measured_gathers(pools, family: str, ulysses: int, ring: int, folder) -> list[tuple]:
    """One step of ``family``'s tiny model (45 tokens, float32) plain and checkpointed on ``ulysses x ring``
    (:func:`measured_model_traffic`): per case, the case, the planner's Workload of the config.json the ranks built
    (written under ``folder``) and each rank's measurement."""
    import json

    from seqmesh.model.presets import model_shape
    from seqmesh.planner.workload import Workload

    cases = [ModelTrafficCase(family, 45, dtype="float32", checkpointing=c) for c in (False, True)]
    per_rank = pools.run(ulysses * ring, measured_model_traffic, ulysses, ring, 1, cases, timeout=600)
    out = []
    for i, case in enumerate(cases):
        path = folder / f"{i}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(per_rank[0][i]["config"]))
        work = Workload(model_shape(str(path)), case.seq_len, bf16=False, checkpointing=case.checkpointing)
        out.append((case, work, [rank[i] for rank in per_rank]))
    return out


def assert_gathers(measured: dict, planned: list, runs: int, case, layers: int = 1) -> None:
    """A rank's ``measured`` step (:func:`measured_gathers`) sent what ``planned`` (the rank's ``RankTraffic`` of each
    layer kind, summed) says ``layers`` times: its all-gathers ``runs`` times (twice with checkpointing, again in the
    recompute), its reduce-scatters once; calls and bytes, none of them zero."""
    for (kind, phase), repeats in ((("all_gather", "forward"), runs), (("reduce_scatter", "backward"), 1)):
        counted = measured["stats"].get(kind, {}).get(phase, {"calls": 0, "bytes_sent": 0})
        want = tuple(layers * repeats * sum(f(t, kind, phase) for t in planned)
                     for f in (lambda t, k, p: t.calls(k, p), lambda t, k, p: t.sent(k, p)))
        assert (counted["calls"], counted["bytes_sent"]) == want and 0 not in want, (case, kind, counted, want)


def assert_relative_plan(config_class: str, sizes: dict, folder, capsys, header: str) -> dict:
    """``seqmesh plan`` on an Inkling or Inkling 2 config.json (``config_class(**sizes)`` written in ``folder``) at
    131,072 tokens on 2 GPUs: its header says ``header``; each layer's row is gathered on U2 (the other rank's 65,536
    tokens of the keys and values, bf16: 2 kv heads of 32 in these tests), none on DP2; TP is excluded as the runtime
    refuses it, and ``--inference`` (seqmesh generate decodes neither). Its candidates, by label."""
    import json

    from seqmesh.planner.relative_attention import ROWS
    from seqmesh.tools.cli import main

    config_shape(config_class, sizes, folder, count=False)
    argv = ["plan", "--model", str(folder / "config.json"), "--seq-len", "131072", "--gpus", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert header in out, out
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    plans = {c["label"]: c for c in result["candidates"]}
    assert plans["U2 x R1 x DP1"]["comm_bytes_per_layer"]["forward"][ROWS] == 65536 * 2 * 2 * 32 * 2
    assert plans["U1 x R1 x DP2"]["comm_bytes_per_layer"]["forward"].get(ROWS, 0) == 0
    assert [(x["layout"]["tp"], "tp 1 only" in x["reason"]) for x in result["excluded"]] == [(2, True)], result
    assert main([*argv, "--inference"]) != 0
    assert "is an Inkling model, whose decode" in capsys.readouterr().err
    return plans
