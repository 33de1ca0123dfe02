"""Gated DeltaNet (Qwen3.5's linear attention) under sequence parallelism, against one process."""

from __future__ import annotations

import itertools

import pytest
import torch

from linear_cases import LayerCase, ModelCase, layer_cases, model_cases, reference_noise, refusals
from seqmesh.planner.traffic import linear_attention_traffic
from seqmesh.linear_attention.gated_delta import causal_conv1d, chunk_gated_delta_rule

# (ulysses, ring): ring 2 reaches every line of the layer (and of its traffic formula) that Ulysses 2, U2 x R2, a ring
# of 4 and Ulysses 4 reached; the model test keeps the 2-D mesh, which a ring of 4 and Ulysses 4 add no line to
# (docs/testing.md)
LAYER_MESHES = [(1, 2)]
MODEL_MESHES = [(1, 2), (2, 1), (2, 2)]
# (key heads, value heads): grouped, one key head for all (replicated over every rank), as many key as
# value heads, value heads that do not split evenly over 4 ranks
HEADS = [(2, 4), (1, 4), (4, 4), (2, 6)]
DOCS = {24: (0, 1, 2, 9, 10, 20, 24), 23: (0, 1, 7, 8, 22, 23)}  # length-1 documents, one crossing shards
# transformers' torch rules, called without a state (transformers 5.15's recurrent rule has no defaults for these)
NO_STATE = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)

# The tolerance of the model comparison comes from the reference's own noise: transformers' Gated
# DeltaNet computes in float32 whatever the model's dtype, so the one-process model is compared
# with itself, the same loss back-propagated over the batch rows in two parts and summed
# (test_reference_noise_floor). Measured: logits <= 1.7e-7, gradients <= 6.8e-7 relative (worst:
# A_log and the gated norms, whose gradients cancel). seqmesh measured <= 2.5e-7 and <= 2.1e-6.
# The shard-local recurrence this replaces is off by 0.1 (logits) and 1.8 (gradients).
LOGITS_RTOL = 1e-6
GRAD_RTOL = 1e-5


def test_route_from_the_head_deal_built_once():
    """2 key and 4 value heads of dims 2 over 4 ranks: rank u runs value head u, which reads key head
    u // 2; its conv channels are that key head's q (2k, 2k+1) and k (4 + 2k, ...) and its value head's v
    (8 + 2u, ...), and each rank receives 2 x 2 + (2 + 2) = 8 channels. An equal deal returns the
    same route, so no layer rebuilds it."""
    from seqmesh.linear_attention.sequence_parallel import LinearHeads

    for u in range(4):
        route = LinearHeads(2, 4, 2, 2, 4).route(u)
        kh = u // 2
        assert route.conv_channels.tolist() == [2 * kh, 2 * kh + 1, 4 + 2 * kh, 5 + 2 * kh, 8 + 2 * u, 9 + 2 * u]
        assert route.key_of.tolist() == [0] and route.key_heads == 1 and route.value_heads == (u, u + 1)
        assert route.sends == (8, 8, 8, 8) and route.out_counts == (1, 1, 1, 1)
        assert route is LinearHeads(2, 4, 2, 2, 4).route(u, "cpu")


def _per_document(fn, bounds: tuple[int, ...], *seqs: torch.Tensor) -> torch.Tensor:
    """``fn`` on each document ``seqs[:, a:e]`` alone (a zero state, a fresh conv), concatenated along dim 1."""
    return torch.cat([fn(*(x[:, a:e] for x in seqs)) for a, e in zip(bounds[:-1], bounds[1:])], dim=1)


