"""What spawned ranks run for tests/hf/test_lightning.py: MiniMax's parity (family_cases.family_parity) with one
part of seqmesh's lightning attention deliberately broken, the break undone afterwards (a pool's rank runs
later cases too)."""

from __future__ import annotations

import torch

import seqmesh
import seqmesh.hf.lightning as lightning
import seqmesh.linear_attention.passing as passing
from dist_cases import get_mesh
from family_cases import _batch, build, family_config, family_parity
from seqmesh.hf import parallelize, unparallelize
from seqmesh.linear_attention.decay_scan import chunk_decay_scan
from seqmesh.linear_attention.halo import placement


def _state_dropped(q, k, v, g, place, keep=None):
    """Each rank's runs from a zero state: no state passed between ranks."""
    return chunk_decay_scan(q, k, v, g, place.mine.segment_bounds)[0]


def _documents_ignored(mesh, local_len, *, layout, seq_len, cu_seqlens=None, **kwargs):
    """The placement of one document: the state not reset where a packed document starts."""
    return placement(mesh, local_len, layout=layout, seq_len=seq_len, cu_seqlens=None, **kwargs)


MUTATIONS = {"state_dropped": ("pass_decay_states", _state_dropped),
             "documents_ignored": ("placement", _documents_ignored)}


def mutated_parity(mutation: str, *case) -> dict:
    """``family_parity(*case)`` with ``mutation`` (a key of MUTATIONS) in seqmesh.hf.lightning."""
    name, broken = MUTATIONS[mutation]
    original = getattr(lightning, name)
    setattr(lightning, name, broken)
    try:
        return family_parity(*case)
    finally:
        setattr(lightning, name, original)


def state_pass_traffic(ulysses: int, ring: int, layout: str, documents: bool) -> list[dict]:
    """The all-gathers of the state pass in one forward of the parallelized MiniMax: per call, the rank's sent rows'
    shape and dtype size, and the bytes it receives from the other ranks."""
    mesh = get_mesh(ulysses, ring)
    config = family_config("minimax")
    lm = parallelize(build(config), mesh)
    local = seqmesh.shard_batch(_batch(45, config.vocab_size, documents), mesh, layout=layout)
    calls, original = [], passing.all_gather

    def counted(x: torch.Tensor, group, dim: int) -> torch.Tensor:
        out = original(x, group, dim=dim)
        calls.append({"sent": tuple(x.shape), "itemsize": x.element_size(),
                      "received": (out.numel() - x.numel()) * x.element_size()})
        return out

    passing.all_gather = counted
    try:
        with torch.no_grad():
            lm(**local, use_cache=False)
    finally:
        passing.all_gather = original
        unparallelize(lm)
    return calls
