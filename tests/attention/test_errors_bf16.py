"""Bad inputs fail on every rank with actionable errors; bf16 error does not grow with the degree."""

from __future__ import annotations

import pytest
import torch

import seqmesh
from dist_cases import Case, bad_inputs, bf16_errors, plain_kernel_errors

PROBLEMS = {
    "local_len": "disagree on local tokens: [4, 6, 4, 4]",
    "head_dim": "rejected their attention inputs|head dim 8 but k and v have 16",
    "dtype": "disagree on dtype: ['float32', 'float64', 'float32', 'float32']",  # names, not codes
    "documents": "disagree on documents: [[0, 5, 16], [0, 5, 16], [0, 5, 16], [0, 6, 16]]",  # values, not hashes
    "cu_seqlens": "strictly increasing, but entry 2 is 3 after 5",
    "cu_too_long": "ends at 19 but the sequence holds 16 tokens",
    "heads": "4 query heads are not a multiple of 3 kv heads",
    "causal": "disagree on causal",
    "cu_not_ints": "cu_seqlens must be a 1-D integer tensor",
    "window": "disagree on window: [None, 3, None, None]",
    "window_full": "sliding windows are supported with causal attention only",
    "sinks": "sinks must be a float tensor of shape (query heads,) = (4,)",
}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_bad_input_raises_on_every_rank(pools, problem):
    """A problem on one rank raises a ValueError on all four ranks (none is left waiting)."""
    answers = pools.run(4, bad_inputs, 2, 2, problem, timeout=120)
    for rank, answer in enumerate(answers):
        assert answer.startswith("ValueError"), (rank, answer)
    assert any(any(part in a for part in PROBLEMS[problem].split("|")) for a in answers), answers


def test_ulysses_degree_above_heads_names_the_fix(pools):
    answers = pools.run(4, bad_inputs_heads, timeout=120)
    assert all("ulysses=4 exceeds the 2 query heads" in a and "ulysses <= 2" in a for a in answers), answers


def bad_inputs_heads() -> str:
    from dist_cases import get_mesh

    mesh = get_mesh(4, 1)
    q = torch.randn(1, 4, 2, 8)
    try:
        seqmesh.attention(q, q, q, mesh)
    except ValueError as err:
        return str(err)
    return "no error"


def mesh_mismatch() -> str:
    try:
        seqmesh.init_mesh(3, 1)
    except ValueError as err:
        return str(err)
    return "no error"


def test_mesh_that_does_not_match_the_world(pools):
    answers = pools.run(2, mesh_mismatch)
    assert all("= 3 ranks, but the world has 2" in a for a in answers), answers


def test_bf16_error_does_not_grow_with_degree(pools):
    """bf16 through USP/ring/Ulysses: error against float64 stays within 2x the error of the plain
    single-device bf16 kernel on the whole sequence, for P = 1, 2, 4."""
    cases = [Case(128, 8, 2, causal, "zigzag", docs, dtype="bfloat16", head_dim=32, seed=7, batch=1)
             for causal in (True, False) for docs in (None, (0, 50, 51, 128))]
    single = plain_kernel_errors(cases)
    for ulysses, ring in ((1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1)):
        multi = pools.run(ulysses * ring, bf16_errors, ulysses, ring, cases)
        for rank_results in multi:
            for one, many in zip(single, rank_results):
                for key in ("out", "dq", "dk", "dv"):
                    assert many[key] <= 2.0 * one[key] + 1e-3, (ulysses, ring, many["case"], key, one[key], many[key])


def fail_mid_ring(fail_rank: int) -> str:
    """Rank ``fail_rank`` dies between the ring's hops; the others are left inside a receive."""
    import torch.distributed as dist

    if dist.get_rank() == fail_rank:
        raise RuntimeError("simulated failure on one rank")
    dist.recv(torch.empty(1), src=fail_rank)  # never satisfied
    return "unreachable"


def test_a_failing_rank_ends_the_group_instead_of_hanging():
    import time

    from seqmesh.comm.launch import WorkerPool

    pool = WorkerPool(2, collective_timeout=300)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)failed on rank\\(s\\) \\[1\\].*simulated failure on one rank"):
        pool.run(fail_mid_ring, 1, timeout=300)
    assert time.monotonic() - start < 30  # the pool is ended at once, not after gloo's 300 s timeout
    assert not pool.alive


def test_named_backend_refusal_reaches_every_rank(pools):
    import time

    from dist_cases import named_backend_refuses_documents

    start = time.monotonic()
    answers = pools.run(2, named_backend_refuses_documents, timeout=120)
    assert all("backend 'math' cannot run this call: no documents" in a for a in answers), answers
    assert time.monotonic() - start < 30  # nobody waited for a peer's collective timeout
