"""``seqmesh plan --inference`` (issue 48): each GPU's KV-cache share as the seed's arithmetic gives it, the prefill
time beside the figures context-parallel inference published (Yang et al., 2024), and the refusals. The fullest rank's
share against the runtime's own cache is tests/inference/test_generate.py's (``cache_share``)."""

from __future__ import annotations

import json

import pytest

from planner_cases import in_process

MIB, GIB = 2**20, 2**30
# Llama 3 405B's config.json sizes (the paper's model)
LLAMA3_405B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16384,
               "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 128,
               "intermediate_size": 53248, "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": False}


def _plan(*args: str) -> dict:
    done = in_process(["plan", "--inference", *args, "--json"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_seeds_70b_at_a_million_tokens():
    """The seed: 'a 70B model at 1M tokens under Ulysses 8: 41 GB of KV cache per GPU'. 80 layers x 8 kv heads x
    (128 + 128) values x 2 bytes a token is 320 KiB, and each of the 8 GPUs keeps an eighth of 2^20 tokens: 40 GiB
    (42.9 GB) on every layout, the token shares being the same size whatever splits the heads; 16 GPUs half as much."""
    eight = _plan("--model", "llama3-70b", "--seq-len", str(2**20), "--gpus", "8")
    whole = [(lay["ulysses"], lay["ring"]) for lay in eight["layouts"] if lay["tp"] == 1]
    assert whole == [(1, 8), (2, 4), (4, 2), (8, 1)], eight
    assert {lay["cache_bytes"] for lay in eight["layouts"]} == {80 * 8 * 256 * 2 * 2**17}, eight
    assert not any(lay["fits"] for lay in eight["layouts"]) and eight["recommended"] is None  # 131 GiB of weights
    sixteen = _plan("--model", "llama3-70b", "--seq-len", str(2**20), "--gpus", "16")
    assert {lay["cache_bytes"] for lay in sixteen["layouts"]} == {40 * GIB // 2}, sixteen
    # the prefill is compute: twice the GPUs, about half the time (the merges and all-to-alls do not halve)
    best = {n: min(lay["prefill_seconds"] for lay in plan["layouts"]) for n, plan in ((8, eight), (16, sixteen))}
    assert 0.45 < best[16] / best[8] < 0.55, best


def test_sharded_weights_fit_the_70b_on_sixteen_gpus():
    """--shard-weights (seqmesh generate's): each GPU holds a sixteenth of the 131 GiB and a few gathered units (two
    layers, the head), so the 70B at 1M fits on 16 H100s; the prefill's gathers hide behind its compute (about the same
    seconds), while each decode step waits for every layer's gather (slower than reading the weights whole)."""
    whole = _plan("--model", "llama3-70b", "--seq-len", str(2**20), "--gpus", "16")
    sharded = _plan("--model", "llama3-70b", "--seq-len", str(2**20), "--gpus", "16", "--shard-weights")
    assert sharded["sharded_weights"] and not whole["sharded_weights"]
    for a, b in zip(whole["layouts"], sharded["layouts"]):
        if a["tp"] > 1:  # below
            continue
        assert a["weight_bytes"] / 16 < b["weight_bytes"] < a["weight_bytes"] / 16 + 6 * GIB, (a, b)
        assert b["fits"] and not a["fits"], (a, b)
        assert abs(b["prefill_seconds"] / a["prefill_seconds"] - 1) < 0.02, (a, b)
        assert b["decode_seconds"] > 2 * a["decode_seconds"], (a, b)
    assert sharded["recommended"] is not None


def test_heads_split_over_tensor_parallel_ranks_fit_the_70b_on_sixteen_gpus():
    """seqmesh generate --tp: each GPU holds its 1/tp split of the layers, the embedding and the head (the norms
    whole), reads it in place at each decode step and caches its heads; the KV cache per GPU is the same on every
    layout (tokens over the sequence ranks, heads over tp). On 16 H100s the 70B at 1M fits at ring 2 x tp 8 without
    sharded weights, and decodes faster than any tp 1 layout (an eighth of the weights read a token)."""
    plan = _plan("--model", "llama3-70b", "--seq-len", str(2**20), "--gpus", "16")
    by = {(lay["ulysses"], lay["ring"], lay["tp"]): lay for lay in plan["layouts"]}
    assert {lay["tp"] for lay in plan["layouts"]} == {1, 2, 4, 8}, plan  # tp stays inside a node of 8
    assert {lay["cache_bytes"] for lay in plan["layouts"]} == {40 * GIB // 2}, plan
    layer = 8192 * (64 + 2 * 8 + 64) * 128 + 3 * 8192 * 28672  # q, k, v, o and the MLP of one layer
    split = 80 * (layer // 8 + 2 * 8192) + 2 * 128256 * 8192 // 8 + 8192  # layers, embedding and head split, norms
    assert by[(1, 2, 8)]["weight_bytes"] == 2 * split and by[(1, 2, 8)]["fits"], by[(1, 2, 8)]
    assert not any(lay["fits"] for lay in plan["layouts"] if lay["tp"] == 1), plan
    assert by[(1, 2, 8)]["decode_seconds"] < 0.5 * min(lay["decode_seconds"] for lay in plan["layouts"]
                                                        if lay["tp"] == 1), plan
    assert plan["recommended"] == "ulysses 1 x ring 2 x tp 8", plan


def test_the_405b_prefill_is_near_what_context_parallelism_measured(tmp_path):
    """Yang et al. (2024) prefilled Llama 3 405B's 1M tokens in 77 s and 128K in 3.8 s on 128 H100s. With its default
    efficiency (half the peak for matmuls and attention) the planner's best layout says 86 s (1.12x) and 2.9 s
    (0.77x: at 128K a GPU's 1K-token blocks run further from peak than it assumes): within a quarter of both."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_405B))
    for tokens, measured in ((2**20, 77.0), (2**17, 3.8)):
        plan = _plan("--model", str(config), "--seq-len", str(tokens), "--gpus", "128")
        best = min(lay["prefill_seconds"] for lay in plan["layouts"])
        assert 0.75 < best / measured < 1.25, (tokens, best)


def test_a_qwen3_5_plan_counts_its_recurrent_states():
    """Qwen3.5's Gated DeltaNet layers keep no cache but their state (float32, every head, on every rank) and their
    conv's last inputs; only its full-attention layers' keys and values are shared out."""
    plan = _plan("--model", "qwen3.5-9b", "--seq-len", "65536", "--gpus", "4", "--new-tokens", "1")
    lay = plan["layouts"][0]
    # 24 Gated DeltaNet layers: 32 value heads x 128 x 128 float32 states, conv (16 x 128 x 2 + 32 x 128) x 3 bf16
    assert lay["state_bytes"] == 24 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2), lay
    # 8 full-attention layers x 4 kv heads x (256 + 256) x 2 bytes x a quarter of the tokens
    assert lay["cache_bytes"] == 8 * 4 * 512 * 2 * 16384, lay


def test_a_recurrent_gemma_plan_counts_its_recurrent_states(tmp_path):
    """RecurrentGemma-9B's shape (tests/planner/test_planner_mixers.py): its 26 recurrent blocks keep no cache but their
    state (float32, lru_width 4096, on every rank) and their conv's last 3 inputs (bf16); its 12 local-attention
    layers' keys and values (one kv head of 256) are shared out; DeepSeek-V3.2 (DSA) keeps MLA's latent, rotary key and
    indexer key a token (seqmesh.inference.indexed_decode), no expanded heads."""
    from test_planner_mixers import RECURRENT_GEMMA_9B

    config = tmp_path / "recurrent_gemma" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(RECURRENT_GEMMA_9B))
    plan = _plan("--model", str(config), "--seq-len", "65536", "--gpus", "4", "--new-tokens", "1")
    lay = plan["layouts"][0]
    assert lay["state_bytes"] == 26 * (4096 * 4 + 3 * 4096 * 2), lay
    assert lay["cache_bytes"] == 12 * 1 * 512 * 2 * 16384, lay
    from family_cases import family_config

    dsa = tmp_path / "deepseek_v32" / "config.json"
    dsa.parent.mkdir()
    dsa.write_text(family_config("deepseek-v3.2").to_json_string())
    plan = _plan("--model", str(dsa), "--seq-len", "4096", "--gpus", "2", "--new-tokens", "1")
    config = family_config("deepseek-v3.2")  # 2 indexed layers, each an indexer: latent 16 + rotary 4 + indexer 8
    per_token = 2 * (config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim)
    assert plan["layouts"][0]["cache_bytes"] == per_token * 2 * 2048, plan  # bf16, 2048 tokens a rank


@pytest.mark.parametrize("args, said", [
    (["--model", "llama3-8b", "--seq-len", "4096", "--max-seq-len"], "--max-seq-len: a training option"),
    (["--model", "llama3-8b"], "--inference needs --seq-len N"),
    (["--model", "llama3-8b", "--seq-len", "4096", "--new-tokens", "0"], "--new-tokens 0"),
    (["--model", "llama3-8b", "--seq-len", "4096", "--dtype", "fp32"], "bf16 generation"),
    (["--model", "qwen2.5-vl-tiny", "--seq-len", "4096"], "from text prompts of decoder-only models so far"),
], ids=["max-seq-len", "no-length", "no-tokens", "fp32", "vision"])
def test_what_generation_cannot_run_is_refused_by_name(args, said):
    done = in_process(["plan", "--inference", *args])
    assert done.returncode == 2 and "seqmesh plan: error:" in done.stderr and said in done.stderr, done.stderr


def test_generation_options_without_inference_are_refused():
    done = in_process(["plan", "--model", "llama3-8b", "--seq-len", "4096", "--shard-weights"])
    assert done.returncode == 2 and "add --inference" in done.stderr, done.stderr


def test_the_table_names_each_layout_and_why_none_fits():
    done = in_process(["plan", "--inference", "--model", "llama3-70b", "--seq-len", str(2**20), "--gpus", "8"])
    assert done.returncode == 0, done.stderr
    assert "ulysses 8 x ring 1" in done.stdout and "40.0 GiB" in done.stdout, done.stdout
    assert "weights 131.4 GiB each: the whole model; --shard-weights shards it" in done.stdout, done.stdout
    fits = in_process(["plan", "--inference", "--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8"])
    assert "recommended: ulysses" in fits.stdout, fits.stdout
