"""Generation on the sequence mesh (issue 48): the prompt's prefill sharded as in training, decode over a KV cache
that stays sharded; greedy tokens equal to transformers' ``generate`` on one process, float64."""

from __future__ import annotations

import pytest

from generate_cases import family_here as _here
from generate_cases import generated_cases, sampled_tokens
from seqmesh.planner.inference import cache_share

def _newest_only(*families: str) -> tuple[str, ...]:
    """``families`` (GPT-NeoX-Japanese by default) where seqmesh computes them (transformers 5.24 and later; refused
    by name before)."""
    from seqmesh.hf.own_attention import _too_old

    return () if _too_old("GPTNeoXJapaneseAttention") else (families or ("gpt-neox-japanese",))


FAMILIES = ["llama", "qwen3", "gemma3", "gpt-oss", "deepseek-v3", "qwen3_5", "recurrent_gemma", "llama4-chunked"]
# GQA; q/k norms; windows; sinks; MLA; Gated DeltaNet and RecurrentGemma's RG-LRU (their states and conv tails from
# the sharded prefill, then one token at a time); Llama 4's chunks of 8 and its no-RoPE layer's temperature
PROMPT, NEW = 101, 6  # a prompt no mesh divides evenly: the layout pads it, and the padding keeps no cache
ULPS = 4  # the bound: a multiple of the float32 rounding of the same model's logits




def _sparse_layers(family: str) -> bool:
    """Whether ``family``'s sparse layers are the ones seqmesh computes (transformers 5.15, the floor, lays DeepSeek
    Sparse Attention out otherwise, and seqmesh refuses it there by name)."""
    from family_cases import family_config

    kinds = getattr(family_config(family), "layer_types", None) or ()
    return "indexed_attention" in kinds or "minimax_m3_sparse" in kinds


def _check(r: dict, ulysses: int, ring: int, against: str = "logits") -> None:
    world, (prompt, new) = ulysses * ring, r["case"][3:5]
    assert r["tokens_equal"], r
    assert r[against] <= ULPS * r["rounding"], r
    assert max(r["counts"]) - min(r["counts"]) <= 2 * world, r  # the shares within one layout block
    assert sum(r["counts"]) == prompt + new - 1, r  # every token but the last drawn, kept once
    assert r["share_bytes"] == r["expected_share_bytes"], r  # the cache's formula, per rank
    assert max(r["counts"]) == cache_share(prompt, new, ulysses, ring), r  # the planner's fullest rank
    # and its recurrent states and conv tails, where the planner sizes the model (not pure Mamba's, without heads)
    assert r["expected_state_elements"] is None or r["state_elements"] == list(r["expected_state_elements"]), r


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)], ids=["u1xr2", "u2xr1"])
def test_greedy_tokens_equal_transformers_generate(pools, ulysses, ring):
    cases = [(f, ulysses, ring, PROMPT, NEW) for f in FAMILIES]
    for results in pools.run(ulysses * ring, generated_cases, cases):
        for r in results:
            _check(r, ulysses, ring)


@pytest.mark.parametrize("ulysses,ring,families", [(1, 2, ("bloom", "gpt-neo", "openai-gpt", *_newest_only())),
                                                   (2, 1, ("falcon", "mpt", "xglm", *_newest_only("megatron-bert")))],
                         ids=["u1xr2", "u2xr1"])
def test_families_with_attention_of_their_own_generate_as_transformers(pools, ulysses, ring, families):
    """BLOOM and MPT (ALiBi: a decode step's bias by each cached key's distance), Falcon (rotary, one kv head),
    GPT-Neo (unscaled; a local layer's window of 5 over a prompt of 101), OpenAI-GPT (learned positions), XGLM
    (sinusoidal positions), GPT-NeoX-Japanese (a partial rotary), RemBERT and MegatronBERT (BERT-style decoders),
    their layers run by seqmesh.hf.own_attention:
    the same tokens as transformers' generate, the cache shares as the formula."""
    for results in pools.run(ulysses * ring, generated_cases, [(f, ulysses, ring, PROMPT, NEW) for f in families]):
        for r in results:
            _check(r, ulysses, ring)


@pytest.mark.parametrize("ulysses,ring,families", [(1, 2, ("jamba", "mamba", "nemotron-h", "mamba2", "lfm2",
                                                                "kimi_linear", "lfm3")),
                                                    (2, 1, ("zamba", "zamba2", "falcon-h1", "lfm2_moe", "minimax", "zaya",
                                                            "granite-4-hybrid", "bamba"))],
                         ids=["r2", "u2"])
