"""Mamba's selective scan (seqmesh.linear_attention.selective_scan) against a token-by-token loop, float64."""

from __future__ import annotations

import pytest
import torch

from seqmesh.linear_attention.selective_scan import selective_scan


def loop_scan(x, dt, A, B, C, bounds, initial=None):
    """The recurrence as written, one token at a time: h = exp(dt A) h + dt B x, y = C . h, zero (or
    ``initial``) at each segment start. (B, L, C) -> (B, L, C), finals (B, S, C, N)."""
    ys, finals = [], []
    for s, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        h = torch.zeros(x.shape[0], A.shape[0], A.shape[1], dtype=x.dtype) if initial is None else initial[:, s]
        for t in range(a, e):
            h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
            ys.append((h * C[:, t, None, :]).sum(-1))
        finals.append(h)
    return torch.stack(ys, 1), torch.stack(finals, 1)


def _inputs(length: int, channels: int = 3, states: int = 4, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, channels, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(batch, length, channels, generator=g, dtype=torch.float64))
    A = -torch.exp(torch.randn(channels, states, generator=g, dtype=torch.float64))
    B = torch.randn(batch, length, states, generator=g, dtype=torch.float64)
    C = torch.randn(batch, length, states, generator=g, dtype=torch.float64)
    return x, dt, A, B, C


@pytest.mark.parametrize("length,bounds,chunk", [
    (7, (0, 7), 4),                 # one segment, a partial last chunk
    (24, (0, 5, 8, 9, 24), 4),      # segment starts inside chunks, one at a chunk start (8), a one-token segment
    (40, (0, 13, 40), 8),
])
def test_selective_scan_matches_loop(length, bounds, chunk):
    x, dt, A, B, C = _inputs(length)
    initial = torch.randn(2, len(bounds) - 1, 3, 4, dtype=torch.float64)
    for init in (None, initial):
        y, finals = selective_scan(x, dt, A, B, C, bounds, init, chunk=chunk)
        y_ref, finals_ref = loop_scan(x, dt, A, B, C, bounds, init)
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(finals, finals_ref, rtol=1e-12, atol=1e-12)


def test_selective_scan_gradients_match_loop():
    x, dt, A, B, C = _inputs(18)
    bounds = (0, 6, 18)
    inputs = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
    ref = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
    weight = torch.randn(2, 18, 3, dtype=torch.float64)
    (selective_scan(*inputs, bounds, chunk=4)[0] * weight).sum().backward()
    (loop_scan(*ref, bounds)[0] * weight).sum().backward()
    for mine, theirs in zip(inputs, ref):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-11, atol=1e-11)


def test_a_state_carried_over_a_document_start_is_caught():
    """The mutation the tests must catch: the scan run with one segment where there are two (the state not reset
    at the second document's start) differs from the loop that resets it."""
    x, dt, A, B, C = _inputs(12)
    y_ref, _ = loop_scan(x, dt, A, B, C, (0, 5, 12))
    y_unreset, _ = selective_scan(x, dt, A, B, C, (0, 12), chunk=4)
    assert not torch.allclose(y_unreset, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_unreset[:, :5], y_ref[:, :5])  # the first document alone agrees
