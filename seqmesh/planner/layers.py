"""What one decoder layer costs on the busiest rank, by kind: seqmesh attention (:mod:`.attention_layer`: full, or a
causal sliding window, with tensor parallelism inside), Gated DeltaNet, DeepSeek Sparse Attention, MiniMax-M3's
block-sparse layers (:mod:`.block_sparse`) and the hybrids' mixers (:mod:`.mamba2`, :mod:`.kda`, :mod:`.lightning`,
:mod:`.short_conv`). Each kind gives its FSDP unit's parameters, its collectives' bytes per phase, its saved
tensors and its time; the step walks take the model's kinds from :func:`layer_kinds`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import functools

from ..hf.indexed_attention import indexer_block, scored_keys
from ..sequence.layout import SequenceLayout
from ..model.shapes import ModelShape
from .activations import GPU, decoder_layer_saved_bytes, hyper_connection_saved, local_tokens, mlp_saved_bytes, tokens
from .attention_layer import Attention
from .block_sparse import BlockSparseAttention
from .qsa import QsaAttention
from .inkling2 import relative_layer_kinds
from .relative_attention import RelativeAttention
from .placement import placement
from .hardware import HardwareSpec
from .layer_cost import Phases, gather_comm_seconds, phases, serial_layer_seconds
from ..linear_attention.choice import (LINEAR_CHUNK, LinearDesign, LinearShape, choose_design, state_passing_bytes,
                                       state_passing_extra_flops)
from .network import axis_all_to_all_seconds, axis_groups, gather_seconds, link_name
from ..rules.heads import HeadDeal
from .mamba2 import FeedForwardBlock, Mamba2Layer
from .ngram_ple import KEY as PLE_KEY, ple_macs, ple_params, ple_phases, ple_ranks, ple_saved
from .kda import KdaLayer
from .lightning import LightningLayer
from .diagonal import Mamba1Layer, RgLruLayer, RwkvLayer, XlstmLayer
from .short_conv import ShortConvLayer
from .traffic import (Collective, RankTraffic, call_bytes, dtype_bytes, indexed_attention_traffic,
                      linear_attention_traffic, worst_rank)
from ..rules.degrees import Degrees
from .workload import Workload, layer_matmul_params, layer_params, mlp_matmul_params



def linear_layer_params(m: ModelShape) -> int:
    """One Gated DeltaNet layer's parameters: token mixer, gated MLP (Qwen3.5-MoE's experts and router), norms
    (Qwen4-Exp's gated residuals)."""
    return m.linear_layer_params + m.mlp_params + m.mixer_norm_params


def linear_layer_matmul_params(m: ModelShape) -> int:
    """Its parameters that multiply every token (an MoE layer's: :func:`.workload.mlp_matmul_params`'s; Qwen4-Exp's
    gated residuals')."""
    return m.linear_layer_params + mlp_matmul_params(m) + m.residual_macs


def linear_state_bytes(m: ModelShape, batch: int, sp: int) -> int:
    """float32 recurrent state of one Gated DeltaNet layer on the busiest rank: (Dk x Dv) per value head of its
    share over the ``sp`` sequence ranks and per sample (the chunked kernels keep one per chunk for backward)."""
    heads = -(-m.linear_value_heads // sp)
    return 4 * batch * heads * m.linear_key_dim * m.linear_value_dim


def linear_rule_saved_bytes(m: ModelShape, tokens: int, heads: int, width: int, chunk: int = LINEAR_CHUNK) -> int:
    """float32 bytes the chunked recurrence (``seqmesh.linear_attention.gated_delta.chunk_gated_delta_rule_states``,
    the torch kernel, which the rehearsal runs) saves for backward over ``tokens`` tokens of ``heads`` value heads
    with values ``width`` wide (Dv; state passing's widened ``[v | 0]``: Dv + Dk). Per token and head, counted from
    its saved storages on CPU (within 0.5% for Dk 64-128, widths 192-256): 14 of Dk (q, k in float32 and
    chunked, k_beta, w, q_read, k_write, and the copies the batched matmuls make of k^T and of each chunk's slices),
    4 of the width (v in float32 and chunked, u, each chunk's v_new), 5 of C (the decays, k k^T, the triangular
    system, q k^T, each chunk's intra scores), the state entering each chunk (Dk x width per C tokens), 7 scalars."""
    dk = m.linear_key_dim
    return 4 * tokens * heads * (14 * dk + 4 * width + 5 * chunk + dk * width // chunk + 7)


def linear_flops(m: ModelShape, seq_len: int, batch: int, chunk: int = LINEAR_CHUNK) -> int:
    """Forward FLOPs of one Gated DeltaNet layer's recurrence over the whole sequence (all heads), chunked
    form: per chunk of C tokens and head, the C x C products (k k^T, q k^T, two triangular solves ~ C^2 Dk
    each, attn @ v) and the state reads and writes (4 C Dk Dv). Linear in the sequence length."""
    dk, dv = m.linear_key_dim, m.linear_value_dim
    per_token_head = 2 * (4 * chunk * dk + chunk * dv + 4 * dk * dv)
    return batch * seq_len * m.linear_value_heads * per_token_head


@dataclass(frozen=True)
class GatedDeltaNet:
    """A Gated DeltaNet layer (``seqmesh.linear_attention``) over the whole sequence group, by the design
    ``work.linear_attention`` names (``auto``: :func:`seqmesh.linear_attention.choice.choose_design`, the rule the
    layers use, given this cluster's sequence link and FLOP rate when known, else its H100 defaults)."""

    work: Workload
    layout: Degrees
    ple: bool = False  # a Qwen4-Exp PLE layer before it (seqmesh.planner.ngram_ple)

    def params(self) -> int:  # tp is 1: seqmesh's tensor parallelism does not split these layers
        return linear_layer_params(self.work.model) + (ple_params(self.work) if self.ple else 0)

    @property
    def kind(self) -> str:
        """How the plan tells its layers apart (``plan.communication`` shows one of each): with a PLE layer or not."""
        return "ple" if self.ple else ""

    def shape(self) -> LinearShape:
        w, lay, m = self.work, self.layout, self.work.model
        return LinearShape(m.linear_key_heads, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim, m.linear_conv,
                           w.seq_len, w.batch, lay.ulysses, lay.ring, w.layout, w.act_bytes)

    def design(self, hw: HardwareSpec | None = None) -> LinearDesign:
        if hw is None:
            return choose_design(self.shape(), self.work.linear_attention)
        link = hw.link_for_group(axis_groups(self.layout, "sequence")[0])
        rate = hw.flops_for(self.work.dtype) * hw.attention_efficiency
        return choose_design(self.shape(), self.work.linear_attention, bandwidth=link.bandwidth, flops=rate)

    def ranks(self, hw: HardwareSpec | None = None):
        """Each sequence rank's traffic in one layer: :func:`.traffic.linear_attention_traffic` for the all-to-all,
        two all-gathers forward and their reduce-scatters backward for state passing; a PLE layer's halos beside."""
        mixer = self._mixer_ranks(hw)
        if not self.ple:
            return mixer
        return [dataclasses.replace(r, collectives=r.collectives + p.collectives)
                for r, p in zip(mixer, ple_ranks(self.work, self.layout))]

    def _mixer_ranks(self, hw: HardwareSpec | None = None):
        w, lay, m = self.work, self.layout, self.work.model
        if self.design(hw) is LinearDesign.STATE_PASSING:
            sent = state_passing_bytes(m.linear_key_heads, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim,
                                       batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout,
                                       kernel=m.linear_conv, dtype_bytes=dtype_bytes(w.torch_dtype))
            calls = (Collective("all_gather", "forward", 2, sent), Collective("reduce_scatter", "backward", 2, sent))
            return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]
        return linear_attention_traffic(m.linear_key_heads, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim,
                                        seq_len=w.seq_len, batch=w.batch, ulysses=lay.ulysses, ring=lay.ring,
                                        dtype=w.torch_dtype, layout=w.layout)

    def traffic(self) -> Phases:
        ranks = self._mixer_ranks()
        if self.design() is LinearDesign.STATE_PASSING:
            fwd = {"linear_state_gather": worst_rank(ranks, "all_gather", "forward")}
            bwd = {"linear_state_gather": worst_rank(ranks, "reduce_scatter", "backward")}
        else:
            fwd, bwd = ({"linear_all_to_all": worst_rank(ranks, "all_to_all", ph)} for ph in ("forward", "backward"))
        own = phases(fwd, bwd, self.work.checkpointing)
        if self.ple:
            return {phase: own[phase] | extra for phase, extra in ple_phases(self.work, self.layout).items()}
        return own

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        name = "linear_state_gather" if self.design() is LinearDesign.STATE_PASSING else "linear_all_to_all"
        link = link_name(hw, axis_groups(self.layout, "sequence")[:1])
        return {name: link} | ({PLE_KEY: link} if self.ple else {})

    def saved_bytes(self) -> int:
        """Bytes saved for backward, as docs/planner.md ("Activations") lists them; rehearsed with Qwen3.5-9B at 131,072
        tokens on 8 GPUs (docs/rehearse.md: 37.79 GB planned, 38.55 GB measured)."""
        w, lay, m = self.work, self.layout, self.work.model
        e, p = w.act_bytes, lay.ulysses * lay.ring
        whole = w.batch * placement(w, lay).sequence_padded
        deal = HeadDeal(m.linear_value_heads, m.linear_key_heads, p)
        h, k = deal.max_q, deal.max_kv
        values = m.linear_value_heads * m.linear_value_dim
        # transformers' gated RMSNorm on the mixer's output (B, L, Hv, Dv): its float32 input, gate and SiLU(gate);
        # the normed and weighted tensors and the output (out_proj's input) in the compute dtype
        gated_norm = values * (3 * 4 + 3 * e)
        # the two norms' inputs and outputs (Qwen4-Exp's gated residuals apart: the block's and the MLP's inputs)
        norms = 4 if m.qwen_exp is None else 2
        per_token = e * norms * m.hidden + gated_norm + 2 * 4  # and its MLP's (experts': mlp_saved_bytes)
        # the causal conv (B, S, conv channels of the rank): its input, the K - 1 shifted products
        # (gated_delta.causal_conv1d) and SiLU's input; beta and the decay
        conv = 2 * k * m.linear_key_dim + h * m.linear_value_dim
        mixer = whole * e * ((m.linear_conv + 1) * conv + 2 * h)
        # the recurrence's float32 tensors, its chunks' entering states included: this rank's heads over the whole
        # sequence; state passing, every head over the local tokens with values [v | 0], Dk columns wider
        rule = linear_rule_saved_bytes(m, whole, h, m.linear_value_dim)
        if self.design() is LinearDesign.STATE_PASSING:
            rule = linear_rule_saved_bytes(m, whole // p, m.linear_value_heads, m.linear_value_dim + m.linear_key_dim)
            # the state pass reads each entering state through G (B, L, Hv, Dk), kept in float32 (passing.pass_states)
            rule += 4 * (whole // p) * m.linear_value_heads * m.linear_key_dim
        ple = ple_saved(w, lay) if self.ple else 0
        kept = tokens(w, lay) * per_token + mlp_saved_bytes(w, lay) + hyper_connection_saved(w, lay)
        return kept + mixer + rule + ple

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` (communication end to end) seconds of one layer; what is counted and
        what overlaps: docs/planner.md ("Time")."""
        work, layout, m = self.work, self.layout, self.work.model
        p = layout.ulysses * layout.ring
        peak = hw.flops_for(work.dtype)
        mm_rate, core_rate = peak * hw.matmul_efficiency, peak * hw.attention_efficiency
        macs = linear_layer_matmul_params(m) + (ple_macs(work) if self.ple else 0)
        mm_fwd = 2 * work.batch * local_tokens(work, layout) * macs / mm_rate
        if self.design(hw) is LinearDesign.STATE_PASSING:  # all heads of the local tokens, Dk more value columns
            local = -(-work.seq_len // p)
            core_fwd = (linear_flops(m, local, work.batch) + state_passing_extra_flops(self.shape())) / core_rate
            group = axis_groups(layout, "sequence")[0]
            a2a_fwd, a2a_bwd = (gather_seconds(worst_rank(self.ranks(hw), kind, ph), hw, group)
                                for kind, ph in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        else:
            heads = -(-m.linear_value_heads // p)  # this rank's share of the value heads
            core_fwd = linear_flops(m, work.seq_len, work.batch) * heads / m.linear_value_heads / core_rate
            a2a_fwd, a2a_bwd = (axis_all_to_all_seconds(call_bytes(self.ranks(hw), "all_to_all", ph), hw, layout,
                                                        "sequence") for ph in ("forward", "backward"))
        if self.ple:  # its halos, which its conv and lookup wait for
            halo_fwd, halo_bwd = gather_comm_seconds(ple_ranks(work, layout), hw, layout)
            a2a_fwd, a2a_bwd = a2a_fwd + halo_fwd, a2a_bwd + halo_bwd
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + core_fwd, 2 * mm_fwd + 2 * core_fwd),
                                     (a2a_fwd, a2a_bwd))


def sparse_attention_flops(m: ModelShape, queries: int, keys: int, batch: int) -> int:
    """Forward FLOPs of one indexed layer's attention (all heads), in MLA's latent space as
    ``seqmesh.hf.indexed_attention`` runs it: each of ``queries`` scores and reads ``min(index_topk, keys)`` keys of
    the row (the picks beyond its causal keys masked, not skipped), ``H x (R + Dr)`` multiply-adds a key for the score
    and ``H x R`` for the output. The absorption of ``kv_b_proj`` into each query is counted with the projections."""
    lat = m.latent
    return 2 * batch * queries * min(lat.index_topk, keys) * m.heads * (2 * lat.kv_lora_rank + lat.qk_rope_head_dim)


@functools.lru_cache(maxsize=64)
def indexer_pairs(layout: str, ulysses: int, ring: int, seq_len: int, batch: int, index_heads: int) -> int:
    """The (query, key) pairs the busiest rank's indexer scores in one row: each block of its queries against the keys
    up to the block's last query, as ``seqmesh.hf.indexed_attention`` blocks and truncates them (its
    ``indexer_block`` and ``scored_keys``); about half the rank's queries times the row on a balanced layout."""
    lay = SequenceLayout.for_length(layout, ring, ulysses, seq_len)
    busiest = 0
    for rank in range(ring * ulysses):
        positions = lay.local_positions(rank).tolist()
        step = indexer_block(batch, index_heads, seq_len, len(positions), GPU)
        counts = scored_keys(positions, seq_len, step)
        busiest = max(busiest, sum(min(step, len(positions) - i * step) * n for i, n in enumerate(counts)))
    return busiest


def indexer_flops(m: ModelShape, pairs: int, batch: int) -> int:
    """Forward FLOPs of one lightning indexer, float32 as transformers scores: ``pairs`` (query, key) pairs of a row
    (:func:`indexer_pairs`), ``Hi x Di`` multiply-adds a pair and ``Hi`` for the per-head weights."""
    lat = m.latent
    return 2 * batch * pairs * lat.index_n_heads * (lat.index_head_dim + 1)


def indexer_memory_bytes(m: ModelShape, pairs: int, batch: int) -> int:
    """GPU-memory bytes one indexer moves beyond its FLOPs: the float32 ``(queries, Hi, keys)`` scores of its ``pairs``
    written by the product, read and written by the scale and by the ReLU, read by the weighted sum; the
    ``(queries, keys)`` index written, masked (read and written) and read by the top-k."""
    return batch * pairs * 4 * (6 * m.latent.index_n_heads + 4)


@dataclass(frozen=True)
class IndexedAttention:
    """A DeepSeek Sparse Attention layer (``seqmesh.hf.indexed_attention``) over the whole sequence group (one flat
    group: the same for every ``ulysses x ring`` split of it); ``indexer`` False: a GLM-5 layer that reuses the
    previous layer's selection."""

    work: Workload
    layout: Degrees
    indexer: bool = True

    def params(self) -> int:  # tp is 1: seqmesh refuses tensor parallelism with indexed attention
        m = self.work.model
        return layer_params(m) - self._beyond_own()

    def _beyond_own(self) -> int:
        """What the model's largest attention (``ModelShape.attention_params``) has beyond this layer's own MLA: a
        shared layer's missing indexer, or dots.llm3's larger sliding layers'."""
        m = self.work.model
        return m.attention_params - m.latent.attention_params(m.hidden, m.heads, indexer=self.indexer)

    def ranks(self, indexer: bool | None = None):
        """Each sequence rank's traffic in one layer (:func:`.traffic.indexed_attention_traffic`); ``indexer`` False:
        without the indexer's keys (default: the layer's own)."""
        w, lay, lat = self.work, self.layout, self.work.model.latent
        return indexed_attention_traffic(lat.index_head_dim, lat.kv_lora_rank, lat.qk_rope_head_dim, seq_len=w.seq_len,
                                         batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, dtype=w.torch_dtype,
                                         layout=w.layout, indexer=self.indexer if indexer is None else indexer)

    def traffic(self) -> Phases:
        ranks = self.ranks()
        sent = phases({"indexed_row_gather": worst_rank(ranks, "all_gather", "forward")},
                      {"indexed_row_gather": worst_rank(ranks, "reduce_scatter", "backward")}, self.work.checkpointing)
        if self.indexer and self.work.checkpointing and self.work.keep_attention:  # the recompute gathers the row alone
            sent["recompute"]["indexed_row_gather"] = worst_rank(self.ranks(indexer=False), "all_gather", "forward")
        return sent

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        return {"indexed_row_gather": link_name(hw, axis_groups(self.layout, "sequence")[:1])}

    def saved_bytes(self) -> int:
        return decoder_layer_saved_bytes(self.work, self.layout)

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer, as :meth:`GatedDeltaNet.seconds` counts them:
        the projections; the sparse attention of this rank's queries, recomputed block by block in
        backward (forward once more, then twice its FLOPs); the indexer's float32 scores of this rank's queries
        against the row up to each block's last query (:func:`indexer_pairs`) and the bytes they move (no backward;
        run again with the layer's recompute); the row's all-gathers before them and the reduce-scatter of its
        gradient, which nothing overlaps (:func:`serial_layer_seconds`); with ``keep_attention`` the recompute skips
        the indexer and its keys' gather."""
        work, layout, m = self.work, self.layout, self.work.model
        p = layout.ulysses * layout.ring
        padded = placement(work, layout).sequence_padded
        local, b = padded // p, work.batch
        peak = hw.flops_for(work.dtype)
        mm_fwd = 2 * b * local * (layer_matmul_params(m) - self._beyond_own()) / (peak * hw.matmul_efficiency)
        sparse_fwd = sparse_attention_flops(m, local, work.seq_len, b) / (peak * hw.attention_efficiency)
        select = 0.0
        if self.indexer:
            pairs = indexer_pairs(work.layout, layout.ulysses, layout.ring, work.seq_len, b, m.latent.index_n_heads)
            select = (indexer_flops(m, pairs, b) / (hw.flops_for("fp32") * hw.matmul_efficiency)
                      + indexer_memory_bytes(m, pairs, b) / hw.memory_bandwidth)
        group = axis_groups(layout, "sequence")[0]
        lat, unit = m.latent, b * local * dtype_bytes(work.torch_dtype) * (p - 1)
        gathered = ([lat.index_head_dim] if self.indexer else []) + [lat.kv_lora_rank + lat.qk_rope_head_dim]
        ag = sum(gather_seconds(n * unit, hw, group) for n in gathered)
        rs = gather_seconds(gathered[-1] * unit, hw, group)
        # keep_attention: the recompute takes the kept selection, neither scoring the keys nor gathering them again
        kept = (select, gather_seconds(gathered[0] * unit, hw, group)) if self.indexer and work.keep_attention else (
            0.0, 0.0)
        return serial_layer_seconds(self, hw, fsdp_ranks, (mm_fwd + select + sparse_fwd, 2 * mm_fwd + 3 * sparse_fwd),
                                     (ag, rs), kept)


LayerKind = (Attention | GatedDeltaNet | IndexedAttention | BlockSparseAttention | QsaAttention | RelativeAttention
             | Mamba2Layer | FeedForwardBlock
             | ShortConvLayer | KdaLayer | LightningLayer | RgLruLayer | Mamba1Layer | RwkvLayer | XlstmLayer)


def attention_kind(work: Workload, layout: Degrees) -> Attention:
    """The seqmesh-attention layer whose time stands for every such layer of the model (full and sliding averaged:
    :meth:`.attention_layer.Attention.seconds`); dots.llm3's, whose attention layers are all sliding ones of sizes of
    their own, on a model of them alone (``ModelShape.sliding_shape``)."""
    if work.model.sliding_latent is not None:
        return Attention(dataclasses.replace(work, model=work.model.sliding_shape()), layout)
    return Attention(work, layout)


def layer_kinds(work: Workload, layout: Degrees) -> list[tuple[LayerKind, int]]:
    """The model's layers by kind, with how many of each (kinds with none left out); a Mamba2 hybrid's by
    :func:`hybrid_layer_kinds`."""
    m = work.model
    if m.hybrid is not None:
        return hybrid_layer_kinds(work, layout)
    if m.inkling is not None:  # Inkling: its relative-bias layers, sliding and full
        return relative_layer_kinds(work, layout)
    if m.compressed is not None:  # DeepSeek-V4: its sliding layers seqmesh attention's, the others its own
        from ..model.deepseek_v4 import CSA, HCA
        from .compressed import CompressedAttention

        return [(kind, n) for kind, n in ((Attention(work, layout, m.sliding_window), m.sliding_layers),
                                          *((CompressedAttention(work, layout, k), m.layer_types.count(k))
                                            for k in (HCA, CSA))) if n]
    qsa = m.layers - m.linear_layers if m.qwen_exp is not None else 0  # Qwen4-Exp's attention layers are QSA's
    full = (m.layers - m.linear_layers - (m.sliding_layers if m.sliding_window else 0) - m.indexed_layers
            - m.block_sparse_layers - qsa)
    kinds: list[tuple[LayerKind, int]] = [(Attention(work, layout), full)]
    if m.sliding_window:
        kinds.append((Attention(attention_kind(work, layout).work, layout, m.sliding_window), m.sliding_layers))
    ple = len(m.qwen_exp.ple.layers) if m.qwen_exp is not None and m.qwen_exp.ple is not None else 0
    kinds += [(GatedDeltaNet(work, layout), m.linear_layers - ple), (GatedDeltaNet(work, layout, ple=True), ple)]
    if m.indexed_layers:
        shared = m.latent.shared_layers
        kinds += [(IndexedAttention(work, layout), m.indexed_layers - shared),
                  (IndexedAttention(work, layout, indexer=False), shared)]
    kinds.append((BlockSparseAttention(work, layout), m.block_sparse_layers))
    kinds.append((QsaAttention(work, layout), qsa))
    if full < 0:  # a layer counted twice (a sliding layer that is also indexed): a reader's error, never a plan
        raise ValueError(f"{m.name}: its layer kinds add up to more than its {m.layers} layers ({m.sliding_layers} "
                         f"sliding, {m.linear_layers} linear, {m.indexed_layers} indexed).")
    return [(kind, n) for kind, n in kinds if n]


def hybrid_layer_kinds(work: Workload, layout: Degrees) -> list[tuple[LayerKind, int]]:
    """A Mamba2 hybrid's layers: attention first (the step's per-layer attention terms), then each Mamba2 layer and
    each Nemotron-H MLP or MoE block by its feed-forward; a Falcon-H1 layer as its attention layer (norms and MLP
    included) and its Mamba2 mixer beside it, each its own FSDP unit (FSDP sends the same bytes in one). The
    attention layers carry their own feed-forward (Nemotron-H's none). LFM2's gated short convs: each by its
    feed-forward; Kimi Linear's KDA, MiniMax-01's lightning layers, RecurrentGemma's recurrent blocks and Jamba's Mamba layers
    likewise. A Zamba hybrid layer as Falcon-H1's: its shared block's attention layer (the block's MLP, its linear and
    norm, its share of the block's parameters) and its Mamba or Mamba2 mixer beside it.
    Where every attention layer has a window (RecurrentGemma's local attention), they are planned with it."""
    from ..model.hybrid_shape import (ATTENTION, CONV, KDA, LIGHTNING, MAMBA1, MAMBA2, PARALLEL, RG_LRU, RWKV,
                                      SHARED_MAMBA1, SHARED_MAMBA2, SLIDING, XLSTM)
    from .attention_layer import hybrid_attention_split

    hybrid, m = work.model.hybrid, work.model
    full, windowed = hybrid_attention_split(m)  # LFM3's sliding layers beside its full ones; RecurrentGemma's local
    kinds: list[tuple[LayerKind, int]] = [(Attention(work, layout), full),
                                          (Attention(work, layout, m.sliding_window), windowed)]
    for (mixer, ffn), n in hybrid.kinds():
        if mixer in (MAMBA2, PARALLEL, SHARED_MAMBA2):  # Falcon-H1's, Zamba2's: beside the layer's attention
            beside = mixer != MAMBA2
            kinds.append((Mamba2Layer(work, layout, "" if beside else ffn, beside_attention=beside), n))
        elif mixer == CONV:
            kinds.append((ShortConvLayer(work, layout, ffn), n))
        elif mixer == KDA:
            kinds.append((KdaLayer(work, layout, ffn), n))
        elif mixer == LIGHTNING:
            kinds.append((LightningLayer(work, layout, ffn), n))
        elif mixer == RG_LRU:
            kinds.append((RgLruLayer(work, layout, ffn), n))
        elif mixer in (MAMBA1, SHARED_MAMBA1):  # Zamba's hybrid layers: the Mamba beside the shared block's
            beside = mixer == SHARED_MAMBA1
            kinds.append((Mamba1Layer(work, layout, "" if beside else ffn, beside_attention=beside), n))
        elif mixer == RWKV:
            kinds.append((RwkvLayer(work, layout, ffn), n))
        elif mixer == XLSTM:
            kinds.append((XlstmLayer(work, layout, ffn), n))
        elif mixer not in (ATTENTION, SLIDING):
            kinds.append((FeedForwardBlock(work, layout, ffn), n))
    return [(kind, n) for kind, n in kinds if n]
