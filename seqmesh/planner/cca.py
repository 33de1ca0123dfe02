"""What ZAYA's Compressed Convolutional Attention projection adds to its attention layer on the busiest rank, as
``seqmesh.hf.cca`` runs it (the model's shape: :mod:`seqmesh.model.zaya`): two halo all-gathers forward, each run's
``time0 + time1 - 2`` rows of q | k before it for the convs and one row of the delayed value projection (their
reduce-scatters backward, the same bytes), which nothing overlaps; the convs' multiply-adds (counted with the
layer's matmuls, :func:`.workload.layer_matmul_params`); and the tensors the projection keeps for backward. The
attention itself is the layer's :class:`.attention_layer.Attention`, which adds these where the model has CCA.
"""

from __future__ import annotations

from ..linear_attention.choice import halo_bytes
from ..rules.degrees import Degrees
from .activations import tokens
from .hardware import HardwareSpec
from .network import axis_groups, gather_seconds
from .traffic import Collective, RankTraffic, dtype_bytes, worst_rank
from .workload import Workload

KEY = "cca_halo_gather"


def _halo_parts(work: Workload, layout: Degrees) -> tuple[int, int]:
    """Bytes each rank sends forward in the layer's two halo all-gathers: q | k's rows, the delayed value's row."""
    cca = work.model.hybrid.cca
    common = dict(batch=work.batch, ulysses=layout.ulysses, ring=layout.ring, layout=work.layout,
                  dtype_bytes=dtype_bytes(work.torch_dtype))
    return halo_bytes(cca.channels, cca.halo_kernel, **common), halo_bytes(cca.delayed, 2, **common)


def cca_ranks(work: Workload, layout: Degrees) -> list[RankTraffic]:
    """Each sequence rank's halo traffic in one layer: two all-gathers forward, their reduce-scatters backward."""
    calls = tuple(Collective(kind, phase, 1, sent) for sent in _halo_parts(work, layout)
                  for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")))
    return [RankTraffic(r % layout.ulysses, r // layout.ulysses, calls) for r in range(layout.ulysses * layout.ring)]


def cca_traffic(work: Workload, layout: Degrees) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) bytes the busiest rank sends in one layer's halo collectives."""
    ranks = cca_ranks(work, layout)
    return ({KEY: worst_rank(ranks, "all_gather", "forward")}, {KEY: worst_rank(ranks, "reduce_scatter", "backward")})


def cca_seconds(work: Workload, layout: Degrees, hw: HardwareSpec) -> float:
    """Seconds of one phase's two halo collectives (forward's all-gathers, backward's reduce-scatters: the same
    bytes), end to end: the convs wait for them."""
    group = axis_groups(layout, "sequence")[0]
    return sum(gather_seconds(sent, hw, group) for sent in _halo_parts(work, layout))


def cca_saved_bytes(work: Workload, layout: Degrees) -> int:
    """Bytes the projection keeps for backward beyond an attention layer's (an estimate, not yet checked against a
    run): per local token q | k and the depthwise conv's output (the convs' inputs), the q and k residual paths
    (``H D`` and ``Hkv D``), the delayed value projection, and the two residual scalings' inputs (two of the hidden
    size each)."""
    m, e = work.model, work.act_bytes
    cca = m.hybrid.cca
    per_token = 3 * cca.channels + cca.delayed + 4 * m.hidden  # q | k, its depthwise conv, the residual paths
    return tokens(work, layout) * e * per_token
