"""seqmesh plan on Mamba2 hybrids (Nemotron-H, Granite-4 hybrid, Bamba): the shapes read from their config.json, each
layer's parameters against the model transformers builds on the meta device, the Mamba2 layer's bytes against what
``comm_stats`` counts while the real layer runs on 2 ranks, and a plan of a published-size model."""

from __future__ import annotations

import json
import re

import pytest
import torch

from seqmesh.linear_attention.mamba2 import SSDHeads, ssd_design_bytes
from seqmesh.model.presets import model_shape

# Nemotron-H-8B's shape (NVIDIA's published Nemotron-H-8B-Base config.json, from memory: 52 layers, 24 Mamba2,
# 4 attention and 24 squared-ReLU MLP blocks in this pattern; Mamba2 128 heads of 64, state 128, 8 groups)
NEMOTRON_H_8B = dict(
    model_type="nemotron_h", hidden_size=4096, num_hidden_layers=52,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=21504, mlp_hidden_act="relu2", mamba_num_heads=128,
    mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2, use_conv_bias=True,
    mamba_proj_bias=False, vocab_size=131072, tie_word_embeddings=False)
# Granite-4.0-H-Small's shape, reconstructed from memory (not checked against IBM's config.json): 40 layers,
# attention in 4 of them, 72 experts of 768 (10 a token) beside a shared MLP of 1024, Mamba2 128 heads of 64, state
# 128, one group: 32B parameters, about 9B active a token, as published
GRANITE_4_H_SMALL = dict(
    model_type="granitemoehybrid", hidden_size=4096, num_hidden_layers=40,
    layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)], num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=768, shared_intermediate_size=1024, num_local_experts=72,
    num_experts_per_tok=10, mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
    mamba_expand=2, vocab_size=100352, tie_word_embeddings=True, position_embedding_type="nope")

# Falcon-H1-7B's shape as transformers' documentation tabulates it (44 layers, width 3072, 12 query / 2 kv heads,
# Mamba2 24 heads of 128, state 256); the MLP width, the B/C groups and the vocabulary are assumed (not published
# in that table)
FALCON_H1_7B = dict(
    model_type="falcon_h1", hidden_size=3072, num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2,
    head_dim=128, intermediate_size=12288, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_d_state=256,
    mamba_n_groups=1, mamba_d_conv=4, mamba_rms_norm=False, vocab_size=130048, tie_word_embeddings=False)


def _tiny(family: str, **changes) -> dict:
    """A tiny config of ``family`` (tests/family_cases.py's) as config.json holds it, with ``changes``."""
    from family_cases import family_config

    return {**json.loads(family_config(family).to_json_string()), **changes}


def _write(tmp_path, cfg: dict, name: str = "model") -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return str(path)


