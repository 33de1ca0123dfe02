"""How big generation's KV cache is on a rank: the one rule ``seqmesh.inference`` and ``seqmesh plan --inference``
share. Every rank of the sequence group keeps its own tokens' keys and values, all heads; the prompt's tokens as the
layout dealt them, each new token on the rank holding fewest. Torch-free."""

from __future__ import annotations

from .padding import padded_length


def cache_bytes(tokens: int, layers: int, kv_heads: int, key_dim: int, value_dim: int, element_bytes: int,
                batch: int = 1) -> int:
    """Bytes of keys and values for ``tokens`` tokens of ``layers`` attention layers (one rank's share: pass its
    token count)."""
    return batch * tokens * layers * kv_heads * (key_dim + value_dim) * element_bytes


def indexed_cache_bytes(tokens: int, layers: int, indexer_layers: int, latent_dim: int, index_head_dim: int,
                        element_bytes: int, batch: int = 1) -> int:
    """Bytes of ``layers`` DeepSeek Sparse Attention layers' cache for ``tokens`` tokens (``seqmesh.inference.
    indexed_decode``): MLA's own, each token's latent and rotated key (``latent_dim`` = kv_lora_rank +
    qk_rope_head_dim) in every layer, and the indexer's key in the ``indexer_layers`` that have one (GLM-5's and
    HY-V4's shared layers do not)."""
    return batch * tokens * (layers * latent_dim + indexer_layers * index_head_dim) * element_bytes


def cache_share(prompt: int, new_tokens: int, ulysses: int, ring: int, layout: str = "zigzag", tp: int = 1) -> int:
    """Tokens the fullest rank's cache holds after ``new_tokens`` (the last one drawn is never run): the prefill's
    share of the padded prompt (the padding falls on one rank; with ``tp``, each share padded to split into ``tp``
    slices), then each new token on the rank holding fewest, which levels the shares."""
    ranks = ulysses * ring
    prefilled = padded_length(prompt, ulysses, ring, layout, tp) // ranks
    return max(prefilled, -(-(prompt + new_tokens - 1) // ranks))


# how a prefill onto a kept cache attends it (seqmesh.inference.extend): the one that moves fewer bytes, or one named
SCHEDULES = ("auto", "pass_kv", "pass_q")
