"""What spawned ranks run for tests/hf/test_lightning.py: MiniMax's parity (family_cases.family_parity) with one
part of seqmesh's lightning attention deliberately broken, the break undone afterwards (a pool's rank runs
later cases too)."""

from __future__ import annotations

import seqmesh.hf.lightning as lightning
from family_cases import family_parity
from seqmesh.linear_attention.decay_scan import chunk_decay_scan
from seqmesh.linear_attention.halo import placement


def _state_dropped(q, k, v, g, place):
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