def test_mamba_and_conv_families_generate_as_transformers(pools, ulysses, ring, families):
    """Jamba (Mamba (v1) layers beside attention), Mamba (no attention at all: no cache, the states alone), Zamba
    (multi-head Mamba layers, a shared attention block), Nemotron-H (Mamba2, attention, MLP and MoE blocks), Granite-4
    hybrid and Bamba (Mamba2 or attention, then a feed-forward), pure
    Mamba2, Falcon-H1 (Mamba2 beside attention in every layer), LFM2 and LFM2-MoE (short convs: a tail, no state),
    LFM3 (its convs beside sliding and full attention),
    MiniMax-01 (lightning attention: a state, no conv), Kimi Linear (KDA beside MLA), ZAYA (CCA: the convs' tail and
    the last delayed value beside the cache):
    the scan's state and the conv's last inputs from the sharded prefill, then one token at a time on every rank. (A
    short conv decoded from a zero tail moves LFM2's logits by 4.3e-5, 99x this test's bound.)"""
    cases = [(f, ulysses, ring, PROMPT, NEW) for f in families if _here(f)]
    for results in pools.run(ulysses * ring, generated_cases, cases):
        for r in results:
            _check(r, ulysses, ring)
            assert sum(r["state_elements"]) > 0, r


def test_doge_experts_generate_as_transformers(pools):
    """Doge's cross-domain experts (is_moe): the prompt's tokens routed by the (2, N, K) view of the whole prefill
    call, as its training does (seqmesh.hf.doge_moe), each decoded token by its batch's, as transformers' generate
    routes them; held to transformers' generate, whose logits its forward over the whole sequence does not reproduce
    (that call's view routes every token by others). 81 prompt tokens (the layout pads them) and 6 new ones stay
    within its keep_window_size of 96; ring 2 and Ulysses 2."""
    if not _here("doge-moe"):
        pytest.skip("transformers' own Doge with experts does not generate at this release (generate_cases)")
    for ulysses, ring in ((1, 2), (2, 1)):
        for r in pools.run(2, generated_cases, [("doge-moe", ulysses, ring, 81, NEW)])[0]:
            _check(r, ulysses, ring, against="against_theirs")


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)], ids=["r2", "u2"])
def test_sparse_attention_families_generate_as_transformers(pools, ulysses, ring):
    """DeepSeek-V3.2, GLM-5 and HY-V4 (layers sharing the previous selection), A.X-K2 and dots.llm3: a decode step's
    indexer scores each rank's share, the row's top k are found from every rank's own top k, and the picked keys of
    each share attend in latent space, merged by log-sum-exp; the cache holds each token's latent, rotated key and
    indexer key once. MiniMax-M3's block-sparse layer (blocks of 4, the top 2 and the token's own): each block's score
    the best of its keys over every rank's share (one all-reduce), each rank attending to its keys in the chosen
    blocks. The logits are held to transformers' own generate, not its forward over the whole sequence:
    the indexer scores in float32 even in a float64 model, and its products over one query and over a whole row
    round differently, so a near tie can fall the other way (DeepSeek-V3.2 here: keys 47 and 63 at the second step,
    3.4e-2 on the logits between transformers' two paths). The prompts hold no near tie in transformers' own picks
    (``selection_margin``: the least relative gap above the k-th score, 100x float32's rounding at least), so the
    tokens do not hang on how this machine rounds; exact ties (the ReLU's zeros) are torch's own topk's to break, the
    same code on any machine at the pinned torch."""
    families = [f for f in ("deepseek-v3.2", "glm-5", "hy-v4", "a.x-k2", "dots.llm3", "minimax-m3-sparse")
                if _here(f) and _sparse_layers(f)]
    for results in pools.run(ulysses * ring, generated_cases, [(f, ulysses, ring, PROMPT, NEW) for f in families]):
        for r in results:
            _check(r, ulysses, ring, against="against_theirs")
            # no near tie in the indexer's float32 picks: another machine's rounding would pick the same keys
            assert r["selection_margin"] > 1e-5, r  # measured: 2.2e-4 (DeepSeek-V3.2) and more


def test_sharded_weights_generate_the_same_tokens(pools):
    """The weights sharded over the ranks (FSDP2, each layer gathered for its forward, the prefill's and every decode
    step's): the same tokens as transformers, Llama on the ring and Qwen3.5's Gated DeltaNet under Ulysses."""
    for family, ulysses, ring in (("llama", 1, 2), ("qwen3_5", 2, 1)):
        for results in pools.run(2, generated_cases, [(family, ulysses, ring, PROMPT, NEW)], sharded=True):
            for r in results:
                _check(r, ulysses, ring)
                assert r["held_fraction"] < 0.55, r  # each rank holds about half of every weight


