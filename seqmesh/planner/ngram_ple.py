"""Qwen4-Exp's PLE layer (the shape: :class:`seqmesh.model.qwen4_exp.PleShape`) as ``seqmesh.hf.ngram_ple`` runs it
before its Gated DeltaNet layer: what it adds to that layer's FSDP unit, collectives, saved tensors and time.

Each rank extends its runs by their halo twice (:func:`seqmesh.linear_attention.choice.halo_bytes`, ``reach`` earlier
rows each, ``reach`` the layer's): its token ids (int64, no gradient) before the n-gram lookup, and the conv's normed
input (``n x E`` channels, the compute dtype) before the dilated conv; backward, the latter's gradient is
reduce-scattered. Everything else is per token: the lookup, two projections, three norms over the streams, a gate.
"""

from __future__ import annotations

from ..linear_attention.choice import halo_bytes
from ..rules.degrees import Degrees
from .activations import tokens
from .layer_cost import Phases, gather_phases
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload

KEY = "ple_halo_gather"
INT64 = 8


def ple_params(work: Workload) -> int:
    """The largest PLE layer's parameters (its n-gram tables most of them), in its layer's FSDP unit."""
    return work.model.qwen_exp.ple_params(work.model.hidden, largest=True)


def ple_ranks(work: Workload, layout: Degrees) -> list[RankTraffic]:
    """Each sequence rank's PLE collectives in one layer: the two halo all-gathers forward (ids, the conv's input),
    the conv input's reduce-scatter backward."""
    m, ple = work.model, work.model.qwen_exp.ple
    halo = dict(kernel=ple.reach + 1, batch=work.batch, ulysses=layout.ulysses, ring=layout.ring, layout=work.layout)
    ids = halo_bytes(1, dtype_bytes=INT64, **halo)
    conv = halo_bytes(m.qwen_exp.streams * m.hidden, dtype_bytes=dtype_bytes(work.torch_dtype), **halo)
    calls = (Collective("all_gather", "forward", 2, ids + conv), Collective("reduce_scatter", "backward", 1, conv))
    return [RankTraffic(r % layout.ulysses, r // layout.ulysses, calls)
            for r in range(layout.ulysses * layout.ring)]


def ple_phases(work: Workload, layout: Degrees) -> Phases:
    return gather_phases(ple_ranks(work, layout), KEY, work.checkpointing)


def ple_saved(work: Workload, layout: Degrees) -> int:
    """What a PLE layer keeps for backward: its three norms' float32 inputs and normalized streams (``n x E`` each),
    the key and query norms' outputs (their product's inputs), the conv's padded input and its output (SiLU's
    input), the embeddings (the projections' input, ``P``), the value (``E``), and the gate's few scalars a stream."""
    m, e, q = work.model, work.act_bytes, work.model.qwen_exp
    wide = q.streams * m.hidden
    return tokens(work, layout) * (6 * 4 * wide + 4 * e * wide + e * (q.ple.embed_dim + m.hidden) + 6 * 4 * q.streams)


def ple_macs(work: Workload) -> int:
    """Multiply-adds a token: the key and value projections and the conv (the lookup reads its rows)."""
    m, q = work.model, work.model.qwen_exp
    wide = q.streams * m.hidden
    return q.ple.embed_dim * (wide + m.hidden) + wide * q.ple.kernel
