"""Gated DeltaNet by state passing (``seqmesh.linear_attention.state_passing``) against one process."""

from __future__ import annotations

import itertools

import pytest
import torch

from linear_cases import LayerCase, ModelCase, layer_cases, model_cases
from seqmesh.linear_attention.choice import state_passing_bytes

# (ulysses, ring): ring 2 and U2 x R2 reach every line that Ulysses 2, a ring of 4 and Ulysses 4 reached
# (docs/testing.md)
MESHES = [(1, 2), (2, 2)]
# documents of length 1 and 2 (shorter than the conv's tail of 3), documents crossing rank boundaries
DOCS = {24: (0, 1, 2, 9, 10, 20, 24), 23: (0, 1, 7, 8, 22, 23), 48: (0, 2, 3, 30, 31, 46, 48)}
# (key heads, value heads): grouped; fewer value heads than ranks, which the all-to-all design refuses
HEADS = [(2, 4), (1, 2)]
# float64 throughout, except the decay g, which seqmesh computes in float32 from A_log as transformers does:
# A_log's gradient is a float32 sum over the tokens, in another order once they are split over ranks.
# Measured: <= 4e-9 relative (the all-to-all design keeps each head's tokens together and is exact); a state
# that skips a rank boundary or a conv that misses a tail is off by more than 1e-2.
FLOAT64_ATOL = 1e-12
A_LOG_RTOL = 64 * torch.finfo(torch.float32).eps


def _cases(p: int) -> list[LayerCase]:
    cases = [LayerCase(s, hk, hv, layout, DOCS[s] if docs else None, design="state_passing")
             for layout, s, docs, (hk, hv) in itertools.product(("zigzag", "contiguous", "per_document"), (24, 48),
                                                                (False, True), HEADS)
             if (docs or layout != "per_document") and s % p == 0]
    # a longer conv (its tail reaches across two short documents and several ranks); a length that pads
    cases += [LayerCase(24, 2, 4, "per_document", DOCS[24], kernel=6, design="state_passing"),
              LayerCase(23, 2, 4, "zigzag", DOCS[23], design="state_passing")]
    return cases


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_state_passing_exact_float64(pools, ulysses, ring):
    """Output, the input's and every parameter's gradient equal the whole-sequence computation (float64);
    every rank sends the bytes of the closed form (two all-gathers forward, their reduce-scatters backward)."""
    p = ulysses * ring
    cases = _cases(p)
    per_rank = pools.run(p, layer_cases, ulysses, ring, cases, timeout=600)
    for rank, results in enumerate(per_rank):
        for case, r in zip(cases, results):
            errors = dict(r["errors"])
            a_log = errors.pop("A_log")
            assert max(errors.values()) <= FLOAT64_ATOL, (rank, r["case"], errors)
            assert a_log <= A_LOG_RTOL * r["A_log_scale"], (rank, r["case"], a_log, r["A_log_scale"])
            assert r["a2a_calls"] == 0 and r["gather_calls"] == (2, 2), (rank, r["case"], r)
            if case.documents is None:  # the runs of zigzag and contiguous follow from the mesh alone
                want = state_passing_bytes(case.key_heads, case.value_heads, case.key_dim, case.value_dim,
                                           batch=case.batch, ulysses=ulysses, ring=ring, layout=case.layout,
                                           kernel=case.kernel, dtype_bytes=8, state_bytes=8)
                assert max(r["gather_bytes"]["forward"] for r in (x[cases.index(case)] for x in per_rank)) == want, \
                    (r["case"], want)
                assert r["gather_bytes"]["backward"] == r["gather_bytes"]["forward"], r


def _model_cases() -> list[ModelCase]:
    return [
        ModelCase(23, "zigzag", design="state_passing"),  # padding
        ModelCase(24, "contiguous", DOCS[24], key_heads=1, value_heads=4, design="state_passing"),
        ModelCase(24, "per_document", DOCS[24], key_heads=1, value_heads=2, design="state_passing"),  # Hv < P on 4
        ModelCase(23, "zigzag", DOCS[23], key_heads=1, value_heads=2, design="auto"),  # auto: state passing if Hv < P
    ]


# the model-level bounds of test_linear_attention (measured noise of the one-process reference)
LOGITS_RTOL, GRAD_RTOL = 1e-6, 1e-5


@pytest.mark.parametrize("ulysses,ring", [(1, 4), (2, 2)], ids=["u1xr4", "u2xr2"])
def test_qwen3_5_by_state_passing_matches_one_process(pools, ulysses, ring):
    """A random Qwen3.5 through seqmesh.hf.parallelize(linear_attention="state_passing"): logits and every
    parameter's gradient equal the unmodified model on the whole sequence (each packed document alone), also
    with fewer value heads than ranks, which the all-to-all design refuses."""
    per_rank = pools.run(ulysses * ring, model_cases, ulysses, ring, _model_cases(), timeout=600)
    for rank, results in enumerate(per_rank):
        for r in results:
            errors = dict(r["errors"])
            assert errors.pop("logits") < LOGITS_RTOL, (rank, r["case"])
            worst = max(errors.items(), key=lambda kv: kv[1])
            assert worst[1] < GRAD_RTOL, (rank, r["case"], worst)
            assert len(errors) == r["params"] > 50


