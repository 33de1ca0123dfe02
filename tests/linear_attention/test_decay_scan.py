"""The scalar-decay rule (Mamba2's SSD, MiniMax's lightning attention) against the recurrence one token at a time."""

from __future__ import annotations

import pytest
import torch

from linear_cases import token_loop_decay as token_loop
from seqmesh.linear_attention.decay_scan import chunk_decay_scan

FLOAT64_ATOL = 1e-10


@pytest.mark.parametrize("chunk", [64, 16, 8])
@pytest.mark.parametrize("s,starts", [(150, (0, 1, 40, 41, 100)), (128, (0, 64))], ids=["padded", "aligned"])
def test_chunked_rule_matches_the_token_loop(chunk, s, starts):
    """Outputs, every segment's final state from its initial one, and the gradients of q, k, v, g and the initial
    states, in float64: documents of one token, documents across chunks, a padded last chunk; and documents that fill
    whole chunks (nothing padded, the input's own strided copy)."""
    gen = torch.Generator().manual_seed(0)
    dt = torch.float64
    q, k = (torch.randn(2, s, 3, 6, generator=gen, dtype=dt) for _ in range(2))
    v = torch.randn(2, s, 3, 4, generator=gen, dtype=dt)
    g = -torch.rand(2, s, 3, generator=gen, dtype=dt) * 2
    initial = torch.randn(2, len(starts), 3, 6, 4, generator=gen, dtype=dt)
    leaves = [q, k, v, g, initial]
    for t in leaves:
        t.requires_grad_(True)
    want, want_final = token_loop(q, k, v, g, list(starts), initial)
    dout, dfinal = torch.randn_like(want), torch.randn_like(want_final)
    want_grads = torch.autograd.grad((want * dout).sum() + (want_final * dfinal).sum(), leaves)
    out, final = chunk_decay_scan(q, k, v, g, starts + (s,), initial, chunk=chunk)
    grads = torch.autograd.grad((out * dout).sum() + (final * dfinal).sum(), leaves)
    assert float((out - want).detach().abs().max()) < FLOAT64_ATOL
    assert float((final - want_final).detach().abs().max()) < FLOAT64_ATOL
    for name, a, b in zip(("q", "k", "v", "g", "initial"), grads, want_grads):
        assert float((a - b).abs().max() / b.abs().max()) < FLOAT64_ATOL, name
    through, _ = token_loop(q, k, v, g, list(starts), initial, reset=False)
    assert float((through - want).detach().abs().max()) > 1e-2  # the mutation: documents not separated


def test_half_precision_runs_in_float32_from_zero():
    """bf16 inputs, one document from zero: the output within bf16's rounding of the float64 loop, the final state in
    float32."""
    gen = torch.Generator().manual_seed(1)
    s = 96
    q, k = (torch.randn(1, s, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, s, 2, 4, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, s, 2, generator=gen, dtype=torch.float64)
    want, _ = token_loop(q, k, v, g, [0], torch.zeros(1, 1, 2, 8, 4, dtype=torch.float64))
    rounded = [x.to(torch.bfloat16) for x in (q, k, v, g)]
    out, final = chunk_decay_scan(*rounded, (0, s), chunk=32)
    exact, _ = token_loop(*[x.double() for x in rounded], [0], torch.zeros(1, 1, 2, 8, 4, dtype=torch.float64))
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    own_rounding = float((exact.to(torch.bfloat16).double() - exact).abs().max())
    assert float((out.double() - exact).abs().max()) <= 4 * own_rounding
    assert float((exact - want).abs().max()) > 0  # the inputs' own rounding is what the rule is measured after


@pytest.mark.parametrize("rule", ["decay_scan", "gated_delta", "kda"])
def test_the_rules_run_in_their_own_dtype_under_a_callers_autocast(rule):
    """``seqmesh train --bf16`` without FSDP2 and transformers' Trainer in bf16 call the rules under autocast: each
    gives, outputs and gradients, what it gives outside autocast, bit for bit (autocast ran the delta rule's products
    in bf16 beside its float32 state, and its autograd function refused the mixed dtypes)."""
    from seqmesh.linear_attention.gated_delta import chunk_gated_delta_rule_states
    from seqmesh.linear_attention.kda import chunk_kda_states

    gen = torch.Generator().manual_seed(0)
    s, h, d = 150, 2, 16
    q, k, v = (torch.randn(1, s, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(1, s, h, d if rule == "kda" else 1, generator=gen) * 0.2
    g = g if rule == "kda" else g[..., 0]
    beta = torch.rand(1, s, h, generator=gen)
    initial = torch.randn(1, 2, h, d, d, generator=gen)
    bounds = (0, 70, s)
    run = {"decay_scan": lambda x: chunk_decay_scan(*x[:4], bounds, x[5]),
           "gated_delta": lambda x: chunk_gated_delta_rule_states(x[0], x[1], x[2], x[3], x[4], bounds, x[5]),
           "kda": lambda x: chunk_kda_states(x[0], x[1], x[2], x[3], x[4], bounds, x[5])}[rule]

    def results(autocast: bool) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, initial)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, finals = run(leaves)
        (out.square().sum() + finals.square().sum()).backward()
        return [out, finals] + [x.grad for x in leaves if x.grad is not None]

    plain, under = results(False), results(True)
    assert len(plain) == len(under) >= 6
    for a, b in zip(plain, under):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
