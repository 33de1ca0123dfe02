"""The torch form of token-sparse latent attention (:mod:`.sparse_latent`'s math) as one autograd op that keeps what
a flash kernel keeps: the query, the row, the picks, the output and a float32 log-sum-exp per (query, head). It runs
in blocks of a few queries, sized so that a block's gathered rows stay in the CPU's cache (a block of 256 queries
gathers 100 MB, and the gather then runs at a tenth of the speed of one of 16), and its backward recomputes each
block's scores from the saved log-sum-exp, as flash attention does, instead of autograd's graph of every block.

With the two halves of MLA's ``kv_b_proj`` (DeepSeek Sparse Attention) the op also takes the query's no-RoPE part
into latent space and the attended latents back out of it, block by block, so the ``(L, H, R + Dr)`` latent query
and ``(L, H, R)`` attended latents (four times the query's size at DeepSeek-V3.2's latent of 512) never exist for
the whole row:

    q_nope (B, L, H, Dn)   with ``w_key`` (H, Dn, R): the query's no-RoPE part; without: the latent query itself (Dn = R)
    q_rot  (B, L, H, Dr)   the rotated part (Dr may be 0)
    row    (B, T, R + Dr)  every key's latent (its value too) and rotated key
    picks  (B, L, K)       indices into ``row``; -1 where the query may not see the pick
    -> (B, L, H, Dv)       with ``w_value`` (H, Dv, R); without: (B, L, H, R)

Scores are products in the inputs' dtype (autocast's on a device where it is on), scaled, then masked and
exponentiated in float32 at least (float64 inputs stay float64), as :func:`.sparse_latent.sparse_latent_reference`;
the gradients of the row and of the projections are summed over blocks in float32 at least.
"""

from __future__ import annotations

import torch

# the gathered rows of one block of queries, (B, n, K, R + Dr) elements, at most this many on a CPU (4 MB of float32:
# 10 queries of the families bench's DSA, top-k 512 of rows 192 wide); a GPU's blocks are sized by the score tensor,
# as the caller's. Measured on the 2-core CPU, forward and backward of one layer at 4,096 tokens (docs/benchmarks.md),
# blocks of 5, 10 and 21 queries: picks drawn at random 3.2, 3.5 and 3.7 s (a block's rows out of a core's cache);
# the picks of the families bench's model, which neighbouring queries share, 2.28, 2.10 and 2.31 s (medians of 8)
CPU_BLOCK_ELEMENTS = 1 << 20
# queries whose projections into and out of MLA's latent space run as one product
PROJECTED_QUERIES = 256
# a block's chosen rows' gradient is added into the row's float32 gradient in this many slices, each cast on its
# own: a bf16 block's float32 copy whole was twice the block (1 GiB of a layer's 2 GiB backward peak at 16K tokens)
ADD_SLICES = 8