def _meta_layers(path: str) -> tuple[int, list[int], int]:
    """Every parameter of the model transformers builds from the config.json at ``path`` on the meta device, each
    layer's, and the weights of a Mamba2 mixer's two projections."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.dirname(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    mixer = next(m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "in_proj"))
    projections = mixer.in_proj.weight.numel() + mixer.out_proj.weight.numel()  # what multiplies every token
    return count(model), [count(layer) for layer in model.model.layers], projections


TINY = {
    "nemotron-h: mamba2, moe, attention": ("nemotron-h", {}),
    # Nemotron-H biases its Mamba2 projections by use_bias and ignores mamba_proj_bias
    "nemotron-h: its original pattern, mlp blocks, biases": (
        "nemotron-h", dict(layers_block_type=None, layer_types=None, hybrid_override_pattern="M-E*M-",
                           num_hidden_layers=6, use_bias=True, mamba_proj_bias=False, use_conv_bias=False,
                           mlp_bias=True)),
    "granite-4-hybrid: moe": ("granite-4-hybrid", {}),
    "granite-4-hybrid: dense, biased attention, no conv bias": (
        "granite-4-hybrid", dict(num_local_experts=0, attention_bias=True, mamba_conv_bias=False,
                                 layer_types=["mamba", "attention"])),
    "bamba": ("bamba", {}),
    "falcon-h1": ("falcon-h1", {}),
    "falcon-h1: gated norm, out_proj and in_proj biased apart": (
        "falcon-h1", dict(mamba_rms_norm=True, projectors_bias=True, mamba_proj_bias=False, attention_bias=True)),
}


@pytest.mark.parametrize("name", list(TINY))
def test_parameters_equal_the_transformers_model(tmp_path, name):
    """Each layer's parameters (mixer, feed-forward, norms), the whole model's and the Mamba2 projections' (the
    weights the planner's matmul time multiplies every token by) equal the model transformers builds from the same
    config.json."""
    family, changes = TINY[name]
    cfg = {k: v for k, v in _tiny(family, **changes).items() if v is not None}
    path = _write(tmp_path, cfg)
    total, layers, projections = _meta_layers(path)
    shape = model_shape(path)
    hybrid = shape.hybrid
    assert shape.layers == len(hybrid.blocks) == len(layers)
    assert hybrid.mamba.matmul_params(shape.hidden) == projections
    assert [hybrid.layer_params(b, shape.hidden, shape.attention_params) for b in hybrid.blocks] == layers
    assert shape.params == total


def test_a_published_size_nemotron_h_counts_as_transformers_builds_it(tmp_path):
    """Nemotron-H-8B's 8.1B parameters, layer by layer (the meta device allocates nothing)."""
    path = _write(tmp_path, NEMOTRON_H_8B)
    total, layers, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and 8.0e9 < total < 8.2e9
    assert [shape.hybrid.layer_params(b, shape.hidden, shape.attention_params) for b in shape.hybrid.blocks] == layers
    assert shape.hybrid.count(mixer="mamba2") == 24 and shape.hybrid.count(mixer="attention") == 4
    assert shape.non_attention_layers == 48


def test_unknown_mamba_mixers_are_refused_by_name(tmp_path, capsys):
    """seqmesh plan refuses a family with Mamba layers it has no reader for (a made-up name: every Mamba family
    transformers 5.24 ships is sized) naming what it sizes; its shape still reads (seqmesh train needs it)."""
    from seqmesh.tools.cli import main

    unknown = dict(model_type="zamba9", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                   intermediate_size=64, mamba_d_state=8)
    path = _write(tmp_path, unknown, "zamba9")
    assert model_shape(path).vocab == 64
    assert main(["plan", "--model", path, "--seq-len", "4096", "--gpus", "2"]) == 2
    assert re.search("does not size the Mamba layers of zamba9.*Falcon-H1.*zamba2", capsys.readouterr().err)


def test_scan_flops_equal_what_torch_counts():
    """The planner's scan FLOPs equal the matmul FLOPs torch's FlopCounterMode counts while the runtime's chunked scan
    (``decay_scan.chunk_decay_scan``) runs: 2 sequences of 3 chunks, 4 heads of 16, state 8."""
    from torch.utils.flop_counter import FlopCounterMode

    from seqmesh.linear_attention.choice import LINEAR_CHUNK
    from seqmesh.linear_attention.decay_scan import chunk_decay_scan
    from seqmesh.model.hybrid import Mamba2Shape
    from seqmesh.planner.mamba2 import mamba2_scan_flops

    b, s, h, n, p = 2, 3 * LINEAR_CHUNK, 4, 8, 16
    q, k = torch.randn(b, s, h, n), torch.randn(b, s, h, n)
    v, g = torch.randn(b, s, h, p), -torch.rand(b, s, h)
    with FlopCounterMode(display=False) as counter:
        chunk_decay_scan(q, k, v, g, (0, s))
    assert counter.get_total_flops() == mamba2_scan_flops(Mamba2Shape(h, p, n, 2), b * s)


def _tiny_workload(tmp_path, seq_len: int, design: str, ulysses: int, ring: int):
    """The planner's Mamba2 layer of the tiny Nemotron-H (tests/family_cases.py's), float32, ``batch`` 2."""
    from seqmesh.rules.degrees import Degrees
    from seqmesh.planner.mamba2 import Mamba2Layer
    from seqmesh.planner.workload import Workload

    shape = model_shape(_write(tmp_path, _tiny("nemotron-h")))
    work = Workload(shape, seq_len, batch=2, bf16=False, linear_attention=design)
    return Mamba2Layer(work, Degrees(ulysses, ring, 1))


