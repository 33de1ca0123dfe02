"""The torch form DeepSeek Sparse Attention's layers run on a CPU (seqmesh.kernels.sparse_latent_blocks: one autograd
op over blocks of queries, its backward recomputing each block's scores from a saved log-sum-exp), against plain
PyTorch autograd on the whole row in float64: every query scored against every key, the unselected masked out, with
MLA's key and value projections around it. Its output and the gradients of every input are held within a multiple of
float32's own rounding of that reference, measured in the same run; a gather one key off, and a backward that takes
another block's log-sum-exp, are seen."""

from __future__ import annotations

import pytest
import torch

from seqmesh.kernels import sparse_latent_blocks as blocks
from sparse_latent_cases import dense_reference

ROUNDING_MULTIPLE = 4
SCALE = 0.3
FLOOR = 2.0**-23  # a few float32 ulps: a reference draw that lands on the float64 value by chance bounds nothing


def dense_mla(q_nope, q_rot, row, picks, sinks, w_key, w_value):
    """The op written out: (B, L, H, Dn) through w_key (H, Dn, R) beside q_rot; every row key scored, the picks kept
    (sparse_latent_cases.dense_reference); the kept latents summed, then through w_value (H, Dv, R)."""
    nope = q_nope if w_key is None else torch.einsum("blhn,hnr->blhr", q_nope, w_key)
    attended = dense_reference(torch.cat([nope, q_rot], dim=-1), row, picks, SCALE, nope.shape[-1], sinks)
    return attended if w_value is None else torch.einsum("blhr,hvr->blhv", attended, w_value)


def _inputs(absorbed: bool, with_sinks: bool, seed: int = 0):
    """2 rows of 40 tokens, 7 queries of 3 heads; a latent of 20, rotated keys of 6, no-RoPE queries of 5 and values
    of 4 (MLA's projections) or none; 17 picks of distinct rows, some hidden."""
    g = torch.Generator().manual_seed(seed)
    b, length, heads, t, rank, rot, k = 2, 7, 3, 40, 20, 6, 17

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q_nope = rand(b, length, heads, 5 if absorbed else rank)
    w_key, w_value = (rand(heads, 5, rank), rand(heads, 4, rank)) if absorbed else (None, None)
    picks = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(b * length)]).view(b, length, k)
    picks = picks.masked_fill(torch.rand(b, length, k, generator=g) < 0.2, -1)
    sinks = rand(heads) if with_sinks else None
    return dict(q_nope=q_nope, q_rot=rand(b, length, heads, rot), row=rand(b, t, rank + rot), picks=picks,
                sinks=sinks, w_key=w_key, w_value=w_value)


def _value_and_grads(fn, inputs: dict, dtype) -> list[torch.Tensor]:
    leaves = {name: x.detach().to(dtype).requires_grad_() for name, x in inputs.items()
              if x is not None and name != "picks"}
    out = fn(**{**inputs, **leaves})
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    (out.double() * weights).sum().backward()
    return [out.detach().double()] + [leaves[name].grad.double() for name in sorted(leaves)]


def blocks_of(step: int):
    def run(q_nope, q_rot, row, picks, sinks, w_key, w_value):
        return blocks.SparseLatentBlocks.apply(q_nope, q_rot, w_key, w_value, row, picks, sinks, SCALE, step)
    return run


def _errors(got, want):
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


def _within(errors, rounding) -> bool:
    # the noise level of the whole computation, its largest output's or gradient's float32 rounding: one gradient's own
    # draw can land near the float64 value (q_rot's 2.8e-7 where the blocks' sums gave 1.3e-6, 11 ulps, on this
    # machine's torch 2.13, which passed on an earlier one), so it bounds nothing alone
    noise = max(max(rounding), FLOOR)
    return all(e <= ROUNDING_MULTIPLE * noise for e in errors)


@pytest.mark.parametrize("absorbed,with_sinks,step,projected", [(True, False, 2, 256), (True, True, 3, 256),
                                                                (False, True, 7, 256), (False, False, 1, 256),
                                                                (True, True, 2, 3), (False, False, 2, 5)])
def test_blocks_match_dense_pytorch_within_float32_rounding(absorbed, with_sinks, step, projected, monkeypatch):
    """Blocks of 1, 2, 3 and all 7 queries, the projections on all of them at once or on 3 or 5 (blocks of 2 inside
    them, the last cut short); with MLA's projections (their weights' gradients summed over blocks) and without
    (DeepSeek-V4's layout, which has the sinks)."""
    monkeypatch.setattr(blocks, "PROJECTED_QUERIES", projected)
    inputs = _inputs(absorbed, with_sinks)
    exact = _value_and_grads(dense_mla, inputs, torch.float64)
    rounding = _errors(_value_and_grads(dense_mla, inputs, torch.float32), exact)
    errors = _errors(_value_and_grads(blocks_of(step), inputs, torch.float32), exact)
    assert len(errors) == 4 + 2 * absorbed + with_sinks  # the output, q_nope, q_rot, row[, w_key, w_value][, sinks]
    assert _within(errors, rounding), (errors, rounding)
    assert max(rounding) < 1e-5  # the bound could not hide a wrong key (a relative error ~1e-1)
    wide = _errors(_value_and_grads(blocks_of(step), inputs, torch.float64), exact)  # float64 stays float64
    assert max(wide) < 1e-12, wide


def test_a_gather_one_key_off_is_seen():
    inputs = _inputs(True, True)
    exact = _value_and_grads(dense_mla, inputs, torch.float64)
    rounding = _errors(_value_and_grads(dense_mla, inputs, torch.float32), exact)
    shifted = {**inputs, "picks": torch.where(inputs["picks"] >= 0, (inputs["picks"] + 1) % 40, -1)}
    errors = _errors(_value_and_grads(blocks_of(2), shifted, torch.float32), exact)
    assert all(e > 100 * ROUNDING_MULTIPLE * r for e, r in zip(errors, rounding)), (errors, rounding)


def test_a_backward_on_another_blocks_log_sum_exp_is_seen(monkeypatch):
    """The mutation: each block's backward recomputes its probabilities from the next block's log-sum-exp."""
    inputs = _inputs(True, False)
    exact = _value_and_grads(dense_mla, inputs, torch.float64)
    rounding = _errors(_value_and_grads(dense_mla, inputs, torch.float32), exact)
    original = blocks._probabilities

    def shifted(query, chosen, hidden, scale, sinks, lse):
        return original(query, chosen, hidden, scale, sinks, None if lse is None else lse.roll(1, dims=1))

    monkeypatch.setattr(blocks, "_probabilities", shifted)
    errors = _errors(_value_and_grads(blocks_of(2), inputs, torch.float32), exact)
    assert _within(errors[:1], rounding[:1])  # the forward is untouched
    assert all(e > 100 * ROUNDING_MULTIPLE * r for e, r in zip(errors[1:], rounding[1:])), (errors, rounding)


def test_cpu_blocks_fit_the_cache_and_a_gpu_takes_its_budget():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert blocks.block_queries(1, 512, 192, cpu, 1 << 28) == blocks.CPU_BLOCK_ELEMENTS // (512 * 192)
    assert blocks.block_queries(1, 512, 192, gpu, 1 << 28) == (1 << 28) // (512 * 192)
    assert blocks.block_queries(4, 4096, 4096, cpu, 1 << 28) == 1
