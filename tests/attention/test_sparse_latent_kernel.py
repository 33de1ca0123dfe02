"""The Triton kernel of DeepSeek Sparse Attention's latent attention (seqmesh.kernels.sparse_latent_triton), run on
this CPU by Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU; on a GPU, compiled), against plain PyTorch on the whole row: dense scores of every query against every
key, the unselected masked, in float64. Its output and the gradients of query, row and sinks are held within a
multiple of float32's own rounding of that reference, measured in the same run; a gather one key off is seen. The
layer on the kernel is held to transformers' model in tests/hf/test_indexed_attention.py."""

from __future__ import annotations

import pytest
import torch

from sparse_latent_cases import dense_reference

pytest.importorskip("triton")

ROUNDING_MULTIPLE = 4


def _inputs(heads: int, with_sinks: bool, seed: int = 0):
    """2 rows of 40 tokens, 5 queries each, latents of 20 and rotated keys of 6 (neither a power of two), 37 picks (two
    blocks of the kernel's 32, the second partial) of distinct rows, some hidden: a query's whole first block hidden,
    so its running maximum starts at -inf."""
    g = torch.Generator().manual_seed(seed)
    b, length, t, rank, rot, k = 2, 5, 40, 20, 6, 37
    query = torch.randn(b, length, heads, rank + rot, generator=g, dtype=torch.float64)
    row = torch.randn(b, t, rank + rot, generator=g, dtype=torch.float64)
    picks = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(b * length)]).view(b, length, k)
    hidden = torch.rand(b, length, k, generator=g) < 0.2
    hidden[0, 1, :32] = True
    picks = picks.masked_fill(hidden, -1)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64) if with_sinks else None
    return query, row, picks, sinks


def _value_and_grads(fn, query, row, picks, sinks, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (query, row) + ((sinks,) if sinks is not None else ())]
    out = fn(leaves[0], leaves[1], picks, 0.3, 20, leaves[2] if sinks is not None else None)
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    (out.double() * weights).sum().backward()
    return [out.detach().double()] + [x.grad.double() for x in leaves]


def _errors(got, want):
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(query, row, picks, scale, rank, sinks=None):
    """The kernel's autograd op on :data:`DEVICE`, its results back on the CPU."""
    from seqmesh.kernels.sparse_latent import SparseLatentTriton

    moved = [x.to(DEVICE) if x is not None else None for x in (query, row, picks, sinks)]
    return SparseLatentTriton.apply(moved[0], moved[1], moved[2], moved[3], scale, rank).cpu()


@pytest.mark.parametrize("heads,with_sinks", [(3, False), (18, True)], ids=["3-heads", "18-heads-sinks"])
def test_kernel_matches_dense_pytorch_within_float32_rounding(heads, with_sinks):
    """3 heads (one block of 16, padded) and 18 (two blocks adding into the same rows' gradients)."""
    inputs = _inputs(heads, with_sinks)
    exact = _value_and_grads(dense_reference, *inputs, torch.float64)
    rounding = _errors(_value_and_grads(dense_reference, *inputs, torch.float32), exact)
    errors = _errors(_value_and_grads(kernel, *inputs, torch.float32), exact)
    print(f"{heads} heads: kernel {errors}, float32 rounding {rounding}")
    assert all(e <= ROUNDING_MULTIPLE * r for e, r in zip(errors, rounding)), (errors, rounding)
    assert max(rounding) < 1e-5  # the bound could not hide a wrong key (a relative error ~1e-1)


def test_the_torch_form_matches_dense_pytorch():
    """The CPU's form, which the kernel replaces on a GPU, held to the same reference."""
    from seqmesh.kernels.sparse_latent import sparse_latent_reference

    inputs = _inputs(18, True)
    exact = _value_and_grads(dense_reference, *inputs, torch.float64)
    rounding = _errors(_value_and_grads(dense_reference, *inputs, torch.float32), exact)
    errors = _errors(_value_and_grads(sparse_latent_reference, *inputs, torch.float32), exact)
    assert all(e <= ROUNDING_MULTIPLE * r for e, r in zip(errors, rounding)), (errors, rounding)