def test_chunked_rule_and_conv_match_transformers_per_document():
    """seqmesh's chunked rule over packed documents (starting mid-chunk, of length 1; chunks of 16 and 64),
    in float64 and float32, equals transformers' own chunked and recurrent rules run on each document alone
    and concatenated. Those compute in float32 whatever their inputs, so the bound is 4x their difference
    from each other, measured here: seqmesh is at most 1.04x it (torch 2.13, transformers 5.24); a state
    carried into the next document is 0.23 off. The conv, restarting at documents, equals transformers'
    conv of each document alone within 4x that conv's own float32 error against float64, scaled by
    eps(dtype) / eps(float32)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (causal_conv1d_fn, torch_chunk_gated_delta_rule,
                                                               torch_recurrent_gated_delta_rule)

    g = torch.Generator().manual_seed(0)
    b, s, h = 2, 150, 3
    # float32 values, exact in float64: transformers' rounding of its inputs to float32 loses nothing
    q, k = (torch.randn(b, s, h, 8, generator=g) for _ in range(2))
    v = torch.randn(b, s, h, 5, generator=g)
    decay, beta = -torch.rand(b, s, h, generator=g), torch.rand(b, s, h, generator=g)
    for bounds in [(0, s), (0, 1, 2, 70, 71, 140, s)]:
        theirs = [_per_document(lambda *x: rule(*x, **NO_STATE)[0], bounds, q, k, v, decay, beta)
                  .double() for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)]
        rounding = float((theirs[0] - theirs[1]).abs().max())
        for chunk, dtype in itertools.product((16, 64), (torch.float64, torch.float32)):
            ours = chunk_gated_delta_rule(*(t.to(dtype) for t in (q, k, v, decay, beta)), bounds, chunk=chunk)
            assert ours.dtype == dtype
            errors = [float((ours.double() - t).abs().max()) for t in theirs]
            assert max(errors) <= 4 * rounding, (bounds, chunk, dtype, errors, rounding)

    x, w, bias = torch.randn(b, s, 10, generator=g), torch.randn(10, 4, generator=g), torch.randn(10, generator=g)
    bounds = (0, 1, 2, 70, 71, 140, s)

    def conv_alone(dtype: torch.dtype) -> torch.Tensor:
        def conv(piece: torch.Tensor) -> torch.Tensor:  # transformers' conv takes (B, C, S)
            out = causal_conv1d_fn(piece.transpose(1, 2), w.to(dtype), bias.to(dtype), activation="silu")
            return out.transpose(1, 2)

        return _per_document(conv, bounds, x.to(dtype))

    exact = conv_alone(torch.float64)
    rounding = float((conv_alone(torch.float32).double() - exact).abs().max())
    for dtype in (torch.float64, torch.float32):
        unit = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps
        err = float((causal_conv1d(x.to(dtype), w.to(dtype), bias.to(dtype), bounds).double() - exact).abs().max())
        assert err <= 4 * unit * rounding, (dtype, err, unit * rounding)


def _heads_from_transformers_pieces(packed, params, case: LayerCase, bounds: tuple[int, ...]) -> dict:
    """The layer's token mixer on the whole sequence written from transformers' Qwen3.5 functions, one
    document at a time (each starts from a zero state and a fresh conv): its chunked and its recurrent
    rule. They compute in float32; their difference is that rounding, measured."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import (causal_conv1d_fn, torch_chunk_gated_delta_rule,
                                                               torch_recurrent_gated_delta_rule)

    hk, hv, dk, dv = case.key_heads, case.value_heads, case.key_dim, case.value_dim
    x, b_in, a_in = packed.split([2 * hk * dk + hv * dv, hv, hv], dim=-1)
    outs: dict = {"chunk": [], "recurrent": []}
    for a, e in zip(bounds[:-1], bounds[1:]):
        mixed = causal_conv1d_fn(x[:, a:e].transpose(1, 2), params.conv_weight, params.conv_bias,
                                 activation="silu").transpose(1, 2)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        n = e - a
        q = q.reshape(case.batch, n, hk, dk).repeat_interleave(hv // hk, dim=2)  # value head h reads key head h // (hv/hk)
        k = k.reshape(case.batch, n, hk, dk).repeat_interleave(hv // hk, dim=2)
        v = v.reshape(case.batch, n, hv, dv)
        beta = b_in[:, a:e].sigmoid()
        g = -params.A_log.exp() * F.softplus(a_in[:, a:e] + params.dt_bias)
        for name, rule in (("chunk", torch_chunk_gated_delta_rule), ("recurrent", torch_recurrent_gated_delta_rule)):
            out, _ = rule(q, k, v, g=g, beta=beta, **NO_STATE)
            outs[name].append(out)
    return {name: torch.cat(parts, dim=1).double() for name, parts in outs.items()}


@pytest.mark.parametrize("key_heads, value_heads", HEADS)
def test_whole_sequence_heads_match_transformers(key_heads, value_heads):
    """The one-process mixer that the sharded layer is compared with (``gated_delta_heads`` on all heads)
    against transformers' own conv and gated delta rules on each document, within 8x their measured
    float32 rounding (the chunked vs the recurrent rule), floored at float32's eps times the output's
    magnitude: so the layer test's reference is not seqmesh's code alone."""
    from linear_cases import layer_inputs
    from seqmesh.linear_attention.gated_delta import segment_bounds
    from seqmesh.linear_attention.sequence_parallel import LinearHeads, gated_delta_heads

    case = LayerCase(24, key_heads, value_heads, documents=DOCS[24])
    whole = LinearHeads(key_heads, value_heads, case.key_dim, case.value_dim, 1)
    packed, params, _ = layer_inputs(case, whole)
    bounds = segment_bounds(case.seq_len, case.documents)
    ours = gated_delta_heads(packed, params, whole, 0, bounds)
    theirs = _heads_from_transformers_pieces(packed, params, case, bounds)
    rounding = float((theirs["chunk"] - theirs["recurrent"]).abs().max())
    bound = 8 * max(rounding, torch.finfo(torch.float32).eps * float(ours.abs().max()))
    assert float((ours - theirs["chunk"]).abs().max()) <= bound, (rounding, bound)


def _layer_cases(ulysses: int, ring: int) -> list[LayerCase]:
    p = ulysses * ring
    return [LayerCase(s, hk, hv, layout, DOCS[s] if docs else None)
            for layout, s, docs, (hk, hv) in itertools.product(("zigzag", "contiguous", "per_document"), (24, 23),
                                                                (False, True), HEADS)
            if hv >= p and (docs or layout != "per_document")]  # without documents per_document is zigzag


@pytest.mark.parametrize("ulysses,ring", LAYER_MESHES, ids=[f"u{u}xr{r}" for u, r in LAYER_MESHES])
def test_layer_exact_float64(pools, ulysses, ring):
    """The sequence-parallel conv + recurrence equals the whole-sequence computation in float64: output,
    the input's gradient and every parameter's (conv weight and bias, A_log, dt_bias), summed over ranks."""
    cases = _layer_cases(ulysses, ring)
    per_rank = pools.run(ulysses * ring, layer_cases, ulysses, ring, cases)
    bad = [(rank, r["case"], r["errors"]) for rank, results in enumerate(per_rank) for r in results
           if max(r["errors"].values()) > 1e-12]
    assert not bad, bad[:3]
    assert len(per_rank[0]) == len(cases) >= 16
    # the bytes each rank's all-to-alls moved are the planner's, derived without seqmesh's code
    for case, results in zip(cases, zip(*per_rank)):
        want = linear_attention_traffic(case.key_heads, case.value_heads, case.key_dim, case.value_dim,
                                        seq_len=case.seq_len, batch=case.batch, ulysses=ulysses, ring=ring,
                                        dtype="float64", layout=case.layout)
        for rank, r in enumerate(results):
            assert r["a2a_calls"] == 4, (case, rank, r)
            for phase in ("forward", "backward"):
                assert r["a2a_bytes"][phase] == want[rank].sent("all_to_all", phase), (case, rank, phase, r)


def _model_cases() -> list[ModelCase]:
    return [
        ModelCase(23, "zigzag"),  # not a multiple of 2P: padding
        ModelCase(24, "contiguous", DOCS[24], key_heads=1, value_heads=4),  # key heads fewer than P
        ModelCase(23, "zigzag", DOCS[23], key_heads=2, value_heads=4),
    ]


@pytest.mark.parametrize("ulysses,ring", MODEL_MESHES, ids=[f"u{u}xr{r}" for u, r in MODEL_MESHES])
def test_qwen3_5_matches_one_process(pools, ulysses, ring):
    """A random Qwen3.5 (3 Gated DeltaNet layers + full attention) through seqmesh.hf.parallelize: logits
    and every parameter's gradient equal the unmodified model on the whole sequence (each packed
    document alone)."""
    per_rank = pools.run(ulysses * ring, model_cases, ulysses, ring, _model_cases(), timeout=600)
    for rank, results in enumerate(per_rank):
        for r in results:
            errors = dict(r["errors"])
            assert errors.pop("logits") < LOGITS_RTOL, (rank, r["case"])
            worst = max(errors.items(), key=lambda kv: kv[1])
            assert worst[1] < GRAD_RTOL, (rank, r["case"], worst)
            assert len(errors) == r["params"] > 50  # every parameter compared


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "olmo_hybrid"])
def test_other_families_match_one_process(pools, family):
    """The same layer in Qwen3.5-MoE, Qwen3-Next (fused, per-key-head interleaved projections) and
    OLMo-hybrid (separate projections, beta in (0, 2)) on USP 2x2: logits and every gradient."""
    cases = [ModelCase(23, "zigzag", DOCS[23], family=family), ModelCase(24, "contiguous", key_heads=1, family=family)]
    for rank, results in enumerate(pools.run(4, model_cases, 2, 2, cases, timeout=600)):
        for r in results:
            errors = dict(r["errors"])
            assert errors.pop("logits") < LOGITS_RTOL, (rank, r["case"])
            worst = max(errors.items(), key=lambda kv: kv[1])
            assert worst[1] < GRAD_RTOL, (rank, r["case"], worst)
            assert len(errors) == r["params"]


