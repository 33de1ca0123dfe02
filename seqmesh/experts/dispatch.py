"""Dropless token dispatch to the ranks holding each token's experts, and back (exact: no capacity, no drop).

One MoE layer on one rank of an expert group of ``ep`` ranks, each holding ``n = E / ep`` experts::

    pairs     (T * k,)     this rank's token-expert pairs, sorted by expert (so by destination rank)
    counts    (ep, n)      pairs for each expert of each rank        -> all-to-all (int64, not differentiable)
    rows      (T * k, H)   the pairs' hidden rows, in that order     -> uneven all-to-all ("dispatch")
    received  (N, H)       rows from every rank, each rank's block sorted by expert: run through this rank's experts
    outputs   (N, H)       each expert's output, unweighted          -> the inverse all-to-all ("combine")
    back      (T * k, H)   in pair order again; weighted by the router and summed over the k picks on the token's rank

Routing weights stay with their tokens (the router's gradient never travels), and the experts see their rows
unweighted, so their math is the model's own per-expert forward. Backward runs the two exchanges reversed
(``seqmesh.comm.collectives.exchange_rows``, whose backward is its adjoint). What is counted equals
``seqmesh.experts.traffic.exchange_bytes`` of the counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import exchange_rows
from ..comm.stats import record
from ..tensor_values import host_ints
from .traffic import INT64


@dataclass(frozen=True)
class Route:
    """Where this rank's pairs go and what it receives (host counts: the all-to-all's sizes)."""

    order: torch.Tensor  # (T * k,) pair indices sorted by expert (stable)
    send: tuple[int, ...]  # (ep,) pairs to each rank
    receive: tuple[int, ...]  # (ep,) pairs from each rank
    local_experts: torch.Tensor  # (N,) which of this rank's experts each received row is for


def pair_counts(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k_index`` (T, k) -> (the pairs sorted by expert (T * k,), pairs per expert (E,) int64)."""
    flat = top_k_index.reshape(-1).long()  # a router may pick in int32; scatter_add_ indexes in int64
    order = torch.sort(flat, stable=True).indices
    # a bin past the last expert takes picks outside [0, experts) (plan_route names them); unlike bincount's, the
    # shape does not depend on the values, so a rehearsal's fake tensors have it too
    bins = torch.where((flat >= 0) & (flat < experts), flat, experts)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
    return order, counts.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int64))[:experts]


def received_experts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``counts`` (ep, n): pairs each rank sends to each of this rank's ``n`` experts, ``rows`` in all (known on the
    host: no second read of the device) -> the local expert of every received row, in arrival order (rank by rank,
    each rank's rows sorted by expert) (N,)."""
    ep, n = counts.shape
    ids = torch.arange(n, device=counts.device).repeat(ep)
    return torch.repeat_interleave(ids, counts.reshape(-1), output_size=rows)


def exchange_counts(per_expert: torch.Tensor, ep: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(E,) pairs per expert on this rank -> (ep, n): pairs every rank of the group sends to each of this rank's
    experts (one int64 all-to-all; counted as the formula counts it)."""
    mine = per_expert.reshape(ep, -1).contiguous()
    if group is None or ep == 1:
        return mine
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    record("all_to_all", "forward", (ep - 1) * mine.shape[1] * INT64, (ep - 1) * mine.shape[1] * INT64)
    return theirs


def plan_route(top_k_index: torch.Tensor, experts: int, ep: int, group: dist.ProcessGroup | None) -> Route:
    """The route of this rank's pairs (one small all-to-all and one read of the counts on the host)."""
    order, per_expert = pair_counts(top_k_index, experts)
    theirs = exchange_counts(per_expert, ep, group)
    # one device-to-host read; a rehearsal (fake tensors) routes every rank's pairs evenly over the ranks' experts:
    # it sends _even's share to each rank, and receives its own share from each
    def even() -> list[int]:
        send = _even(order.numel(), ep)
        return send + [send[dist.get_rank(group) if group is not None else 0]] * ep

    sizes = host_ints(torch.cat([per_expert.reshape(ep, -1).sum(1), theirs.sum(1)]), even)
    if sum(sizes[:ep]) != order.numel():
        raise ValueError(f"a router picked {order.numel() - sum(sizes[:ep])} expert indices outside [0, {experts}) "
                         "(a 'no expert' slot?): seqmesh's expert parallelism sends every pick to a real expert. "
                         "Use ep=1 for this model.")
    receive = tuple(int(s) for s in sizes[ep:])
    return Route(order, tuple(int(s) for s in sizes[:ep]), receive, received_experts(theirs, sum(receive)))


def _even(pairs: int, ep: int) -> list[int]:
    """``pairs`` split as evenly as whole numbers go over ``ep`` ranks."""
    return [pairs // ep + (r < pairs % ep) for r in range(ep)]


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int,
                     ep: int, group: dist.ProcessGroup | None,
                     run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     summed_in: torch.dtype | None = None) -> torch.Tensor:
    """``sum_j w_tj * expert_{e_tj}(x_t)`` for every token of ``hidden`` (T, H), with the experts spread over the
    ``ep`` ranks of ``group`` (rank ``r`` holds experts ``[r * n, (r + 1) * n)``).

    ``run_experts(rows (N, H), local_expert (N,))`` is this rank's experts' unweighted output for the rows it
    received (N, H). Every rank of ``group`` must call this together (the exchanges are collective). ``summed_in``:
    each weighted output cast to that dtype and a token's summed in it by ascending expert, as a module that sums
    into a buffer of that dtype expert by expert does (Inkling 2's float32 one)."""
    tokens, k = top_k_index.shape
    route = plan_route(top_k_index, experts, ep, group)
    rows = hidden[route.order // k]  # (T * k, H) by destination rank, then expert
    exchanged = group is not None and ep > 1  # else every expert is here (one process, a test's split)
    if exchanged:
        rows = exchange_rows(rows, group, route.send, route.receive)
    out = run_experts(rows, route.local_experts)  # (N, H)
    if exchanged:
        out = exchange_rows(out, group, route.receive, route.send)
    back = torch.empty_like(route.order)
    back[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    picked = out[back].reshape(tokens, k, -1)  # (T, k, H) in pair order
    if summed_in is None:
        return (picked * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)
    products = (picked * top_k_weights.unsqueeze(-1)).to(summed_in)  # (T, k, H)
    by_expert = top_k_index.argsort(dim=1, stable=True)  # (T, k)
    products = products.gather(1, by_expert[..., None].expand_as(products))
    total = products[:, 0]
    for j in range(1, k):  # one pick after another, as the buffer takes them
        total = total + products[:, j]
    return total.to(hidden.dtype)