def test_choice_rule():
    """auto: the all-to-all when the state outweighs the sequence's channels (short sequences), state passing
    for long ones and whenever the ranks outnumber the value heads; an explicit all-to-all with too few heads
    is refused naming the fix; the bytes of both designs as the module docstring writes them."""
    from seqmesh.linear_attention.choice import LinearDesign, LinearShape, all_to_all_bytes, choose_design

    qwen = dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128, kernel=4, batch=1)
    short, long = (LinearShape(**qwen, seq_len=s, ulysses=1, ring=8) for s in (4096, 131072))
    assert choose_design(short) is LinearDesign.ALL_TO_ALL
    assert choose_design(long) is LinearDesign.STATE_PASSING
    assert choose_design(long, "all_to_all") is LinearDesign.ALL_TO_ALL
    few = LinearShape(**{**qwen, "value_heads": 4, "key_heads": 2}, seq_len=1024, ulysses=2, ring=4)
    assert choose_design(few) is LinearDesign.STATE_PASSING
    with pytest.raises(ValueError, match="4 value heads, fewer than the 8 ranks.*'state_passing'"):
        choose_design(few, "all_to_all")
    with pytest.raises(ValueError, match="unknown linear_attention design 'ring'"):
        choose_design(long, "ring")
    # Qwen3.5-9B at 128K on 8 ranks, bf16: 354 MB all-to-all (sequence_parallel.py's figure) vs two 4 MiB states
    assert all_to_all_bytes(long) == 131072 * 7 * (2 * 16 * 128 + 32 * (2 * 128 + 2)) * 2 // 64
    assert state_passing_bytes(16, 32, 128, 128, batch=1, ulysses=1, ring=8, layout="zigzag", kernel=4,
                               dtype_bytes=2) == 7 * (2 * 32 * 128 * 256 * 4 + 2 * 3 * (2 * 16 * 128 + 32 * 128) * 2)


def test_planner_costs_state_passing():
    """seqmesh plan on Qwen3.5-9B at 128K over 8 H100s (one NVLink node): auto takes state passing (the rule of
    the layers, given the node's link); a layer then sends the closed form's bytes in two all-gathers instead of
    the all-to-all's 354 MB (59 MB: every rank receives every run's [B | A]), and its communication time drops;
    the all-to-all stays what test_linear_attention checks."""
    from seqmesh.rules.degrees import Degrees
    from seqmesh.model.presets import MODELS
    from seqmesh.planner.hardware import PRESETS, make_cluster
    from seqmesh.planner.layers import GatedDeltaNet
    from seqmesh.planner.workload import Workload

    m = MODELS["qwen3.5-9b"]
    hw = make_cluster(PRESETS["h100-nvlink"], nodes=1).hardware
    layout = Degrees(1, 8, 1)
    auto, a2a = (GatedDeltaNet(Workload(m, 131072, **kw), layout) for kw in ({}, {"linear_attention": "all_to_all"}))
    assert auto.design(hw).value == "state_passing" and a2a.design(hw).value == "all_to_all"
    want = state_passing_bytes(16, 32, 128, 128, batch=1, ulysses=1, ring=8, layout="zigzag", kernel=4, dtype_bytes=2)
    assert auto.traffic()["forward"] == {"linear_state_gather": want}
    assert a2a.traffic()["forward"]["linear_all_to_all"] > 5 * want  # 354 MB against 59 MB
    fsdp = list(range(8))
    sp, base = auto.seconds(hw, fsdp), a2a.seconds(hw, fsdp)
    assert sp["serial"] < base["serial"] and sp["total"] < base["total"]
    assert sp["compute"] > base["compute"]  # the widened recurrence


def test_bench_linear_runs_both_designs():
    """seqmesh bench linear: both designs on every mesh of the world, side by side in one run, each checked
    against the one process, state passing's time as a ratio to the all-to-all's on the same mesh."""
    from seqmesh.bench.linear import LinearBench, bench_linear, format_linear_rows

    cfg = LinearBench(seq_len=256, key_heads=2, value_heads=4, key_dim=16, value_dim=16, world=2, repeats=1,
                      warmup=0)
    rows = bench_linear(cfg)
    assert [(r["method"], r["mesh"]) for r in rows] == [("one device", "1x1"), ("all to all", "2x1"),
                                                        ("state passing", "2x1"), ("all to all", "1x2"),
                                                        ("state passing", "1x2")]
    assert all(r["max_error"] < 1e-5 for r in rows[1:]), rows
    assert all(r["vs_all_to_all"] > 0 for r in rows if r["method"] == "state passing")
    assert "/ a2a" in format_linear_rows(cfg, rows)
