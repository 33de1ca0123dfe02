"""What autograd keeps for backward on one GPU, op by op, for the modules seqmesh really runs (transformers'
decoder layer with seqmesh's attention), and each layer's backward as a timeline of its ops. What each op saves
and allocates: docs/planner.md ("Activations").
"""

from __future__ import annotations

import torch

from ..hf import indexed_attention
from ..kernels import sparse_latent_blocks
from ..model.shapes import ModelShape
from ..rules.degrees import Degrees
from .depth_states import final_depth_bytes
from .expert_activations import experts_backward_steps, experts_saved, mlp_tensors
from .placement import placement, tp_heads
from .workload import Workload

INT64 = 8
# (B, l, H, k) float32 tensors a sparse block's backward holds at once: its probabilities, their gradient, the scores'
# gradient and a temporary of their product
SCORE_TENSORS = 4
GPU = torch.device("cuda")  # the device the planner plans for (block sizes that differ by device)
TILED_RECOMPUTE = "tiled MLP recompute"  # under TP, checkpointed: a layer's peak before its weight gradients exist


def local_tokens(work: Workload, layout: Degrees) -> int:
    """Tokens of each sequence one GPU holds between the layers (the padded length over ulysses x ring x tp)."""
    return placement(work, layout).local_tokens


def tokens(work: Workload, layout: Degrees) -> int:
    """``T``: tokens one GPU holds between the layers (the residual stream, the norms), all ``batch`` sequences."""
    return work.batch * local_tokens(work, layout)


def gathered_tokens(work: Workload, layout: Degrees) -> int:
    """Tokens of one GPU inside the tensor-parallel regions (attention's projections, the MLP, the loss): its TP
    group's slices gathered, ``B x L``; :func:`tokens` without TP."""
    return tokens(work, layout) * layout.tp


def attention_heads(work: Workload, layout: Degrees) -> tuple[int, int, int]:
    """(tokens, query heads, kv heads) inside attention on the busiest GPU: Ulysses gathers ``U`` ranks'
    tokens for a share of this TP rank's heads."""
    deal = placement(work, layout).heads
    return gathered_tokens(work, layout) * layout.ulysses, deal.max_q, deal.max_kv


# families whose RMSNorm scales by ``1 + weight`` in float32 and casts after (Gemma's): the product keeps the float32
# normalized tensor, where Llama's casts first and keeps it in the compute dtype
FLOAT32_SCALED_NORMS = ("gemma", "gemma2", "gemma3_text", "minimax_m3_vl_text", "qwen3_5_text", "qwen3_5_moe_text",
                        "qwen3_next")


def norm_saved(m: ModelShape, e: int, efficient: bool = False) -> int:
    """Bytes per token an RMSNorm keeps, its output excluded, eager or ``efficient`` (docs/planner.md, Activations;
    a Gemma-style norm stays eager: :func:`efficient_norm`)."""
    if efficient and _leanable(m):
        return e * m.hidden + 4
    return 4 * m.hidden + 4 + _normalized_bytes(m, e) * m.hidden


def efficient_norm(work: Workload) -> bool:
    """Whether ``work``'s norms run seqmesh's lean RMSNorm: asked, and Llama-style."""
    return work.efficient_norm and _leanable(work.model)


def _leanable(m: ModelShape) -> bool:
    """Whether seqmesh's lean RMSNorm replaces ``m``'s norms: ``seqmesh.memory.rmsnorm`` leaves a norm that scales by
    ``1 + weight`` in float32 (:data:`FLOAT32_SCALED_NORMS`) as it is."""
    return m.family not in FLOAT32_SCALED_NORMS


def _normalized_bytes(m: ModelShape, e: int) -> int:
    """Bytes an eager RMSNorm keeps of each normalized value for its weight's product (:data:`FLOAT32_SCALED_NORMS`)."""
    return 4 if m.family in FLOAT32_SCALED_NORMS else e