def test_reference_noise_floor():
    """The measurement behind LOGITS_RTOL and GRAD_RTOL: the reference differs from itself by rounding
    well below them (if transformers' rounding grows, this says so before the parity test does)."""
    for r in reference_noise(_model_cases()):
        errors = dict(r["errors"])
        assert errors.pop("logits") < LOGITS_RTOL / 3, r["case"]
        assert max(errors.values()) < GRAD_RTOL / 5, r["case"]


def test_refusals_and_restore(pools):
    """A recurrent layer seqmesh does not know is refused by name before anything changes; so are
    fewer value heads than ranks; unparallelize restores the layers' own forward exactly."""
    r = pools.run(2, refusals, 1, 2)[0]
    assert "model.layers.0.mixer is a ToyMambaMixer, which mixes tokens" in r["unknown"], r
    assert "Gated DeltaNet" in r["unknown"], r
    assert r["unknown_untouched"], r
    assert "1 value heads" in r["too_few_heads"] and "at most 1" in r["too_few_heads"], r
    assert r["installed"] == 3, r
    assert "shard_batch" in r["no_info"], r
    assert r["restored"], r


def _job(out, **kw):
    from seqmesh.training.config import TrainConfig

    base = dict(model="qwen3.5-tiny", seq_len=61, ulysses=2, ring=2, dp=1, steps=4, lr=1e-2, warmup=1, log_every=1,
                eval_every=0, out=str(out), symbols=16)
    return TrainConfig(**{**base, **kw})


