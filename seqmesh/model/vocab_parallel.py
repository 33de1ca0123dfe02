"""The loss with a vocabulary-parallel LM head: no rank ever holds a whole-vocabulary logit row.

Each tensor-parallel rank gathers its group's final hidden states (the ``L`` tokens of their sequence
shard, from ``L / T`` each) and holds ``V / T`` rows of the LM head, starting at ``start``. Per tile of
tokens it computes its ``V / T`` logits, and the group agrees on the log-sum-exp and the target's logit
with two all-reduces (the maximum, then the sum of exponentials with the target's logit, which exactly one
rank holds)::

    lse_t = log(sum_r sum_{v in r} exp(z_tv - m_t)) + m_t        m_t = max_r max_{v in r} z_tv
    loss  = sum_t valid_t (lse_t - z_t,target)

Every rank gets the same loss; its forward also makes this rank's part of d(hidden), ``(softmax - onehot)``
over its vocabulary slice times its rows, and its rows' gradient, which its backward scales. The hidden
states' gather is a DTensor redistribution whose gradient is marked partial, so the parts are summed by the
gather's adjoint (a reduce-scatter over the group). The loss is then pooled over the ranks that hold
different tokens (``mesh.batch_group``) exactly as without tensor parallelism (``seqmesh.model.loss``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_
from ..comm.ranks import partial_local
from .loss import add_tile_products, checked_mean, invalid_labels, matmul_dtype, scaled, wide_dtype


def gathered_tokens(hidden) -> torch.Tensor:
    """A DTensor ``(B, L/T, H)`` sharded on the sequence over the tensor-parallel group, as the plain local
    ``(B, L, H)`` of the whole group; its gradient is taken as each rank's partial sum (reduce-scattered)."""
    from torch.distributed.tensor import Replicate

    return partial_local(hidden.redistribute(hidden.device_mesh, [Replicate()]))


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of the cross-entropy of ``hidden @ weight.T`` where ``weight`` is this rank's vocabulary rows
    ``[start, start + V/T)``, tile by tile, with this rank's parts of d(hidden) and its rows' d(weight) made in the
    same pass once the group agrees on the tile's log-sum-exp; backward scales them by the incoming scalar, as
    ``seqmesh.model.loss.ChunkedLinearCrossEntropy`` does. ``grads`` ``(hidden, weight)``: which want a gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, start, chunk, ignore_index, group,  # type: ignore[override]
                grads=(False, False)):
        # hidden (N, H), weight (V/T, H), labels (N,) global ids
        wide = wide_dtype(hidden.dtype)
        mm = matmul_dtype(hidden, weight)
        w = weight.to(mm)
        rows = weight.shape[0]
        d_hidden = torch.empty_like(hidden) if grads[0] else None
        d_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if grads[1] else None
        total = hidden.new_zeros((), dtype=wide)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s : s + chunk].to(mm)
                logits = (h @ w.t()).to(wide)  # (n, V/T)
                top = logits.max(dim=-1).values
                all_reduce_(top, group, dist.ReduceOp.MAX)
                target = labels[s : s + chunk]
                valid = target != ignore_index
                local = target - start
                mine = (local >= 0) & (local < rows)
                picked = logits.gather(1, local.clamp(0, rows - 1).unsqueeze(1)).squeeze(1) * mine
                sums = torch.stack([(logits - top.unsqueeze(1)).exp().sum(-1), picked])  # (2, n)
                all_reduce_(sums, group)
                tile_lse = sums[0].log() + top
                total += ((tile_lse - sums[1]) * valid).sum()
                if d_hidden is None and d_weight is None:
                    continue
                d_logits = logits.sub_(tile_lse.unsqueeze(1)).exp_()  # this rank's slice of the softmax, in place
                d_logits.scatter_add_(1, local.clamp(0, rows - 1).unsqueeze(1), -mine.unsqueeze(1).to(wide))
                d_logits = d_logits.mul_(valid.unsqueeze(1)).to(mm)
                del logits  # in bf16, the float32 tile is freed before the matmuls
                add_tile_products(d_logits, h, w, d_hidden, d_weight, slice(s, s + chunk))
                del d_logits
        ctx.save_for_backward(d_hidden, d_weight)  # released after the backward unless the graph is retained
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        d_hidden, d_weight = ctx.saved_tensors
        return scaled(d_hidden, grad), scaled(d_weight, grad, ctx.weight_dtype), None, None, None, None, None, None


def vocab_parallel_loss(hidden, weight, shift_labels: torch.Tensor, batch_group: dist.ProcessGroup, *,
                        chunk: int, ignore_index: int) -> torch.Tensor:
    """The batch's mean next-token loss (as ``seqmesh.model.loss.chunked_linear_cross_entropy``) from
    ``hidden``, a DTensor ``(B, L/T, H)`` sharded on the sequence over the tensor-parallel group, and
    ``weight``, the LM head as a DTensor ``(V, H)`` sharded on the vocabulary over the same group.
    ``shift_labels`` ``(B, L)``: this sequence shard's targets (the same on every rank of the group)."""
    from torch.distributed.tensor import Shard

    if list(weight.placements) != [Shard(0)]:
        raise ValueError(f"the LM head's weight is placed {weight.placements}; the vocabulary-parallel loss needs "
                         "it sharded on the vocabulary (Shard(0)) over the tensor-parallel group.")
    tp_mesh = weight.device_mesh
    group = tp_mesh.get_group()
    vocab = weight.shape[0]
    rows = vocab // tp_mesh.size()
    tokens = gathered_tokens(hidden)  # (B, L, H)
    flat = shift_labels.reshape(-1)
    if tokens.shape[:2] != shift_labels.shape:
        raise ValueError(f"the hidden states hold {tuple(tokens.shape[:2])} tokens but the labels are "
                         f"{tuple(shift_labels.shape)}; call the model with seqmesh.shard_batch's output.")
    bad = invalid_labels(flat, vocab, ignore_index)
    safe = flat.masked_fill(bad, ignore_index)
    local_weight = weight.to_local()
    grads = tuple(torch.is_grad_enabled() and t.requires_grad for t in (tokens, local_weight))
    local_sum = VocabParallelCrossEntropy.apply(tokens.reshape(-1, tokens.shape[-1]), local_weight, safe,
                                                tp_mesh.get_local_rank() * rows, chunk, ignore_index, group, grads)
    return checked_mean(local_sum, flat, bad, batch_group, vocab, ignore_index)


@torch.no_grad()
def vocab_parallel_argmax(hidden: torch.Tensor, weight_local: torch.Tensor, start: int, group: dist.ProcessGroup,
                          chunk: int) -> torch.Tensor:
    """``(N,)`` global argmax of ``hidden (N, H) @ head.T`` from this rank's ``weight_local`` rows
    ``[start, start + V/T)``: each rank's best, then the group's (ties to the lowest id, as ``argmax``)."""
    world = dist.get_world_size(group)
    out = []
    for s in range(0, hidden.shape[0], chunk):
        logits = hidden[s : s + chunk] @ weight_local.t().to(hidden.dtype)
        value, index = logits.max(dim=-1)
        pair = torch.stack([value.to(torch.float64), (index + start).to(torch.float64)])  # (2, n)
        every = [torch.empty_like(pair) for _ in range(world)]
        dist.all_gather(every, pair, group=group)
        values = torch.stack([p[0] for p in every])  # (T, n), ranks in vocabulary order
        best = values.argmax(dim=0)  # the first rank with the maximum holds the lowest id
        out.append(torch.stack([p[1] for p in every]).gather(0, best.unsqueeze(0)).squeeze(0).to(torch.long))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.long)
