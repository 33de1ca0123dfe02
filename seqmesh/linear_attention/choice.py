"""Which of the two sequence-parallel Gated DeltaNet designs a layer runs: the one rule, shared by the
layers (``linear_attention="auto"``) and the planner.

Per layer, rank and direction (forward; backward sends the same bytes through the adjoints)::

    all_to_all:    two all-to-alls, B S (P-1)/P^2 (2 Hk Dk + Hv (2 Dv + 2)) elements; no extra compute;
                   needs P <= Hv (each rank runs the recurrence of whole heads)
    state_passing: two all-gathers, (P-1) B (runs Hv Dk (Dk + Dv) float32 + tails (K-1) conv_dim elements),
                   independent of S; the recurrence runs Dk more value columns and reads the state once
                   more: B S/P Hv (2 (4 C Dk + C Dk + 4 Dk Dk) + 2 Dk Dv) extra FLOPs

Both designs issue two collectives each way over the whole sequence group, so their latency terms are
equal and the rule compares bytes over the link's bandwidth plus the extra compute over the achieved
FLOP rate. Without hardware figures the defaults are one H100 node (NVLink), where the planner's
presets put them; the planner passes its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..sequence.layout import LayoutKind

LINEAR_CHUNK = 64  # tokens per chunk of the chunked recurrence: gated_delta's CHUNK and the planner's
# one H100 SXM node: NVLink bytes/s one GPU sends, dense bf16 FLOP/s achieved by the recurrence's kernels
H100_NVLINK_BANDWIDTH = 360e9
H100_RECURRENCE_FLOPS = 0.3 * 989e12


class LinearDesign(str, enum.Enum):
    ALL_TO_ALL = "all_to_all"
    STATE_PASSING = "state_passing"
    AUTO = "auto"


def parse_design(design: str | LinearDesign) -> LinearDesign:
    try:
        return LinearDesign(design)
    except ValueError:
        names = ", ".join(repr(d.value) for d in LinearDesign)
        raise ValueError(f"unknown linear_attention design {design!r}; choose one of {names}.") from None


@dataclass(frozen=True)
class LinearShape:
    """One Gated DeltaNet layer on a ``ulysses x ring`` sequence group."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int  # the short conv's width
    seq_len: int
    batch: int
    ulysses: int
    ring: int
    layout: str = "zigzag"
    dtype_bytes: int = 2  # activations
    state_bytes: int = 4  # the recurrent state travels in float32 (float64 for float64 inputs)

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def runs_and_tails(ulysses: int, ring: int, layout: str) -> tuple[int, int]:
    """(runs of consecutive positions, positions-before-a-run-start blocks) on the busiest rank, for zigzag and
    contiguous layouts whose pieces are at least ``kernel - 1`` tokens long (per_document: as zigzag, a lower
    bound). Zigzag: ring rank r holds chunks r and 2R-1-r (chunks R-1 and R meet on rank R-1); an odd number
    of Ulysses ranks leaves one piece straddling the two chunks."""
    if LayoutKind(layout) is LayoutKind.CONTIGUOUS or ring == 1:
        return 1, 1
    if ulysses % 2 == 0:
        return 1, 1
    return 2, 2 if ring >= 3 or ulysses >= 3 else 1


def halo_bytes(channels: int, kernel: int, *, batch: int, ulysses: int, ring: int, layout: str, dtype_bytes: int) -> int:
    """Bytes each rank sends forward (its reduce-scatter the same backward) in the all-gather of a depthwise causal
    conv's halo (:func:`seqmesh.linear_attention.halo.halo_causal_conv`): ``(P - 1) x max_tail`` rows of
    ``channels`` per batch row, ``max_tail = tails x (kernel - 1)`` on the busiest rank (:func:`runs_and_tails`)."""
    _, tails = runs_and_tails(ulysses, ring, layout)
    return (ulysses * ring - 1) * batch * tails * (kernel - 1) * channels * dtype_bytes


