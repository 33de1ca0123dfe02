"""The state pass across ranks, shared by every recurrence that is affine in its state.

Over a run of consecutive positions a linear recurrence (Gated DeltaNet, KDA, Mamba, Mamba2,
lightning attention) maps the state entering the run to the state leaving it affinely, and adds
to each output a term linear in the entering state::

    S_out = T(S_in) + S_0      T: the run's transition (a matrix, a diagonal or a scalar per head)
    o_t   = o_t(0) + R_t(S_in) R_t: read through the run's decay up to t

Each rank runs its runs from zero (``o(0)``, ``S_0``) and its transition at once, with no rank waiting
for another; this module is the rest, the schedule, the same for every mixer::

    1. all-gather every run's [S_0 | T], packed flat (B, P * R, X)             (one collective)
    2. scan the runs in global order: S_in(j) = T_{j-1}(S_in(j-1)) + S_0(j-1), zero at segment starts
    3. o += R(S_in) on each run that does not start a segment

A mixer gives its packing (``carry``: a run's packed row and a state -> the next state) and its read
(``read``: the run's slice of ``lift`` and the entering state -> the output's correction). Backward is
autograd through the same steps; the all-gather's adjoint (a reduce-scatter) carries the gradient back
to the rank that produced each run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather
from .choice import runs_and_tails
from .halo import Placement, pad_rows

Carry = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (packed run (B, X), state) -> state
Read = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (lift (B, t, ...), state) -> (B, t, ...) correction


class _Tie(torch.autograd.Function):
    """Forward: ``out`` unchanged; backward: ``out``'s gradient, and zeros for ``tied``. A rank whose
    output does not read the gathered states (its runs all start segments) still runs the gather's
    adjoint, which the other ranks wait for."""

    @staticmethod
    def forward(ctx, out, tied):  # type: ignore[override]
        ctx.shape, ctx.dtype = tied.shape, tied.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def pass_states(out: torch.Tensor, lift: torch.Tensor, finals: torch.Tensor, place: Placement, zero_state: torch.Tensor,
                *, carry: Carry, read: Read, keep: dict | None = None) -> torch.Tensor:
    """``out`` (B, L, ...) the rank's outputs from zero entering states, shard order; ``lift`` (B, L, ...) what
    ``read`` needs per token; ``finals`` (B, N, X) every segment's packed [S_0 | T] (N: the segments of
    ``place.mine.segment_bounds``); ``zero_state`` the state at a segment start -> ``out`` with every
    run's entering state read in. ``keep`` (one document a row): ``keep["end"]``, the local index of the row's last
    real token on the rank that holds it (None elsewhere), is given ``keep["state"]``, the state after that token on
    every rank (what a decode starts from; the layout's padding after it is a segment of its own, not carried)."""
    def corrected(segment: int, state: torch.Tensor) -> torch.Tensor:
        a, e = place.mine.segment_bounds[segment], place.mine.segment_bounds[segment + 1]
        return (out[:, a:e] + read(lift[:, a:e], state)).to(out.dtype)

    return rerun_states(out, finals, place, zero_state, carry=carry, rerun=corrected, keep=keep)


def rerun_state_bytes(values: int, *, batch: int, ulysses: int, ring: int, layout: str, state_bytes: int = 4) -> int:
    """Bytes each rank sends forward in the all-gather of :func:`pass_states` or :func:`rerun_states` (its
    reduce-scatter the same backward) for ``values`` a run (``[S_0 | T]``'s, RWKV's ``[a0 | b0 | p0 | log T]``):
    ``(P - 1) x runs x B x values``, ``runs`` the busiest rank's (``choice.runs_and_tails``), whatever the length."""
    runs, _ = runs_and_tails(ulysses, ring, layout)
    return (ulysses * ring - 1) * batch * runs * values * state_bytes


def rerun_states(out: torch.Tensor, finals: torch.Tensor, place: Placement, zero_state: torch.Tensor, *, carry: Carry,
                 rerun: Callable[[int, torch.Tensor], torch.Tensor], keep: dict | None = None) -> torch.Tensor:
    """As :func:`pass_states`, for a recurrence whose outputs are not affine in the entering state (RWKV's ratio):
    ``rerun(segment, state)`` gives the outputs (B, e - a, ...) of the segment ``[a, e)`` of
    ``place.mine.segment_bounds`` from ``state``, which replace its slice of ``out`` on every segment that receives a
    state; ``carry`` may be any associative combination (RWKV's runs in log space)."""
    chain, mine, rank = place.chain, place.mine, place.rank
    if len(chain.runs) == 1:  # one rank: every run starts a segment, nothing to pass
        if keep is not None:
            keep["state"] = _state_after(keep["end"], finals, mine, {}, zero_state, carry)
        return out
    leaving = pad_rows(finals[:, list(mine.last_segment)], chain.max_runs)  # (B, R, X)
    every = all_gather(leaving, place.group, dim=1)  # (B, P * R, X)

    state, entering = zero_state, {}
    last = max(j for j, (r, _) in enumerate(chain.order) if r == rank)
    for r, j in chain.order[: last + 1]:
        if r == rank:
            entering[j] = state
        state = carry(every[:, r * chain.max_runs + j], state)  # zero T where the run ends in a new segment
    if keep is not None:
        final = _state_after(keep["end"], finals, mine, entering, zero_state, carry).detach()
        dist.all_reduce(final, group=place.group)  # held by one rank, zero on the others
        keep["state"] = final

    pieces, at = [], 0
    for segment, j in zip(mine.incoming, mine.run_of_incoming):
        a, e = mine.segment_bounds[segment], mine.segment_bounds[segment + 1]
        pieces += [out[:, at:a], rerun(segment, entering[j])]
        at = e
    out = torch.cat(pieces + [out[:, at:]], dim=1) if pieces else out
    return _Tie.apply(out, every) if every.requires_grad else out


def _state_after(end: int | None, finals: torch.Tensor, mine, entering: dict, zero_state: torch.Tensor,
                 carry: Carry) -> torch.Tensor:
    """The state after local token ``end`` where its segment ends there (zero where ``end`` is None): its segment's
    [S_0 | T] carried from the state entering it (its run's, or zero at a segment start)."""
    if end is None:
        return torch.zeros_like(zero_state)
    segment = max(i for i, b in enumerate(mine.segment_bounds[:-1]) if b <= end)
    if mine.segment_bounds[segment + 1] != end + 1:
        raise ValueError(f"local token {end} does not end its segment {mine.segment_bounds}: the state after it is not "
                         "a segment's final state.")
    start = entering.get(mine.run_of_incoming[mine.incoming.index(segment)]) if segment in mine.incoming else None
    return carry(finals[:, segment], zero_state if start is None else start)
