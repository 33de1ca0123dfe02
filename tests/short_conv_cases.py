"""Worker-side cases for the gated short convolutions (LFM2, LFM2-MoE, LFM3): a halo one token short (the mutation
the parity tolerance must see) and the halo's measured traffic per layer."""

from __future__ import annotations

import dataclasses

import torch

import seqmesh
import seqmesh.linear_attention.halo as halo
from dist_cases import get_mesh
from family_cases import _batch, build, family_config, family_parity, share_references
from seqmesh.hf import parallelize, unparallelize
from seqmesh.hf.short_conv import is_short_conv


def parity_all(cases: list[tuple], seq_len: int = 45) -> list[dict]:
    """family_parity of each ``(family, ulysses, ring, layout, documents)`` on ``seq_len`` tokens."""
    share_references(cases, seq_len)
    return [{"case": c, **family_parity(*c, seq_len=seq_len)} for c in cases]


def parity_with_a_short_halo(cases: list[tuple]) -> list[dict]:
    """As :func:`parity_all`, with every conv placement built for a kernel one narrower than the conv: each run's
    first token reads one halo token too few (the farthest tap drops), everything else as the library does."""
    original = halo.placement

    def one_short(mesh, local_len, *, kernel: int = 1, **kwargs):
        return dataclasses.replace(original(mesh, local_len, kernel=kernel - 1, **kwargs), kernel=kernel)

    halo.placement = one_short
    try:
        return parity_all(cases)
    finally:
        halo.placement = original


def halo_traffic(family: str, ulysses: int, ring: int, layout: str, documents: bool, seq_len: int = 45) -> dict:
    """One forward of the parallelized float64 model: every all-gather the conv halos send (seen at
    ``halo.all_gather``) as the rows this rank receives from the others and their bytes, per conv layer."""
    mesh = get_mesh(ulysses, ring)
    config = family_config(family)
    model = parallelize(build(config), mesh)
    calls = []
    original = halo.all_gather

    def recording(x: torch.Tensor, group, dim: int) -> torch.Tensor:
        calls.append((tuple(x.shape), x.element_size()))
        return original(x, group, dim)

    batch = seqmesh.shard_batch(_batch(seq_len, config.vocab_size, documents), mesh, layout=layout)
    halo.all_gather = recording
    try:
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        halo.all_gather = original
        unparallelize(model)
    p = mesh.sp_size
    convs = sum(1 for m in model.modules() if is_short_conv(m))
    # x (B, max_tail, C) sent; the all-gather brings (P - 1) such blocks from the other ranks
    received = [(p - 1) * shape[0] * shape[1] * shape[2] * size for shape, size in calls]
    return {"convs": convs, "calls": len(calls), "max_tail": sorted({shape[1] for shape, _ in calls}),
            "channels": config.hidden_size, "bytes_per_layer": max(received, default=0)}


def layer_refusals() -> dict:
    """What a parallelized LFM2 short-conv layer says when called without seqmesh's entry, with a cache, with a
    padding mask, and what the model says asked for a cache: each ValueError's message (or None if none came)."""
    from transformers import DynamicCache

    mesh = get_mesh(1, 2)
    config = family_config("lfm2")
    model = parallelize(build(config), mesh)
    layer = next(m for m in model.modules() if is_short_conv(m))
    batch = seqmesh.shard_batch(_batch(45, config.vocab_size, False), mesh)
    hidden = torch.zeros(1, batch["input_ids"].shape[1], config.hidden_size, dtype=torch.float64)
    calls = {
        "no entry": lambda: layer(hidden),
        "cache": lambda: layer(hidden, cache=DynamicCache(config=config), seqmesh=batch["seqmesh"]),
        "padding mask": lambda: layer(hidden, attention_mask=torch.ones(1, hidden.shape[1]), seqmesh=batch["seqmesh"]),
        "model cache": lambda: model(**batch, use_cache=True),
    }
    said = {}
    for what, call in calls.items():
        try:
            call()
            said[what] = None
        except ValueError as err:
            said[what] = str(err)
    unparallelize(model)
    return said
