"""Item 6 of issue 12: nothing unknown runs silently or crashes inside. A sample of the decoder
families in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, as tiny float32 models on a ring of 2:
each is exact against the single-process model or refused before any work with a ValueError naming
the layer or variant and what would make it computable. (Linear-attention hybrids of the Gated DeltaNet kind
are covered with their own support, not here.)"""

from __future__ import annotations

from registry_cases import registry_sample

EXACT = ["llama", "qwen2", "phi3", "olmo2", "granite", "starcoder2", "cohere2", "gemma3_text", "mistral",
         "gpt_oss", "deepseek_v3", "gemma2", "llama4_text",  # soft-capping; chunked attention (8192: one chunk here)
         "lfm2",  # a gated short convolution (its halo across ranks) and attention
         "falcon_h1",  # Mamba2 beside attention in every layer (the state passed across ranks)
         "jamba",  # a Mamba (v1) layer and an attention layer
         "recurrent_gemma",  # RG-LRU blocks (their state passed across ranks) and local attention
         "rwkv",  # RWKV-4's token shifts and time mixing (its state passed across ranks in log space)
         "xlstm"]  # xLSTM's mLSTM memory (passed the same way)
REFUSED = {  # the reason, and what would make it computable (none for XLNet: no layout makes it exact)
    "xlnet": "two-stream relative attention",  # computed in its own layers, not one causal stream
}


def test_registry_sample_is_exact_or_refused(pools):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = EXACT + list(REFUSED)
    assert all(f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES for f in families)
    results = pools.run(2, registry_sample, families, timeout=600)[0]
    by_family = {r["family"]: r for r in results}
    for family in EXACT:
        r = by_family[family]
        assert r["outcome"] == "exact" and r["err"] < 1e-5, r
    for family, words in REFUSED.items():
        r = by_family[family]
        assert r["outcome"] == "refused", r
        assert words.lower() in r["message"].lower() and "no layout makes it exact" in r["message"], r