def indexed_attention_saved(work: Workload, layout: Degrees) -> int:
    """Bytes one DeepSeek Sparse Attention layer (``seqmesh.hf.indexed_attention``) keeps for backward: its queries'
    no-RoPE and rotary parts (B, L, H, Dn + Dr), MLA's gathered latent row and rotary keys (B, S, R + Dr), each
    query's top-k picks (int64, -1 where it may not see one), the output, ``o_proj``'s input (B, L, H, Dv), and a
    float32 log-sum-exp per query and head (``seqmesh.kernels.sparse_latent_blocks``)."""
    m, e, lat = work.model, work.act_bytes, work.model.latent
    t, row = tokens(work, layout), work.batch * work.seq_len
    top = min(lat.index_topk, work.seq_len)
    return t * (m.heads * ((lat.qk_head_dim + lat.v_head_dim) * e + 4) + top * INT64) + row * (
        lat.kv_lora_rank + lat.qk_rope_head_dim) * e


def indexed_attention_working_bytes(work: Workload, layout: Degrees) -> int:
    """Peak bytes of a DeepSeek Sparse Attention layer beyond what it keeps, the larger of two moments. The selection
    (forward, and again in a checkpointed layer's recompute): the gathered row of indexer keys (B, S, Di), its float32
    copy, and a float32 score block (B, l, Hi, S) of ``indexer_block`` queries (scaled and rectified in place) beside
    their weighted sum over the heads (B, l, S). The
    attention's backward: the gradients of its queries (B, L, H, Dn + Dr) and of the gathered row (B, S, R + Dr), and a
    block's chosen latents and rotary keys (B, l, k, R + Dr) with their gradient (a GPU's blocks, as
    ``seqmesh.kernels.sparse_latent_blocks.block_queries`` sizes them) beside its float32 probabilities, their
    gradient and its temporaries (:data:`SCORE_TENSORS` of (B, l, H, k)), and a float32 (B, L, H) sum."""
    m, e, lat, b = work.model, work.act_bytes, work.model.latent, work.batch
    row, local, top = b * work.seq_len, local_tokens(work, layout), min(lat.index_topk, work.seq_len)
    per_query = b * (lat.index_n_heads + 1) * work.seq_len  # each head's scores and their weighted sum
    scores = indexed_attention.indexer_block(b, lat.index_n_heads, work.seq_len, local, GPU) * per_query
    # the row's keys (and their float32 copy) and the rank's queries of every indexer head, beside a score block
    select = row * lat.index_head_dim * (e + 4) + local * b * lat.index_n_heads * lat.index_head_dim * e + scores * 4
    width = lat.kv_lora_rank + lat.qk_rope_head_dim
    step = min(sparse_latent_blocks.block_queries(b, top, width, GPU, indexed_attention.BLOCK_ELEMENTS), local)
    queries = local * b * m.heads * (lat.qk_head_dim * e + 4)  # with the float32 sum of out . d out per head
    block = sparse_block_bytes(step, b, m.heads, top, width, e)
    return max(select, block + row * width * e + queries)


def sparse_block_bytes(step: int, batch: int, heads: int, picks: int, width: int, e: int) -> int:
    """What one block of ``step`` queries of the torch form's backward holds (``seqmesh.kernels.sparse_latent_blocks``;
    DeepSeek Sparse Attention's and V4's compressed layers'): its chosen rows ``(B, l, k, width)`` and their
    gradient, its float32 probabilities and their gradients (:data:`SCORE_TENSORS` of (B, l, H, k)), beside the
    larger of two passing tensors: the two operands of the one product that makes the rows' gradient
    ((B, l, 2H, k) and (B, l, 2H, width)), or a slice of that gradient in float32 where the row's float32 gradient
    takes it (``_add_rows``)."""
    chosen = step * batch * picks * width
    cast = chosen * 4 // sparse_latent_blocks.ADD_SLICES if e < 4 else 0
    passing = max(cast, 2 * step * batch * heads * (picks + width) * e)
    return 2 * chosen * e + passing + step * batch * heads * picks * 4 * SCORE_TENSORS


def attention_saved(work: Workload, layout: Degrees) -> int:
    """Bytes seqmesh attention keeps for one layer (q, k, v, output, float32 LSE; Ulysses: the output projection's
    own input; the q and k norms', :func:`qk_norm_saved`); a DeepSeek Sparse Attention model's layers:
    :func:`indexed_attention_saved`."""
    m, e = work.model, work.act_bytes
    if m.indexed_layers:
        return indexed_attention_saved(work, layout)
    n, hq, hk = attention_heads(work, layout)
    saved = n * (e * m.head_dim * (2 * hq + 2 * hk) + 4 * hq) + qk_norm_saved(work, layout)
    if layout.ulysses > 1:
        saved += gathered_tokens(work, layout) * e * m.heads // layout.tp * m.head_dim
    return saved  # DeepSeek-V4's compressed layers: their own (seqmesh.planner.compressed), beside this