def _plain_transformers_curve(cfg, dtype: torch.dtype) -> list[float]:
    """The loss curve ``cfg`` should give, from plain transformers and torch on one process: the
    transformers model ``build_model`` makes (the job's initial weights, nothing of seqmesh wrapped
    around it) in ``dtype``, each step's copy-task batch whole, the next-token loss written out, the
    gradient clipped to ``grad_clip``, torch's AdamW and its own schedulers for the warm-up and cosine."""
    import torch.nn.functional as F
    from torch.optim import lr_scheduler

    from seqmesh.model.lm import build_model
    from seqmesh.training.datasets import LongRangeCopy

    model = build_model(cfg.model, seed=cfg.seed).to(dtype)
    data = LongRangeCopy(cfg.seq_len, symbols=cfg.symbols, period=cfg.copy_period, seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=1 / cfg.warmup, total_iters=max(1, cfg.warmup - 1))
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, cfg.steps - cfg.warmup),
                                            eta_min=cfg.min_lr_ratio * cfg.lr)
    schedule = lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[cfg.warmup])
    curve = []
    for step in range(cfg.steps):
        batch = data.batch(step, 0, cfg.batch)
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits  # (B, S, vocab)
        targets = batch["labels"][:, 1:]  # token t predicts label t + 1
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        curve.append(loss.item())
    return curve


