"""DeepSeek-V4's compressed attentions exact under sequence parallelism: heavily compressed (HCA) and compressed
sparse (CSA) layers.

Each such layer's queries (``H`` heads) attend, in one softmax with a sink per head, to

- a sliding window: the ``W`` latest tokens' single shared key, which is also the value (``kv``, ``D`` wide), and
- compressed entries: one per window of ``m`` tokens, counted from the document's start. An entry is a
  softmax-gated sum of its window's projected tokens (CSA: of ``2m`` tokens, the previous window's other half
  overlapping), normed and rotated at its window's first position. HCA (``m`` = 128 in V4) lets a query see every
  entry whose window has closed; CSA (``m`` = 4) lets it see the ``index_topk`` of those that its lightning indexer
  (its own compressed keys, the same windows) scores highest.

On a shard, every one of these reads only a few tokens before each of a rank's tokens: the window ``W - 1``, an
entry's window ``2m - 1``. So each rank extends its runs of tokens by their halo (the ``max(W, 2m, m') - 1``
positions before each run, one all-gather of per-token projections: :func:`seqmesh.linear_attention.halo.extend`), builds
the entries whose window closes at one of its own tokens, and all-gathers those entries (``D`` values per window),
placed by window. A query's keys are then rows of its extended run and of the gathered entries, attended by
:func:`seqmesh.kernels.sparse_latent.sparse_latent_attention` (the Triton kernel on a GPU), the sink in its
softmax. Nothing else crosses a link; the backward of each gather is its adjoint.

The rest of the layer (queries, norms, the rotary on queries, keys and entries, the output's inverse rotary, the
grouped output projection) runs per token with the module's own submodules and functions.

Packed documents are computed as the documents one model call each: windows, entries and the sliding window restart
at each document, whose queries see only its entries (transformers' compressors, given one packed row, would window
it across documents by its index). Rows of unequal length (an ``attention_mask``) are refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..comm.collectives import all_gather
from ..kernels.sparse_latent import sparse_latent_attention, uses_kernel
from ..linear_attention import halo
from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo
from ..tensor_values import host_ints, real_tensors
from .indexed_attention import block_queries, entry_of, replace_forward, restore_forward
from .indexed_layouts import module_function

_ATTR = "_seqmesh_compressed"
INDEXER_ELEMENTS = 2**26  # float32 scores one pass of CSA's indexer makes (256 MiB; the scorer holds a few such)
LAYER_TYPES = ("heavily_compressed_attention", "compressed_sparse_attention")


def is_compressed(module: nn.Module) -> bool:
    """Whether ``module`` is the attention of a DeepSeek-V4 HCA or CSA layer (a ``compressor`` that windows the row)."""
    compressor = getattr(module, "compressor", None)
    return (type(module).__name__.endswith("Attention") and compressor is not None
            and hasattr(compressor, "compress_rate") and hasattr(module, "sinks") and hasattr(module, "o_a_proj"))


def _overlaps(compressor: nn.Module) -> bool:
    """CSA's compressors (the layer's and its indexer's) gate windows of ``2m`` tokens: their projections are twice
    the entry's width, the previous window's first half beside the current window's second."""
    return compressor.kv_proj.out_features == 2 * compressor.kv_norm.weight.shape[0]


def compressed_layers(model: nn.Module, mesh: SPMesh) -> list[nn.Module]:
    """The HCA and CSA attention modules of ``model``; a ValueError for one seqmesh cannot run (tensor parallelism)."""
    found = [m for m in model.modules() if is_compressed(m)]
    if found and getattr(mesh, "tp", 1) > 1:
        raise ValueError(f"seqmesh cannot run DeepSeek-V4's compressed attention with tensor parallelism "
                         f"(tp={mesh.tp}); use tp=1.")
    return found


@dataclass(frozen=True)
class Windows:
    """One compress rate's windows on one rank (index tensors on the host)."""

    ids: torch.Tensor  # (n,) the row's entry number of each window that closes at one of this rank's tokens
    number: torch.Tensor  # (n,) its number within its document (its entry is rotated at number x rate)
    current: torch.Tensor  # (n, m) its rows of the extended runs, in order
    previous: torch.Tensor  # (n, m) the previous window's rows (-1: the document's first window has none)
    first: torch.Tensor  # (L,) the row's number of each own token's document's first entry
    closed: torch.Tensor  # (L,) how many of them the token sees (the windows closed by it): [first, first + closed)
    count: int  # N, the row's entries


@dataclass(frozen=True)
class Rows:
    """Host-side index arithmetic of one rank's extended runs (:func:`seqmesh.linear_attention.halo.extend`)."""

    keys: torch.Tensor  # (L, W) each own token's window: its own row, then the rows before it (-1: none)
    windows: dict[int, Windows]  # per compress rate


