"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; HY-V4, A.X-K2, dots.llm3) exact under sequence parallelism.

An ``indexed_attention`` layer is MLA whose every query attends only to ``index_topk`` keys: a lightning indexer
scores the query against every earlier key of its row, ``sum_h w_h relu(q_h . k_t) / sqrt(D) / sqrt(H)`` (one
shared key per token, ``H`` small query heads weighted per token), and the top ``k`` of those scores are the keys
it sees. transformers (5.24) runs the indexer under ``no_grad``: the selection is a constant, trained by nothing.

On a shard the indexer would choose among the shard's own keys. Here each rank all-gathers, in row order, the two
things every query may read from any earlier token, both per token and small:

- the indexer's key (``index_head_dim`` values, rotated; no gradient), and
- MLA's latent: the normalised ``kv_lora_rank`` values and the rotated ``qk_rope_head_dim`` key, in one gather
  (gradient back by its adjoint, one reduce-scatter),

then scores its own queries against the row up to each block's last query (the same float32 products as
transformers; the later keys, masked for the whole block, are not scored but filled with the mask's ``-inf``, so the
``topk`` call sees a row of the same length and values and ties fall the same way), and attends over the selected
keys in MLA's latent space: the query's no-RoPE part taken through ``kv_b_proj``'s key half, the output back through its
value half (the same products, associated the other way). Nothing per head ever crosses a link: a token moves
``index_head_dim + kv_lora_rank + qk_rope_head_dim`` values (704 for DeepSeek-V3.2), on every mesh (Ulysses, ring,
or both: the sequence group is one group here). Queries are scored and attend in blocks whose score tensors stay
under ``BLOCK_ELEMENTS``; the indexer's blocks are at most an eighth of the rank's queries, so that each scores only the
keys up to its last query (56% of a causal row's pairs instead of all of them). Each attention block gathers its
queries' selected rows with one ``index_select`` (its backward one ``index_add_``, where advanced indexing's sorted
``index_put_`` took half the layer's CPU time) and is recomputed in backward rather than kept.

On a CUDA device both steps run as Triton kernels (:mod:`seqmesh.kernels.sparse_latent`, each probed once per device
first): the indexer's scores by tiles of queries and keys with the heads summed inside, never the ``(l, H, T)`` tensor;
the attention with each query's selected rows gathered inside the kernel and an online softmax, never the
``(l, k, R + Dr)`` gathered rows. The selection and the masks are the same; only float32's order of summation differs.

A bf16 model (FSDP2's mixed precision, as ``seqmesh train`` runs a GPU) makes the indexer's queries and keys in
bf16 already: the kernel multiplies them as bf16, on a GPU's tensor cores, and sums in float32. Two bf16 values
multiply exactly in float32, so these are transformers' float32 products of the same values; only the sums' rounding
differs (tensor cores' adders, as any order of summation). Wider values (a float32 model; autocast's float32 norm
of the keys) are multiplied in float32, off the tensor cores. ``indexer_precision="bfloat16"`` (a flag, off by
default) rounds those to bfloat16 first, then the same: every mesh still picks alike (the torch form rounds the same
values), but against float32 a query may pick another key where two scores are within the rounding
(docs/attention.md: how often, measured).

GLM-5's ``shared`` layers reuse the previous full layer's selection, which travels between layers as transformers
passes it (``prev_topk_indices``): the local queries' indices into the whole row.

The families' other layouts (their queries, latents, rotaries, sinks, output gates, their indexers' order and scale)
differ per token only; :mod:`.indexed_layouts` reads them from each module.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..kernels.sparse_latent import index_scores_kernel, sparse_latent_attention, uses_kernel
from ..kernels.sparse_latent_blocks import sparse_latent_blocks
from ..mesh import SPMesh
from ..sharded_attention.kept import computed_or_kept
from ..sequence.batch import SequenceInfo
from ..sequence.sharding import gather_sequence, sequence_positions
from ..tensor_values import real_tensors
from . import indexed_layouts as layouts

_ATTR = "_seqmesh_indexed"
LAYER_TYPE = "indexed_attention"
# the score tensor of one block of queries, (B, block, H, T) floats, at most this many elements (1 GiB of float32)
BLOCK_ELEMENTS = 1 << 28
# the indexer's blocks of queries: at least this many per rank's queries (a causal block scores only the keys up to its
# last query: 8 blocks score 56% of a causal row's pairs, one block all), each at least INDEXER_MIN_BLOCK queries
INDEXER_BLOCKS = 8
INDEXER_MIN_BLOCK = 128
# on a CPU, the indexer's (B, l, H, T) float32 scores at most this many elements (16 MB, within the shared cache: its
# rectification and head sum then read it from there; a block of 512 queries at 4,096 keys took 1.6x as long)
CPU_INDEXER_ELEMENTS = 1 << 22
# the indexer's precisions: the dtype its queries and keys are rounded to before their products (sums in float32)
INDEXER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def is_indexed(module: nn.Module) -> bool:
    """Whether ``module`` is the attention of an indexed-attention layer (it holds, or shares, an indexer)."""
    return type(module).__name__.endswith("Attention") and not layouts.is_block_sparse(module) \
        and not hasattr(getattr(module, "indexer", None), "compress_ratio") and (
        getattr(module, "indexer", None) is not None or getattr(module, "skip_topk", False))


def indexed_layers(model: nn.Module, mesh: SPMesh) -> list[nn.Module]:
    """The indexed-attention modules of ``model`` that seqmesh computes; a ValueError naming the first it cannot
    (another indexer, a trained indexer, tensor parallelism). Layers of that type left unfound are refused by
    :func:`seqmesh.hf.layers.check_layers`."""
    found = [m for m in model.modules() if is_indexed(m)]
    for module in found:
        problem = _problem(module, mesh)
        if problem:
            raise ValueError(f"seqmesh cannot run {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) "
                             f"exactly: {problem}. seqmesh computes DeepSeek Sparse Attention in the layouts of "
                             f"transformers' {', '.join(layouts.FAMILIES)}: MLA with a lightning indexer run without "
                             "gradients.")
    return found


def _problem(module: nn.Module, mesh: SPMesh) -> str | None:
    problem = layouts.layout_problem(module)
    if problem:
        return problem
    if getattr(mesh, "tp", 1) > 1:
        return f"tensor parallelism (tp={mesh.tp}) is not combined with indexed attention; use tp=1"
    indexer = getattr(module, "indexer", None)
    if indexer is None:
        takes_selection = "prev_topk_indices" in inspect.signature(module.forward).parameters
        if not getattr(module, "skip_topk", False) or not takes_selection:
            return "it has no indexer and does not take the previous layer's selection (prev_topk_indices)"
        return None
    rule = layouts.indexer_rule(indexer)
    return rule if isinstance(rule, str) else None


def block_queries(batch: int, heads: int, keys: int) -> int:
    """How many queries one block scores or attends at once: its ``(B, block, heads, keys)`` tensor within
    ``BLOCK_ELEMENTS``."""
    return max(1, BLOCK_ELEMENTS // max(1, batch * heads * keys))


def indexer_block(batch: int, heads: int, keys: int, queries: int, device: torch.device) -> int:
    """How many of a rank's ``queries`` the indexer scores at once on ``device``: on a CPU, a block whose scores fit
    ``CPU_INDEXER_ELEMENTS``; elsewhere at most an ``INDEXER_BLOCKS``-th of them (each block scores only the keys up to
    its last query), at least ``INDEXER_MIN_BLOCK``, within ``BLOCK_ELEMENTS``."""
    if device.type == "cpu":
        return max(1, CPU_INDEXER_ELEMENTS // max(1, batch * heads * keys))
    return min(block_queries(batch, heads, keys), max(INDEXER_MIN_BLOCK, -(-queries // INDEXER_BLOCKS)))


def scored_keys(positions: list[int], seq_len: int, step: int) -> list[int]:
    """How many keys of the row the indexer scores for each block of ``step`` consecutive local queries
    (``positions``: each local token's index in the row, padding at or past ``seq_len``): those up to the block's
    last real query, since every later key is masked for all of them (a block of padding: the first key). The rest of
    the row is filled with the mask's ``-inf``, so ``topk`` still sees the row transformers sees."""
    counts = []
    for start in range(0, len(positions), step):
        real = [p for p in positions[start:start + step] if p < seq_len]
        counts.append(max(real) + 1 if real else 1)
    return counts


def check_precision(precision: str, layers: list[nn.Module]) -> None:
    """Refuse an indexer precision that is not one of :data:`INDEXER_DTYPES`, or one other than float32 for a model
    without DeepSeek Sparse Attention's indexer (``layers`` from :func:`indexed_layers`): it would change nothing."""
    if precision not in INDEXER_DTYPES:
        raise ValueError(f"indexer_precision={precision!r}: choose one of {', '.join(map(repr, INDEXER_DTYPES))}.")
    if precision != "float32" and not any(getattr(m, "indexer", None) is not None for m in layers):
        raise ValueError(f"indexer_precision={precision!r} (--indexer-precision) sets DeepSeek Sparse Attention's "
                         "indexer, and this model has no such layer; leave it at 'float32'.")


def _select(indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings, mesh: SPMesh,
            info: SequenceInfo, positions: list[int], allowed, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, L, k)`` int64 indices into the whole row of each local query's top-k keys (no gradient), and the
    indexer's keys of the local tokens (B, L, D); ``positions`` and ``allowed`` from :func:`_key_rules`, the scores'
    ``precision`` a key of :data:`INDEXER_DTYPES`."""
    with torch.no_grad():
        rule = layouts.indexer_rule(indexer)
        q, k = layouts.indexer_keys(indexer, rule, hidden, q_resid, position_embeddings)  # (B, L, H, D), (B, L, D)
        keys = whole_row(k, mesh, info)  # (B, T, D)
        weights = layouts.head_weights(indexer, rule, hidden)  # (B, L, H)
        top = min(indexer.index_topk, keys.shape[1])
        picks = []
        for block, index in index_rows(indexer, rule, q, keys, weights, positions, info.seq_len, precision):
            picks.append(index.masked_fill_(~allowed(block), float("-inf")).topk(top, dim=-1).indices)
            del index  # a block's (B, l, T) scores freed before the next block's are made
        return torch.cat(picks, dim=1), k


def index_rows(indexer: nn.Module, rule, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
               positions: list[int], seq_len: int, precision: str = "float32"):
    """Each block of local queries and its indexer scores against the whole row, ``(slice, (B, l, T) float32)``, the
    keys past the block's queries -inf (masked for all of them: not scored): q (B, L, H, D), keys (B, T, D), weights
    (B, L, H) float32, ``positions`` each query's index in the row. The products are float32's of the queries' and
    keys' values, as transformers takes them (``q.float() @ k.float()``); ``precision="bfloat16"`` rounds those
    values to bfloat16 first (:data:`INDEXER_DTYPES`). On the Triton kernel where it runs (one tile of queries by keys
    at a time, the heads summed in it; values that are all bf16 or fp16 multiplied as such, on a GPU's tensor cores,
    the same exact products summed in float32), else in torch by :func:`indexer_block`'s blocks."""
    b, length, heads, _ = q.shape
    total = keys.shape[1]
    if precision != "float32":
        q, keys = q.to(INDEXER_DTYPES[precision]), keys.to(INDEXER_DTYPES[precision])
    if uses_kernel(keys, "index_scores"):
        index = torch.tensor(positions, device=keys.device)
        limit = torch.where(index < seq_len, index + 1, 1)  # a padding query sees the first key
        scale = 1.0 if rule.scale_on_weights else indexer.softmax_scale
        step = block_queries(b, 1, total)
        for start in range(0, length, step):
            block = slice(start, start + step)
            yield block, index_scores_kernel(q[:, block], keys, weights[:, block], scale, limit[block])
        return
    keys = keys.float().transpose(-1, -2).unsqueeze(1)  # (B, 1, D, T)
    step = indexer_block(b, heads, total, length, q.device)
    for start, count in zip(range(0, length, step), scored_keys(positions, seq_len, step)):
        block = slice(start, start + step)
        index = layouts.index_scores(indexer, rule, q[:, block], keys[..., :count], weights[:, block])  # (B, l, n)
        padded = F.pad(index, (0, total - count), value=float("-inf"))  # (B, l, T): the row transformers scores
        del index
        yield block, padded
        del padded  # not held while the next block is scored


def recomputed(fn, *inputs):
    """``fn(*inputs)``, recomputed in backward rather than kept where a gradient is being built (a block of queries
    of a sparse layer: its gathered keys are the memory)."""
    return checkpoint(fn, *inputs, use_reentrant=False) if torch.is_grad_enabled() else fn(*inputs)


def whole_row(x: torch.Tensor, mesh: SPMesh, info: SequenceInfo) -> torch.Tensor:
    """``x`` (B, L, ...) of every rank, in row order, without the layout's padding: (B, T, ...)."""
    return gather_sequence(x, mesh, dim=1, layout=info.layout, length=info.seq_len, cu_seqlens=info.cu_seqlens)


def _key_rules(mesh: SPMesh, info: SequenceInfo, device: torch.device):
    """Each local token's index in the row (a list), and ``allowed(block) -> (1, l, T)`` bool: which keys of the row
    each local query of ``block`` may see (its own document's, up to itself), and ``valid(block, picks) -> (B, l, k)``
    bool, the same rule read at each pick alone. A padding query sees the row's first token, so that nothing is
    empty."""
    with real_tensors():  # on the host, from the layout alone: values even in a rehearsal's fake mode
        positions = sequence_positions(info.seq_len, mesh, layout=info.layout, cu_seqlens=info.cu_seqlens).tolist()
    index = torch.tensor(positions, device=device)
    keys = torch.arange(info.seq_len, device=device)
    bounds = torch.tensor(info.cu_seqlens or (0, info.seq_len), device=device)
    doc_of = lambda t: torch.bucketize(t, bounds[1:], right=True)  # noqa: E731  the document each position is in
    padding = index >= info.seq_len
    query_doc, key_doc = doc_of(index.clamp(max=info.seq_len - 1)), doc_of(keys)

    def valid(block: slice, picks: torch.Tensor) -> torch.Tensor:  # picks (B, l, k) -> (B, l, k), read at each pick
        q, d, pad = index[block, None], query_doc[block, None], padding[block, None]  # (l, 1)
        return ((picks <= q) & (key_doc[picks] == d)) | (pad & (picks == 0))

    def allowed(block: slice) -> torch.Tensor:  # the same rule at every key of the row: (1, l, T)
        return valid(block, keys[None, None])

    return positions, allowed, valid


def latent_query(module: nn.Module, q_pass: torch.Tensor, q_rot: torch.Tensor) -> torch.Tensor:
    """The query in MLA's latent space: its no-RoPE part (B, l, H, Dn) through ``kv_b_proj``'s key half, beside its
    rotated part (B, l, H, Dr) -> (B, l, H, R + Dr), to score against a row's latent and rotated key side by side."""
    heads, nope = q_pass.shape[2], module.qk_nope_head_dim
    w_key = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, -1)[:, :nope]  # (H, Dn, R)
    return torch.cat([torch.einsum("blhn,hnr->blhr", q_pass, w_key), q_rot], dim=-1)


def latent_output(module: nn.Module, attended: torch.Tensor) -> torch.Tensor:
    """(B, l, H, R) the attention's weighted sum of latents -> (B, l, H, Dv) through ``kv_b_proj``'s value half."""
    heads, nope = attended.shape[2], module.qk_nope_head_dim
    w_value = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, -1)[:, nope:]  # (H, Dv, R)
    return torch.einsum("blhr,hvr->blhv", attended, w_value)


def _latent_attention(module: nn.Module, q_pass, q_rot, row, picks) -> torch.Tensor:
    """MLA over the selected keys, in latent space. q_pass (B, l, H, Dn), q_rot (B, l, H, Dr); row (B, T, R + Dr): the
    whole row's latent and rotated key side by side; picks (B, l, k) indices into it (-1: not seen) -> (B, l, H, Dv)."""
    rank = row.shape[-1] - q_rot.shape[-1]
    attended = sparse_latent_attention(latent_query(module, q_pass, q_rot), row, picks, module.scaling, rank,
                                       layouts.sinks(module))  # (B, l, H, R)
    return latent_output(module, attended)


def _attend_sharded(module: nn.Module, mesh: SPMesh, info: SequenceInfo, hidden_states, q_resid, q_pass, q_rot,
                    latent, k_rot, position_embeddings, prev_topk_indices,
                    precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's attention over the whole row, its queries the local tokens (training, or a generation's prefill,
    which keeps this rank's rows and indexer keys) -> ((B, L, H, Dv), the selection (B, L, k))."""
    b, length = hidden_states.shape[:-1]
    positions, allowed, valid = _key_rules(mesh, info, hidden_states.device)
    index_keys = None
    keep = getattr(info, "keep_indexed", None)  # a prefill of seqmesh.inference.generate: this rank's share
    if getattr(module, "indexer", None) is None:
        picks = prev_topk_indices.long()
    elif keep is None:  # training: the selection alone, which a layer keeping its attention keeps for its recompute
        picks, = computed_or_kept(lambda: _select(module.indexer, hidden_states, q_resid, position_embeddings, mesh,
                                                  info, positions, allowed, precision)[:1])
    else:
        picks, index_keys = _select(module.indexer, hidden_states, q_resid, position_embeddings, mesh, info,
                                    positions, allowed, precision)
    local_rows = torch.cat([latent, k_rot], dim=-1)  # (B, L, R + Dr)
    if keep is not None:
        keep(module, local_rows, index_keys)
    row = whole_row(local_rows, mesh, info)  # (B, T, R + Dr): one gather, one scatter
    if not uses_kernel(row):  # the torch form: one op over small blocks, MLA's latent projections inside it
        step = block_queries(b, 1, row.shape[1])
        seen = torch.cat([_seen(picks, valid, slice(start, start + step)) for start in range(0, length, step)], 1)
        heads, nope = q_pass.shape[2], module.qk_nope_head_dim
        weight = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, -1)  # (H, Dn + Dv, R)
        out = sparse_latent_blocks(q_pass, q_rot, row, seen, module.scaling, layouts.sinks(module),
                                   weight[:, :nope], weight[:, nope:], budget=BLOCK_ELEMENTS)
        return out, picks
    step = block_queries(b, q_pass.shape[2], row.shape[-1])  # the kernel gathers inside itself: its latent query
    outputs = []
    for start in range(0, length, step):
        block = slice(start, start + step)
        inputs = (q_pass[:, block], q_rot[:, block], row, _seen(picks, valid, block))
        outputs.append(recomputed(_latent_attention, module, *inputs))
    return torch.cat(outputs, dim=1), picks


def _seen(picks: torch.Tensor, valid, block: slice) -> torch.Tensor:
    """The block's picks (B, l, k), -1 where its query may not see the pick (another document's, or later)."""
    return picks[:, block].masked_fill(~valid(block, picks[:, block]), -1)


def _make_forward(mesh: SPMesh, precision: str):
    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
        # hidden_states (B, L, E) -> ((B, L, E), None[, (B, L, k) the selection, for GLM-5's shared layers])
        info, name = entry_of(self, cache, kwargs)
        b, length = hidden_states.shape[:-1]
        q_resid, query, gate = layouts.queries(self, hidden_states)  # query (B, L, H, Dn + Dr)
        q_pass, q_rot = torch.split(query, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = layouts.latent(self, hidden_states)  # (B, L, R), (B, L, Dr)
        # (B, H, L, Dr), (B, 1, L, Dr)
        q_rot, k_rot = layouts.rotate(self, q_rot.transpose(1, 2), k_rot[:, None], position_embeddings)
        q_rot, k_rot = q_rot.transpose(1, 2), k_rot[:, 0]
        if getattr(self, "indexer", None) is None and prev_topk_indices is None:
            raise ValueError(f"{name} shares the previous full layer's selection, but none was passed to it.")
        decode = getattr(info, "indexed_step", None)  # a decode step of seqmesh.inference.generate
        if decode is not None:
            attended, picks = decode(self, hidden_states, q_resid, q_pass, q_rot, torch.cat([latent, k_rot], dim=-1),
                                     position_embeddings, prev_topk_indices)
        else:
            attended, picks = _attend_sharded(self, mesh, info, hidden_states, q_resid, q_pass, q_rot, latent, k_rot,
                                              position_embeddings, prev_topk_indices, precision)
        out = layouts.gated(self, hidden_states, attended, gate)  # (B, L, H, Dv)
        out = self.o_proj(out.reshape(b, length, -1))
        if "prev_topk_indices" in inspect.signature(type(self).forward).parameters:
            return out, None, picks
        return out, None

    return forward


def entry_of(module: nn.Module, cache, kwargs: dict) -> tuple[SequenceInfo, str]:
    """The seqmesh entry of a sparse layer's call and the layer's name; a ValueError for a call it cannot serve
    (no entry, a transformers cache, attention dropout in training)."""
    info: SequenceInfo | None = kwargs.get("seqmesh")
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if info is None:
        raise ValueError(f"{name} runs sequence-parallel but was called without the 'seqmesh' entry; call the "
                         "model with the batch returned by seqmesh.shard_batch (model(**batch)).")
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"{name} runs sequence-parallel and keeps no cache: call the model without one.")
    if module.training and module.attention_dropout:
        raise ValueError(f"attention dropout ({module.attention_dropout}) is not supported by seqmesh; set "
                         "attention_dropout=0.")
    return info, name


def replace_forward(layers: list[nn.Module], forward, attr: str) -> None:
    """Give each of ``layers`` ``forward`` as its own, marked with ``attr``; the class is untouched."""
    for module in layers:
        module.forward = types.MethodType(forward, module)
        setattr(module, attr, True)


def restore_forward(model: nn.Module, attr: str) -> None:
    """Undo :func:`replace_forward` on every module of ``model`` marked with ``attr``: the class's own forward."""
    for module in model.modules():
        if getattr(module, attr, False):
            del module.forward
            delattr(module, attr)


def install(layers: list[nn.Module], mesh: SPMesh, precision: str = "float32") -> None:
    """Give ``layers`` (from :func:`indexed_layers`) the sequence-parallel forward, their indexers scoring in
    ``precision`` (:func:`check_precision`); the class is untouched."""
    replace_forward(layers, _make_forward(mesh, precision), _ATTR)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the class's own forward again."""
    restore_forward(model, _ATTR)