def test_a_gather_one_key_off_is_seen():
    """The mutation: the kernel gathers the row after each pick's."""
    query, row, picks, sinks = _inputs(3, False)
    shifted = torch.where(picks >= 0, (picks + 1) % row.shape[1], picks)
    exact = _value_and_grads(dense_reference, query, row, picks, sinks, torch.float64)
    rounding = _errors(_value_and_grads(dense_reference, query, row, picks, sinks, torch.float32), exact)
    errors = _errors(_value_and_grads(kernel, query, row, shifted, sinks, torch.float32), exact)
    assert all(e > 100 * ROUNDING_MULTIPLE * r for e, r in zip(errors, rounding)), (errors, rounding)


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter (3.9) multiplies bfloat16 operands wrongly (a "
                    "tl.dot of two bf16 tiles is off by 1e10); on a GPU the kernel's probe holds bf16 too")
def test_bf16_within_the_torch_forms_own_bf16_error():
    """In bfloat16 (the GPU's training dtype) the kernel keeps its products and softmax in float32, so it is no
    further from the float64 reference than the torch form in bfloat16."""
    from seqmesh.kernels.sparse_latent import sparse_latent_reference

    inputs = _inputs(18, True)
    exact = _value_and_grads(dense_reference, *inputs, torch.float64)
    torch_form = _errors(_value_and_grads(sparse_latent_reference, *inputs, torch.bfloat16), exact)
    errors = _errors(_value_and_grads(kernel, *inputs, torch.bfloat16), exact)
    print(f"bf16: kernel {errors}, torch form {torch_form}")
    assert all(e <= 2 * t for e, t in zip(errors, torch_form)), (errors, torch_form)


def dense_index_scores(q, keys, weights, scale, limit):
    """``sum_h w_h relu(scale q_h . k_t)`` for every query and key, -inf at and past each query's limit."""
    scores = (weights[..., None] * torch.relu(torch.einsum("blhd,btd->blht", q, keys) * scale)).sum(2)
    return scores.masked_fill(torch.arange(keys.shape[1]) >= limit[:, None], float("-inf"))


