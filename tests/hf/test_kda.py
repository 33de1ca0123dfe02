"""Kimi Delta Attention (transformers' kimi_linear) sequence-parallel, by state passing and by the all-to-all: the
chunked rule against the recurrence one token at a time, the layer on a mesh against the whole sequence on one
process, and Kimi Linear through seqmesh.hf against the unmodified transformers model."""

from __future__ import annotations

import pytest
import torch

from family_cases import KeepFloat64, family_parity, share_references
from kda_cases import KdaCase, kda_layer_cases, token_loop_kda, without_document_resets
from seqmesh.linear_attention.kda import chunk_kda_states
from seqmesh.linear_attention.kda_all_to_all import kda_all_to_all_bytes
from seqmesh.linear_attention.kda_state_passing import KdaHeads, kda_state_passing_bytes

ROUNDING_MULTIPLE = 4  # as test_hf_families: the error may be this multiple of the reference's own rounding
FLOAT64_ATOL = 1e-12  # everything float64 (measured <= 3e-15 on the rule, <= 1e-14 relative on the layer)


def _rule_inputs(s: int, seed: int = 0, strong: bool = False):
    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv, dt = 2, 2, 6, 4, torch.float64
    q, k = (torch.randn(b, s, h, dk, generator=gen, dtype=dt) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen, dtype=dt)
    # log decays per channel: some near 0 (long memory), strong ones (-60 a token) where exp(-G) would overflow
    g = -torch.rand(b, s, h, dk, generator=gen, dtype=dt).pow(3) * (60 if strong else 2)
    beta = torch.rand(b, s, h, generator=gen, dtype=dt)
    return [q, k, v, g, beta]


@pytest.mark.parametrize("strong", [False, True], ids=["decay", "strong-decay"])
def test_chunked_rule_matches_the_token_loop(strong):
    """chunk_kda_states (chunks of 64 split into sub-chunks of 16, and 8 / 4) equals the recurrence one token at a
    time in float64: outputs, every segment's final state from its initial state, and the gradients of every input;
    documents of 1 token, documents across chunks. A state that runs through a document start is off by far more."""
    s, starts = 150, (0, 1, 40, 41, 100)
    leaves = _rule_inputs(s, strong=strong)
    initial = torch.randn(2, len(starts), 2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for t in leaves + [initial]:
        t.requires_grad_(True)
    want, want_final = token_loop_kda(*leaves, starts, initial)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * dout).sum() + want_final.sum(), leaves + [initial])
    for chunk, sub in ((64, 16), (8, 4), (16, 16)):
        out, final = chunk_kda_states(*leaves, starts + (s,), initial, chunk=chunk, sub=sub)
        grads = torch.autograd.grad((out * dout).sum() + final.sum(), leaves + [initial])
        assert out.dtype == final.dtype == torch.float64
        assert float((out - want).detach().abs().max()) < FLOAT64_ATOL, (chunk, sub)
        assert float((final - want_final).detach().abs().max()) < FLOAT64_ATOL, (chunk, sub)
        for name, a, b in zip("qkvgb", grads, want_grads):
            assert float((a - b).abs().max() / b.abs().max()) < FLOAT64_ATOL, (name, chunk, sub)
    through, _ = token_loop_kda(*leaves, starts, initial, reset=False)
    assert float((through - want).detach().abs().max()) > 1e-2  # the mutation: documents not separated


def test_chunked_rule_matches_transformers_fallback():
    """On one document from zero, the rule equals transformers' own torch KDA (chunk_kimi_delta_attention, run in
    float64 through KeepFloat64: it casts to float32 itself)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, g, beta = _rule_inputs(100, seed=1)
    with KeepFloat64():
        want, _ = kimi.chunk_kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    out, _ = chunk_kda_states(q, k, v, g, beta, (0, 100))
    assert want.dtype == torch.float64
    assert float((out - want).abs().max()) < FLOAT64_ATOL


DOCS = {24: (0, 1, 2, 9, 10, 20, 24), 23: (0, 1, 7, 8, 22, 23)}  # documents shorter than the conv's halo
MESHES = [(1, 2), (2, 1), (2, 2)]


def _layer_cases(p: int) -> list[KdaCase]:
    cases = [KdaCase(24, layout, DOCS[24] if docs else None)
             for layout in ("zigzag", "contiguous", "per_document") for docs in (False, True)
             if docs or layout != "per_document"]
    return cases + [KdaCase(24, "per_document", DOCS[24], kernel=6), KdaCase(23, "zigzag", DOCS[23])]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_kda_state_passing_exact_float64(pools, ulysses, ring):
    """The layer's conv and recurrence by state passing on the mesh equal the whole sequence on one process
    (a conv per document, the token loop): output and the gradients of q | k | v, the conv weight, g and beta;
    two all-gathers forward, their reduce-scatters backward, of the closed form's bytes."""
    cases = _layer_cases(ulysses * ring)
    per_rank = pools.run(ulysses * ring, kda_layer_cases, ulysses, ring, cases, timeout=600)
    for rank, results in enumerate(per_rank):
        for case, r in zip(cases, results):
            assert max(r["errors"].values()) < FLOAT64_ATOL, (rank, r)
            assert r["gather_calls"] == (2, 2), (rank, r)
    worst = max(max(r["errors"].values()) for results in per_rank for r in results)
    print(f"state passing u{ulysses}xr{ring}: worst error {worst:.1e}")
    for case in cases:
        if case.documents is None:  # the runs of zigzag and contiguous follow from the mesh alone
            want = kda_state_passing_bytes(KdaHeads(case.heads, case.key_dim, case.value_dim), batch=case.batch,
                                           ulysses=ulysses, ring=ring, layout=case.layout, kernel=case.kernel,
                                           dtype_bytes=8, state_bytes=8)
            assert max(results[cases.index(case)]["gather_bytes"] for results in per_rank) == want, case


