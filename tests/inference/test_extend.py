"""Prefill onto a kept cache (issue 48): a conversation's second turn runs only the tokens the cache lacks, by
pass-KV or pass-Q (``seqmesh.inference.extend``), and the tokens and logits after it equal transformers' ``generate``
on the whole row on one process, float64."""

from __future__ import annotations

import pytest

from generate_cases import extended_cases
from seqmesh.inference.extend import choose

FAMILIES = ("llama", "qwen3", "gemma3", "gpt-oss", "deepseek-v3", "bloom", "llama4-chunked")  # GQA; q/k norms;
# windows; sinks and windows; MLA (its key and value widths differ); ALiBi through seqmesh's own attention; Llama 4's
# chunks of 8 positions and its no-RoPE layer's temperature by position
ULPS = 4


def _check(r: dict, world: int, schedule: str) -> None:
    assert r["tokens_equal"], r
    assert r["logits"] <= ULPS * r["rounding"], r
    assert r["schedules"] == ((schedule,) if r["case"][0] not in ("mamba", "mamba2") else ()), r  # no attention
    assert sum(r["counts"]) == r["row"] + 4, r  # every token but the last drawn, kept once
    assert r["same_cache"] and r["kept_before"] == 101 + 4 - 1, r  # the first turn's cache, grown in place
    assert r["positions_unique"] and r["share_bytes"] == r["expected_share_bytes"], r
    assert max(r["counts"]) - min(r["counts"]) <= 3 * 2 * world, r  # a layout block each prefill, the decode's one


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)], ids=["r2", "u2"])
def test_a_second_turn_onto_the_kept_cache_generates_as_transformers(pools, ulysses, ring):
    cases = [(f, ulysses, ring, s) for f in FAMILIES for s in ("pass_kv", "pass_q")]
    for results in pools.run(ulysses * ring, extended_cases, cases):
        for r in results:
            _check(r, ulysses * ring, r["case"][3])


def test_a_second_turn_on_a_two_dimensional_mesh(pools):
    cases = [(f, 2, 2, s) for f in ("llama", "gemma3") for s in ("pass_kv", "pass_q")]
    for results in pools.run(4, extended_cases, cases):
        for r in results:
            _check(r, 4, r["case"][3])


@pytest.mark.parametrize("ulysses,ring,families,schedule", [
    (1, 2, ("qwen3_5", "nemotron-h", "mamba2", "jamba", "mamba", "lfm2", "kimi_linear", "recurrent_gemma"), "pass_q"),
    (2, 1, ("qwen3_5", "zamba", "falcon-h1", "lfm2_moe", "minimax", "granite-4-hybrid", "bamba", "zaya"), "pass_kv")],
    ids=["r2", "u2"])
def test_a_second_turn_of_a_recurrent_hybrid_runs_from_the_kept_state(pools, ulysses, ring, families, schedule):
    """Gated DeltaNet, Mamba2, Mamba, short convs, KDA, RG-LRU, lightning layers and ZAYA's CCA projections run the
    new tokens whole on every rank from the state and conv tail the first turn left (each rank gathers the layer's
    input of the new tokens), the attention layers by the schedule: transformers' tokens and logits on the whole
    row."""
    from generate_cases import family_here

    cases = [(f, ulysses, ring, schedule) for f in families if family_here(f)]
    for results in pools.run(ulysses * ring, extended_cases, cases):
        for r in results:
            _check(r, ulysses * ring, schedule)


@pytest.mark.parametrize("mutation,family", [("plain_sum", "llama"), ("offset_dropped", "llama"),
                                             ("state_not_carried", "qwen3_5"), ("state_not_carried", "nemotron-h")])
def test_a_merge_without_its_log_sum_exp_queries_at_the_wrong_positions_or_a_state_not_carried_is_seen(
        pools, mutation, family):
    """Both schedules: the partial results summed without their log-sum-exp, the new queries placed at their indices
    among the new tokens (the kept keys after them, so hidden), or the recurrent layers run from a zero state and
    tail, move the logits far past the bound."""
    cases = [(family, 1, 2, s) for s in ("pass_kv", "pass_q")]
    for results in pools.run(2, extended_cases, cases, mutation=mutation):
        for r in results:
            assert r["logits"] > 100 * ULPS * r["rounding"], r


