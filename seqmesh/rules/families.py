"""The families seqmesh refuses whatever their sizes, and why: one table, read by ``seqmesh.hf`` (which refuses the
model before it runs) and by the config.json reader (which refuses the file before its sizes are read, where the
family's names would otherwise surface as a missing entry). Torch-free: ``seqmesh plan`` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

# families whose attention is not one causal stream seqmesh could shard, or that seqmesh does not compute yet: why,
# precisely, and what would make them computable (config.json's model_type -> its reason, given the config; None where
# the config is one seqmesh runs). The census (tests/hf/test_family_census.py) meets each.
FAMILY_REASONS: dict[str, Callable[[object], str | None]] = {
    "big_bird": lambda c: None if getattr(c, "attention_type", None) == "original_full" else (
        "its block-sparse attention (attention_type='block_sparse', the default) attends both ways over global, "
        "sliding and random blocks drawn per call, which is not a causal language model's attention; set "
        "attention_type='original_full' and is_decoder=True, which seqmesh runs exactly"),
    "cpmant": lambda c: (
        "CPM-Ant's causal LM attends both ways: its model marks every token as context (_prepare_attention_mask), so "
        "each position's logits read the tokens after it, which is not a causal language model's attention and no "
        "config setting changes; beside it, each call prepends "
        f"prompt_length={getattr(c, 'prompt_length', '?')} learned prompt tokens and adds a learned bias by the "
        "bucket of each key's relative position and segment (CpmAntSegmentPositionEmbedding), outside transformers' "
        "AttentionInterface. Computing it would take attention both ways with that bias over the gathered row and "
        "the prompt held once, which seqmesh does not build for a model that is not causal; train a causal model"),
    "reformer": lambda c: (
        "Reformer's LSH attention hashes each call's keys into buckets by random rotations and attends within sorted "
        "chunks, and its local attention within fixed chunks of the call: neither is the causal attention of the "
        "whole row, and a rank would hash and chunk its own shard only; no layout makes it exact"),
    "xlnet": lambda c: (
        "XLNet's two-stream relative attention (a content and a query stream, relative encodings of each call's "
        "length, a permutation mask) is not one causal stream over the row; no layout makes it exact"),
    "prophetnet": lambda c: (
        "ProphetNet's decoder predicts n future tokens in n-gram streams beside its main one, with a relative "
        "position bucket bias over each call; its streams are not one causal stream over the row"),
    "blt": lambda c: (
        "BLT reads bytes with a local encoder, groups them into patches by an entropy model and runs its global "
        "transformer over the patches, cross-attending bytes and patches; its patches are drawn from each call's "
        "bytes, not positions seqmesh can shard (it has no attention heads at its top level)"),
}


def config_reason(config: object) -> str | None:
    """Why the family of ``config`` (a transformers config, or a config.json's dict) is refused, or None."""
    if isinstance(config, dict):
        config = SimpleNamespace(**config)
    rule = FAMILY_REASONS.get(getattr(config, "model_type", None))
    return rule(config) if rule is not None else None