def block_queries(batch: int, picks: int, width: int, device: torch.device, budget: int) -> int:
    """Queries per block: the gathered rows ``(batch, n, picks, width)`` within :data:`CPU_BLOCK_ELEMENTS` on a CPU,
    within ``budget`` elsewhere."""
    limit = CPU_BLOCK_ELEMENTS if device.type == "cpu" else budget
    return max(1, limit // max(1, batch * picks * width))


class SparseLatentBlocks(torch.autograd.Function):
    """The module docstring's op. ``step``: queries per block of gathered rows (:func:`block_queries`); MLA's
    projections run on ``PROJECTED_QUERIES`` at once (a block of ``step`` makes them matrix products of a few rows)."""

    @staticmethod
    def forward(ctx, q_nope, q_rot, w_key, w_value, row, picks, sinks, scale: float, step: int):
        dtype = product_dtype(q_rot, row)
        b, length, heads, _ = q_rot.shape
        rank = _rank(row, q_rot)
        out = q_rot.new_empty(b, length, heads, w_value.shape[1] if w_value is not None else rank, dtype=dtype)
        lse = torch.empty(b, length, heads, dtype=_wide(dtype), device=q_rot.device)
        flat_row = row.to(dtype).reshape(-1, row.shape[-1])
        with torch.no_grad():
            for outer in _blocks(length, max(step, PROJECTED_QUERIES)):
                query = _latent_query(q_nope[:, outer], q_rot[:, outer], w_key, dtype)  # (B, l, H, R + Dr)
                attended = query.new_empty(*query.shape[:-1], rank)
                flat, hidden = _flat_picks(picks[:, outer], row.shape[1])
                for inner in _blocks(query.shape[1], step):
                    block = flat[:, inner]  # (B, l, K)
                    chosen = _gathered(flat_row, block.reshape(-1), block.shape)
                    probs, lse[:, outer][:, inner] = _probabilities(query[:, inner], chosen, hidden[:, inner], scale,
                                                                    sinks, None)
                    attended[:, inner] = torch.matmul(probs.to(dtype), chosen[..., :rank])
                out[:, outer] = attended if w_value is None else torch.einsum(
                    "blhr,hvr->blhv", attended, w_value.to(dtype))
        ctx.save_for_backward(q_nope, q_rot, w_key, w_value, row, picks, sinks, out, lse)
        ctx.scale, ctx.step, ctx.dtype = scale, step, dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        q_nope, q_rot, w_key, w_value, row, picks, sinks, out, lse = ctx.saved_tensors
        dtype, scale, rank, step = ctx.dtype, ctx.scale, _rank(row, q_rot), ctx.step
        flat_row = row.to(dtype).reshape(-1, row.shape[-1])
        wide = _wide(dtype)  # sums over blocks and keys: float32 at least (float64 stays float64)
        d_nope, d_rot = torch.zeros_like(q_nope, dtype=dtype), torch.zeros_like(q_rot, dtype=dtype)
        d_row = torch.zeros_like(flat_row, dtype=_wide(torch.promote_types(row.dtype, dtype)))
        d_key = torch.zeros_like(w_key, dtype=wide) if w_key is not None else None
        d_value = torch.zeros_like(w_value, dtype=wide) if w_value is not None else None
        delta = torch.empty_like(lse)  # each (query, head)'s sum of out . d out: the softmax's backward, the sink's
        for outer in _blocks(q_rot.shape[1], max(step, PROJECTED_QUERIES)):
            query = _latent_query(q_nope[:, outer], q_rot[:, outer], w_key, dtype)
            d_out = grad[:, outer].to(dtype)  # (B, l, H, Dv)
            delta[:, outer] = (out[:, outer].to(wide) * grad[:, outer].to(wide)).sum(-1)
            d_attended = d_out if w_value is None else torch.einsum("blhv,hvr->blhr", d_out, w_value.to(dtype))
            attended = query.new_empty(*query.shape[:-1], rank) if w_value is not None else None
            d_query = torch.empty_like(query)
            flat, hidden = _flat_picks(picks[:, outer], row.shape[1])
            for inner in _blocks(query.shape[1], step):
                block = flat[:, inner]  # (B, l, K)
                mine = block.reshape(-1)  # the rows gathered, then the rows their gradient goes to
                chosen = _gathered(flat_row, mine, block.shape)
                probs, _ = _probabilities(query[:, inner], chosen, hidden[:, inner], scale, sinks,
                                          lse[:, outer][:, inner])
                values, d_att = chosen[..., :rank], d_attended[:, inner]  # (B, l, K, R), (B, l, H, R)
                if attended is not None:  # out = attended . w_value: the attended latents again, for w_value's
                    attended[:, inner] = torch.matmul(probs.to(dtype), values)
                d_probs = torch.matmul(d_att, values.transpose(-1, -2)).to(wide)  # (B, l, H, K)
                d_scores = (probs * (d_probs - delta[:, outer][:, inner, :, None]) * scale).to(dtype)
                d_query[:, inner] = torch.matmul(d_scores, chosen)  # (B, l, H, R + Dr)
                # a row's gradient through its scores and as a value in one product over 2H rows (two of H each ran
                # at half the speed on a CPU): [d_scores; probs]^T . [query; d_att with zeros for the rotary part],
                # its (B, l, 2H, K) and (B, l, 2H, R + Dr) operands freed once it is made
                d_chosen = torch.matmul(torch.cat([d_scores, probs.to(dtype)], dim=2).transpose(-1, -2), torch.cat(
                    [query[:, inner], torch.nn.functional.pad(d_att, (0, chosen.shape[-1] - rank))], dim=2))
                _add_rows(d_row, mine, d_chosen.reshape(-1, d_chosen.shape[-1]))  # (B, l, K, R + Dr) added in
                del chosen, probs, values, d_probs, d_scores, d_chosen  # freed before the next block's
            if attended is not None:
                d_value += torch.einsum("blhv,blhr->hvr", d_out, attended).to(wide)
            d_rot[:, outer] = d_query[..., rank:]
            if w_key is not None:
                d_nope[:, outer] = torch.einsum("blhr,hnr->blhn", d_query[..., :rank], w_key.to(dtype))
                d_key += torch.einsum("blhn,blhr->hnr", q_nope[:, outer].to(dtype), d_query[..., :rank]).to(wide)
            else:
                d_nope[:, outer] = d_query[..., :rank]
        d_sinks = None
        if sinks is not None:  # the sink's probability times minus each (query, head)'s delta
            d_sinks = -(torch.exp(sinks.to(wide) - lse) * delta).sum((0, 1)).to(sinks.dtype)
        return (d_nope.to(q_nope.dtype), d_rot.to(q_rot.dtype), _as(d_key, w_key), _as(d_value, w_value),
                d_row.view(row.shape).to(row.dtype), None, d_sinks, None, None)


def sparse_latent_blocks(q_nope: torch.Tensor, q_rot: torch.Tensor, row: torch.Tensor, picks: torch.Tensor,
                         scale: float, sinks: torch.Tensor | None = None, w_key: torch.Tensor | None = None,
                         w_value: torch.Tensor | None = None, budget: int = 1 << 28) -> torch.Tensor:
    """The module docstring's op, in blocks of :func:`block_queries` queries (``budget``: a GPU's elements per
    block's gathered rows)."""
    step = block_queries(picks.shape[0], picks.shape[-1], row.shape[-1], row.device, budget)
    return SparseLatentBlocks.apply(q_nope, q_rot, w_key, w_value, row, picks, sinks, scale, step)


def _blocks(length: int, step: int):
    return (slice(start, start + step) for start in range(0, length, step))


def _rank(row: torch.Tensor, q_rot: torch.Tensor) -> int:
    return row.shape[-1] - q_rot.shape[-1]


def _add_rows(total: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``total.index_add_(0, index, rows)`` with ``rows`` cast to ``total``'s dtype :data:`ADD_SLICES` rows at a time
    (the same sums in the same order: one row's additions stay in index order)."""
    if rows.dtype == total.dtype:
        total.index_add_(0, index, rows)
        return
    piece = max(1, -(-rows.shape[0] // ADD_SLICES))
    for start in range(0, rows.shape[0], piece):
        total.index_add_(0, index[start:start + piece], rows[start:start + piece].to(total.dtype))


def _flat_picks(picks: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, l, K) picks -> their rows of the flat row (B, l, K), -1 read as the row's first key, and which picks the
    query may not see (B, l, 1, K), to mask. Made once for the queries of many blocks: a block's own index work was
    a tenth of its operators."""
    offsets = torch.arange(picks.shape[0], device=picks.device)[:, None, None] * keys
    return picks.clamp(min=0) + offsets, (picks < 0)[:, :, None]


def _latent_query(q_nope, q_rot, w_key, dtype) -> torch.Tensor:
    """(B, l, H, Dn), (B, l, H, Dr) -> the latent query (B, l, H, R + Dr) in ``dtype``."""
    nope = q_nope.to(dtype)
    if w_key is not None:
        nope = torch.einsum("blhn,hnr->blhr", nope, w_key.to(dtype))
    return torch.cat([nope, q_rot.to(dtype)], dim=-1)


def _gathered(flat_row, index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The rows (B, l, K, R + Dr) of the flat row that ``index`` (B * l * K,: a block's :func:`_flat_picks` rows,
    flattened) names, ``shape`` the block's (B, l, K)."""
    return flat_row.index_select(0, index).view(*shape, flat_row.shape[-1])


def _probabilities(query, chosen, hidden, scale: float, sinks, lse):
    """(B, l, H, K) softmax of the block's scores (with each head's sink) in float32 at least, and its log-sum-exp
    (B, l, H); with ``lse`` given, the probabilities from it (the backward's). ``hidden`` (B, l, 1, K), from
    :func:`_flat_picks`: the picks the query may not see, the same for every head."""
    scores = torch.matmul(query, chosen.transpose(-1, -2)).to(_wide(query.dtype)) * scale
    scores = scores.masked_fill_(hidden, float("-inf"))  # (B, l, 1, K): the picks the query may not see
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.to(scores.dtype))
    return torch.exp(scores - lse[..., None]), lse


def product_dtype(query: torch.Tensor, row: torch.Tensor) -> torch.dtype:
    """The products' dtype: autocast's where it is on for the device, else the wider of the two inputs'."""
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return torch.promote_types(query.dtype, row.dtype)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision and float32, float64 for float64: the dtype sums run in."""
    return torch.promote_types(dtype, torch.float32)


def _as(grad, like):
    return None if grad is None else grad.to(like.dtype)
