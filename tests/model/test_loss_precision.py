"""The chunked LM-head loss under bf16 autocast is as accurate as autocast's own linear + cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqmesh.model.loss import chunked_linear_cross_entropy


def test_chunked_loss_under_autocast_matches_plain_autocast_accuracy():
    """Forward and the backward's recomputation must use the same (autocast) matmul dtype; when the
    backward recomputed in float32 against a bf16 log-sum-exp, gradients were ~4x further off."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 256, 64, generator=g, dtype=torch.float64)
    weight = torch.randn(300, 64, generator=g, dtype=torch.float64)  # sharp logits, as a trained head has
    labels = torch.randint(0, 300, (1, 256), generator=g)
    labels[0, ::7] = -100
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    F.cross_entropy(h_ref[0] @ w_ref.t(), labels[0], ignore_index=-100).backward()

    def errors(loss_fn) -> tuple[float, float]:
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(h, w)
        loss.backward()
        return float((h.grad.double() - h_ref.grad).abs().max()), float((w.grad.double() - w_ref.grad).abs().max())

    plain = errors(lambda h, w: F.cross_entropy(F.linear(h[0], w).float(), labels[0], ignore_index=-100))
    chunked = errors(lambda h, w: chunked_linear_cross_entropy(h, w, labels, None, chunk=64))
    assert chunked[0] <= 1.5 * plain[0] and chunked[1] <= 1.5 * plain[1], (chunked, plain)
