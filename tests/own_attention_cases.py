"""Worker-side cases for the families whose attention seqmesh runs itself (BLOOM, MPT, Falcon, GPT-Neo, GPT-NeoX-
Japanese, Doge, ...): the mutations the parity tolerance must see (each Ulysses rank's heads given the first heads'
slopes; one rank's rotary positions off by one; GPT-Neo's local window dropped; GPT-NeoX-Japanese's rotary over the
whole head; Doge's key bias dropped), and the refusals of a parallelized layer."""

from __future__ import annotations

import dataclasses

import torch

import seqmesh
import seqmesh.sharded_attention.api as api
from dist_cases import get_mesh, refusals_said
from family_cases import _batch, build, family_config, family_parity
from short_conv_cases import parity_all
from seqmesh.hf import parallelize, unparallelize


def parity_with_slopes_unmoved(cases: list[tuple]) -> list[dict]:
    """As :func:`short_conv_cases.parity_all`, with every Ulysses rank's heads biased by the first heads' slopes
    (the slopes not dealt with their heads), everything else as the library does."""
    original = api.for_heads
    api.for_heads = lambda schedule, first, stop: original(schedule, 0, stop - first)
    try:
        return parity_all(cases)
    finally:
        api.for_heads = original


def parity_with_positions_off_by_one(cases: list[tuple]) -> list[dict]:
    """As :func:`short_conv_cases.parity_all`, with rank 1's position ids one too far (its rotary rotated one step
    more) in the logits' forward."""
    return [{"case": c, **family_parity(*c, seq_len=45, shift_positions_on=1)} for c in cases]


def _parity_with_family_changed(cases: list[tuple], key: str, **changes) -> list[dict]:
    """As :func:`short_conv_cases.parity_all`, with ``changes`` made to seqmesh's own-attention entry ``key`` (a field
    each, made from the original entry by :func:`dataclasses.replace`), restored after."""
    from seqmesh.hf import own_attention

    original = own_attention.FAMILIES[key]
    own_attention.FAMILIES[key] = dataclasses.replace(original, **changes)
    try:
        return parity_all(cases)
    finally:
        own_attention.FAMILIES[key] = original


def parity_with_whole_rotary(cases: list[tuple]) -> list[dict]:
    """GPT-NeoX-Japanese's partial rotary applied to the whole head."""
    from seqmesh.hf import own_attention

    def whole(module, q, k, cos, sin):  # its tables cover the leading half: repeated to the whole head
        return own_attention._rotate_whole(module, q, k, cos.repeat(1, 1, 2), sin.repeat(1, 1, 2))

    return _parity_with_family_changed(cases, "GPTNeoXJapaneseAttention", rotate=whole)


def parity_with_bias_dropped(cases: list[tuple]) -> list[dict]:
    """Doge's bias of each key left at zero in its folded channel."""
    from seqmesh.hf import own_attention

    fold = own_attention.FAMILIES["DogeAttention"].fold

    def unbiased(module, q, k, v, info):
        q, k, v = fold(module, q, k, v, info)
        return q, torch.cat([k[..., :-1], torch.zeros_like(k[..., -1:])], dim=-1), v

    return _parity_with_family_changed(cases, "DogeAttention", fold=unbiased)


def parity_with_both_ways(cases: list[tuple]) -> list[dict]:
    """RemBERT's decoder attention run both ways (its is_decoder flag not read)."""
    return _parity_with_family_changed(cases, "RemBertSelfAttention", causal=lambda module, args: False)


def _table_from_each_shard(lm) -> None:
    """RoFormer's sinusoidal table as its encoder makes it for each call: from each shard's first token."""
    lm.roformer.encoder.embed_positions._forward_hooks.clear()


def parity_with_table_from_each_shard(cases: list[tuple]) -> list[dict]:
    return [{"case": c, **family_parity(*c, seq_len=45, alter=_table_from_each_shard)} for c in cases]


def parity_with_windows_dropped(cases: list[tuple]) -> list[dict]:
    """GPT-Neo's local layers run as global ones (their window dropped)."""
    return _parity_with_family_changed(cases, "GPTNeoAttention", window=lambda module: None)


def _counted_per_shard(ids: torch.Tensor, pad: int, mesh, info) -> tuple[torch.Tensor, torch.Tensor]:
    real = ids != pad  # (B, L): XLM's own count, of this rank's tokens
    return torch.arange(ids.shape[1])[None] < real.sum(dim=1, keepdim=True), real


def parity_with_padding_counted_per_shard(cases: list[tuple]) -> list[dict]:
    """XLM's padding counted by each rank over its own tokens, as its model does on a call."""
    import seqmesh.hf.xlm as xlm

    original, xlm.kept_tokens = xlm.kept_tokens, _counted_per_shard
    try:
        return parity_all(cases)
    finally:
        xlm.kept_tokens = original


def xlm_refusals() -> dict[str, str]:
    """What a parallelized XLM says, on each rank, when it attends both ways over a row holding its padding id (on
    rank 0's shard only), and when called with lengths, langs or a cache: each ValueError's message."""
    mesh = get_mesh(1, 2)
    both, causal = (parallelize(build(family_config(f)), mesh) for f in ("xlm-both-ways", "xlm"))
    ids = _batch(16, 64, False)["input_ids"].clone()
    ids[0, 0] = both.config.pad_index  # the first token: rank 0's under zigzag
    padded = seqmesh.shard_batch({"input_ids": ids}, mesh)
    batch = seqmesh.shard_batch(_batch(16, 64, False), mesh)
    rows = torch.ones(1, 1, dtype=torch.long)
    calls = {
        "both ways, padded": lambda: both(**padded),
        "lengths": lambda: causal(**batch, lengths=torch.full((1,), 8)),
        "langs": lambda: causal(**batch, langs=rows.expand(1, 8)),
        "cache": lambda: causal.transformer(batch["input_ids"], cache=object(), seqmesh=batch["seqmesh"]),
    }
    said = refusals_said(calls)
    for model in (both, causal):
        unparallelize(model)
    return said


def layer_refusals(family: str = "bloom") -> dict[str, str]:
    """What a parallelized ALiBi layer says when called without the entry, with a padding mask, asked for its
    attention weights, or when the model is asked for a cache: each ValueError's message."""
    mesh = get_mesh(1, 2)
    config = family_config(family)
    model = parallelize(build(config), mesh)
    batch = seqmesh.shard_batch(_batch(16, config.vocab_size, False), mesh)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    hidden = torch.zeros(1, 8, config.hidden_size, dtype=torch.float64)
    calls = {
        "no entry": lambda: layer(hidden, hidden),
        "padding mask": lambda: layer(hidden, hidden, attention_mask=torch.ones(1, 1, 8, 8), seqmesh=batch["seqmesh"]),
        "weights": lambda: layer(hidden, hidden, output_attentions=True, seqmesh=batch["seqmesh"]),
        "model cache": lambda: model(**batch, use_cache=True),
    }
    said = refusals_said(calls)
    unparallelize(model)
    return said
