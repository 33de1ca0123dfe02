"""``seqmesh bench baseline``: both sides train the same model, and the search finds the longest length
within a budget (checked against a formula and against measuring the next length)."""

from __future__ import annotations

import pytest

from seqmesh.bench.baseline import BaselineBench, longest_within, run_method


def test_search_finds_the_longest_multiple_within_the_budget():
    """Against a peak linear in the length, where the answer is a formula; and the lengths it measures."""
    per_token, fixed, budget = 1000, 50_000, 3_000_000
    measured = []

    def peak_of(length: int) -> int:
        measured.append(length)
        return fixed + per_token * length

    longest, peaks = longest_within(peak_of, budget, start=256, resolution=64, limit=1 << 20)
    assert longest == (budget - fixed) // per_token // 64 * 64 == 2944
    assert peaks[longest] <= budget < peaks[longest + 64]
    assert measured[:5] == [256, 512, 1024, 2048, 4096]  # doubling to the first failure, then bisection
    assert len(measured) == 5 + 5  # 2048..4096 halved to 64 tokens: log2(2048 / 64) steps
    assert longest_within(peak_of, 10, 256, 64, 1 << 20) == (None, {256: fixed + per_token * 256})
    assert longest_within(peak_of, budget, 256, 64, 1024)[0] == 1024  # the limit fits: no failure measured


def test_bench_refuses_a_start_off_the_resolution():
    with pytest.raises(ValueError, match="start=300 must be a multiple of resolution=256"):
        BaselineBench(start=300)


def test_both_sides_compute_the_same_loss_on_one_process(pools):
    """Transformers' own loss (full logits, its SDPA attention) and seqmesh's (chunked LM head, its
    kernel) over the same batch of the same model: equal to float32 rounding."""
    bench = BaselineBench(world=1, loss_chunk=100)
    plain, ours = (pools.run(1, run_method, bench, m, 512, track=False)[0] for m in ("transformers", "seqmesh"))
    assert plain["tokens_per_step"] == ours["tokens_per_step"] == 512
    # measured |difference| 4.8e-7 on a loss of 5.56 (one float32 ulp) at 512 and 1,024 tokens: summation order
    assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=0)


def test_on_two_processes_seqmesh_trains_the_first_baseline_sequence(pools):
    """Sequence parallel over 2 ranks: the loss of the whole sequence that data parallelism gives to its
    rank 0 (plain transformers, whole sequence, FSDP2 over the 2), with and without FSDP2 in seqmesh."""
    bench = BaselineBench(world=2, loss_chunk=100)
    plain = pools.run(2, run_method, bench, "transformers", 512, track=False)
    assert [r["tokens_per_step"] for r in plain] == [1024, 1024]  # two whole sequences per step
    for method in ("seqmesh", "seqmesh_replicated"):
        ours = pools.run(2, run_method, bench, method, 512, track=False)
        assert ours[0]["tokens_per_step"] == 512 and ours[0]["loss"] == ours[1]["loss"]
        assert ours[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6, abs=0)


def test_both_sides_run_the_same_cpu_attention_op(pools):
    """What the docs say: transformers' SDPA and seqmesh's cpu_flash kernel call one op, forward and backward."""
    from baseline_cases import attention_ops_of_both_sides

    (found,) = pools.run(1, attention_ops_of_both_sides, 256)
    flash = {"aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}
    assert found["seqmesh"] == flash  # chunked loss: logsumexp, no softmax op
    assert found["transformers"] == flash | {"aten._log_softmax.default", "aten._log_softmax_backward_data.default"}


class _OneRank:
    def __init__(self, pools):
        self.pools = pools

    def run(self, fn, *args, timeout: float, **kwargs):
        return self.pools.run(1, fn, *args, timeout=timeout, **kwargs)


def test_longest_length_fits_and_the_next_one_does_not(pools):
    """A real sweep on one process: the reported longest fits the budget, and a fresh measurement of
    the length one resolution step above it does not."""
    from seqmesh.bench.baseline import compare

    bench = BaselineBench(world=1, budget=6 << 20, start=128, resolution=64, limit=2048, repeats=1, loss_chunk=100)
    result = compare(bench, ("transformers", "seqmesh"), pool=_OneRank(pools))
    for method, row in result["methods"].items():
        longest = row["longest"]
        assert not row["reached_limit"] and row["peaks"][longest] <= bench.budget
        again = pools.run(1, run_method, bench, method, longest + bench.resolution, track=True)[0]
        assert again["peak_bytes"] == row["peaks"][longest + bench.resolution] > bench.budget  # deterministic
    (pair,) = result["pairs"]
    mine, base = result["methods"]["seqmesh"]["longest"], result["methods"]["transformers"]["longest"]
    assert pair["longest_ratio"] == mine / base
    assert pair["both_seqmesh"]["seq_len"] == pair["both_baseline"]["seq_len"] == min(mine, base)