def kept_attention_bytes(work: Workload, layout: Degrees) -> int:
    """What one checkpointed layer keeps of its attention until its backward with ``keep_attention``
    (:mod:`seqmesh.sharded_attention.kept`): the output in the compute dtype and the float32 log-sum-exp, over the
    tokens and heads attention runs on (after Ulysses' exchange); 0 without it."""
    if not (work.checkpointing and work.keep_attention):
        return 0
    n, hq, _ = attention_heads(work, layout)
    return n * hq * (work.model.value_dim * work.act_bytes + 4)


def qk_norm_saved(work: Workload, layout: Degrees) -> int:
    """What a layer's q and k norms keep (:attr:`seqmesh.model.shapes.ModelShape.qk_norms`), before Ulysses' exchange:
    each head's float32 input (in a narrower dtype its float32 copy), the float32 scale and the normalized head (the
    weight's product reads it; in the compute dtype, or float32 for :data:`FLOAT32_SCALED_NORMS`), over this TP
    rank's heads."""
    m, e = work.model, work.act_bytes
    if not m.qk_norms:
        return 0
    hq, hk = tp_heads(m, layout)
    if efficient_norm(work):  # seqmesh.memory.rmsnorm's: its input in its own dtype and the float32 scale
        return gathered_tokens(work, layout) * (hq + hk) * (m.head_dim * e + 4)
    return gathered_tokens(work, layout) * (hq + hk) * (m.head_dim * (4 + _normalized_bytes(m, e)) + 4)


def decoder_layer_saved_bytes(work: Workload, layout: Degrees) -> int:
    """Bytes one attention decoder layer keeps for backward on one GPU: two norms, the projections' inputs (the
    norms' outputs; under TP their gathered copies), attention, the MLP (docs/planner.md lists them); a Mamba2
    hybrid's: its norms and feed-forward (an estimate, :class:`seqmesh.model.hybrid.FeedForward`)."""
    m, e, g = work.model, work.act_bytes, gathered_tokens(work, layout)
    if m.hybrid is not None:  # a Mamba2 hybrid's attention layer: its own norms and feed-forward (Nemotron-H's: none)
        ffn = m.hybrid.ffn(m.hybrid.attention_ffn())  # its saved elements include its input's row (tp is 1)
        norms = m.hybrid.norms * tokens(work, layout) * norm_saved(m, e, work.efficient_norm)
        return norms + g * e * m.hidden + attention_saved(work, layout) + (0 if work.tiled_mlp else g * e * ffn.kept)
    norms = 2 * tokens(work, layout) * norm_saved(m, e, work.efficient_norm) if m.qwen_exp is None else 0
    return (norms + 2 * g * e * m.hidden + attention_saved(work, layout) + mlp_saved_bytes(work, layout)
            + hyper_connection_saved(work, layout))


