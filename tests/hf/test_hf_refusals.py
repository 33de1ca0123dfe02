"""Attention variants seqmesh does not compute are refused, never silently replaced by full attention."""

from __future__ import annotations


def refusals() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import seqmesh
    from dist_cases import get_mesh
    from seqmesh.hf import parallelize

    mesh = get_mesh(1, 1)
    answers = {}
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    config.attention_chunk_size = 8  # Llama-4 style chunked attention
    try:
        parallelize(LlamaForCausalLM(config), mesh)
        answers["chunked"] = "no error"
    except ValueError as err:
        answers["chunked"] = str(err)

    config.attention_chunk_size = None
    model = parallelize(LlamaForCausalLM(config), mesh)
    layer = model.model.layers[0].self_attn
    attention = seqmesh.hf._make_attention(mesh, "auto")
    q = torch.randn(1, 4, 8, 8)
    info = seqmesh.SequenceInfo(seq_len=8, cu_seqlens=None, layout="zigzag")
    try:  # a model that builds its own (B, 1, S, S) mask
        attention(layer, q, q[:, :2], q[:, :2], torch.zeros(1, 1, 8, 8), seqmesh=info)
        answers["own_mask"] = "no error"
    except ValueError as err:
        answers["own_mask"] = str(err)
    out, _ = attention(layer, q, q[:, :2], q[:, :2], None, seqmesh=info)
    answers["plain_shape"] = list(out.shape)
    return answers


def test_chunked_attention_and_model_built_masks_are_refused(pools):
    (answers,) = pools.run(1, refusals)
    assert "attention_chunk_size=8" in answers["chunked"] and "Set config.attention_chunk_size = None" in answers["chunked"]
    assert "passed its own attention mask (shape (1, 1, 8, 8))" in answers["own_mask"], answers
    assert answers["plain_shape"] == [1, 8, 4, 8]


def test_layers_seqmesh_would_not_compute_are_named():
    """Soft-capping (Gemma 2 style, set on Gemma 3) and bidirectional windows are refused by name before
    any work; Gemma 3 as published (no soft-capping) passes."""
    import pytest
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from seqmesh.hf.layers import check_layers

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, vocab_size=64, sliding_window=4)
    check_layers(Gemma3ForCausalLM(Gemma3TextConfig(**small)))
    assert Gemma3TextConfig().attn_logit_softcapping is None
    with pytest.raises(ValueError, match=r"soft-capping \(attn_logit_softcapping=30.0.*seqmesh supports"):
        check_layers(Gemma3ForCausalLM(Gemma3TextConfig(**small, attn_logit_softcapping=30.0)))
    with pytest.raises(ValueError, match="bidirectional"):
        check_layers(Gemma3ForCausalLM(Gemma3TextConfig(**small, use_bidirectional_attention=True)))
