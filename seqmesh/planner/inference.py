"""``seqmesh plan --inference``: what ``seqmesh generate`` holds on each GPU and how long it takes, per layout of the
sequence mesh (:mod:`seqmesh.inference`).

Generation runs every GPU in one sequence group (``ulysses x ring`` = the GPUs, or with tensor parallelism ``tp``
ranks inside each of its ranks: ``seqmesh generate --tp``; no data parallelism), each holding the whole model (its
``1 / tp`` split), or with ``sharded`` (``--shard-weights``) its FSDP2 shard of that. The prefill is the
training forward on the prompt, sharded by the zigzag layout, with nothing kept for a backward: each layer kind's
forward seconds as the training plan counts them (no recompute; sharded, each layer's gather beside its compute).
Each rank keeps the keys and values of its own tokens, all heads (its ``1 / tp``; :mod:`seqmesh.rules.kv_cache`);
a decode step runs the new token through every layer on every rank (each reads its weights and its cache share from
GPU memory: one token is bandwidth-bound; sharded, it waits for each layer's gather) and merges the attention partials
in one all-gather per attention layer. The assumptions are listed in docs/planner.md ("Inference").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..model.hybrid_shape import (ATTENTION, CONV, KDA, LIGHTNING, MAMBA1, MAMBA2, PARALLEL, RG_LRU, SHARED_MAMBA1,
                                  SHARED_MAMBA2, SLIDING)
from ..model.shapes import ModelShape
from ..rules.degrees import Degrees
from ..rules.kv_cache import cache_bytes, cache_share, indexed_cache_bytes
from .activations import decoder_layer_saved_bytes, layer_input_bytes
from .hardware import Cluster, HardwareSpec
from .attention_layer import Attention
from .experts import layer_fsdp_seconds
from .layers import GatedDeltaNet, IndexedAttention, layer_kinds, linear_layer_matmul_params
from .mamba2 import FeedForwardBlock
from .placement import placement, ulysses_refusal
from .network import axis_groups, gather_seconds
from .report import attention_heads, human_bytes, human_count, short_number
from .tensor_parallel import tensor_parallel_refusal
from .workload import Workload, layer_matmul_params

__all__ = ["InferenceLayout", "InferencePlan", "cache_share", "inference_plan", "inference_refusal",
           "recurrent_state_elements"]

PARTIAL_BYTES = 4  # a decode partial's output and log-sum-exp are merged in float32


def inference_refusal(m: ModelShape) -> str | None:
    """Why ``seqmesh generate`` cannot run ``m`` yet (:func:`seqmesh.inference.generate.check_generate`'s rule on a
    model shape), or None."""
    if m.vision is not None:
        return f"{m.name} is a vision-language model: seqmesh generates from text prompts of decoder-only models so far."
    if m.hybrid is not None and not _decoded_hybrid(m):
        return (f"{m.name} has layers whose decode seqmesh does not run yet; plan an attention-only model (DeepSeek "
                "Sparse Attention included), one with Gated DeltaNet layers (Qwen3.5), or RecurrentGemma, Jamba, a "
                "Mamba2 hybrid, LFM2, LFM3, MiniMax-01 or Kimi Linear.")
    if m.compressed_layers:  # seqmesh.inference.generate.check_generate refuses them too
        return (f"{m.name} has DeepSeek-V4's compressed attention layers, whose decode seqmesh does not run yet; plan "
                "its training (without --inference).")
    if m.sliding_latent is not None:  # seqmesh generate runs them; the planner sizes one cache geometry
        return (f"{m.name}'s sliding layers have MLA sizes of their own (per_layer_config), whose cache and decode "
                "seqmesh plan does not size beside the indexed layers' yet; seqmesh generate runs it, and seqmesh "
                "plan sizes its training (without --inference).")
    if m.inkling is not None:  # seqmesh.hf.inkling refuses a cache
        return (f"{m.name} is an Inkling model, whose decode (its short convolutions' and relative bias's caches) "
                "seqmesh does not run yet; plan its training (without --inference).")
    if m.qwen_exp is not None:  # seqmesh.inference.generate.check_generate refuses them too
        return (f"{m.name} has Qwen4-Exp's QSA layers, whose decode seqmesh does not run yet; plan its training "
                "(without --inference).")
    if m.block_sparse_layers:  # seqmesh generate runs them; the planner does not size their cache and decode yet
        return (f"{m.name} has MiniMax-M3's block-sparse layers, whose decode (each step's indexer over the rank's "
                "share of the cached indexer keys, then the picked blocks) seqmesh plan does not size yet; seqmesh "
                "generate runs it, and seqmesh plan sizes its training (without --inference).")
    return None


def _decoded_hybrid(m: ModelShape) -> bool:
    """Whether every layer of the hybrid ``m`` is one whose decode seqmesh runs: attention, RecurrentGemma's recurrent
    block (seqmesh.hf.rg_lru), Jamba's Mamba (seqmesh.hf.mamba), Mamba2 (seqmesh.hf.mamba2, Falcon-H1's beside
    attention), LFM2's short convolution (seqmesh.hf.short_conv), MiniMax-01's lightning attention
    (seqmesh.hf.lightning), Kimi Linear's KDA (seqmesh.hf.kda), a Zamba hybrid layer (its shared block's attention,
    then its Mamba or Mamba2) or a Nemotron-H feed-forward block (no mixer); LFM3's sliding layers are attention with
    a window."""
    return all(mixer in (ATTENTION, SLIDING, RG_LRU, MAMBA1, MAMBA2, PARALLEL, CONV, LIGHTNING, KDA, SHARED_MAMBA1,
                         SHARED_MAMBA2, "") for mixer, _ in m.hybrid.blocks)


def _cache_bytes(m: ModelShape, tokens: int, element_bytes: int, batch: int, tp: int = 1) -> tuple[int, int]:
    """One rank's cache of ``tokens`` tokens: (the attention layers' keys and values, of its ``1 / tp`` of the heads;
    the DeepSeek Sparse Attention layers' latents and indexer keys) (:mod:`seqmesh.rules.kv_cache`); Doge's keys and
    values a channel wider (``seqmesh.hf.own_attention``'s fold of its dynamic mask)."""
    indexed = m.indexed_layers
    fold = 1 if m.family == "doge" else 0  # Doge's key bias one more key channel, the values padded to match
    dense = cache_bytes(tokens, m.layers - m.non_attention_layers - indexed, cached_heads(m) // tp, m.head_dim + fold,
                        m.value_dim + fold, element_bytes, batch)
    if not indexed:
        return dense, 0
    lat = m.latent
    latent = lat.kv_lora_rank + lat.qk_rope_head_dim
    return dense, indexed_cache_bytes(tokens, indexed, indexed - lat.shared_layers, latent, lat.index_head_dim,
                                      element_bytes, batch)


def _merge_seconds(m: ModelShape, batch: int, hw: HardwareSpec, group, tp: int = 1) -> float:
    """A decode step's all-gathers: each attention layer's partials (output and log-sum-exp per head of the rank's
    ``1 / tp``, float32; a sparse layer's output is its latent), and each indexer's candidates (its top k scores and
    positions, 16 bytes each)."""
    indexed = m.indexed_layers
    dense = m.layers - m.non_attention_layers - indexed
    seconds = dense * gather_seconds(batch * m.heads // tp * (m.value_dim + 1) * PARTIAL_BYTES, hw, group)
    if indexed:
        lat = m.latent
        seconds += indexed * gather_seconds(batch * m.heads * (lat.kv_lora_rank + 1) * PARTIAL_BYTES, hw, group)
        seconds += (indexed - lat.shared_layers) * gather_seconds(batch * lat.index_topk * 16, hw, group)
    return seconds


def cached_heads(m: ModelShape) -> int:
    """Key (and value) heads each attention layer's cache holds a token of: MLA's every head (its keys and values as
    attention receives them, expanded from the latent), the others' kv heads."""
    return m.heads if m.latent is not None else m.kv_heads


@dataclass(frozen=True)
class InferenceLayout:
    """One layout's figures, per GPU (the fullest one)."""

    ulysses: int
    ring: int
    weight_bytes: int  # the whole model, or its shard and the gathered units, in the compute dtype
    cache_bytes: int  # this rank's keys and values after the prefill and every new token
    state_bytes: int  # the recurrent layers' states and conv tails (every rank the same)
    prefill_working_bytes: int  # the prefill's activations at their largest (one layer's, an upper bound)
    total_bytes: int
    fits: bool
    prefill_seconds: float
    prefill_tokens_per_second: float
    decode_seconds: float  # one new token (every row of the batch)
    merge_seconds: float  # of which: the attention layers' all-gathers of the partials
    tp: int = 1  # tensor-parallel ranks inside each sequence rank (seqmesh generate --tp)

    @property
    def label(self) -> str:
        return f"ulysses {self.ulysses} x ring {self.ring}" + (f" x tp {self.tp}" if self.tp > 1 else "")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class InferencePlan:
    work: Workload
    cluster: Cluster
    new_tokens: int
    layouts: list[InferenceLayout]
    excluded: list[tuple[str, str]]
    sharded: bool = False

    @property
    def best(self) -> InferenceLayout | None:
        """The fastest prefill among the layouts that fit (then the fastest decode)."""
        fitting = [lay for lay in self.layouts if lay.fits]
        return min(fitting, key=lambda lay: (lay.prefill_seconds, lay.decode_seconds), default=None)

    def as_dict(self) -> dict:
        best = self.best
        return {"model": self.work.model.name, "prompt_tokens": self.work.seq_len, "batch": self.work.batch,
                "new_tokens": self.new_tokens, "sharded_weights": self.sharded, "dtype": self.work.dtype,
                "gpus": self.cluster.gpus,
                "hardware": self.cluster.hardware.name, "layouts": [lay.as_dict() for lay in self.layouts],
                "excluded": [{"layout": name, "why": why} for name, why in self.excluded],
                "recommended": None if best is None else best.label}


def recurrent_state_elements(m: ModelShape, batch: int) -> tuple[int, int]:
    """Elements of what generation keeps for the Gated DeltaNet layers (or RecurrentGemma's recurrent blocks, Jamba's
    Mamba layers, the Mamba2 hybrids' Mamba2 layers, Zamba's, ZAYA's CCA projections), the same on every rank: their recurrent states (Dk x Dv per value
    head and sample; the RG-LRU's ``lru_width``; Mamba's inner x state; Mamba2's heads x head_dim x state) and
    their convolutions' last ``kernel - 1`` inputs (the conv's width per sample); ``seqmesh.inference``'s cache holds
    exactly these (tests/inference/test_generate.py)."""
    if m.hybrid is not None and m.hybrid.rg_lru is not None:
        block, layers = m.hybrid.rg_lru, m.hybrid.count(RG_LRU)
        return layers * batch * block.width, layers * batch * (block.conv - 1) * block.width
    if m.hybrid is not None and m.hybrid.mamba1 is not None:  # Jamba's: inner x state, the conv over inner channels
        mixer, layers = m.hybrid.mamba1, m.hybrid.count(MAMBA1) + m.hybrid.count(SHARED_MAMBA1)  # Zamba's too
        return layers * batch * mixer.inner * mixer.state, layers * batch * (mixer.conv - 1) * mixer.inner
    if m.hybrid is not None and m.hybrid.kda is not None:  # Kimi Linear's: D x D a head, the conv over q | k | v
        mixer, layers = m.hybrid.kda, m.hybrid.count(KDA)
        return layers * batch * mixer.heads * mixer.head_dim ** 2, layers * batch * (mixer.conv - 1) * 3 * mixer.inner
    if m.hybrid is not None and m.hybrid.lightning is not None:  # MiniMax-01's: D x D a head, no conv
        mixer, layers = m.hybrid.lightning, m.hybrid.count(LIGHTNING)
        return layers * batch * mixer.heads * mixer.head_dim ** 2, 0
    if m.hybrid is not None and m.hybrid.cca is not None:  # ZAYA's CCA: the delayed value's last row (counted as a
        # float32 state, though the model's dtype: a row a layer), and q | k's last time0 + time1 - 2 rows
        cca, layers = m.hybrid.cca, m.hybrid.attention_layers
        return layers * batch * cca.delayed, layers * batch * (cca.halo_kernel - 1) * cca.channels
    if m.hybrid is not None and m.hybrid.conv is not None:  # LFM2's short convs: no state, the conv over hidden
        layers = m.hybrid.count(CONV)
        return 0, layers * batch * (m.hybrid.conv.kernel - 1) * m.hidden
    if m.hybrid is not None and m.hybrid.mamba is not None:  # Mamba2's: heads x head_dim x state, x | B | C's conv
        mixer, layers = m.hybrid.mamba, sum(m.hybrid.count(k) for k in (MAMBA2, PARALLEL, SHARED_MAMBA2))
        return layers * batch * mixer.inner * mixer.state, layers * batch * (mixer.conv - 1) * mixer.conv_dim
    if not m.linear_layers:
        return 0, 0
    conv_dim = 2 * m.linear_key_heads * m.linear_key_dim + m.linear_value_heads * m.linear_value_dim
    state = batch * m.linear_value_heads * m.linear_key_dim * m.linear_value_dim
    return m.linear_layers * state, m.linear_layers * batch * (m.linear_conv - 1) * conv_dim


def _recurrent_state_bytes(m: ModelShape, batch: int, element_bytes: int) -> int:
    """Every Gated DeltaNet layer's float32 state (all heads, on every rank) and its conv's last inputs."""
    states, tails = recurrent_state_elements(m, batch)
    return 4 * states + element_bytes * tails


def _read_bytes(kind, m: ModelShape, element_bytes: int) -> int:
    """Weights one decode token reads in a layer of ``kind``: its projections (an MoE layer's routed and shared
    experts only; a hybrid's layer, every parameter of it)."""
    if m.hybrid is not None and m.hybrid.shared is not None and isinstance(kind, Attention):
        return m.hybrid.shared_layer_reads(m.hidden) * element_bytes  # a Zamba hybrid layer: its whole block
    if m.hybrid is not None:
        return kind.params() * element_bytes
    params = linear_layer_matmul_params(m) if isinstance(kind, GatedDeltaNet) else layer_matmul_params(m)
    return params * element_bytes


def evaluate(work: Workload, layout: Degrees, hw: HardwareSpec, new_tokens: int,
             sharded: bool = False) -> InferenceLayout:
    """One layout's figures; ``sharded``: the weights sharded over the group (``seqmesh.inference.shard_weights``),
    each layer gathered for its forward (FSDP2's next layer prefetched beside it) and the root kept gathered. With
    ``layout.tp``, each GPU holds, reads and caches its split (``placement``'s ``split``: the layers' projections,
    the embedding and the head ``1 / tp``), and a decode step's token passes each layer's two tensor-parallel regions
    (an all-gather and a reduce-scatter each, of one token: their latency)."""
    m, e, b, tp = work.model, work.act_bytes, work.batch, layout.tp
    p = layout.ulysses * layout.ring
    share = cache_share(work.seq_len, new_tokens, layout.ulysses, layout.ring, work.layout, tp)
    dense_kv, sparse_kv = _cache_bytes(m, share, e, b, tp)
    kv = dense_kv + sparse_kv
    states = _recurrent_state_bytes(m, b, e)
    split = placement(work, layout).split
    if sharded:  # the shards, the root (head and final norm) gathered, two layers or the embedding gathered at once
        # and Zamba's shared-block units, gathered across the layers that run them
        weights = (-(-split["total"] // p) + split["root"] + max(2 * split["layer"], split["embedding"])
                   + split["held"]) * e
    else:
        weights = split["total"] * e
    working = 2 * layer_input_bytes(work, layout) + decoder_layer_saved_bytes(work, layout)
    total = weights + kv + states + working + work.reserve_bytes
    group = axis_groups(layout, "sequence")[0]
    gathering = group if sharded else []
    kinds = layer_kinds(work, layout)
    prefill = sum(n * kind.seconds(hw, gathering)["forward"] for kind, n in kinds)
    merge = _merge_seconds(m, b, hw, group, tp)
    decode = merge + (-(-m.vocab // tp) * m.hidden + m.hidden) * e / hw.memory_bandwidth  # the head, the token's row
    regions = 4 * gather_seconds(b * m.hidden * e, hw, axis_groups(layout, "tp")[0]) if tp > 1 else 0.0
    dense_layers = m.layers - m.non_attention_layers - m.indexed_layers
    # the layers that keep a recurrent state (Zamba's and Falcon-H1's beside their attention too), a feed-forward none
    stateful = sum(n for kind, n in kinds if not isinstance(kind, (Attention, IndexedAttention, FeedForwardBlock)))
    for kind, n in kinds:  # each layer reads its weights and its cache share or state; sharded, it waits for its gather
        if isinstance(kind, IndexedAttention):  # its share's latents and indexer keys, all scored
            own = sparse_kv / m.indexed_layers
        elif isinstance(kind, Attention):
            own = dense_kv / dense_layers
        else:
            own = 0 if isinstance(kind, FeedForwardBlock) else states / stateful
        weights_read = _read_bytes(kind, m, e) if tp == 1 else split["layer"] * e  # tp: a dense layer's split
        read = (weights_read + own) / hw.memory_bandwidth
        gather = layer_fsdp_seconds(kind.params(), work, layout, hw, gathering)[0]
        decode += n * (max(read, gather) + regions)
    return InferenceLayout(layout.ulysses, layout.ring, weights, kv, states, working, total,
                           total <= hw.memory_bytes, prefill, b * work.seq_len / prefill, decode, merge, tp)


def inference_plan(work: Workload, cluster: Cluster, new_tokens: int, sharded: bool = False) -> InferencePlan:
    """Every ``ulysses x ring x tp`` layout of the cluster's GPUs as one sequence group (``tp`` ranks inside each of
    its ranks, within a node) generating ``new_tokens`` after ``work``'s prompt (``work.seq_len`` tokens,
    ``work.batch`` rows); raises ValueError for a model generation does not run yet. ``sharded``: the weights sharded
    over the sequence group (``seqmesh generate --shard-weights``)."""
    why = inference_refusal(work.model)
    if why:
        raise ValueError(why)
    if new_tokens < 1:
        raise ValueError(f"--new-tokens {new_tokens} must be at least 1.")
    n = cluster.gpus
    layouts, excluded = [], []
    for tp in (t for t in range(1, n + 1) if n % t == 0):
        sp = n // tp
        refusal = tensor_parallel_refusal(work, cluster.hardware, Degrees(1, sp, 1, tp)) if tp > 1 else None
        if refusal:
            excluded.append((f"tp {tp}", refusal))
            continue
        splits = [(u, sp // u, ulysses_refusal(work.model, u, tp)) for u in range(1, sp + 1) if sp % u == 0]
        excluded += [(Degrees(u, r, 1, tp), why) for u, r, why in splits if why]
        layouts += [evaluate(work, Degrees(u, r, 1, tp), cluster.hardware, new_tokens, sharded)
                    for u, r, why in splits if not why]
    excluded = [(name if isinstance(name, str) else _label(name), why) for name, why in excluded]
    return InferencePlan(work, cluster, new_tokens, layouts, excluded, sharded)


def _label(layout: Degrees) -> str:
    return f"ulysses {layout.ulysses} x ring {layout.ring}" + (f" x tp {layout.tp}" if layout.tp > 1 else "")


def inference_workload(model: ModelShape, prompt: int, batch: int, bf16: bool, reserve_bytes: int) -> Workload:
    """The prefill as the planner's :class:`Workload`: the zigzag layout, no checkpointing, Gated DeltaNet by state
    passing (what generation's prefill runs)."""
    return Workload(model, prompt, batch=batch, bf16=bf16, checkpointing=False, layout="zigzag",
                    linear_attention="state_passing", reserve_bytes=reserve_bytes)


def format_inference(p: InferencePlan) -> str:
    """The table of :func:`inference_plan`, the layouts it left out and why, and what fits."""
    w, m, hw = p.work, p.work.model, p.cluster.hardware
    lines = [f"model {m.name}: {human_count(m.params)} params, {m.layers} layers, {attention_heads(m)}; "
             f"prompt {w.seq_len:,} tokens x {w.batch} row(s), {p.new_tokens} new, {w.dtype}",
             f"cluster: {p.cluster.gpus} GPUs = {p.cluster.nodes} node(s); {hw.describe()}",
             "seqmesh generate runs the GPUs as one sequence group (ulysses x ring, tp ranks inside each), "
             + ("the weights sharded over them (--shard-weights: each layer gathered for its forward)"
                if p.sharded else "each holding the whole model") + "; the KV cache is split by tokens over the sequence ranks, by heads over tp",
             f"{'layout':<27}{'weights':>11}{'KV cache':>11}{'states':>10}{'prefill act.':>14}{'total':>11}  fits"
             f"{'prefill s':>11}{'tokens/s':>11}{'decode ms/token':>17}{'(merge)':>9}"]
    for lay in p.layouts:
        lines.append(f"{lay.label:<27}{human_bytes(lay.weight_bytes):>11}"
                     f"{human_bytes(lay.cache_bytes):>11}{human_bytes(lay.state_bytes):>10}"
                     f"{human_bytes(lay.prefill_working_bytes):>14}{human_bytes(lay.total_bytes):>11}  "
                     f"{'yes' if lay.fits else 'no ':<4}{short_number(lay.prefill_seconds):>11}"
                     f"{short_number(lay.prefill_tokens_per_second):>11}{short_number(lay.decode_seconds * 1e3):>17}"
                     f"{short_number(lay.merge_seconds * 1e3):>9}")
    for name, why in p.excluded:
        lines.append(f"{name}: not planned, {why}")
    best = p.best
    if best is not None:
        lines.append(f"recommended: {best.label} (the fastest prefill that fits)")
    else:
        weights = human_bytes(p.layouts[0].weight_bytes) if p.layouts else "?"
        lines.append(f"no layout fits {human_bytes(hw.memory_bytes)} per GPU (weights {weights} each"
                     + ("" if p.sharded else ": the whole model; --shard-weights shards it over the GPUs") + "); the "
                     "prefill and decode times above are what the layouts would take with the memory. Plan fewer "
                     "prompt tokens, more GPUs (the KV cache and activations shrink with them), or a smaller model.")
    return "\n".join(lines)