def test_job_trains_qwen3_5_like_one_process(pools, tmp_path):
    """seqmesh train on the built-in copy task: USP 2x2 (with activation checkpointing, so the layers'
    all-to-alls also run in the recompute) and FSDP2 from the meta device gives the loss curve of plain
    transformers trained with torch's AdamW on the whole sequence in one process (the initial weights come
    from (seed, module name), so they agree); seqmesh verify passes on ring 4."""
    import json

    from train_job_cases import run_train, run_verify

    cfg = _job(tmp_path / "usp", checkpointing=True)  # layers recomputed in backward
    pools.run(4, run_train, cfg)
    with open(tmp_path / "usp" / "metrics.jsonl") as f:
        job = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    exact, rounded = (_plain_transformers_curve(cfg, dtype) for dtype in (torch.float64, torch.float32))
    assert len(job) == len(exact) == 4, job
    # The bound: the plain run's own float32 rounding, its largest distance from its float64 run over the
    # curve (whose Gated DeltaNet rules still compute in float32, as transformers writes them; AdamW
    # amplifies rounding after the first step: it moves a weight by up to 2 x lr where the sign of a
    # near-zero gradient flips). Measured (torch 2.13, transformers 5.24): the job is within 1.6e-6 of
    # the float64 run, the float32 run 4.2e-6; seqmesh's delta rule with q scaled by Dk^-1/4 is 1.4e-3
    # off at the first step, 4e-2 later (against seqmesh's own one-process job, which shared it, it passed).
    rounding = max(abs(a - b) for a, b in zip(rounded, exact))
    worst = max(abs(a - b) for a, b in zip(job, exact))
    assert worst <= 8 * rounding, (job, exact, rounded)
    report = pools.run(4, run_verify, _job(tmp_path / "verify", ulysses=1, ring=4), None)[0]
    assert report["ok"] and report["loss_diff"] < 1e-5, report


def test_planner_counts_gated_deltanet_layers():
    """seqmesh plan on Qwen3.5-9B: its 24 Gated DeltaNet layers send the linear all-to-all (fwd + bwd +
    recompute) and its 8 full-attention layers the Ulysses one; sequence degrees above the 32 value heads
    are excluded, naming them; the closed form for even heads holds."""
    from seqmesh.planner.hardware import PRESETS, make_cluster
    from seqmesh.planner.plan import communication, layouts
    from seqmesh.rules.degrees import Degrees
    from seqmesh.planner.workload import Workload
    from seqmesh.model.presets import MODELS

    m = MODELS["qwen3.5-9b"]
    work = Workload(m, 131072, linear_attention="all_to_all")  # state passing: test_state_passing
    cluster = make_cluster(PRESETS["h100-nvlink"], nodes=8)
    per_layer, links, step = communication(work, Degrees(4, 2, 8), cluster.hardware)
    assert m.linear_layers == 24 and m.layers - m.linear_layers == 8
    lin = per_layer["forward"]["linear_all_to_all"]
    assert lin == 131072 * 7 * (2 * 16 * 128 + 32 * (2 * 128 + 2)) * 2 // 64  # B S (P-1)/P^2 (2 Hk Dk + Hv (2 Dv + 2)) bf16
    assert step["linear_all_to_all"] == 24 * 3 * lin
    assert step["ulysses_all_to_all"] == 8 * sum(per_layer[p]["ulysses_all_to_all"] for p in per_layer)
    _, excluded = layouts(work, cluster)
    assert any(lay.ulysses * lay.ring == 64 and "32 Gated DeltaNet value heads" in why for lay, why in excluded)
    assert not any("value heads" in why for _, why in layouts(Workload(m, 131072), cluster)[1])  # auto: no limit
    # state memory: one float32 (Dk x Dv) per value head of the rank's share, kept per 64-token chunk
    from seqmesh.planner.layers import GatedDeltaNet, linear_state_bytes
    from seqmesh.planner.memory import layer_saved_bytes

    assert linear_state_bytes(m, 1, 8) == 4 * 4 * 128 * 128
    at8, at1 = (GatedDeltaNet(work, lay).saved_bytes() for lay in (Degrees(8, 1, 1), Degrees(1, 1, 8)))
    assert at8 > 2048 * linear_state_bytes(m, 1, 8)  # 131072 / 64 chunk states, 512 MiB
    assert 7.9 < at1 / at8 < 8.1  # everything of the layer scales as 1/P
    assert at8 == layer_saved_bytes(work, Degrees(8, 1, 1))  # the hybrid's larger layer kind


