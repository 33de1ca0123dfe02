"""xLSTM (``xlstm``) as the planner sizes it, read from a transformers ``config.json``: ``num_blocks`` (else
``num_hidden_layers``) blocks of hidden ``H``, each an RMSNorm, an mLSTM layer, an RMSNorm and a gated feed-forward;
the embeddings, a final RMSNorm (``out_norm``) and a head, never tied (transformers ties no xLSTM weights, whatever
``tie_word_embeddings`` says). With ``NH =
num_heads``, ``Q = int(H x qk_dim_factor)``, ``V = int(H x v_dim_factor)`` and ``U = H x ffn_proj_factor`` rounded up
to ``ffn_round_up_to_multiple_of``, a block holds (``seqmesh.hf.xlstm`` runs it; ``weight_mode`` "fused" holds the
same weights in two matrices)::

    mLSTM         q, k  H x Q each;  v, ogate_preact  H x V each;  igate, fgate  H x NH each, biased
                  multihead_norm  V;  out_proj  V x H   (q, k, v, ogate, out_proj and the norm biased with use_bias)
    feed-forward  proj_up_gate, proj_up  H x U each;  proj_down  U x H   (biased with use_bias)
    norms         norm_mlstm, norm_ffn  H each (and a bias each with use_bias)

Each head's memory is ``(Q / NH) x (V / NH)``, with its normaliser (``Q / NH``) and stabiliser.
"""

from __future__ import annotations

from .hybrid_shape import XLSTM, FeedForward, HybridShape, XlstmShape

FEED_FORWARD = "xlstm_ffn"


def xlstm_fields(cfg: dict) -> dict:
    """The :class:`.hybrid_shape.HybridShape` of an xLSTM config.json (``hybrid``, ``layers``)."""
    h = cfg.get("hidden_size") or cfg.get("embedding_dim") or 4096
    n = cfg.get("num_blocks") or cfg.get("num_hidden_layers") or 32
    bias = bool(cfg.get("use_bias", False))
    multiple = cfg.get("ffn_round_up_to_multiple_of", 64)
    # transformers' rounding, on the float width: 1536 x 2.667 = 4096.5 gives 4096, not 4160
    up = int(((h * cfg.get("ffn_proj_factor", 2.667) + multiple - 1) // multiple) * multiple)
    mixer = XlstmShape(cfg.get("num_heads", 8), int(h * cfg.get("qk_dim_factor", 0.5)),
                       int(h * cfg.get("v_dim_factor", 1.0)), bias, cfg.get("chunk_size", 64))
    # kept for backward a token: the gate's and the up projection's outputs, the SiLU's, their product (down's input)
    ffn = FeedForward(3 * h * up + ((2 * up + h) if bias else 0), 3 * h * up, 4 * up)
    hybrid = HybridShape(None, ((XLSTM, FEED_FORWARD),) * n, ((FEED_FORWARD, ffn),), norms=4 if bias else 2,
                         xlstm=mixer)
    # its head is never tied (transformers 5.24's xLSTMForCausalLM names no tied weights, whatever the file says)
    return {"hybrid": hybrid, "layers": n, "config": {"hidden_size": h, "intermediate_size": up,
                                                      "tie_word_embeddings": False}}
