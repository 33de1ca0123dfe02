"""RWKV-4 (``rwkv``) as the planner sizes it, read from a transformers ``config.json``: ``num_hidden_layers`` blocks
of hidden ``H``, each a LayerNorm, the time mix, a LayerNorm and the channel mix (block 0 normalises its input once
more first); the embeddings, a final LayerNorm and an untied head. With ``A = attention_hidden_size`` (default H) and
``I = intermediate_size`` (default 4 H), a block holds (``seqmesh.hf.rwkv`` runs it)::

    time mix     time_decay, time_first  A each;  time_mix_key / _value / _receptance  H each
                 key, value, receptance  H x A each;  output  A x H
    channel mix  time_mix_key / _receptance  H each;  key  H x I;  receptance  H x H;  value  I x H
    ln1, ln2     LayerNorms of H (weight and bias)
"""

from __future__ import annotations

from .hybrid_shape import RWKV, FeedForward, HybridShape, RwkvShape

CHANNEL_MIX = "rwkv_channel_mix"


def rwkv_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of an RWKV config.json (``hybrid``, ``layers``)."""
    n, h = cfg.get("num_hidden_layers") or 32, cfg["hidden_size"]
    width = cfg.get("intermediate_size") or 4 * h
    matmuls = h * width + h * h + width * h  # key, receptance, value
    # kept for backward a token: its two mixes of the input and key's output, the squared ReLU's input and output,
    # the receptance's output and its sigmoid, value's output
    mix = FeedForward(matmuls + 2 * h, matmuls, 2 * h + 3 * width + 3 * h)
    hybrid = HybridShape(None, ((RWKV, CHANNEL_MIX),) * n, ((CHANNEL_MIX, mix),), norms=4,
                         rwkv=RwkvShape(cfg.get("attention_hidden_size") or h), extra_params=3 * h)
    # extra: block 0's pre_ln (weight and bias) and the final LayerNorm's bias (its weight is the final norm)
    return {"hybrid": hybrid, "layers": n, "config": {"tie_word_embeddings": cfg.get("tie_word_embeddings", False)}}
