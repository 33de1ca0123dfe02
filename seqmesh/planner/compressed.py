"""A DeepSeek-V4 compressed layer (HCA or CSA, ``seqmesh.hf.compressed_attention``; the model's shape:
:mod:`seqmesh.model.deepseek_v4`) on the busiest rank: its FSDP unit, its collectives, what it keeps and its time.

Each rank extends its runs by the rows before them (one all-gather of the key, the compressor's projections and CSA's
indexer's, ``halo - 1`` rows a run), builds the entries whose window closes at one of its tokens and all-gathers them
(a count, the entries padded to the busiest rank's number, their numbers; CSA's indexer keys likewise, without
gradient); backward reduce-scatters the halo's and the entries' gradients. Its queries attend to their window and to
the entries (HCA: every closed one; CSA: the indexer's top k, scored against every entry of the row in float32), on
the Triton kernel in blocks of queries recomputed in backward, as DeepSeek Sparse Attention's. Its sliding layers are
seqmesh attention (:class:`.attention_layer.Attention` with the window).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..hf import compressed_attention, indexed_attention
from ..hf.indexed_attention import block_queries
from ..kernels import sparse_latent_blocks
from ..linear_attention.choice import halo_bytes, runs_and_tails
from ..model.deepseek_v4 import CSA
from ..rules.degrees import Degrees
from ..sequence.layout import SequenceLayout
from .activations import (GPU, attention_saved, decoder_layer_saved_bytes, hyper_connection_share, local_tokens,
                          mlp_saved_bytes, norm_saved, sparse_block_bytes, tokens)
from .hardware import HardwareSpec
from .layer_cost import (Phases, gather_comm_seconds, gather_links, gather_phases,
                         serial_layer_seconds)
from .placement import placement
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload, mlp_matmul_params

INT64 = 8
KEY = "compressed_gather"  # the halo's and the entries' collectives


@functools.lru_cache(maxsize=256)
def own_windows(layout: str, ulysses: int, ring: int, seq_len: int, rate: int) -> tuple[int, ...]:
    """Per sequence rank, the windows of ``rate`` tokens that close at one of its tokens (one document)."""
    lay = SequenceLayout.for_length(layout, ring, ulysses, seq_len)
    return tuple(sum(1 for p in lay.local_positions(r).tolist() if p < seq_len and (p + 1) % rate == 0)
                 for r in range(ring * ulysses))


@functools.lru_cache(maxsize=256)
def attended_pairs(layout: str, ulysses: int, ring: int, seq_len: int, batch: int, heads: int, head_dim: int,
                   window: int, rate: int, topk: int) -> int:
    """The (query, key) slots the busiest rank's kernel walks in one row: each query its window and, block by block
    of queries (``block_queries``, as the layer blocks them on a GPU), the entries its block's queries may see (HCA:
    the most any of them sees; CSA, ``topk > 0``: the top k of the row's entries)."""
    lay = SequenceLayout.for_length(layout, ring, ulysses, seq_len)
    step = block_queries(batch, heads, head_dim)
    busiest = 0
    for rank in range(ring * ulysses):
        seen = [(p + 1) // rate if p < seq_len else 0 for p in lay.local_positions(rank).tolist()]
        if topk:
            total = len(seen) * (window + min(topk, seq_len // rate))
        else:
            total = sum(len(seen[i:i + step]) * (window + max(seen[i:i + step])) for i in range(0, len(seen), step))
        busiest = max(busiest, total)
    return busiest


@dataclass(frozen=True)
class CompressedAttention:
    """One DeepSeek-V4 layer of ``kind`` (HCA or CSA) over the whole sequence group (one flat group: only the
    layout's runs a rank holds, not its ``ulysses x ring`` split, change what it sends)."""

    work: Workload
    layout: Degrees
    kind: str

    @property
    def sparse(self) -> bool:
        return self.kind == CSA

    def params(self) -> int:  # tp is 1: seqmesh refuses tensor parallelism with compressed attention
        m = self.work.model
        return m.kind_attention_params(self.kind) + m.mlp_params + m.norm_params

    def halo_channels(self) -> int:
        """What each halo row carries: the shared key, the compressor's projection and gate (CSA's two halves each),
        CSA's indexer's (``2 Di`` each)."""
        m, c = self.work.model, self.work.model.compressed
        wide = 2 if self.sparse else 1
        return m.head_dim * (1 + 2 * wide) + (4 * c.index_head_dim if self.sparse else 0)

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: forward the halo's all-gather and, per kind of entry, three
        all-gathers (the count, the padded entries, their numbers); backward the reduce-scatters of the halo's and
        of the compressor's entries' gradients (CSA's indexer has none)."""
        w, lay, m, c = self.work, self.layout, self.work.model, self.work.model.compressed
        p = lay.ulysses * lay.ring
        if p == 1:
            return [RankTraffic(0, 0, ())]
        e = dtype_bytes(w.torch_dtype)
        halo = halo_bytes(self.halo_channels(), c.halo(self.kind), batch=w.batch, ulysses=lay.ulysses,
                          ring=lay.ring, layout=w.layout, dtype_bytes=e)
        most = max(own_windows(w.layout, lay.ulysses, lay.ring, w.seq_len, c.rate(self.kind)))
        widths = (m.head_dim, c.index_head_dim) if self.sparse else (m.head_dim,)
        forward = sum((p - 1) * (INT64 + w.batch * most * width * e + most * INT64) for width in widths)
        entries = (p - 1) * w.batch * most * m.head_dim * e
        calls = (Collective("all_gather", "forward", 1 + 3 * len(widths), halo + forward),
                 Collective("reduce_scatter", "backward", 2, halo + entries))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(p)]

    def traffic(self) -> Phases:
        return gather_phases(self.ranks(), KEY, self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return gather_links(KEY, hw, self.layout)

    def saved_bytes(self) -> int:
        """The layer's norms, hyper-connections and experts as any decoder layer's; its attention's own
        (:func:`compressed_attention_saved`)."""
        w, lay = self.work, self.layout
        own = compressed_attention_saved(w, lay, self.kind)
        return decoder_layer_saved_bytes(w, lay) - attention_saved(w, lay) + own

    @property
    def backward_op(self) -> str:
        """Where :meth:`backward_bytes` peaks (the planner's memory moment names it)."""
        if self.sparse:
            return "CSA selection (recompute)" if self.work.checkpointing else "CSA selection"
        return "compressed attention backward"

    def backward_bytes(self) -> int:
        """What the layer holds at its peak beyond what it saved (possibly less: part of it is not held then), the
        larger of two moments: its attention's backward (:func:`compressed_attention_working_bytes`, its own kind's,
        not the model's largest kind's), by when the experts' block has freed what it kept
        (:func:`freed_before_attention`); CSA's selection in the recompute, when only part of what the layer saves
        has been made again (:func:`selection_live_bytes`)."""
        w, lay = self.work, self.layout
        backward = compressed_attention_working_bytes(w, lay, self.kind, selection=False) - freed_before_attention(w, lay)
        if not self.sparse:
            return backward
        select = compressed_attention_working_bytes(w, lay, self.kind, backward=False)
        return max(backward, select + selection_live_bytes(w, lay) - self.saved_bytes())

    def matmul_params(self) -> tuple[int, int]:
        """(weights multiplying every token with a gradient, the indexer's without one): the attention's
        projections and compressor, the routed experts a token goes to, the shared ones and the router; CSA's indexer
        (its compressor, queries and head weights). The hyper-connections' mixing weights multiply in float32
        (:meth:`seconds`)."""
        m, c = self.work.model, self.work.model.compressed
        hd, q, o = m.heads * m.head_dim, c.q_lora_rank, c.o_lora_rank
        wide = 2 if self.sparse else 1
        attention = m.hidden * q + q * hd + m.hidden * m.head_dim + hd * o + c.o_groups * o * m.hidden
        attention += 2 * wide * m.hidden * m.head_dim
        experts = mlp_matmul_params(m)
        di, hi = c.index_head_dim, c.index_n_heads
        indexer = 4 * m.hidden * di + q * hi * di + m.hidden * hi if self.sparse else 0
        return attention + experts, indexer

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer, as :meth:`.layers.IndexedAttention.seconds`
        counts them: the projections (the indexer's forward only; the hyper-connections' mixes in float32); the
        attention's slots (:func:`attended_pairs`, a score and a weighted value of ``D`` for each head), twice its
        FLOPs in backward and, where the layer's queries make more than one block, recomputed block by block (its
        forward once more); CSA's indexer scoring every entry of the row for each query in float32, and the
        bytes its scores move; the halo's and entries' collectives before them and their reduce-scatters after,
        which nothing overlaps."""
        work, layout, m, c = self.work, self.layout, self.work.model, self.work.model.compressed
        p = layout.ulysses * layout.ring
        local, b = placement(work, layout).sequence_padded // p, work.batch
        peak = hw.flops_for(work.dtype)
        mm_rate = peak * hw.matmul_efficiency
        trained, indexer = self.matmul_params()
        mm_fwd, index_fwd = (2 * b * local * n / mm_rate for n in (trained, indexer))
        mixes = 2 * (2 + c.hc_mult) * c.hc_mult * c.hc_mult * m.hidden  # the two hyper-connections', float32
        streams = 2 * b * local * mixes / (hw.flops_for("fp32") * hw.matmul_efficiency)
        pairs = attended_pairs(work.layout, layout.ulysses, layout.ring, work.seq_len, b, m.heads, m.head_dim,
                               c.window, c.rate(self.kind), c.index_topk if self.sparse else 0)
        attend = 4 * b * pairs * m.heads * m.head_dim / (peak * hw.attention_efficiency)
        # blocks of queries are recomputed in backward where the layer has more than one (its forward once more)
        again = 1 if block_queries(b, m.heads, m.head_dim) < local else 0
        select = 0.0
        if self.sparse:  # every (query, entry) pair of the row in float32: each head's product, then the weighted sum
            scored = b * local * (work.seq_len // c.csa_rate)
            select = (2 * scored * c.index_n_heads * (c.index_head_dim + 1) / (hw.flops_for("fp32")
                                                                                * hw.matmul_efficiency)
                      + scored * 4 * (7 * c.index_n_heads + 3) / hw.memory_bandwidth)
        comm = gather_comm_seconds(self.ranks(), hw, layout)
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + index_fwd + select + attend + streams,
                                                           2 * (mm_fwd + streams) + (2 + again) * attend), comm)


def _row_rows(work: Workload, layout: Degrees, kind: str) -> int:
    """Rows of the (B, E + N, D) row the busiest rank's queries read: its tokens, the halo before each of its runs,
    and every entry of the row."""
    c = work.model.compressed
    runs, _ = runs_and_tails(layout.ulysses, layout.ring, work.layout)
    halo = runs * (c.halo(kind) - 1) if layout.ulysses * layout.ring > 1 else 0
    return local_tokens(work, layout) + halo + work.seq_len // c.rate(kind)


def _attention_saved_parts(work: Workload, layout: Degrees, kind: str) -> tuple[int, int]:
    """What one DeepSeek-V4 attention of ``kind`` keeps for backward on the busiest rank, in two parts: made before
    CSA's selection runs (per local token the low-rank query: q_a's output, its float32 norm's input, q_b's input;
    the queries: q_b's output, its unweighted norm's output, the rotated queries, a float32 scale a head; the key:
    its float32 norm's input, the normed and rotated key; the compressor's share of its windows: the float32 softmax
    of the gates, its cast, the gathered values; and once, the row of keys and entries, :func:`_row_rows`), and after
    it (the picks, int64: the window and the entries each query's block walks, :func:`attended_pairs`; a float32
    log-sum-exp a head; the output and its rotated-back copy, ``o_a_proj``'s input; ``o_b_proj``'s input)."""
    m, e, c = work.model, work.act_bytes, work.model.compressed
    hd, wide, t = m.heads * m.head_dim, 2 if kind == CSA else 1, tokens(work, layout)
    before = (c.q_lora_rank * (2 * e + 4) + 3 * hd * e + 4 * m.heads + m.head_dim * (4 + 2 * e)
              + wide * m.head_dim * (4 + 3 * e))
    row = work.batch * _row_rows(work, layout, kind) * m.head_dim * e
    pairs = attended_pairs(work.layout, layout.ulysses, layout.ring, work.seq_len, work.batch, m.heads, m.head_dim,
                           c.window, c.rate(kind), c.index_topk if kind == CSA else 0)
    after = t * (4 * m.heads + 2 * hd * e + c.o_groups * c.o_lora_rank * e) + work.batch * pairs * INT64
    return t * before + row, after


def compressed_attention_saved(work: Workload, layout: Degrees, kind: str) -> int:
    """Bytes one DeepSeek-V4 attention of ``kind`` (HCA or CSA) keeps for backward on the busiest rank (both parts of
    :func:`_attention_saved_parts`)."""
    return sum(_attention_saved_parts(work, layout, kind))


def freed_before_attention(work: Workload, layout: Degrees) -> int:
    """What a layer's backward has freed by its attention's: the experts' saved tensors (``mlp_saved_bytes``),
    its norm's and input, the second hyper-connection's, the block's output and the streams between the two
    blocks."""
    m, e = work.model, work.act_bytes
    per_token = norm_saved(m, e, work.efficient_norm) + 2 * e * m.hidden + hyper_connection_share(work) \
        + e * m.compressed.hc_mult * m.hidden
    return tokens(work, layout) * per_token + mlp_saved_bytes(work, layout)


def selection_live_bytes(work: Workload, layout: Degrees) -> int:
    """What a CSA layer holds when its selection runs in its recompute, beside the selection's own scores: its input
    norm's saved tensors, the first hyper-connection's (:func:`.activations.hyper_connection_saved`'s share before
    the attention), the attention's first part (:func:`_attention_saved_parts`), the indexer's queries, and the
    extended rows of every projection the halo carried (freed when the forward ends, kept by nothing)."""
    m, e, c = work.model, work.act_bytes, work.model.compressed
    hyper = hyper_connection_share(work)
    norm = norm_saved(m, e, work.efficient_norm)
    extended = _row_rows(work, layout, CSA) - work.seq_len // c.csa_rate
    channels = CompressedAttention(work, layout, CSA).halo_channels()
    index_q = c.index_n_heads * c.index_head_dim * e  # the indexer's rotated queries, held through the blocks
    return (tokens(work, layout) * (hyper + norm + index_q) + _attention_saved_parts(work, layout, CSA)[0]
            + work.batch * extended * channels * e)


def _picks_width(work: Workload, layout: Degrees, kind: str) -> int:
    """The most keys any query's block walks: its window and the entries (HCA: every closed one of the row; CSA: the
    top k)."""
    c = work.model.compressed
    entries = work.seq_len // c.rate(kind)
    return c.window + (min(c.index_topk, entries) if kind == CSA else entries)


def compressed_attention_working_bytes(work: Workload, layout: Degrees, kind: str, selection: bool = True,
                                       backward: bool = True) -> int:
    """Peak bytes of a DeepSeek-V4 attention of ``kind`` beyond what it keeps, the larger of two moments. CSA's
    selection (forward, and again in the recompute): a pass of the indexer's float32 scores
    (``seqmesh.hf.compressed_attention.indexer_step`` queries, three such tensors at once: the product, its rectified
    copy and that scaled; and the pass's (queries, entries) mask of the entries each query sees). The attention's backward, as the torch form runs it
    (``seqmesh.kernels.sparse_latent_blocks``, which a rehearsal measures; the Triton kernel holds less): a block's
    chosen rows and their gradient (blocks of the layer's queries, as ``seqmesh.hf.compressed_attention`` sizes them
    for the torch form), beside the larger of the operands of the one product that makes their gradient and a
    slice of that gradient's float32 cast, its float32 probabilities and their gradients, the row's float32
    gradient, and the queries' gradient with a float32 sum a head, as DeepSeek Sparse Attention's
    (:func:`.activations.indexed_attention_working_bytes`)."""
    m, e, c = work.model, work.act_bytes, work.model.compressed
    b, local = work.batch, local_tokens(work, layout)
    select = 0
    if kind == CSA and selection:
        entries = work.seq_len // c.csa_rate
        queries = min(local, compressed_attention.indexer_step(b, c.index_n_heads, entries))
        scores = b * queries * c.index_n_heads * entries
        select = 3 * 4 * scores + queries * entries
    if not backward:
        return select
    top = _picks_width(work, layout, kind)
    step = min(block_queries(b, m.heads, top * m.head_dim),
               sparse_latent_blocks.block_queries(b, top, m.head_dim, GPU, indexed_attention.BLOCK_ELEMENTS), local)
    queries = b * local * m.heads * (m.head_dim * e + 4)
    row = b * _row_rows(work, layout, kind) * m.head_dim * 4
    return max(select, sparse_block_bytes(step, b, m.heads, top, m.head_dim, e) + row + queries)