def test_recurrent_families_are_refused_by_name():
    """transformers' families with recurrent token mixers (built on the meta device from their own config
    classes): the Gated DeltaNet ones, the gated short convs (LFM2, LFM2-MoE, LFM3) and KDA (Kimi Linear, Bailing
    hybrid) are taken and pass the one layer check, every other recurrent mixer is refused by its name before any
    change, and plain attention models have nothing to take."""
    import types

    from transformers import AutoConfig, AutoModelForCausalLM

    from seqmesh.hf.layers import check_layers
    from seqmesh.hf.mixers import mixer_layers

    mesh = types.SimpleNamespace(sp_size=2)  # the mixers' find() read only the degree
    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=97, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    refused = {}  # every recurrent family of transformers 5.24 is taken; a mixer not handled is refused (below)
    # Gated DeltaNet (1 layer each), Mamba2 (Nemotron-H's first layer; Falcon-H1's in both of its layers), lightning,
    # LFM's gated short convolutions
    taken = {"qwen3_5_text": 1, "qwen3_next": 1, "olmo_hybrid": 1, "llama": 0, "nemotron_h": 1, "falcon_h1": 2,
             "minimax": 1, "lfm2": 1, "lfm2_moe": 1, "lfm3": 1, "mamba": 2, "falcon_mamba": 2, "jamba": 2,
             "recurrent_gemma": 1, "rwkv": 4, "xlstm": 2}  # RWKV: each block's time mix and channel mix
    newer = {"kimi_linear": 1, "bailing_hybrid": 1}  # KDA, taken where the release has the family
    hybrid = ["linear_attention", "full_attention"]  # one of each, so the model has attention to route
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # families a release does not have (kimi_linear before transformers 5.17) cannot reach seqmesh there
    assert all(family in CONFIG_MAPPING for family in taken)
    taken_here = {**taken, **{f: n for f, n in newer.items() if f in CONFIG_MAPPING}}
    for family in [f for f in (*refused, *taken_here) if f in CONFIG_MAPPING]:
        extra = {"layer_types": hybrid} if family in taken_here and family not in (
            "llama", "falcon_h1", "mamba", "falcon_mamba", "jamba", "rwkv", "xlstm") else {}
        extra = {"layer_types": ["conv", "full_attention"]} if family.startswith("lfm") else extra
        extra = {**extra, "mamba_d_ssm": 64, "mamba_n_heads": 4} if family == "falcon_h1" else extra
        extra = {"block_types": ["recurrent", "attention"]} if family == "recurrent_gemma" else extra
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **small, **extra))
        found = mixer_layers(model, mesh, "auto")
        layers = [layer for kind in found.values() for layer in kind]
        if family in taken_here:
            assert len(layers) == taken_here[family], family
            check_layers(model, handled=[m for _, m in layers],
                         handled_types=tuple(t for kind in found for t in kind.layer_types))
            continue
        assert layers == [], family
        with pytest.raises(ValueError, match=rf"is a {refused[family]}, which mixes tokens outside") as err:
            check_layers(model, handled=[])
        assert "Gated DeltaNet layers of Qwen3.5" in str(err.value)
    with torch.device("meta"):  # a recurrent mixer seqmesh is not told it runs: refused by its name
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("rwkv", **small))
    with pytest.raises(ValueError, match=r"is a RwkvSelfAttention, which mixes tokens outside") as err:
        check_layers(model, handled=[])
    assert "Gated DeltaNet layers of Qwen3.5" in str(err.value)