def _all_to_all_cases(p: int) -> list[KdaCase]:
    cases = [KdaCase(24, layout, DOCS[24] if docs else None, heads=4, design="all_to_all")
             for layout in ("zigzag", "contiguous", "per_document") for docs in (False, True)
             if docs or layout != "per_document"]
    cases.append(KdaCase(23, "zigzag", DOCS[23], heads=4, design="all_to_all"))
    return cases + ([KdaCase(24, "zigzag", DOCS[24], heads=3, design="all_to_all")] if p <= 3 else [])  # uneven


# ring 2 alone: the all-to-all runs over the whole sequence group, and Ulysses 2 and U2 x R2 reached no line it does
# not (docs/testing.md)
@pytest.mark.parametrize("ulysses,ring", [(1, 2)], ids=["u1xr2"])
def test_kda_all_to_all_exact_float64(pools, ulysses, ring):
    """The all-to-all by heads on the mesh equals the whole sequence on one process (as the state passing test),
    also with heads that do not split evenly; three all-to-alls forward (q | k | v | beta, g, the output) and their
    adjoints backward, no all-gather, of the closed form's bytes."""
    p = ulysses * ring
    cases = _all_to_all_cases(p)
    per_rank = pools.run(p, kda_layer_cases, ulysses, ring, cases, timeout=600)
    for rank, results in enumerate(per_rank):
        for case, r in zip(cases, results):
            assert max(r["errors"].values()) < FLOAT64_ATOL, (rank, r)
            assert r["a2a_calls"] == (3, 3) and r["gather_calls"] == (0, 0), (rank, r)
            if case.heads % p == 0 and case.seq_len % p == 0:
                want = kda_all_to_all_bytes(KdaHeads(case.heads, case.key_dim, case.value_dim), batch=case.batch,
                                            seq_len=case.seq_len, ranks=p, dtype_bytes=8, g_bytes=8)
                assert r["a2a_bytes"] == {"forward": want, "backward": want}, (rank, r, want)
    worst = max(max(r["errors"].values()) for results in per_rank for r in results)
    print(f"all-to-all u{ulysses}xr{ring}: worst error {worst:.1e}")


def test_a_state_not_passed_is_seen(pools):
    """The mutation: every run starts from zero (no state passed between ranks); the layer test's bound sees it."""
    cases = [KdaCase(24, "zigzag"), KdaCase(24, "contiguous", DOCS[24])]
    for results in pools.run(2, kda_layer_cases, 1, 2, cases, mutation="no_pass"):
        for r in results:
            assert r["errors"]["out"] > 1e4 * FLOAT64_ATOL, r
    print(f"a state not passed: output off by {r['errors']['out']:.1e} (output scale {r['scale']:.1e})")


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    share_references(cases, kwargs.get("seq_len", 45))
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def _run_designs(cases: list[tuple], designs: tuple[str, ...]) -> list[dict]:
    """Each family_parity case once per KDA design."""
    share_references(cases)
    return [{"case": (*c, design), **family_parity(*c, design=design)} for c in cases for design in designs]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_kimi_linear_exact(pools, ulysses, ring):
    """Kimi Linear (two KDA layers around an MLA layer, MoE) through seqmesh.hf, KDA by state passing and by the
    all-to-all: logits, loss and every parameter's gradient within ROUNDING_MULTIPLE of the reference's own rounding
    (transformers' KDA computes in float32), zigzag on one sequence and on packed documents."""
    cases = [("kimi_linear", ulysses, ring, "zigzag", docs) for docs in (False, True)]
    for results in pools.run(ulysses * ring, _run_designs, cases, ("state_passing", "all_to_all"), timeout=600):
        for r in results:
            assert not _outside_rounding(r), r
    print(f"u{ulysses}xr{ring} error / reference rounding (docs, design, logits, grad):",
          [(*r["case"][4:], r["logits"] / r["rounding"]["logits"], r["grad"] / r["rounding"]["grad"]) for r in results])