# (ulysses, ring, seq_len, design): both designs on both meshes; at 40 tokens auto takes state passing on these
CASES = [(1, 2, 40, "auto"), (2, 1, 40, "auto"), (1, 2, 8, "all_to_all"), (2, 1, 40, "all_to_all")]


@pytest.mark.parametrize("ulysses,ring,seq_len,design", CASES, ids=[f"u{u}xr{r}-{n}-{d}" for u, r, n, d in CASES])
def test_bytes_equal_what_the_layer_sends(pools, tmp_path, ulysses, ring, seq_len, design):
    """What the planner's Mamba2 layer says the busiest rank sends (the runtime's ssd_design_bytes, by the design the
    runtime's rule picks) equals what comm_stats counts while the real layer runs on 2 ranks in float32: state
    passing's two all-gathers forward and two reduce-scatters backward, or the all-to-all's two each way; the layer
    is right (its output is the whole sequence's)."""
    from mamba2_plan_cases import mamba2_layer_bytes
    from seqmesh.linear_attention.choice import LinearDesign

    layer = _tiny_workload(tmp_path, seq_len, design, ulysses, ring)
    chosen = layer.design()
    assert chosen is (LinearDesign.ALL_TO_ALL if design == "all_to_all" else LinearDesign.STATE_PASSING)
    per_rank = pools.run(ulysses * ring, mamba2_layer_bytes, ulysses, ring, seq_len, 2, "zigzag", design)
    # measured 3e-7 (float32; transformers' torch path); a state or a halo lost between ranks is off by far more
    assert all(r["error"] < 1e-4 for r in per_rank), per_rank
    traffic = layer.traffic()
    if chosen is LinearDesign.STATE_PASSING:
        kinds = {("all_gather", "forward"): 2, ("reduce_scatter", "backward"): 2}
        fwd, bwd = ("all_gather", "forward"), ("reduce_scatter", "backward")
    else:
        kinds = {("all_to_all", "forward"): 2, ("all_to_all", "backward"): 2}
        fwd, bwd = ("all_to_all", "forward"), ("all_to_all", "backward")
    assert all({k: n for k, n in r["calls"].items() if n} == kinds for r in per_rank), per_rank
    key = layer._key()
    assert traffic["forward"][key] == max(r["sent"][fwd] for r in per_rank) > 0, (traffic, per_rank)
    assert traffic["backward"][key] == max(r["sent"][bwd] for r in per_rank), (traffic, per_rank)


# Granite-4.0-H-Small's 32B parameters and AdamW state (16 bytes a parameter) fill 8 GPUs' 80 GiB before activations
@pytest.mark.parametrize("cfg,gpus", [(NEMOTRON_H_8B, "8"), (GRANITE_4_H_SMALL, "16"), (FALCON_H1_7B, "8")],
                         ids=["nemotron-h-8b", "granite-4.0-h-small", "falcon-h1-7b"])
