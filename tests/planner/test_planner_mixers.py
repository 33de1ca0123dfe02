"""seqmesh plan on the recurrent mixers beside Mamba2: LFM2's and LFM2-MoE's gated short convolutions and Kimi
Linear's KDA and MiniMax-01's lightning attention, sized from their config.json (each layer's parameters against the model transformers builds on the
meta device); the short conv's halo bytes against the runtime's schedule and against what ``comm_stats`` counts
while the real layer runs on 2 ranks, KDA's against the runtime's own formulas by the design its rule picks
(tests/hf/test_kda.py counts those while the layer runs); plans of published-size models (Zamba's and Zamba2's:
tests/planner/test_planner_zamba.py). MiniMax-01's lightning attention:
its state gather against the runtime's schedule (tests/hf/test_lightning.py counts it while the layer runs)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from seqmesh.model.presets import model_shape

# LFM2-2.6B's shape as remembered (not checked against Liquid AI's config.json): 30 layers, attention in 8 of
# them, width 2560, 32 query / 8 kv heads, block_ff_dim 10752 (auto-adjusted to 7168), conv width 3, tied embeddings
LFM2_2_6B = dict(
    model_type="lfm2", hidden_size=2560, num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=8,
    layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21, 24, 27) else "conv" for i in range(30)],
    intermediate_size=10752, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
    conv_L_cache=3, conv_bias=False, vocab_size=65536, tie_word_embeddings=True)
# LFM2-8B-A1B's shape as remembered (not checked): 24 layers, 6 attention, the first 2 dense (7168), then 32 experts
# of 1792, 4 a token; as LFM2's original releases write it (full_attn_idxs, tie_embedding): about 8.3B parameters
LFM2_8B_A1B = dict(
    model_type="lfm2_moe", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
    layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
    intermediate_size=7168, moe_intermediate_size=1792, num_dense_layers=2, num_experts=32, num_experts_per_tok=4,
    conv_L_cache=3, vocab_size=65536, tie_embedding=True)
# Kimi-Linear-48B-A3B's shape as remembered (transformers' KimiLinearConfig defaults match it; not checked against
# Moonshot's config.json): 27 layers, MLA in every 4th (7), KDA 32 heads of 128 in the rest, 256 experts of 1024
# (8 a token) and one shared, the first layer dense (9216); written as the release writes it (linear_attn_config)
KIMI_LINEAR_48B = dict(
    model_type="kimi_linear", hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    intermediate_size=9216, moe_intermediate_size=1024, num_experts=256, num_experts_per_token=8,
    num_shared_experts=1, first_k_dense_replace=1, vocab_size=163840, tie_word_embeddings=False,
    linear_attn_config=dict(head_dim=128, num_heads=32, short_conv_kernel_size=4,
                            full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                            kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]))


def _tiny(family: str, **changes) -> dict:
    """A tiny config of ``family`` (tests/family_cases.py's) as config.json holds it, with ``changes``."""
    from family_cases import family_config

    return {**json.loads(family_config(family).to_json_string()), **changes}


def _write(tmp_path, cfg: dict, name: str = "model") -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return str(path)


def _meta_layers(path: str) -> tuple[int, list[int], int]:
    """Every parameter of the model transformers builds from the config.json at ``path`` on the meta device, each
    layer's, and the weights of a short conv's two projections."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.dirname(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    layers = (model.model if hasattr(model, "model") else model.backbone).layers  # pure Mamba's: its backbone's
    mixer = next((layer.conv for layer in layers if hasattr(layer, "conv")), None)
    block = next((layer.temporal_block for layer in layers
                  if hasattr(getattr(layer, "temporal_block", None), "rg_lru")), None)
    mamba = next((getattr(layer, "mamba", None) or layer.mixer for layer in layers
                  if hasattr(layer, "mamba") or hasattr(getattr(layer, "mixer", None), "dt_proj")), None)
    if mixer is not None:  # a short conv's projections
        projections = mixer.in_proj.weight.numel() + mixer.out_proj.weight.numel()
    elif mamba is not None:  # a Mamba (v1) mixer's four
        projections = sum(mamba.get_submodule(n).weight.numel() for n in ("in_proj", "x_proj", "dt_proj", "out_proj"))
    elif block is not None:  # a recurrent block's three projections and its gates' blocks
        projections = sum(block.get_submodule(n).weight.numel() for n in ("linear_x", "linear_y", "linear_out")) \
            + block.rg_lru.input_gate_weight.numel() + block.rg_lru.recurrent_gate_weight.numel()
    else:  # a KDA or lightning mixer's: every Linear in it
        mixer = next(layer.self_attn for layer in layers
                     if hasattr(layer.self_attn, "forget_gate") or hasattr(layer.self_attn, "slope_rate"))
        projections = sum(m.weight.numel() for m in mixer.modules() if isinstance(m, torch.nn.Linear))
    return count(model), [count(layer) for layer in layers], projections


def _sends_as_measured(layer, per_rank: list[dict], keys: tuple[str, ...], gathers: int) -> None:
    """The planner's ``layer`` against what comm_stats counted on each rank (a ``*_plan_cases`` function's results):
    the layer right (within 1e-5 of transformers'), ``gathers`` all-gathers forward and as many reduce-scatters
    backward, each of ``keys`` sending bytes, and their sum the busiest rank's bytes in each phase."""
    assert all(r["error"] < 1e-5 for r in per_rank), per_rank
    kinds = {("all_gather", "forward"): gathers, ("reduce_scatter", "backward"): gathers}
    assert all({k: n for k, n in r["calls"].items() if n} == kinds for r in per_rank), per_rank
    traffic = layer.traffic()
    assert all(traffic["forward"][key] > 0 for key in keys), traffic
    for phase, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
        assert sum(traffic[phase][key] for key in keys) == max(r["sent"][(kind, phase)] for r in per_rank), phase


TINY = {
    "lfm2": ("lfm2", {}),
    # the MLP's width auto-adjusted (2/3, x 1.5, rounded up to 16), a biased conv of width 5
    "lfm2: auto-adjusted MLP, biased conv": (
        "lfm2", dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5, block_multiple_of=16, conv_bias=True,
                     conv_L_cache=5, num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"])),
    # LFM2's original release: full_attn_idxs and block_ff_dim instead of layer_types and intermediate_size, untied
    "lfm2: original release's names": (
        "lfm2", dict(layer_types=None, full_attn_idxs=[1], block_ff_dim=48, intermediate_size=None,
                     tie_embedding=False, tie_word_embeddings=None)),
    "lfm2_moe": ("lfm2_moe", {}),
    # conv, sliding and full attention layers; q/k norms, a gate a head and sandwich norms
    "lfm3": ("lfm3", {}),
    # no gate, no sandwich norms, every projection biased, a conv of width 3, transformers' default layer pattern
    "lfm3: ungated, unsandwiched, biased": (
        "lfm3", dict(use_attention_gate=False, use_sandwich_norm=False, attention_bias=True, conv_bias=True,
                     conv_L_cache=3, layer_types=None, num_hidden_layers=8)),
    "kimi_linear": ("kimi_linear", {}),
    # the release's names: linear_attn_config (1-indexed layers), first_k_dense_replace; MLA with a q latent
    "kimi_linear: the release's names": (
        "kimi_linear", dict(layer_types=None, mlp_layer_types=None, linear_head_dim=None, linear_num_heads=None,
                            linear_conv_kernel_dim=None, first_k_dense_replace=2, q_lora_rank=24, num_hidden_layers=4,
                            linear_attn_config=dict(head_dim=4, num_heads=2, short_conv_kernel_size=3,
                                                    full_attn_layers=[2], kda_layers=[1, 3, 4]))),
    "minimax": ("minimax", {}),
    # no layer_types: transformers' default (every other layer full, the first one), whatever the release's
    # attn_type_list says (transformers 5.24 does not read it); 3 experts, head_dim from the width
    "minimax: default layers, attn_type_list ignored": (
        "minimax", dict(layer_types=None, attn_type_list=[0, 0, 1], num_hidden_layers=3, head_dim=None,
                        num_local_experts=3, num_experts=None)),
    "recurrent_gemma": ("recurrent_gemma", {}),
    "jamba": ("jamba", {}),
    # every layer's MLP (one expert: no MoE), biased projections, no conv bias, dt_rank "auto" (hidden / 16), tied
    "jamba: MLP only, biases, auto dt rank": (
        "jamba", dict(num_experts=1, num_experts_per_tok=1, mamba_proj_bias=True, mamba_conv_bias=False,
                      mamba_dt_rank="auto", num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3,
                      tie_word_embeddings=True)),
    "mamba": ("mamba", {}),
    # biased projections, no conv bias, dt rank "auto" (hidden / 16), a conv of 3, untied
    "mamba: biases, auto dt rank, untied": (
        "mamba", dict(use_bias=True, use_conv_bias=False, time_step_rank="auto", conv_kernel=3,
                      tie_word_embeddings=False)),
    "falcon_mamba": ("falcon-mamba", {}),  # the norms on dt, B and C have no weights
    # attention first, every projection of it biased, a conv of width 3, the pattern repeated over 4 layers, untied
    "recurrent_gemma: biased attention first, conv 3": (
        "recurrent_gemma", dict(block_types=["attention", "recurrent"], attention_bias=True, conv1d_width=3,
                                num_hidden_layers=4, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(TINY))
def test_parameters_equal_the_transformers_model(tmp_path, name):
    """Each layer's parameters (mixer, feed-forward, norms, LFM2's q/k norms), the whole model's and the short conv's
    projections' (what the planner's matmul time multiplies every token by) equal the model transformers builds."""
    family, changes = TINY[name]
    path = _write(tmp_path, _tiny(family, **changes))
    total, layers, projections = _meta_layers(path)
    shape = model_shape(path)
    hybrid = shape.hybrid
    assert shape.layers == len(hybrid.blocks) == len(layers)
    mixer = hybrid.conv or hybrid.kda or hybrid.lightning or hybrid.rg_lru or hybrid.mamba1
    assert mixer.matmul_params(shape.hidden) == projections
    assert [hybrid.layer_params(b, shape.hidden, shape.attention_params) for b in hybrid.blocks] == layers
    assert shape.params == total


def _conv_layer(tmp_path, seq_len: int, ulysses: int, ring: int, layout: str = "zigzag", batch: int = 2,
                family: str = "lfm2", dtype: str = "fp32"):
    from seqmesh.rules.degrees import Degrees
    from seqmesh.planner.short_conv import ShortConvLayer
    from seqmesh.planner.workload import Workload

    shape = model_shape(_write(tmp_path, _tiny(family), family))
    work = Workload(shape, seq_len, batch=batch, bf16=dtype == "bf16", layout=layout)
    return ShortConvLayer(work, Degrees(ulysses, ring, 1))


MESHES = [(1, 2, "zigzag"), (2, 1, "zigzag"), (1, 4, "zigzag"), (2, 2, "zigzag"), (3, 2, "zigzag"), (1, 3, "zigzag"),
          (1, 4, "contiguous"), (2, 4, "contiguous")]


@pytest.mark.parametrize("ulysses,ring,layout", MESHES, ids=[f"u{u}xr{r}-{lay}" for u, r, lay in MESHES])
def test_halo_bytes_follow_the_runtime_schedule(tmp_path, ulysses, ring, layout):
    """The planner's halo bytes equal ``(P - 1) x B x max_tail x hidden x dtype`` with ``max_tail`` the busiest rank's
    tail rows in the schedule the runtime builds (``chain_for`` on the layout ``shard_sequence`` places), for a conv
    of width 3 (LFM2) and 5 (a halo of 4: two zigzag runs on one rank send 8 rows)."""
    from seqmesh.linear_attention.chain import chain_for
    from seqmesh.sequence.layout import SequenceLayout

    for changes in ({}, dict(conv_L_cache=5)):
        shape = model_shape(_write(tmp_path, _tiny("lfm2", **changes), "lfm2"))
        layer = _conv_layer(tmp_path, 4096, ulysses, ring, layout)
        layer = type(layer)(type(layer.work)(shape, 4096, batch=2, bf16=False, layout=layout), layer.layout)
        p, k = ulysses * ring, shape.hybrid.conv.kernel
        seq = SequenceLayout.for_length(layout, ring, ulysses, 4096, None, 1, 1)
        padded = seq.local_len * p
        tail = chain_for(seq, (0, padded), k).max_tail
        assert layer.sent_bytes() == (p - 1) * 2 * tail * shape.hidden * 4 > 0, (changes, tail)
        traffic = layer.traffic()
        assert traffic["forward"] == traffic["backward"] == traffic["recompute"] == {"conv_halo_gather": layer.sent_bytes()}


def test_bytes_equal_what_the_layer_sends(pools, tmp_path):
    """What the planner's short-conv layer says the busiest rank sends equals what comm_stats counts while the real
    layer runs on 2 ring ranks in float32 (2 sequences of 40 tokens): one all-gather forward, one reduce-scatter
    backward; the layer is right (its output is transformers' on the whole sequence). tests/hf/test_short_conv.py
    checks the halo's rows on 4 ranks for LFM2 and LFM3."""
    from short_conv_plan_cases import short_conv_layer_bytes

    layer = _conv_layer(tmp_path, 40, 1, 2)
    per_rank = pools.run(2, short_conv_layer_bytes, 1, 2, 40, 2, "zigzag")
    _sends_as_measured(layer, per_rank, ("conv_halo_gather",), 1)


def _lfm3_defaults() -> dict:
    """transformers' LFM3 config (24 layers of 2048: 12 convs of width 7, 6 full and 5 sliding attention layers of a
    window of 256), as a config.json holds it."""
    from transformers import Lfm3Config

    return json.loads(Lfm3Config().to_json_string())


@pytest.mark.parametrize("cfg,billions", [(LFM2_2_6B, (2.4, 2.7)), (LFM2_8B_A1B, (8.0, 8.6)), ("lfm3", (1.7, 1.8))],
                         ids=["lfm2-2.6b", "lfm2-8b-a1b", "lfm3"])
def test_plan_recommends_a_layout_at_128k(tmp_path, capsys, cfg, billions):
    """``seqmesh plan --model config.json --seq-len 131072 --gpus 8`` runs and recommends a layout; the model counts
    as transformers builds it; each conv layer sends the runtime's halo bytes (bf16), the same at 32K (they do not
    grow with the sequence); the step counts them once per conv layer and phase."""
    from seqmesh.linear_attention.choice import halo_bytes
    from seqmesh.tools.cli import main
    from test_planner_cli import _schema, conform

    path = _write(tmp_path, _lfm3_defaults() if cfg == "lfm3" else cfg)
    total, _, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and billions[0] * 1e9 < total < billions[1] * 1e9
    convs = shape.hybrid.count(mixer="conv")
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and re.search(r"layers: \d+ conv\+", out), out
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    schema = _schema()
    conform(plan, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    best = plan["recommended"]["layout"]
    want = halo_bytes(shape.hidden, shape.hybrid.conv.kernel, batch=1, ulysses=best["ulysses"], ring=best["ring"],
                      layout="zigzag", dtype_bytes=2)
    row = next(c for c in plan["candidates"] if c["layout"] == best)
    if best["ulysses"] * best["ring"] > 1:
        assert row["comm_bytes_per_layer"]["forward"]["conv_halo_gather"] == want > 0
        assert row["comm_bytes_per_step"]["conv_halo_gather"] == 3 * want * convs
    assert sum(b.startswith("conv") for b in plan["model"]["hybrid"]["blocks"]) == convs
    if cfg == "lfm3":  # its sliding layers planned with their window, the full ones without
        from seqmesh.planner.attention_layer import Attention
        from seqmesh.planner.layers import layer_kinds
        from seqmesh.planner.workload import Workload
        from seqmesh.rules.degrees import Degrees

        assert sum(b.startswith("sliding_attention") for b in plan["model"]["hybrid"]["blocks"]) == 5
        kinds = layer_kinds(Workload(shape, 131072), Degrees(best["ulysses"], best["ring"], best["dp_shard"]))
        windows = {kind.window: n for kind, n in kinds if isinstance(kind, Attention)}
        assert windows == {None: 6, 256: 5}, windows
        from seqmesh.planner.attention_layer import attention_average  # the time's pairs: 6 full, 5 windowed

        work, lay = Workload(shape, 131072), Degrees(best["ulysses"], best["ring"], best["dp_shard"])
        full, windowed = Attention(work, lay).pairs(), Attention(work, lay, 256).pairs()
        assert attention_average(work, lay, Attention.pairs) == pytest.approx((6 * full + 5 * windowed) / 11)
    assert main(["plan", "--model", path, "--seq-len", "32768", "--gpus", "8", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    same = next(c for c in short["candidates"] if c["layout"] == best)
    assert same["comm_bytes_per_layer"]["forward"].get("conv_halo_gather", 0) == want


KDA_CASES = [(1, 2, 131072, "zigzag"), (2, 2, 131072, "zigzag"), (1, 4, 131072, "contiguous"), (1, 8, 2048, "zigzag"),
             (2, 4, 2048, "zigzag")]


@pytest.mark.parametrize("ulysses,ring,seq_len,layout", KDA_CASES, ids=[f"u{u}xr{r}-{n}-{lay}" for u, r, n, lay in KDA_CASES])
def test_kda_bytes_follow_the_runtime(tmp_path, ulysses, ring, seq_len, layout):
    """The planner's KDA layer runs the design the runtime's rule picks (``auto``: state passing at 128K, the
    all-to-all at 2K for Kimi-Linear-48B's 32 heads of 128) and sends its bytes, written out here from
    kda_all_to_all.py's docstring: state passing ``(P - 1) B (R H D 2D x 4 + T (K - 1) 3 H D x 2)`` with R runs and
    T (K - 1) tail rows the busiest rank holds in the schedule the runtime builds (``chain_for``), the all-to-all
    ``B S (P - 1) / P^2 H ((4 D + 1) x 2 + D x 4)``; each way, and again in the recompute."""
    from seqmesh.rules.degrees import Degrees
    from seqmesh.linear_attention.chain import chain_for
    from seqmesh.linear_attention.choice import LinearDesign
    from seqmesh.planner.kda import KdaLayer
    from seqmesh.planner.workload import Workload
    from seqmesh.sequence.layout import SequenceLayout

    shape = model_shape(_write(tmp_path, KIMI_LINEAR_48B))
    layer = KdaLayer(Workload(shape, seq_len, batch=1, layout=layout), Degrees(ulysses, ring, 1))
    p, h, d, k = ulysses * ring, 32, 128, 4
    seq = SequenceLayout.for_length(layout, ring, ulysses, seq_len, None, 1, 1)
    chain = chain_for(seq, (0, seq.local_len * p), k)
    if seq_len > 100_000:
        assert layer.design() is LinearDesign.STATE_PASSING
        want = (p - 1) * (chain.max_runs * h * d * 2 * d * 4 + chain.max_tail * 3 * h * d * 2)
        key = "kda_state_gather"
    else:
        assert layer.design() is LinearDesign.ALL_TO_ALL
        want = seq.local_len * p * (p - 1) * h * ((4 * d + 1) * 2 + d * 4) // (p * p)
        key = "kda_all_to_all"
    traffic = layer.traffic()
    assert traffic["forward"] == traffic["backward"] == traffic["recompute"] == {key: want}, (traffic, want)


def test_a_kimi_linear_plan_recommends_a_layout_at_128k(tmp_path, capsys):
    """``seqmesh plan`` on Kimi-Linear-48B's shape at 128K on 16 GPUs (its 49B parameters' weights, gradients and
    AdamW state do not fit 8 GPUs of 80 GiB) runs and recommends a layout; the model counts
    as transformers builds it (48B); each KDA layer sends state passing's bytes (the runtime's pick at 128K), the
    step counts them once per KDA layer and phase."""
    from seqmesh.tools.cli import main
    from test_planner_cli import _schema, conform

    path = _write(tmp_path, KIMI_LINEAR_48B)
    total, _, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and 48e9 < total < 50e9
    assert shape.hybrid.count(mixer="kda") == 20
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and re.search(r"layers: 1 kda\+mlp, 19 kda\+moe, 7 attention\+moe;", out), out
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    schema = _schema()
    conform(plan, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    best = plan["recommended"]["layout"]
    row = next(c for c in plan["candidates"] if c["layout"] == best)
    if best["ulysses"] * best["ring"] > 1:
        sent = row["comm_bytes_per_layer"]["forward"]["kda_state_gather"]
        assert sent > 0 and row["comm_bytes_per_step"]["kda_state_gather"] == 3 * sent * 20


# MiniMax-01's layer shapes scaled down (not a published model): MiniMax-Text-01 itself (from memory: width 6144,
# 80 layers, 64 heads of 128, 32 experts of 9216, 456B) leaves no layout that fits the planner's per-layer FSDP
# units on 128 GPUs. Softmax attention in every 8th layer
MINIMAX_SHAPED = dict(
    model_type="minimax", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=4096, num_local_experts=16, num_experts_per_tok=2, vocab_size=200064,
    tie_word_embeddings=False,
    layer_types=["full_attention" if (i + 1) % 8 == 0 else "linear_attention" for i in range(32)])


@pytest.mark.parametrize("ulysses,ring,layout", MESHES, ids=[f"u{u}xr{r}-{lay}" for u, r, lay in MESHES])
def test_lightning_bytes_follow_the_runtime_schedule(tmp_path, ulysses, ring, layout):
    """The planner's lightning layer sends, each way and in the recompute, what tests/hf/test_lightning.py counts:
    ``(P - 1) x runs x B x H x (D^2 + 1)`` float32 values, ``runs`` the busiest rank's in the schedule the runtime
    builds (``chain_for``); 2 sequences, 32 heads of 128."""
    from seqmesh.rules.degrees import Degrees
    from seqmesh.linear_attention.chain import chain_for
    from seqmesh.planner.lightning import LightningLayer
    from seqmesh.planner.workload import Workload
    from seqmesh.sequence.layout import SequenceLayout

    shape = model_shape(_write(tmp_path, MINIMAX_SHAPED))
    layer = LightningLayer(Workload(shape, 131072, batch=2, layout=layout), Degrees(ulysses, ring, 1))
    p = ulysses * ring
    seq = SequenceLayout.for_length(layout, ring, ulysses, 131072, None, 1, 1)
    runs = chain_for(seq, (0, seq.local_len * p), 1).max_runs
    want = (p - 1) * runs * 2 * 32 * (128 * 128 + 1) * 4
    traffic = layer.traffic()
    assert traffic["forward"] == traffic["backward"] == traffic["recompute"] == {"lightning_state_gather": want} != {}


def test_a_minimax_plan_recommends_a_layout_at_128k(tmp_path, capsys):
    """``seqmesh plan`` on a MiniMax-shaped 30B at 128K on 8 GPUs runs and recommends a layout; the model counts as
    transformers builds it; each lightning layer's gather is counted once per lightning layer and phase."""
    from seqmesh.tools.cli import main
    from test_planner_cli import _schema, conform

    path = _write(tmp_path, MINIMAX_SHAPED)
    total, _, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and 29e9 < total < 31e9
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and re.search(r"layers: 28 lightning\+moe, 4 attention\+moe;", out), out
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    schema = _schema()
    conform(plan, schema["plan"], {k: v for k, v in schema.items() if k.startswith("@")})
    best = plan["recommended"]["layout"]
    row = next(c for c in plan["candidates"] if c["layout"] == best)
    if best["ulysses"] * best["ring"] > 1:
        sent = row["comm_bytes_per_layer"]["forward"]["lightning_state_gather"]
        assert sent > 0 and row["comm_bytes_per_step"]["lightning_state_gather"] == 3 * sent * 28


# RecurrentGemma-9B's shape as remembered (not checked against Google's config.json): 38 layers in the pattern
# recurrent, recurrent, attention; width 4096, 16 heads with one kv head, lru_width 4096, a window of 2048, a gated MLP
# of 12288 (intermediate_size 24576, halved), tied embeddings of 256000
RECURRENT_GEMMA_9B = dict(
    model_type="recurrent_gemma", hidden_size=4096, num_hidden_layers=38, num_attention_heads=16, num_key_value_heads=1,
    lru_width=4096, attention_window_size=2048, conv1d_width=4, intermediate_size=24576, vocab_size=256000,
    block_types=["recurrent", "recurrent", "attention"], logits_soft_cap=30.0)


def test_rg_lru_bytes_equal_what_the_block_sends(pools, tmp_path):
    """What the planner's RecurrentGemma recurrent layer says the busiest rank sends equals what comm_stats counts
    while the real block runs on 2 ring ranks in float32 (2 sequences of 40 tokens): two all-gathers forward (the
    conv's halo, the runs' states), two reduce-scatters backward; the block is right (its output is transformers' on
    the whole sequence)."""
    from rg_lru_plan_cases import rg_lru_layer_bytes
    from seqmesh.planner.diagonal import HALO, STATES, RgLruLayer
    from seqmesh.planner.workload import Workload
    from seqmesh.rules.degrees import Degrees

    shape = model_shape(_write(tmp_path, _tiny("recurrent_gemma"), "recurrent_gemma"))
    layer = RgLruLayer(Workload(shape, 40, batch=2, bf16=False, layout="zigzag"), Degrees(1, 2, 1))
    per_rank = pools.run(2, rg_lru_layer_bytes, 1, 2, 40, 2, "zigzag")
    _sends_as_measured(layer, per_rank, (HALO, STATES), 2)


def test_a_recurrent_gemma_plan_recommends_a_layout_at_128k(tmp_path, capsys):
    """``seqmesh plan`` on RecurrentGemma-9B's shape at 128K on 8 GPUs: the model counts as transformers builds it, every
    layer is planned as what it is (recurrent blocks and windowed attention, never full attention), and the recurrent
    layers' bytes do not grow with the sequence (the same at 32K)."""
    from seqmesh.tools.cli import main

    path = _write(tmp_path, RECURRENT_GEMMA_9B)
    total, _, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and 8.4e9 < total < 8.8e9
    assert shape.hybrid.count(mixer="rg_lru") == 26 and shape.sliding_window == 2048
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sum(b.startswith("rg_lru") for b in plan["model"]["hybrid"]["blocks"]) == 26
    best = plan["recommended"]["layout"]
    row = next(c for c in plan["candidates"] if c["layout"] == best)
    assert main(["plan", "--model", path, "--seq-len", "32768", "--gpus", "8", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    same = next(c for c in short["candidates"] if c["layout"] == best)
    for key in ("rg_lru_halo_gather", "rg_lru_state_gather"):
        assert row["comm_bytes_per_layer"]["forward"].get(key, 0) == same["comm_bytes_per_layer"]["forward"].get(key, 0)
    sp = next(c for c in plan["candidates"] if c["layout"]["ring"] * c["layout"]["ulysses"] > 1)
    assert sp["comm_bytes_per_layer"]["forward"]["rg_lru_state_gather"] > 0, sp


def test_a_jamba_plan_sizes_every_layer_at_128k(tmp_path, capsys):
    """``seqmesh plan`` on Jamba-v0.1's shape (transformers' JambaConfig defaults: 32 layers, attention in every 8th,
    MoE of 16 experts in every 2nd, Mamba inner 8192 with a state of 16) at 128K on 8 GPUs: the model counts as
    transformers builds it (about 52B), every Mamba layer planned as one, and its bytes the same at 32K. (None of the
    layouts fits 80 GB: the torch scan keeps inner x state float32 values a token, 512 KiB.)"""
    import transformers as tf

    from seqmesh.planner.diagonal import MAMBA_HALO, MAMBA_STATES
    from seqmesh.tools.cli import main

    path = _write(tmp_path, json.loads(tf.JambaConfig().to_json_string()), "jamba")
    total, _, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and 51e9 < total < 53e9
    assert shape.hybrid.count(mixer="mamba1") == 28 and shape.hybrid.count(ffn="moe") == 16
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sum(b.startswith("mamba1") for b in plan["model"]["hybrid"]["blocks"]) == 28
    assert main(["plan", "--model", path, "--seq-len", "32768", "--gpus", "8", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    for row in plan["candidates"]:
        same = next(c for c in short["candidates"] if c["layout"] == row["layout"])
        for key in (MAMBA_HALO, MAMBA_STATES):
            assert row["comm_bytes_per_layer"]["forward"].get(key, 0) == same["comm_bytes_per_layer"]["forward"].get(key, 0)
    sp = next(c for c in plan["candidates"] if c["layout"]["ring"] * c["layout"]["ulysses"] > 1)
    assert sp["comm_bytes_per_layer"]["forward"][MAMBA_STATES] > 0, sp


def test_pure_mamba_bytes_equal_what_the_mixer_sends(pools, tmp_path):
    """What the planner's Mamba layer says the busiest rank sends, for pure Mamba's config.json (no attention, every
    layer a norm and a mixer), equals what comm_stats counts while transformers' mixer runs under seqmesh on 2 ring
    ranks in float32 (one sequence of 40 tokens): two all-gathers forward (the conv's halo, the runs' states), two
    reduce-scatters backward; the mixer is right (its own forward on the whole sequence)."""
    import transformers as tf

    from mamba_cases import HIDDEN, VOCAB, mamba_mixer_bytes
    from seqmesh.planner.diagonal import MAMBA_HALO, MAMBA_STATES, Mamba1Layer
    from seqmesh.planner.workload import Workload
    from seqmesh.rules.degrees import Degrees

    config = tf.MambaConfig(hidden_size=HIDDEN, state_size=4, expand=2, conv_kernel=4, time_step_rank=4,
                            vocab_size=VOCAB, num_hidden_layers=1)
    shape = model_shape(_write(tmp_path, json.loads(config.to_json_string()), "mamba"))
    layer = Mamba1Layer(Workload(shape, 40, batch=1, bf16=False, layout="zigzag"), Degrees(1, 2, 1), ffn="")
    per_rank = pools.run(2, mamba_mixer_bytes, 2, 40)
    _sends_as_measured(layer, per_rank, (MAMBA_HALO, MAMBA_STATES), 2)


# Mamba-2.8B's shape as remembered (not checked against the release's config.json): 64 layers of width 2560, a state
# of 16, the mixer twice as wide, dt rank 160, a conv of 4, tied embeddings of 50280
MAMBA_2_8B = dict(model_type="mamba", hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2,
                  intermediate_size=5120, conv_kernel=4, time_step_rank=160, use_bias=False, use_conv_bias=True,
                  vocab_size=50280, tie_word_embeddings=True)


def test_a_pure_mamba_plan_puts_the_sequence_on_the_ring(tmp_path, capsys):
    """``seqmesh plan`` on Mamba-2.8B's shape at 128K on 8 GPUs: the model counts as transformers builds it (about
    2.77B), every layer is planned as a Mamba layer, and a Ulysses degree is refused by its reason (no attention to
    split by heads), never as "exceeds the 1 query heads" of a nominal attention shape."""
    from seqmesh.tools.cli import main

    path = _write(tmp_path, MAMBA_2_8B, "mamba")
    total, _, _ = _meta_layers(path)
    shape = model_shape(path)
    assert shape.params == total and 2.7e9 < total < 2.8e9
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["hybrid"]["blocks"] == ["mamba1"] * 64
    best = plan["recommended"]["layout"]
    assert best["ulysses"] == 1 and best["ring"] > 1, best
    refused = [e["reason"] for e in plan["excluded"] if e["layout"]["ulysses"] > 1 and e["layout"]["tp"] == 1]
    assert refused and all("no attention layer" in why for why in refused), refused


@pytest.mark.parametrize("sizes", [
    dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_heads=4),  # the factors' defaults
    dict(vocab_size=1000, hidden_size=96, num_blocks=3, num_hidden_layers=None, num_heads=2, qk_dim_factor=0.25,
         v_dim_factor=0.5, ffn_proj_factor=1.5, ffn_round_up_to_multiple_of=32, use_bias=True, weight_mode="fused",
         tie_word_embeddings=True),
    dict(vocab_size=50304, hidden_size=4096, num_hidden_layers=32, num_heads=8),  # xLSTM-7B's shape
    dict(vocab_size=1000, hidden_size=1536, num_hidden_layers=1, num_heads=4)],  # 1536 x 2.667 = 4096.5: 4096 wide
    ids=["tiny", "biased-fused-tied", "7b", "1536"])
def test_xlstm_parameters_equal_the_transformers_model(tmp_path, sizes):
    """xLSTM's config.json: every parameter transformers builds (the mLSTM layer's projections, gates, head norm and
    out_proj, the feed-forward rounded up to its multiple, both norms, biases where use_bias), each block planned as
    an mLSTM block, never as attention."""
    from transformers import AutoModelForCausalLM, xLSTMConfig

    config = xLSTMConfig(**{k: v for k, v in sizes.items() if v is not None})
    folder = tmp_path / "xlstm"
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = model_shape(str(folder))
    blocks = model.backbone.blocks
    assert not shape.unplanned and shape.hybrid.count(mixer="mlstm") == len(blocks) == shape.layers
    assert [shape.hybrid.layer_params(b, shape.hidden, shape.attention_params) for b in shape.hybrid.blocks] == [
        sum(p.numel() for p in block.parameters()) for block in blocks]
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_mlstm_bytes_equal_what_the_layer_sends(pools, tmp_path):
    """What the planner's xLSTM layer says the busiest rank sends equals what comm_stats counts while the real mLSTM
    layer runs on 2 ring ranks in float32 (2 sequences of 40 tokens): one all-gather forward (every run's
    ``[C0 | n0 | m0 | F]``), its reduce-scatter backward; the layer is right (transformers' own on the whole sequence)."""
    from family_cases import family_config
    from rwkv_plan_cases import mlstm_layer_bytes
    from seqmesh.planner.diagonal import MLSTM_STATES, XlstmLayer
    from seqmesh.planner.workload import Workload
    from seqmesh.rules.degrees import Degrees

    config = family_config("xlstm")
    folder = tmp_path / "xlstm"
    config.save_pretrained(folder)
    shape = model_shape(str(folder))
    layer = XlstmLayer(Workload(shape, 40, batch=2, bf16=False, layout="zigzag"), Degrees(1, 2, 1), ffn="xlstm_ffn")
    per_rank = pools.run(2, mlstm_layer_bytes, 2, 40, 2)
    _sends_as_measured(layer, per_rank, (MLSTM_STATES,), 1)


def test_an_xlstm_plan_puts_the_sequence_on_the_ring(tmp_path, capsys):
    """``seqmesh plan`` on xLSTM-7B's shape (transformers' defaults: 32 blocks of 4096, 8 heads) at 128K on 8 GPUs:
    about 6.9B parameters as transformers builds them, every block planned as an mLSTM block with its state gather,
    Ulysses refused for want of attention, no attention working set in the peak."""
    import transformers as tf

    from seqmesh.tools.cli import main

    folder = tmp_path / "xlstm"
    tf.xLSTMConfig().save_pretrained(folder)
    path = str(folder / "config.json")
    with torch.device("meta"):
        total = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(tf.xLSTMConfig()).parameters())
    assert model_shape(path).params == total and 6.8e9 < total < 7.0e9
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["hybrid"]["blocks"] == ["mlstm+xlstm_ffn"] * 32
    best = plan["recommended"]["layout"]
    assert best["ulysses"] == 1 and best["ring"] > 1, best
    row = next(c for c in plan["candidates"] if c["layout"] == best)
    assert row["comm_bytes_per_layer"]["forward"]["mlstm_state_gather"] > 0 and row["memory_bytes"]["attention"] == 0, row
    refused = [e["reason"] for e in plan["excluded"] if e["layout"]["ulysses"] > 1 and e["layout"]["tp"] == 1]
    assert refused and all("no attention layer" in why for why in refused), refused


def test_rwkv_parameters_equal_the_transformers_model(tmp_path):
    """RWKV-4's config.json (a tiny one with its own widths, and the 169M shape with the defaults: attention and
    feed-forward widths from the hidden size): every parameter transformers builds, block 0's extra LayerNorm and
    the final one's bias included; each block planned as an RWKV block."""
    from transformers import AutoModelForCausalLM, RwkvConfig

    for sizes in (dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, attention_hidden_size=48,
                       intermediate_size=160), dict(vocab_size=50277, hidden_size=768, num_hidden_layers=12)):
        folder = tmp_path / str(sizes["hidden_size"])
        RwkvConfig(**sizes).save_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(RwkvConfig(**sizes))
        shape = model_shape(str(folder))
        assert not shape.unplanned and shape.hybrid.count(mixer="rwkv") == sizes["num_hidden_layers"]
        assert shape.params == sum(p.numel() for p in model.parameters()), sizes


def test_rwkv_bytes_equal_what_the_block_sends(pools, tmp_path):
    """What the planner's RWKV layer says the busiest rank sends equals what comm_stats counts while the real block's
    time and channel mixes run on 2 ring ranks in float32 (2 sequences of 40 tokens): three all-gathers forward (the
    two token shifts' halos, the runs' states), three reduce-scatters backward; the mixes are right (transformers'
    own on the whole sequence)."""
    from family_cases import family_config
    from rwkv_plan_cases import rwkv_block_bytes
    from seqmesh.planner.diagonal import RWKV_SHIFT, RWKV_STATES, RwkvLayer
    from seqmesh.planner.workload import Workload
    from seqmesh.rules.degrees import Degrees

    family_config("rwkv").save_pretrained(tmp_path)
    layer = RwkvLayer(Workload(model_shape(str(tmp_path)), 40, batch=2, bf16=False, layout="zigzag"), Degrees(1, 2, 1),
                      "rwkv_channel_mix")
    per_rank = pools.run(2, rwkv_block_bytes, 1, 2, 40, 2, "zigzag")
    _sends_as_measured(layer, per_rank, (RWKV_SHIFT, RWKV_STATES), 3)


@pytest.mark.parametrize("head_dim", [32, 128])
def test_kda_rule_bytes_equal_the_tracked_ones(head_dim):
    """What the KDA rule keeps for backward (``kda_rule_saved`` a token and head) and what its backward holds beyond
    that (``kda_rule_backward``), against ``MemoryTracker`` around the rule alone: bf16 inputs, 2 heads, 16 chunks."""
    from seqmesh.linear_attention.choice import LINEAR_CHUNK
    from seqmesh.linear_attention.kda import chunk_kda_states
    from seqmesh.memory import MemoryTracker
    from seqmesh.planner.kda import kda_rule_backward, kda_rule_saved

    s, h, gen = 16 * LINEAR_CHUNK, 2, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, head_dim, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    g = (-torch.rand(1, s, h, head_dim, generator=gen) * 0.1).bfloat16().requires_grad_()
    beta = torch.rand(1, s, h, generator=gen).bfloat16().requires_grad_()
    held = sum(x.numel() * x.element_size() for x in (q, k, v, g, beta))
    with MemoryTracker(torch.nn.Linear(1, 1)) as tracker:
        out, _ = chunk_kda_states(q, k, v, g, beta, (0, s))
        after_forward = tracker.live_bytes()
        out.backward(torch.ones_like(out))
    kept = after_forward - held - out.numel() * out.element_size() - 4 * 2  # the tracked module's weight and bias
    beyond = tracker.report().peak_bytes - after_forward
    assert abs(kept / (s * h * 4 * kda_rule_saved(head_dim)) - 1) < 0.01, kept
    assert abs(beyond / (s * h * 4 * kda_rule_backward(head_dim)) - 1) < 0.03, beyond