def _index_inputs(seed: int = 0):
    """2 rows of 90 keys (a tile of 64 and a partial one), 37 queries (a tile of 32 and a partial one) of 5 heads of
    24; limits from 1 to 90, the first 32 queries' all under 64 (their second key tile skipped)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 37, 5, 24, generator=g, dtype=torch.float64)
    keys = torch.randn(2, 90, 24, generator=g, dtype=torch.float64)
    weights = torch.randn(2, 37, 5, generator=g, dtype=torch.float64)
    limit = torch.cat([torch.randint(1, 64, (32,), generator=g), torch.tensor([1, 90, 64, 65, 70])])
    return q, keys, weights, 0.7, limit


def _index_kernel(q, keys, weights, scale, limit):
    from seqmesh.kernels.sparse_latent import index_scores_kernel

    return index_scores_kernel(q.to(DEVICE), keys.to(DEVICE), weights.to(DEVICE), scale, limit.to(DEVICE)).cpu()


def _index_error(got, want) -> float:
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    return float((got.double() - want)[finite].abs().max() / want[finite].abs().max())


def test_index_kernel_matches_dense_pytorch_within_float32_rounding():
    q, keys, weights, scale, limit = _index_inputs()
    exact = dense_index_scores(q, keys, weights, scale, limit)
    rounding = _index_error(dense_index_scores(q.float(), keys.float(), weights.float(), scale, limit), exact)
    error = _index_error(_index_kernel(q.float(), keys.float(), weights.float(), scale, limit), exact)
    print(f"indexer: kernel {error:.3g}, float32 rounding {rounding:.3g}")
    assert error <= ROUNDING_MULTIPLE * rounding and rounding < 1e-5, (error, rounding)


NARROW = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter (3.9) multiplies bfloat16 operands wrongly (a tl.dot of two bf16 "
    "tiles is off by 1e10); fp16 runs the same code here, and on a GPU the index probe holds bf16 too"))]


@pytest.mark.parametrize("dtype", NARROW, ids=["fp16", "bf16"])
def test_index_kernel_multiplies_16_bit_values_exactly(dtype):
    """Queries and keys of a bf16 model (or fp16's) go to the kernel as they are, their products on tensor cores
    (slices of a whole head): the scores of those same values in float64, within float32's rounding of its sums."""
    q, keys, weights, scale, limit = _index_inputs()
    q, keys = q.to(dtype), keys.to(dtype)
    exact = dense_index_scores(q.double(), keys.double(), weights, scale, limit)
    rounding = _index_error(dense_index_scores(q.float(), keys.float(), weights.float(), scale, limit), exact)
    error = _index_error(_index_kernel(q, keys, weights.float(), scale, limit), exact)
    print(f"indexer in {dtype}: kernel {error:.3g}, float32 rounding {rounding:.3g}")
    assert error <= ROUNDING_MULTIPLE * rounding and rounding < 1e-5, (error, rounding)


def test_only_values_all_16_bit_reach_the_kernel_narrow(monkeypatch):
    """A bf16 (here fp16) model's queries and keys reach the kernel as they are, its products on tensor cores; a
    float32 key beside them (autocast's float32 norm) takes both to float32, which holds every value exactly."""
    from seqmesh.kernels import sparse_latent_triton

    seen = []
    real = sparse_latent_triton.index_scores

    def spy(q, keys, *rest):
        seen.append((q.dtype, keys.dtype))
        return real(q, keys, *rest)

    monkeypatch.setattr(sparse_latent_triton, "index_scores", spy)
    q, keys, weights, scale, limit = _index_inputs()
    narrow = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    _index_kernel(q.to(narrow), keys.to(narrow), weights, scale, limit)
    _index_kernel(q.to(narrow), keys.float(), weights, scale, limit)
    assert seen == [(narrow, narrow), (torch.float32, torch.float32)], seen


def test_an_index_limit_one_off_is_seen():
    """The mutation: every query scores one key more than it may see."""
    q, keys, weights, scale, limit = _index_inputs()
    exact = dense_index_scores(q, keys, weights, scale, limit)
    with pytest.raises(AssertionError):
        _index_error(_index_kernel(q.float(), keys.float(), weights.float(), scale, (limit + 1).clamp(max=90)), exact)


def test_the_index_probe_passes_the_kernel_and_fails_a_wrong_one():
    """The probe a GPU runs before the kernel's first use (seqmesh.kernels.sparse_latent.PROBE), here on the
    interpreter (its 16-bit values fp16 here, bf16 on a GPU): the kernel passes; one that scores a key too many
    fails, and so does one wrong only on 16-bit values, so its device keeps torch's scores."""
    from seqmesh.kernels.sparse_latent import _probe_index, index_scores_kernel

    device = torch.device(DEVICE)
    narrow = torch.bfloat16 if DEVICE == "cuda" else torch.float16

    def probe(fn):
        _probe_index(fn, device, torch.Generator(device).manual_seed(0), narrow)

    probe(index_scores_kernel)

    def one_too_many(q, keys, weights, scale, limit):
        return index_scores_kernel(q, keys, weights, scale, limit + 1)

    def narrow_one_too_many(q, keys, weights, scale, limit):
        return index_scores_kernel(q, keys, weights, scale, limit + (q.dtype != torch.float32))

    with pytest.raises(RuntimeError, match="indexer kernel's scores in torch.float32"):
        probe(one_too_many)
    with pytest.raises(RuntimeError, match=f"indexer kernel's scores in {narrow}"):
        probe(narrow_one_too_many)


def test_the_kernels_compile_for_hopper_without_spilling_registers():
    """Each kernel compiled for an H100/H200 (sm_90) on this CPU with the runtime's launch settings (Triton's wheel
    carries ptxas): DeepSeek-V3.2's and DeepSeek-V4's latent attention in bf16, forward and backward, and the indexer,
    each within the register file (no stack: spills go to local memory, as whole float32 tiles once did: the indexer
    9.8 KB a thread, the backward 80 bytes, V4's backward 6.4 KB), the indexer in float32 and on a bf16 model's values.
    In float32 the backward spills (2.3 KB, reported)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a kernel compiles outside the interpreter
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(here, "kernel_compile_cases.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    print(report)
    for name, usage in report.items():
        if "fp32" not in name:
            assert usage["stack"] == 0 and usage["registers"] <= 255, (name, usage)
    assert set(report) >= {"forward v3.2 bf16", "backward v3.2 bf16", "forward v4 bf16", "backward v4 bf16",
                           "index_scores v3.2", "index_scores v3.2 bf16"}