def test_plan_recommends_a_layout_at_128k(tmp_path, capsys, cfg, gpus):
    """``seqmesh plan --model config.json --seq-len 131072 --gpus 8`` (16) runs and recommends a layout; each Mamba2
    layer sends the runtime's formula's bytes (bf16 halo, float32 states), the same at 32K: they do not grow with the
    sequence; the step counts them once per Mamba2 layer."""
    from seqmesh.linear_attention.choice import LinearDesign
    from seqmesh.tools.cli import main

    path = _write(tmp_path, cfg)
    mamba_layers = {"nemotron_h": ("mamba2", 24), "granitemoehybrid": ("mamba2+moe", 36),
                    "falcon_h1": ("attention+mamba2+mlp", 44)}[cfg["model_type"]]
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", gpus]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and re.search(rf"layers: {mamba_layers[1]} {re.escape(mamba_layers[0])}[,;]", out), out
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", gpus, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    from test_planner_cli import _schema, conform  # the JSON as docs/planner.md documents it, "@hybrid" included

    schema = _schema()
    conform(plan, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    best = plan["recommended"]["layout"]
    shape = model_shape(path)
    m = shape.hybrid.mamba
    want = ssd_design_bytes(SSDHeads(m.heads, m.head_dim, m.groups, m.state), m.conv, seq_len=131072, batch=1,
                            ulysses=best["ulysses"], ring=best["ring"], layout="zigzag", dtype_bytes=2)
    want = want[LinearDesign.STATE_PASSING]  # auto's pick at 128K: it sends far less than the all-to-all
    row = next(c for c in plan["candidates"] if c["layout"] == best)
    assert row["comm_bytes_per_layer"]["forward"]["mamba2_state_gather"] == want > 0
    assert row["comm_bytes_per_step"]["mamba2_state_gather"] == 3 * want * mamba_layers[1]
    assert plan["model"]["hybrid"]["blocks"].count(mamba_layers[0]) == mamba_layers[1]
    assert main(["plan", "--model", path, "--seq-len", "32768", "--gpus", gpus, "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    same = next(c for c in short["candidates"] if c["layout"] == best)
    assert same["comm_bytes_per_layer"]["forward"]["mamba2_state_gather"] == want


@pytest.mark.parametrize("key_dim,value_dim", [(32, 128), (64, 64), (128, 64), (256, 32)])
def test_scan_saved_and_backward_bytes_equal_the_tracked_ones(key_dim, value_dim):
    """What the scalar-decay rule keeps for backward (``decay_scan_saved`` a token and head, one state a chunk) and
    what its backward holds beyond that (``decay_scan_backward``), against ``MemoryTracker`` around the rule alone:
    bf16 inputs, 2 heads, 16 chunks."""
    from seqmesh.linear_attention.choice import LINEAR_CHUNK
    from seqmesh.linear_attention.decay_scan import chunk_decay_scan
    from seqmesh.memory import MemoryTracker
    from seqmesh.planner.mamba2 import decay_scan_backward, decay_scan_saved

    s, h, gen = 16 * LINEAR_CHUNK, 2, torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, s, h, key_dim, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(1, s, h, value_dim, generator=gen).bfloat16().requires_grad_()
    g = (-torch.rand(1, s, h, generator=gen) * 0.1).requires_grad_()
    held = sum(x.numel() * x.element_size() for x in (q, k, v, g))
    with MemoryTracker(torch.nn.Linear(1, 1)) as tracker:
        out, _ = chunk_decay_scan(q, k, v, g, (0, s))
        after_forward = tracker.live_bytes()
        out.backward(torch.ones_like(out))
    kept = after_forward - held - out.numel() * out.element_size() - 4 * 2  # the tracked module's weight and bias
    beyond = tracker.report().peak_bytes - after_forward
    per_chunk = 16 * h * key_dim * value_dim * 4
    want_kept = s * h * 4 * decay_scan_saved(key_dim, value_dim) + per_chunk
    want_beyond = s * h * 4 * decay_scan_backward(key_dim, value_dim)
    assert abs(kept / want_kept - 1) < 0.01, (kept, want_kept)
    # the fit's worst, a small key width: 65 of some 1,000 values a token and head the rule holds in all
    assert abs(beyond - want_beyond) < 0.08 * (kept + beyond), (beyond, want_beyond, kept)


def test_a_pure_mamba2_model_counts_as_transformers_builds_it(tmp_path, capsys):
    """A pure Mamba2 config.json (``mamba2``: every layer a Mamba2 mixer behind one RMSNorm, biased projections,
    an untied head) reads into a shape whose layers and whole count equal transformers' model, and plans; before,
    seqmesh plan, train and verify refused the file ("no num_attention_heads entry")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from seqmesh.tools.cli import main

    cfg = dict(model_type="mamba2", hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16,
               n_groups=2, vocab_size=100, use_bias=True)
    path = _write(tmp_path, cfg, "mamba2")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "mamba2", local_files_only=True))
    shape = model_shape(path)
    hybrid = shape.hybrid
    assert [hybrid.layer_params(b, shape.hidden, shape.attention_params) for b in hybrid.blocks] == [
        sum(p.numel() for p in layer.parameters()) for layer in model.backbone.layers]
    assert shape.params == sum(p.numel() for p in model.parameters()) and not shape.unplanned
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8"]) == 0
    assert "no attention (layers: 3 mamba2; Mamba2 8 heads x 16, state 16, 2 groups" in capsys.readouterr().out