def mlp_saved_bytes(work: Workload, layout: Degrees) -> int:
    """What a decoder layer's MLP keeps: gate, up, SiLU(gate) and the product (a two-matrix MLP: up and its
    activation), and Doge's cross-domain experts' (:meth:`seqmesh.model.doge.CrossDomainExperts.saved_bytes`); an MoE
    layer's, :func:`experts_saved`; none when the tiled MLP recomputes them (which refuses Doge's experts)."""
    m = work.model
    if work.tiled_mlp:
        return 0
    if m.experts and m.hybrid is None:  # tp is 1 (seqmesh's tensor parallelism does not split experts)
        return experts_saved(work, layout)
    tensors = mlp_tensors(m) if m.mlp_matrices == 3 else 2
    beside = m.cross_domain.saved_bytes(m.hidden, work.act_bytes) if m.cross_domain is not None else 0  # tp is 1
    return gathered_tokens(work, layout) * (tensors * m.intermediate // layout.tp * work.act_bytes + beside)


def layer_input_bytes(work: Workload, layout: Degrees) -> int:
    """The input a checkpointed layer keeps (the residual stream, compute dtype; HY-V4's ``hc_mult`` streams,
    Qwen4-Exp's ``hc_count``)."""
    return tokens(work, layout) * work.model.hidden * work.act_bytes * work.model.streams


def hyper_connection_saved(work: Workload, layout: Degrees) -> int:
    """What a layer's two hyper-connections keep. HY-V4's: each its streams flattened in float32 (the mixing weights'
    input) and its block's output in float32 (the streams' update). DeepSeek-V4's: each its streams in float32 (a
    copy unless the model is) and normed (the mixing weights' input), the float32 (n, n) mixes of each Sinkhorn
    iteration (two divisions, each keeping its input and denominator) and its block's output; the streams between
    the two blocks; and, without checkpointing, the layer's input streams (a checkpointed layer keeps them as its
    input anyway)."""
    m, n = work.model, work.model.hc_mult
    if m.qwen_exp is not None:
        return 2 * tokens(work, layout) * gated_residual_saved(work)
    if not n:
        return 0
    if m.compressed is None:
        return 2 * tokens(work, layout) * 4 * m.hidden * (n + 1)
    e = work.act_bytes
    streams = (1 if work.checkpointing else 2) * e * n * m.hidden
    return tokens(work, layout) * (2 * (hyper_connection_share(work) + e * m.hidden) + streams)


def gated_residual_saved(work: Workload, inject: bool = True) -> int:
    """Bytes a token's one Qwen4-Exp gated residual keeps: its norm's float32 input (a copy unless the model is
    float32) and normalized streams, the normed streams (its three projections' input) and the mixing weights'
    sigmoid (``n x E`` each, the compute dtype), the low-rank projection's SiLU input and output (``r`` each); with
    its injection (not the model's last), the block's output, which the injection weights multiply."""
    m, e, q = work.model, work.act_bytes, work.model.qwen_exp
    wide = q.streams * m.hidden
    return 2 * 4 * wide + 2 * e * wide + 2 * e * q.lowrank + (e * m.hidden if inject else 0)


def hyper_connection_backward_bytes(work: Workload, layout: Degrees) -> int:
    """What DeepSeek-V4's layer holds beyond its saved tensors and its output's gradient as its backward starts: its
    second hyper-connection's expansion (the block's output times each stream's weight) makes its two operands'
    gradients at once, ``(tokens, hc_mult, hidden)`` each before it is reduced to its operand's shape, beside the
    streams' gradient through the mixing, made just before; all in the compute dtype (measured in a rehearsal,
    docs/planner.md)."""
    m = work.model
    if m.compressed is None:
        return 0
    return 3 * tokens(work, layout) * m.compressed.hc_mult * m.hidden * work.act_bytes


def hyper_connection_share(work: Workload) -> int:
    """Bytes a token's one DeepSeek-V4 hyper-connection keeps: its streams in float32 (a copy unless the model is)
    and normed, and its Sinkhorn iterations' mixes (each division's (n, n) output and its sums; the first and last
    iterations' two fewer, as a rehearsal holds them)."""
    m, e, c = work.model, work.act_bytes, work.model.compressed
    n = c.hc_mult
    return 4 * n * m.hidden * (2 if e < 4 else 1) + 4 * (2 * c.hc_iters - 2) * (n * n + n)


def outside_layers_bytes(work: Workload, layout: Degrees) -> int:
    """Kept all step outside the layers: token ids, positions, labels (and the loss's masked copy), and
    RoPE's cos and sin; Inkling's embedding norm's saved tensors."""
    t, m = gathered_tokens(work, layout), work.model  # every TP rank of a group holds its sequence rank's L tokens
    # under TP the first layer's input is kept twice more (in host memory with the other inputs when offloaded)
    first_input = 2 * layer_input_bytes(work, layout) if layout.tp > 1 and not work.offload_checkpoints else 0
    embed_norm = t * norm_saved(m, work.act_bytes) if m.inkling is not None else 0
    return t * (4 * INT64 + 2 * m.head_dim * work.act_bytes) + first_input + embed_norm


def final_norm_bytes(work: Workload, layout: Degrees) -> int:
    """The final norm's saved tensors and its output (saved by the loss); offloaded, only the output stays, and the
    efficient norm's scale (made outside autograd's graph, which the offload leaves where it is)."""
    m, e, t = work.model, work.act_bytes, tokens(work, layout)
    if work.offload_checkpoints:
        return t * (e * m.hidden + (4 if efficient_norm(work) else 0))
    output = e * m.hidden if layout.tp == 1 else 0  # under TP the loss keeps its gathered copy (and the output only
    # while its forward runs: memory.loss_memory)
    return t * (norm_saved(m, e, work.efficient_norm) + output + final_depth_bytes(work))


def norm_backward_steps(work: Workload, layout: Degrees) -> list[tuple[str, int, int]]:
    """An RMSNorm's backward, op by op (``(op, allocated, freed)``), from its output's gradient to its input's
    (Qwen4-Exp's: :func:`gated_residual_backward_steps`)."""
    m, e, t = work.model, work.act_bytes, tokens(work, layout)
    if m.qwen_exp is not None:
        return gated_residual_backward_steps(work, layout)
    c, f = t * m.hidden * e, t * m.hidden * 4  # one (token, hidden) tensor in the compute dtype / in float32
    if efficient_norm(work):  # seqmesh.memory.rmsnorm: one step, the input gradient and one tile's float32 tensors
        tile = -(-t // max(1, -(-t // m.hidden)))  # seqmesh.memory.tiled_mlp.tile_count over all B x L tokens
        working = (2 if e == 4 else 3) * tile * m.hidden * 4
        return [("norm tiled backward", c + working, working + c + t * norm_saved(m, e, True))]
    kept = t * norm_saved(m, e) - c  # float32 input and scale (n is freed by the first step)
    steps = [("norm weight backward", 2 * c, 3 * c)]  # dn and dn*n; dn*n, n and the incoming gradient freed
    if e == 4:
        return steps + [("norm scale backward", 2 * f, 3 * f),  # dx and dn*x; dn*x, dn freed, dx added in place
                        ("norm square backward", 4 * f, 4 * f + kept)]  # its four tensors; x and r freed
    return steps + [("norm cast backward", f, c),
                    ("norm scale backward", 2 * f, 2 * f),  # dx and dn*x; dn*x and dn freed
                    ("norm square backward", 4 * f, 3 * f),  # the product stays, to be added to dx
                    ("norm gradient sum", 0, f + kept),  # in place into dx; the float32 copy and r freed
                    ("norm cast back", c, f)]  # dx in bf16, added in place into the residual gradient


def gated_residual_backward_steps(work: Workload, layout: Degrees) -> list[tuple[str, int, int]]:
    """A Qwen4-Exp gated residual's backward, op by op, from the gradient of its mixed output to its streams': the
    normed streams' gradient (``n x E`` a token; the mix's and the three projections', summed), then its norm's, in
    float32 (as an RMSNorm's in a narrower dtype, :func:`norm_backward_steps`, at ``n x E``, the weight's product
    float32 too; three float32 tensors at its square's backward, as a rehearsal holds them), the float32 input and
    normalized streams it kept freed at the end."""
    m, e, t = work.model, work.act_bytes, tokens(work, layout)
    wide = m.streams * m.hidden
    c, f = t * wide * e, t * wide * 4
    return [("gated residual mix backward", c, 2 * c),  # the normed streams' gradient; they and the mixing weights
            # freed
            ("norm cast backward", f, c),
            ("norm weight backward", 2 * f, 2 * f),  # d(normalized) and its product with the normalized streams
            ("norm scale backward", 2 * f, 2 * f),
            ("norm square backward", 3 * f, 2 * f),
            ("norm gradient sum", 0, f + t * (2 * 4 * wide)),  # its float32 input and normalized streams freed
            ("norm cast back", c, f)]


def gather_backward(name: str, gathered: int) -> tuple[str, int, int]:
    """The adjoint of a TP region's reduce-scatter on its output: the output's gradient all-gathered over the TP
    group, ``(B, L, hidden)``. DTensor waits for it lazily and cuts the dim-0 result into the sequence dim, which
    leaves three such tensors until the projection's backward has used them (measured, torch 2.13)."""
    return (f"{name} output gather backward", 3 * gathered, 0)


def scatter_backward(name: str, gathered: int, local: int) -> tuple[str, int, int]:
    """The adjoint of a TP region's input all-gather: its gradient reduce-scattered to this rank's slice, through a
    dim-0-contiguous copy; the copy and the gathered gradient freed."""
    return (f"{name} input reduce-scatter backward", gathered + local, 2 * gathered)


# (token, intermediate) tensors a two-matrix MLP's activation holds at once in backward, d(up) included: torch's gelu
# one; BLOOM's tanh GeLU (transformers' GeLUFunction, its derivative in Python) four (fitted to a rehearsal)
TWO_MATRIX_ACTIVATION_BACKWARD = {"bloom": 4}
ATTENTION_STEPS = "post-attention "  # the prefix of the first of a layer's attention steps, after its MLP's


def layer_backward_timeline(work: Workload, layout: Degrees) -> list[tuple[str, int, int]]:
    """One decoder layer's backward, op by op, as ``(op, allocated, freed)`` bytes on one GPU, from the state where
    it starts (every tensor the layer saved and the gradient of its output alive). Under TP the regions between
    the norms work on the gathered tokens with 1/tp of the heads and MLP columns."""
    m, e, t, g = work.model, work.act_bytes, tokens(work, layout), gathered_tokens(work, layout)
    hidden, wide = t * m.hidden * e, g * m.hidden * e  # one (token, hidden) tensor: a slice, a TP group's tokens
    inner = g * m.intermediate // layout.tp * e  # one (token, intermediate) tensor, this rank's columns
    tp = layout.tp > 1
    hq_rank, hk_rank = tp_heads(m, layout)
    norm = norm_backward_steps(work, layout)
    qkv = g * (hq_rank + 2 * hk_rank) * m.head_dim * e
    out = g * hq_rank * m.head_dim * e
    if m.hybrid is not None and not m.hybrid.attention_layers and not any(f for _, f in m.hybrid.blocks):
        # a mixer and its norm alone (pure Mamba): the mixer's backward is its kind's (backward_bytes)
        return [*(("input " + op, a, f) for op, a, f in norm), ("residual gradient sum", 0, hidden)]
    steps = [gather_backward("down_proj", wide)] if tp and not work.tiled_mlp else []
    if tp and work.tiled_mlp:  # the tiled MLP waits for its gathered output gradient at once: one (B, L, hidden)
        steps += [("MLP output gather backward", 2 * wide, wide)]
    if tp and work.tiled_mlp and work.checkpointing:  # the recompute reaches the tiled MLP's input, the last tensor
        # saved, after running its forward whole: the tiles' partial outputs and their concatenation, beside the
        # residual and the norm's output slices; before the layer's weight gradients exist (memory.memory_at)
        recompute = 2 * wide + 2 * hidden
        steps += [(TILED_RECOMPUTE, recompute, recompute)]
    if work.tiled_mlp:  # dx, then one tile at a time: recomputed gate, up, SiLU, product, output and their gradients
        columns = m.intermediate // layout.tp  # under TP each tile of the gathered tokens has this rank's columns
        tile_set = mlp_tile_tokens(work, layout) * (7 * columns + m.hidden) * e
        tile_grads = 3 * m.hidden * columns * e  # this tile's weight gradients beside the running sums
        incoming = wide  # the output's gradient (under TP its gathered copy) freed at the end
        steps += [("tiled MLP backward", wide + tile_set + tile_grads, tile_set + tile_grads + incoming)]
    elif m.experts and m.hybrid is None:  # the experts (tp is 1), then the shared experts and the router
        steps += experts_backward_steps(work, layout)
    elif m.mlp_matrices == 2:  # up, its activation, down
        held = TWO_MATRIX_ACTIVATION_BACKWARD.get(m.family, 1)
        steps += [("down_proj backward", inner, inner + (3 * wide if tp else 0)),  # d(activation); its output freed
                  # d(up) and the activation's own temporaries; up's output, d(activation) and the temporaries freed
                  ("activation backward", held * inner, (held + 1) * inner),
                  ("up_proj backward", wide, inner + wide)]  # d(input); the norm's output freed
    else:
        steps += [("down_proj backward", inner, inner + (3 * wide if tp else 0)),  # d(product); the product (and
                  # the gathered output gradient) freed
                  ("SwiGLU product backward", 2 * inner, 3 * inner),  # d(SiLU), d(up); SiLU, up, d(product) freed
                  ("SiLU backward", inner, 2 * inner),  # d(gate); gate, d(SiLU) freed
                  # two input gradients, the second added in place into the first; the norm's output freed (and a
                  # clamped SwiGLU's further tensors)
                  ("gate/up_proj backward", 2 * wide, (mlp_tensors(m) - 2) * inner + 2 * wide)]
    if m.cross_domain is not None:  # then Doge's experts (tp is 1): the up rows' gradient, then the down rows', each
        # freed with the rows it kept
        rows = t * m.cross_domain.row_bytes(m.hidden, e)
        steps += [("experts' up rows backward", rows, 2 * rows), ("experts' down rows backward", rows, 2 * rows)]
    if tp:
        steps += [scatter_backward("MLP", wide, hidden)]
    if m.hybrid is not None and not m.hybrid.attention_layers:  # no attention (pure Mamba, RWKV, xLSTM): the mixer's
        # backward is its layer kind's (backward_bytes), not a nominal attention head's
        return steps + [*(("input " + op, a, f) for op, a, f in norm), ("residual gradient sum", 0, hidden)]
    n, hq, _ = attention_heads(work, layout)
    o_input = out if layout.ulysses > 1 and not m.indexed_layers else 0  # o_proj's own input (Ulysses; not DSA)
    steps += [*((ATTENTION_STEPS + op, a, f) for op, a, f in norm),
              ("residual gradient sum", 0, hidden)]  # in place into the residual stream's gradient
    steps += [gather_backward("o_proj", wide)] if tp else []
    steps += [("o_proj backward", out, o_input + (3 * wide if tp else 0))]
    d_out = out
    if o_input:  # the output's gradient scattered to this rank's heads, the local one freed
        d_out = n * hq * m.head_dim * e
        steps += [("output all-to-all backward", d_out, out)]
    work_set = attention_backward_bytes(work, layout)
    steps += [("attention backward", work_set, work_set - qkv + attention_saved(work, layout) - o_input + d_out),
              ("rotary backward", qkv, qkv),
              ("q/k/v_proj backward", 2 * wide, qkv + 2 * wide)]  # summed in place; the norm's output freed
    if tp:
        steps += [scatter_backward("attention", wide, hidden)]
    steps += [*(("input " + op, a, f) for op, a, f in norm),
              ("residual gradient sum", 0, hidden)]
    return steps


def timeline_peak(steps: list[tuple[str, int, int]]) -> tuple[int, str]:
    """The most bytes a timeline adds above its start, and the op at which it does."""
    live, peak, where = 0, 0, "start"
    for op, allocated, freed in steps:
        live += allocated
        if live > peak:
            peak, where = live, op
        live -= freed
    return peak, where


def attention_backward_bytes(work: Workload, layout: Degrees) -> int:
    """Peak bytes of seqmesh's attention backward beyond its saved tensors and the output's gradient, the q, k, v
    gradients it returns included; a DeepSeek Sparse Attention model's layers: :func:`indexed_attention_working_bytes`."""
    m, e = work.model, work.act_bytes
    if m.indexed_layers:
        return indexed_attention_working_bytes(work, layout)
    n, hq, hk = attention_heads(work, layout)
    d = m.head_dim
    kernel = n * (hq + 2 * hk) * d * e
    lat = m.latent
    if lat is not None and 0 < lat.v_head_dim < d and layout.ulysses == layout.ring == 1:
        # MLA's narrower values padded to the query width for the fused kernel (seqmesh.kernels.base.PadsHeadDims):
        # in backward the padded values, output and output gradient (the bench's MLA config at 8K on one GPU: plan
        # 0.809 of the rehearsal without them, 1.004 with). Not added under Ulysses or ring, whose working sets below
        # already count more than a rehearsal holds there (16K on 2 GPUs: U2 1.285, R2 1.044 without them)
        kernel += n * (hk + 2 * hq) * d * e
    inner = kernel
    if layout.ring > 1:  # a ring of two has no middle step: no block being received while one is computed
        fp32_blocks, kv_blocks = (3, 2) if layout.ring == 2 else (4, 3)
        inner += n * hq * d * 4 + n * 2 * hk * d * (fp32_blocks * 4 + kv_blocks * e)
    if layout.ulysses == 1:
        return inner
    hq_rank, hk_rank = tp_heads(m, layout)
    returned = gathered_tokens(work, layout) * (hq_rank + 2 * hk_rank) * d * e
    return max(inner, 2 * kernel + returned)


def mlp_tile_tokens(work: Workload, layout: Degrees) -> int:
    """Tokens of one MLP tile on one GPU, all ``batch`` sequences: each sequence's tokens inside the MLP (under TP
    its group's gathered ``L``) cut into ``mlp_tiles`` tiles, by default tiles of at most ``hidden``
    (``seqmesh.memory.tiled_mlp.tile_count``)."""
    local = local_tokens(work, layout) * layout.tp
    tiles = work.mlp_tiles or max(1, -(-local // work.model.hidden))
    return work.batch * -(-local // min(tiles, local))