def test_tolerance_sees_kda_without_document_resets(pools):
    """The mutation at the model: the KDA layers run through the packed documents' starts."""
    for results in pools.run(2, _run_all, [("kimi_linear", 1, 2, "zigzag", True)], alter=without_document_resets):
        for r in results:
            assert _outside_rounding(r), r
    print("without document resets, error / reference rounding (logits, grad):",
          r["logits"] / r["rounding"]["logits"], r["grad"] / r["rounding"]["grad"])


def test_design_rule():
    """auto: the all-to-all for short sequences, state passing for long ones and whenever the ranks outnumber the
    heads; an explicit all-to-all with too few heads is refused naming the fix. Kimi-Linear-48B's KDA (32 heads of
    128, conv 4) at 128K on 8 ranks (ring), bf16 with a float32 gate: the all-to-all sends 706 MB a layer and rank,
    state passing 60 MB."""
    import types

    from seqmesh.linear_attention.choice import LinearDesign
    from seqmesh.linear_attention.kda_all_to_all import choose_kda_design

    kimi = KdaHeads(32, 128, 128)
    mesh = types.SimpleNamespace(sp_size=8, ulysses=1, ring=8)
    shape = dict(batch=1, layout="zigzag", kernel=4, dtype_bytes=2)
    assert choose_kda_design(kimi, mesh, "auto", seq_len=131072, **shape) is LinearDesign.STATE_PASSING
    assert choose_kda_design(kimi, mesh, "auto", seq_len=2048, **shape) is LinearDesign.ALL_TO_ALL
    assert choose_kda_design(kimi, mesh, "all_to_all", seq_len=131072, **shape) is LinearDesign.ALL_TO_ALL
    few = KdaHeads(4, 128, 128)
    assert choose_kda_design(few, mesh, "auto", seq_len=2048, **shape) is LinearDesign.STATE_PASSING
    with pytest.raises(ValueError, match="4 heads, fewer than the 8 ranks.*'state_passing'"):
        choose_kda_design(few, mesh, "all_to_all", seq_len=2048, **shape)
    a2a = kda_all_to_all_bytes(kimi, batch=1, seq_len=131072, ranks=8, dtype_bytes=2)
    passing = kda_state_passing_bytes(kimi, batch=1, ulysses=1, ring=8, layout="zigzag", kernel=4, dtype_bytes=2)
    assert a2a == 131072 * 7 * 32 * ((2 * 128 + 2 * 128 + 1) * 2 + 128 * 4) // 64
    assert passing == 7 * (2 * 32 * 128 * 256 * 4 + 2 * 3 * 3 * 32 * 128 * 2)
    print(f"Kimi-Linear-48B KDA, 128K on U1xR8, bf16: all-to-all {a2a / 1e6:.0f} MB, "
          f"state passing {passing / 1e6:.1f} MB")


@pytest.mark.parametrize("ulysses,ring", [(1, 2)], ids=["u1xr2"])  # U2 x R2 reached no other line (docs/testing.md)
def test_bailing_hybrid_layer_exact_float64(pools, ulysses, ring):
    """Bailing hybrid's KDA layer (its own gate: a sigmoid bounded below, one output-gate projection) through seqmesh
    on the mesh, both designs, equals transformers' forward of the layer on each document in float64: output, input
    and every parameter's gradient. (No family_parity: its reference measures float32 rounding with KeepFloat64,
    which cannot run the model's float32 conv in float64.)"""
    from kda_cases import bailing_layer_cases

    cases = [(layout, docs, design) for layout, docs in (("zigzag", None), ("contiguous", DOCS[24]))
             for design in ("state_passing", "all_to_all")]
    per_rank = pools.run(ulysses * ring, bailing_layer_cases, ulysses, ring, cases, timeout=600)
    for rank, results in enumerate(per_rank):
        for r in results:
            assert len(r["errors"]) > 8 and max(r["errors"].values()) < FLOAT64_ATOL, (rank, r)
    worst = max(max(r["errors"].values()) for results in per_rank for r in results)
    print(f"bailing hybrid layer u{ulysses}xr{ring}: worst relative error {worst:.1e}")


def test_kda_layer_refusals(pools):
    """parallelize installs a forward on each KDA layer of Kimi Linear (two), which refuses a call without the
    seqmesh entry, with a cache or with a padding mask, naming the way out; unparallelize removes both."""
    from kda_cases import kda_refusals

    (r,) = pools.run(1, kda_refusals)
    assert r["installed"] == 2 and r["left"] == 0, r
    assert "without the 'seqmesh' entry" in r["no_entry"] and "shard_batch" in r["no_entry"], r
    assert "keeps no cache" in r["cache"] and "unparallelize" in r["cache"], r
    assert "padding mask" in r["mask"] and "position_ids" in r["mask"], r