@functools.lru_cache(maxsize=64)
def _rows(chain, rank: int, kernel: int, bounds: tuple[int, ...], window: int, rates: tuple[int, ...]) -> Rows:
    """:func:`_host_rows`, once per layout, on real host tensors even in a rehearsal's fake step (its values are the
    layout's, never the step's)."""
    with real_tensors():
        return _host_rows(chain, rank, kernel, bounds, window, rates)


def _host_rows(chain, rank: int, kernel: int, bounds: tuple[int, ...], window: int, rates: tuple[int, ...]) -> Rows:
    """:class:`Rows` for ``rank`` of ``chain`` with halos of ``kernel - 1``; ``bounds``: the documents' starts and the
    real tokens' end (0, ..., T). Windows, entries and keys are counted within each document, from its start (the
    documents one model call each); a padding token sees itself only and no entry. Cached per layout."""
    seq_len = bounds[-1]
    positions = torch.tensor(halo.extended_positions(chain, rank, kernel))  # (E,)
    edges = torch.tensor(bounds)
    doc = torch.bucketize(positions, edges[1:], right=True)  # each row's document (the padding: one past the last)
    start = torch.cat([edges, edges[-1:]])[doc]
    offset = positions - start  # each row's position within its document
    own = halo.rank_chain(chain, rank, kernel).own
    back = torch.arange(window)
    real = positions[own] < seq_len
    ok = (offset[own][:, None] - back >= 0) & (real[:, None] | (back == 0))
    keys = torch.where(ok, own[:, None] - back, -1)  # (L, W)
    windows = {}
    for m in rates:
        counts = (edges[1:] - edges[:-1]) // m  # each document's closed windows
        first = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])  # its first entry's number in the row
        ends = own[real & ((offset[own] + 1) % m == 0)]  # own rows that close a window (all within the document)
        number = offset[ends] // m
        current = ends[:, None] - (m - 1) + torch.arange(m)  # (n, m)
        previous = torch.where((number >= 1)[:, None], current - m, -1)
        closed = torch.where(real, (offset[own] + 1) // m, 0)  # (L,) entries of its document a token sees
        mine = first[doc[own].clamp(max=len(counts) - 1)]
        windows[m] = Windows(first[doc[ends]] + number, number, current, previous, mine, closed, int(first[-1]))
    return Rows(keys, windows)


def _entries(compressor: nn.Module, ext: torch.Tensor, gate: torch.Tensor, current: torch.Tensor,
             previous: torch.Tensor, index: torch.Tensor, rate: int) -> torch.Tensor:
    """The compressed entries of the windows closing at this rank's tokens, as transformers' compressor computes
    them: ext, gate (B, E, C) the compressor's projections on the extended runs, current / previous (n, m) rows
    (-1: none), index (n,) window numbers -> (B, n, D) normed and rotated at each window's first position."""
    b = ext.shape[0]
    dim = compressor.kv_norm.weight.shape[0]
    bias = compressor.position_bias  # (m, C)
    take = lambda x, rows: x[:, rows.clamp(min=0)]  # noqa: E731  (B, n, m, C)
    kv_now, gate_now = take(ext, current), take(gate, current) + bias
    if _overlaps(compressor):  # [previous window's first half | this window's second half], 2m slots
        kv_before = take(ext, previous)[..., :dim]
        gate_before = (take(gate, previous) + bias)[..., :dim]
        hidden = (previous < 0)[None, :, :, None]
        kv_before = kv_before.masked_fill(hidden, 0.0)
        gate_before = gate_before.masked_fill(hidden, float("-inf"))
        kv_now = torch.cat([kv_before, kv_now[..., dim:]], dim=2)
        gate_now = torch.cat([gate_before, gate_now[..., dim:]], dim=2)
    weights = gate_now.softmax(dim=2, dtype=torch.float32).to(kv_now.dtype)
    entries = compressor.kv_norm((kv_now * weights).sum(dim=2))  # (B, n, D)
    positions = (index * rate).to(entries.device).unsqueeze(0).expand(b, -1)
    cos, sin = compressor.rotary_emb(entries, position_ids=positions, layer_type=compressor.rope_layer_type)
    rotate = module_function(compressor, "apply_rotary_pos_emb")
    return rotate(entries.unsqueeze(1), cos, sin).squeeze(1)


def _gather_entries(entries: torch.Tensor, index: torch.Tensor, count: int, mesh: SPMesh) -> torch.Tensor:
    """Every rank's entries (B, n_r, D) with their numbers in the row -> the row's (B, count, D) in that order: one
    all-gather (padded to the busiest rank's count), its adjoint backward."""
    if mesh.sp_size == 1:
        return entries.new_zeros(entries.shape[0], count, entries.shape[-1]).index_copy(1, index, entries)
    counts = all_gather(torch.tensor([index.numel()], device=entries.device), mesh.sp_group, dim=0)
    most = host_ints(counts.max().view(1), lambda: [index.numel()])[0]  # a rehearsal: this rank's count the most
    padded = halo.pad_rows(entries, most)
    numbers = torch.cat([index, index.new_full((most - index.numel(),), count)])  # padding: a spare slot
    every = all_gather(padded, mesh.sp_group, dim=1)  # (B, P * most, D)
    where = all_gather(numbers, mesh.sp_group, dim=0)  # (P * most,)
    full = every.new_zeros(every.shape[0], count + 1, every.shape[-1]).index_copy(1, where, every)
    return full[:, :count]


def _most(closed: torch.Tensor, block: slice = slice(None)) -> int:
    """The most entries any query of ``block`` sees (0 for none), read from the layout's host tensor (:func:`_rows`):
    real even in a rehearsal's fake step."""
    with real_tensors():
        part = closed[block]
        return int(part.max()) if part.numel() else 0


def _seen(first: torch.Tensor, closed: torch.Tensor, count: int) -> torch.Tensor:
    """(l, N) bool: the entries ``[first, first + closed)`` of each of ``l`` queries, among the row's ``count``."""
    entry = torch.arange(count, device=first.device)[None]
    return (entry >= first[:, None]) & (entry < (first + closed)[:, None])


def indexer_step(batch: int, heads: int, entries: int) -> int:
    """Queries CSA's indexer scores in one pass: as many as keep their ``(batch, queries, heads, entries)`` float32
    scores within :data:`INDEXER_ELEMENTS`, and at least one (a row of more than ``INDEXER_ELEMENTS / heads`` entries
    then makes more)."""
    return max(1, INDEXER_ELEMENTS // max(1, batch * heads * entries))


def _indexer_picks(indexer: nn.Module, q: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor,
                   first: torch.Tensor, closed: torch.Tensor) -> torch.Tensor:
    """CSA's selection for a block of queries: (B, l, k) each query's top ``index_topk`` entries (-1: one it may not
    see), scored by the indexer's own scorer (q (B, l, Hi, Di) rotated, hidden (B, l, E)) against its compressed keys
    (B, N, Di); the entries it sees: ``[first, first + closed)``. No gradient. The scorer's float32 ``(B, l, Hi, N)``
    scores are made for as many of the queries at once as :func:`indexer_step` gives (an attention block holds
    thousands of queries on a GPU, and N is the row's entries, a quarter of the row: at 128K tokens one block's
    scores would be 68 GB)."""
    b, length = q.shape[:2]
    step = indexer_step(b, indexer.num_heads, keys.shape[1])
    with torch.no_grad():
        parts = []
        for start in range(0, length, step):
            part = slice(start, start + step)
            seen = _seen(first[part], closed[part], keys.shape[1])
            scores = indexer.scorer(q[:, part], keys, hidden[:, part]).masked_fill(~seen, float("-inf"))
            chosen = scores.topk(min(indexer.index_topk, keys.shape[1]), dim=-1).indices
            del scores
            parts.append(torch.where(torch.gather(seen.expand(b, -1, -1), 2, chosen), chosen, -1))
        return torch.cat(parts, dim=1)


def _indexer_queries(indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, position_ids) -> torch.Tensor:
    """The indexer's rotated queries of the local tokens (B, L, Hi, Di), without gradient."""
    with torch.no_grad():
        b, length, _ = hidden.shape
        rotate = module_function(indexer, "apply_rotary_pos_emb")
        cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_resid).view(b, length, -1, indexer.head_dim).transpose(1, 2)
        return rotate(q, cos, sin).transpose(1, 2)


def _problem(info: SequenceInfo, position_ids) -> str | None:
    if info.lengths is not None:
        return "rows of unequal length (an attention_mask): give DeepSeek-V4 rows of one length"
    if position_ids is None:
        return "a call without position_ids (DeepSeek-V4's model passes them to every layer)"
    return None


def _make_forward(mesh: SPMesh):
    def forward(self, hidden_states: torch.Tensor, position_embeddings, position_ids=None, attention_mask=None,
                cache=None, **kwargs):
        # hidden_states (B, L, E) -> ((B, L, E), None)
        info, name = entry_of(self, cache, kwargs)
        problem = _problem(info, position_ids)
        if problem:
            raise ValueError(f"{name} (DeepSeek-V4's compressed attention) cannot run on {problem}.")
        b, length = hidden_states.shape[:-1]
        compressor = self.compressor
        indexer = getattr(compressor, "indexer", None)
        rate, window = compressor.compress_rate, self.sliding_window
        rotate = module_function(self, "apply_rotary_pos_emb")
        cos, sin = position_embeddings[self.rope_layer_type]
        q_resid = self.q_a_norm(self.q_a_proj(hidden_states))
        q = self.q_b_norm(self.q_b_proj(q_resid).view(b, length, -1, self.head_dim).transpose(1, 2))
        q = rotate(q, cos, sin).transpose(1, 2)  # (B, L, H, D)
        kv = rotate(self.kv_norm(self.kv_proj(hidden_states))[:, None], cos, sin)[:, 0]  # (B, L, D)
        # one halo for everything a token reads before it: the window, the entries' windows (CSA: two)
        rates = (rate,) if indexer is None else (rate, indexer.compress_rate)
        kernel = max(window, *(2 * r if _overlaps(c) else r for r, c in zip(rates, (compressor, indexer))))
        place = halo.placement(mesh, length, layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens,
                               kernel=kernel)
        bounds = tuple(info.cu_seqlens) if info.cu_seqlens else (0, info.seq_len)
        rows = _rows(place.chain, place.rank, kernel, bounds, window, rates)
        parts = [kv, compressor.kv_proj(hidden_states), compressor.gate_proj(hidden_states)]
        if indexer is not None:  # its selection has no gradient (transformers' indexer trains nothing either)
            with torch.no_grad():
                parts += [indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states)]
        widths = [p.shape[-1] for p in parts]
        ext = torch.split(halo.extend(torch.cat(parts, dim=-1), place), widths, dim=-1)  # each (B, E, C)
        device = hidden_states.device

        def row_entries(module, kv_ext, gate_ext, m):
            win = rows.windows[m]
            current, previous = win.current.to(device), win.previous.to(device)
            local = _entries(module, kv_ext, gate_ext, current, previous, win.number.to(device), m)
            return _gather_entries(local, win.ids.to(device), win.count, mesh), win

        entries, seen = row_entries(compressor, ext[1], ext[2], rate)
        if indexer is not None:  # CSA: its indexer's entries and queries, no gradient (as transformers' indexer)
            with torch.no_grad():
                index_keys, index_seen = row_entries(indexer, ext[3], ext[4], indexer.compress_rate)
            index_q = _indexer_queries(indexer, hidden_states, q_resid, position_ids)
        extended = ext[0].shape[1]
        row = torch.cat([ext[0], entries], dim=1)  # (B, E + N, D): the extended runs' keys, then the entries
        keys, first, closed = rows.keys.to(device), seen.first.to(device), seen.closed.to(device)
        # blocks of queries: the torch form's by its gathered keys (B, l, W + picks, D) times heads (HCA's picks:
        # every entry a query sees; CSA's: index_topk), as DeepSeek Sparse Attention's; the kernel gathers inside
        # itself, so by its (B, l, H, D) queries
        most = _most(seen.closed)
        picked = most if indexer is None else min(indexer.index_topk, entries.shape[1])
        width = self.head_dim if uses_kernel(row) else (window + picked) * self.head_dim
        step = block_queries(b, self.num_heads, width)
        outputs = []
        for start in range(0, length, step):
            block = slice(start, start + step)
            if indexer is None:  # HCA: every entry of its document whose window has closed
                reach = torch.arange(_most(seen.closed, block), device=device)
                chosen = torch.where(reach[None] < closed[block, None], first[block, None] + reach[None], -1)
                chosen = chosen.expand(b, -1, -1)
            else:  # CSA: the indexer's top k of them
                chosen = _indexer_picks(indexer, index_q[:, block], hidden_states[:, block], index_keys,
                                        index_seen.first.to(device)[block], index_seen.closed.to(device)[block])
            picks = torch.cat([keys[block].expand(b, -1, -1), torch.where(chosen >= 0, chosen + extended, -1)], -1)
            inputs = (q[:, block], row, picks, self.scaling, self.head_dim, self.sinks)
            if torch.is_grad_enabled() and step < length and uses_kernel(row):  # each block recomputed in backward,
                # not kept (the torch form keeps a flash kernel's tensors and recomputes its scores itself)
                outputs.append(checkpoint(sparse_latent_attention, *inputs, use_reentrant=False))
            else:
                outputs.append(sparse_latent_attention(*inputs))
        out = torch.cat(outputs, dim=1)  # (B, L, H, D)
        out = rotate(out.transpose(1, 2), cos, -sin).transpose(1, 2)  # the values' rotary undone at the query
        grouped = self.o_a_proj(out.reshape(b, length, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None

    return forward


def install(layers: list[nn.Module], mesh: SPMesh) -> None:
    """Give ``layers`` (from :func:`compressed_layers`) the sequence-parallel forward; the class is untouched."""
    replace_forward(layers, _make_forward(mesh), _ATTR)


def uninstall(model: nn.Module) -> None:
    restore_forward(model, _ATTR)
