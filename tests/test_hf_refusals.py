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