def test_the_schedule_that_moves_fewer_bytes_is_chosen():
    """Llama-3-70B's attention (64 query heads, 8 key heads of 128, bf16) on 8 ranks. A turn of 1,024 tokens beside a
    kept million: pass-Q receives 7 x 128 x 64 x (128 x 2 + 129 x 4) = 44 MB a layer, pass-KV every other share,
    7 x 131,200 x (8 x 256 x 2 + 8) = 3.77 GB: pass-Q. A prompt of 131,072 tokens onto 1,024 kept: pass-Q 5.7 GB,
    pass-KV 7 x 16,512 x 4,104 = 474 MB: pass-KV."""
    turn = [131_072 + 128] * 8
    assert choose("auto", 128, 64, 8, 128, 128, turn, 2) == "pass_q"
    prompt = [128 + 16_384] * 8
    assert choose("auto", 16_384, 64, 8, 128, 128, prompt, 2) == "pass_kv"
    assert choose("pass_kv", 128, 64, 8, 128, 128, turn, 2) == "pass_kv"  # a schedule named is kept


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)], ids=["r2", "u2"])
def test_a_prompt_prefilled_in_chunks_generates_as_transformers(pools, ulysses, ring):
    """``prefill_chunk=30``: the 101-token prompt in chunks of 30, 30, 30 and 11, each onto the cache the ones before
    left (the schedule chosen by bytes), then decode: the tokens and logits of the prompt at once."""
    from generate_cases import generated_cases

    cases = [(f, ulysses, ring, 101, 6) for f in ("llama", "gemma3", "deepseek-v3", "qwen3_5", "llama4-chunked")]
    for results in pools.run(ulysses * ring, generated_cases, cases, prefill_chunk=30):
        for r in results:
            assert r["tokens_equal"] and r["logits"] <= ULPS * r["rounding"], r
            assert sum(r["counts"]) == 101 + 6 - 1 and r["share_bytes"] == r["expected_share_bytes"], r
            assert r["schedules"], r


def test_what_prefill_onto_a_kept_cache_cannot_run_is_refused_by_name(pools):
    from generate_cases import extension_refusals

    hybrid, short, other_batch, schedule, chunk, whole, split = pools.run(2, extension_refusals, 1, 2)[0]
    from generate_cases import family_config

    if "indexed_attention" in (getattr(family_config("deepseek-v3.2"), "layer_types", None) or ()):
        assert "sparse attention" in hybrid and "without the cache" in hybrid, hybrid
    else:  # transformers 5.15 lays DeepSeek Sparse Attention out otherwise: refused before (by parallelize)
        assert "seqmesh cannot run" in hybrid, hybrid
    assert "holds 42 tokens" in short and "whole row" in short, short
    assert "holds 2 rows" in other_batch, other_batch
    assert "pass_everything" in schedule and "pass_q" in schedule, schedule
    assert "prefill_chunk=0" in chunk, chunk
    assert "tp=2" in whole and "split_heads" in whole, whole
    assert "Qwen3_5GatedDeltaNet layers split over tp=2" in split and "tp=1" in split, split


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["cpu-flash", "math"])
def test_a_partial_over_scattered_keys_is_the_softmax_over_the_keys_each_query_sees(monkeypatch, softcap):
    """``chunk_partial`` against the softmax written out on the whole (queries x keys) score matrix: keys at scattered
    positions (a share's), a window, ALiBi's slopes, GQA, a value narrower than the key (MLA), a padding query at -1
    and a query before every key (both: nothing seen, lse -inf); blocks of 3 keys and 4 queries."""
    import torch

    from seqmesh.inference import extend

    monkeypatch.setattr(extend, "KEY_BLOCK", 3)
    monkeypatch.setattr(extend, "BLOCK_SCORES", 2 * 4 * 4 * 3)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 6, dtype=torch.float64, generator=g)
    k = torch.randn(2, 11, 2, 6, dtype=torch.float64, generator=g)
    v = torch.randn(2, 11, 2, 5, dtype=torch.float64, generator=g)
    kpos = torch.tensor([3, 40, 7, 8, 21, 22, 30, 31, 1, 12, 39])
    qpos = torch.tensor([41, 22, 8, 0, -1, 30, 35, 12, 39])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    out, lse = extend.chunk_partial(q, qpos, k, v, kpos, 0.4, window=20, softcap=softcap, slopes=slopes)

    scores = torch.einsum("bnhd,bmhd->bhnm", q, k.repeat_interleave(2, dim=2)) * 0.4
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    distance = (qpos[:, None] - kpos[None, :]).double()
    scores = scores - slopes[:, None, None] * distance
    seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - 20)
    scores = scores.masked_fill(~seen, float("-inf"))
    want_lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))
    want = torch.einsum("bhnm,bmhd->bnhd", probs, v.repeat_interleave(2, dim=2))
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and bool(torch.isinf(lse[:, :, [3, 4]]).all())
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-12, rtol=0)
    assert torch.allclose(out, want, atol=1e-12, rtol=0)


def test_a_second_turn_with_heads_split_over_tensor_parallel_ranks(pools):
    cases = [("llama", 1, 2, s) for s in ("pass_kv", "pass_q")]
    for results in pools.run(4, extended_cases, cases, tp=2):
        for r in results:
            assert r["tokens_equal"] and r["logits"] <= ULPS * r["rounding"], r
            assert r["schedules"] == (r["case"][3],) and r["share_bytes"] == r["expected_share_bytes"], r


def test_a_turn_that_fails_part_way_leaves_the_cache_as_it_was(pools):
    from generate_cases import kept_after_a_failure

    r = pools.run(2, kept_after_a_failure, 1, 2)[0]
    assert r["failed"] and r["kept"] and r["right_after"], r