def state_passing_bytes(key_heads: int, value_heads: int, key_dim: int, value_dim: int, *, batch: int, ulysses: int,
                        ring: int, layout: str, kernel: int, dtype_bytes: int, state_bytes: int = 4) -> int:
    """Bytes each rank sends forward (and again backward) in the two all-gathers of state passing."""
    p = ulysses * ring
    runs, _ = runs_and_tails(ulysses, ring, layout)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    states = runs * value_heads * key_dim * (key_dim + value_dim) * state_bytes  # [B | A] of each run
    return (p - 1) * batch * states + halo_bytes(conv_dim, kernel, batch=batch, ulysses=ulysses, ring=ring,
                                                 layout=layout, dtype_bytes=dtype_bytes)


def all_to_all_bytes(shape: LinearShape) -> int:
    """Bytes each rank sends forward in the all-to-all design, heads split evenly."""
    p = shape.ranks
    channels = 2 * shape.key_heads * shape.key_dim + shape.value_heads * (2 * shape.value_dim + 2)
    return shape.batch * shape.seq_len * (p - 1) * channels * shape.dtype_bytes // (p * p)


def state_passing_extra_flops(shape: LinearShape) -> int:
    """FLOPs state passing adds on each rank forward: Dk more value columns in the chunked recurrence (its
    value-width terms) and the incoming state read through G."""
    dk, dv, c = shape.key_dim, shape.value_dim, LINEAR_CHUNK
    local = shape.batch * -(-shape.seq_len // shape.ranks)
    return local * shape.value_heads * (2 * (c * dk + 4 * dk * dk) + 2 * dk * dv)


def design_seconds(shape: LinearShape, design: LinearDesign, *, bandwidth: float, flops: float) -> float:
    """Forward seconds a design adds to the layer beyond the work both share (its bytes over ``bandwidth``, its
    extra compute over ``flops``); infinite for an all-to-all the heads cannot split."""
    if design is LinearDesign.ALL_TO_ALL:
        return all_to_all_bytes(shape) / bandwidth if shape.ranks <= shape.value_heads else float("inf")
    sent = state_passing_bytes(shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim, batch=shape.batch,
                               ulysses=shape.ulysses, ring=shape.ring, layout=shape.layout, kernel=shape.kernel,
                               dtype_bytes=shape.dtype_bytes, state_bytes=shape.state_bytes)
    return sent / bandwidth + state_passing_extra_flops(shape) / flops


def choose_design(shape: LinearShape, design: str | LinearDesign = LinearDesign.AUTO, *,
                  bandwidth: float = H100_NVLINK_BANDWIDTH, flops: float = H100_RECURRENCE_FLOPS) -> LinearDesign:
    """``design`` itself unless it is ``auto`` (then the cheaper by :func:`design_seconds`, the all-to-all on a
    tie); on one rank, the all-to-all (both are the one-device computation). An explicit all-to-all with more
    ranks than value heads is refused here, naming the fix."""
    design = parse_design(design)
    if shape.ranks == 1:
        return LinearDesign.ALL_TO_ALL
    if design is LinearDesign.ALL_TO_ALL and shape.ranks > shape.value_heads:
        raise ValueError(
            f"the Gated DeltaNet layers have {shape.value_heads} value heads, fewer than the {shape.ranks} ranks of the "
            f"sequence group: the all-to-all design needs a sequence degree of at most {shape.value_heads}; choose "
            "linear_attention='state_passing' (or 'auto'), which keeps every head on every rank.")
    if design is not LinearDesign.AUTO:
        return design
    # two plain comparisons, not min(..., key=...), which torch 2.9's dynamo cannot trace under --compile
    all_to_all = design_seconds(shape, LinearDesign.ALL_TO_ALL, bandwidth=bandwidth, flops=flops)
    passing = design_seconds(shape, LinearDesign.STATE_PASSING, bandwidth=bandwidth, flops=flops)
    return LinearDesign.STATE_PASSING if passing < all_to_all else LinearDesign.ALL_TO_ALL