def test_greedy_tokens_on_a_two_dimensional_mesh(pools):
    for results in pools.run(4, generated_cases, [(f, 2, 2, PROMPT, NEW) for f in ("llama", "gemma3")]):
        for r in results:
            _check(r, 2, 2)


@pytest.mark.parametrize("mutation, family", [("plain_mean", "llama"), ("every_rank_keeps", "llama"),
                                              ("state_not_carried", "qwen3_5"), ("state_not_carried", "recurrent_gemma"),
                                              ("state_not_carried", "jamba"), ("state_not_carried", "mamba2"),
                                              ("state_not_carried", "minimax"), ("state_not_carried", "kimi_linear"),
                                              ("state_not_carried", "zaya"),
                                              ("local_selection", "deepseek-v3.2"), ("plain_mean", "hy-v4"),
                                              ("local_blocks", "minimax-m3-sparse")])
def test_a_merge_without_its_log_sum_exp_a_token_kept_twice_or_a_state_not_carried_is_seen(pools, mutation, family):
    """Each fault moves the logits far from transformers' forward and from its generate alike; ``local_selection``: a
    sparse-attention decode step that takes each rank's own top k keys for the row's; ``local_blocks``: a
    block-sparse step that scores each block by the rank's own keys only."""
    if not _here(family):
        pytest.skip(f"this transformers has no {family}")
    for results in pools.run(2, generated_cases, [(family, 1, 2, PROMPT, NEW)], mutation=mutation):
        for r in results:
            seen = min(r["logits"], r["against_theirs"])
            assert seen > 100 * ULPS * r["rounding"], r  # measured: 1,700x (plain mean), 36,000x


def test_a_row_that_draws_the_end_token_stops_as_in_transformers(pools):
    """The token row 0 draws at its third step is made the end of a sequence: row 0 pads from then on, as transformers'
    generate pads it, and generation stops once both rows have ended (or after NEW tokens)."""
    for results in pools.run(2, generated_cases, [("llama", 1, 2, PROMPT, NEW)], end_at=2):
        for r in results:
            assert r["tokens_equal"] and r["logits"] <= ULPS * r["rounding"], r
            assert r["tokens"][0][3:] == [0] * (len(r["tokens"][0]) - 3), r


def test_sampling_draws_the_same_tokens_on_every_rank(pools):
    """Temperature and top-p: every rank draws the same tokens from its (identical) logits with a generator seeded
    alike; two seeds draw differently; a top-p below every token's probability keeps the most likely one (greedy)."""
    settings = [(0.9, 0.95, 1), (0.9, 0.95, 2), (1.0, 1e-9, 3), (0.0, 1.0, 0)]
    ranks = pools.run(2, sampled_tokens, 2, 1, settings)
    assert ranks[0] == ranks[1], ranks
    first, second, nucleus, greedy = ranks[0]
    assert first != second and nucleus == greedy, ranks[0]


def test_heads_split_over_tensor_parallel_ranks_generate_the_same_tokens(pools):
    """``split_heads`` (tp 2) beside the sequence mesh: each rank runs and caches its half of the heads (its cache
    half the bytes of a share of all heads), the decode's token a sequence of one; transformers' tokens and logits
    for Llama and Mistral (a window) on ring 2 x tp 2, Qwen3 on Ulysses 2 x tp 2 and Llama on tp 2 alone."""
    for ulysses, ring, family in ((1, 2, "llama"), (1, 2, "mistral"), (2, 1, "qwen3"), (1, 1, "llama")):
        for results in pools.run(ulysses * ring * 2, generated_cases, [(family, ulysses, ring, PROMPT, NEW)], tp=2):
            for r in results:
                assert r["tokens_equal"] and r["logits"] <= ULPS * r["rounding"], r
                assert sum(r["counts"]) == PROMPT + NEW - 1 and r["share_bytes"] == r["expected_share_bytes"], r
                assert r["held_fraction"] < 0.75, r  # the layers' matrices halved (norms and the embedding's rows not)
                assert max(r["counts"]) == cache_share(PROMPT, NEW, ulysses, ring, tp=2), r  # the planner's fullest


def test_what_generation_cannot_run_is_refused_before_any_work(pools):
    """A Doge whose prompt and new tokens pass its keep_window_size (its dynamic mask would keep each query's keys of
    largest bias), a model parallelized with async Ulysses (whose attention keeps no cache)."""
    from generate_cases import generation_refusals

    doge, async_model = pools.run(2, generation_refusals, 1, 2)[0]
    if "upgrade transformers" not in doge:  # transformers 5.15 lays Doge out otherwise: refused by parallelize
        assert "keep_window_size" in doge and "the prompt and the new tokens" in doge, doge
    assert "async_ulysses" in async_model, async_model
