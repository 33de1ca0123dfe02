"""Bytes one GPU holds at its peak during a training step, by what they are for.

The peak is the largest of three moments of backward, each adding what coexists then:

- ``layer backward`` (inside the first layer's backward, its forward recomputed): saved activations,
  one layer's backward buffers, seqmesh's attention working set, the root's gradient (LM head and final
  norm) and the layer's own unsharded gradient with its fp32 reduce copy;
- ``loss backward`` (the step's first backward op): every checkpointed layer input, the final norm's and
  LM head's inputs, the logits or one chunk of them (and the chunked loss's fp32 gradient accumulator),
  the head's gradient;
- ``end of backward`` (the reduce-scatters after the last layer, no activations left): the larger of the
  untied embedding's reduce-scatter (its unsharded gradient and fp32 copy while the root's gradient is
  still alive) and the root's, last (the root's unsharded gradient and its fp32 copy).

Assumptions (each figure's docstring says what it counts):

- Mixed precision as FSDP2 does it, with seqmesh's units (``seqmesh.training.fsdp.apply_fsdp``): each decoder
  layer is one unit; an input embedding not tied to the LM head is a unit of its own; the root unit
  holds the rest: the final norm and the LM head (and the embedding when it is tied to the head, once).
  The sharded parameters are the fp32 master weights; a unit is all-gathered into compute-dtype copies
  just before use and resharded after (the embedding: gathered for its forward at the start of the step,
  resharded, gathered again for its backward at the very end). The root's forward contains every layer
  and the loss, which reads the head's weight, and its backward starts with the loss, so the root stays
  gathered for the whole step; two layer units are gathered at once (the current one and the prefetched
  next one). Gradients are reduce-scattered to fp32 shards; AdamW keeps two fp32 moments per parameter.
  So 4 + 4 + 8 bytes per parameter, divided by the FSDP group (dp_shard x ring x ulysses; x TP for the
  reference layouts), plus the unsharded working copies.
- Unsharded gradients: the LM head's (the loss's backward runs first) and then the final norm's stay
  until the root's reduce-scatter at the end of backward; each layer's lives until its own
  reduce-scatter, which first copies it into an fp32 buffer (the reduce dtype); an untied embedding's
  until its own reduce-scatter, right after its backward and before the root's.
- Activations follow a Llama-style block with flash attention (no S^2 term), fused RMSNorm (saves its
  input and one fp32 scale per token) and a SwiGLU MLP; PyTorch autograd saves what each op needs.
- With full activation checkpointing only each layer's input is kept, and one layer is recomputed
  (and its saved tensors live) at a time during backward.
- The attention working set is seqmesh's: all-to-all send/receive buffers, two K/V blocks in flight,
  float32 output/LSE accumulators forward and float32 dQ and dK/dV partials backward.
- Memory techniques (``seqmesh.memory``; ``Workload`` options): the tiled MLP saves only its input, and
  its ``(token, intermediate)`` tensors exist for one tile (about ``hidden`` tokens) at a time; the
  activation offload keeps on the GPU only the checkpointed inputs being fetched (the current layer's and
  the next two), the rest, and the final norm's saved tensors, in host memory; FSDP2's CPU offload keeps
  the fp32 shards, their gradients and AdamW's moments in host memory, and on the GPU only the fp32
  shards of the units being gathered next to their gathered copies.
- Logits: without chunking, the local tokens' full-vocabulary logits in the compute dtype plus an fp32
  copy and an fp32 gradient (10 bytes per logit in bf16); with chunking (``seqmesh.training.loss``), one chunk of
  that plus the fp32 accumulator of the head's weight gradient, ``vocab x hidden`` floats, that the
  chunked backward allocates before casting it to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .traffic import HeadDeal, padded_length
from .workload import Layout, Workload, embedding_unit_params, layer_params, linear_state_bytes, root_params

MASTER, GRAD_SHARD, ADAM = 4, 4, 8  # bytes per parameter held sharded
MOMENTS = ("layer backward", "loss backward", "end of backward")
OFFLOAD_PREFETCH = 2  # checkpointed inputs fetched ahead of the layer being recomputed (seqmesh.memory.offload)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU at one moment of the step (``moment``), by purpose; ``total`` adds them."""

    weights: int  # fp32 master shard + compute-dtype copies of the root unit and (but at the end) two layer units
    grads: int  # fp32 gradient shard + the unsharded gradients alive at this moment
    optimizer: int  # AdamW first and second moments, fp32, sharded
    activations: int  # tensors saved for backward + backward buffers alive at this moment
    attention: int  # the attention call's own working set beyond what it saves (inside a layer)
    logits: int  # LM-head logits and the cross-entropy working set (at the loss)
    reserved: int  # CUDA context, communication buffers, allocator slack
    moment: str = "layer backward"  # one of MOMENTS

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.attention + self.logits + self.reserved

    def as_dict(self) -> dict[str, int]:
        """Bytes by purpose and their total (the moment is left out: every value is an int)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "moment"}, "total": self.total}


def local_tokens(work: Workload, layout: Layout) -> int:
    """Tokens of each sequence one GPU holds outside attention (the padded length over the sequence degree)."""
    if layout.tp > 1:
        return padded_length(work.seq_len, layout.tp, 1, "contiguous") // layout.tp
    return padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout) // (layout.ulysses * layout.ring)


def _heads(work: Workload, layout: Layout) -> tuple[int, int]:
    """(query heads, kv heads) of the busiest GPU inside attention."""
    m = work.model
    if layout.tp > 1:
        return m.heads // layout.tp, max(1, m.kv_heads // layout.tp)
    deal = HeadDeal(m.heads, m.kv_heads, layout.ulysses)
    return deal.max_q, deal.max_kv


def end_of_backward_grads(work: Workload, layout: Layout) -> dict[str, int]:
    """Unsharded gradient bytes per GPU at each reduce-scatter of the end of backward (compute dtype, plus
    the fp32 copy FSDP reduces from): ``embedding`` (an untied embedding's unit, right after its backward:
    its gradient and fp32 copy while the root's gradient, the LM head's and the final norm's, is still
    alive; absent when tied) and ``root`` (last: the root's gradient and its fp32 copy)."""
    m, e, t = work.model, work.act_bytes, layout.tp
    root, emb = (-(-n // t) for n in (root_params(m), embedding_unit_params(m)))
    reduce_copy = 4 if e != 4 else 0  # FSDP copies the compute-dtype gradient into an fp32 reduce buffer
    out = {"root": root * (e + reduce_copy)}
    if emb:
        out = {"embedding": root * e + emb * (e + reduce_copy), **out}
    return out


def parameter_memory(work: Workload, layout: Layout, moment: str = "layer backward") -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per GPU at ``moment``.

    weights: fp32 master shard + the root unit and two layer units unsharded in the compute dtype (at the
    end only the root: the last layer and the embedding were resharded after their backward). The untied
    embedding's unit is gathered only for its own forward and backward, at the two ends of the step.
    grads: fp32 gradient shard + the unsharded gradients alive: in a layer's backward the root's (LM head
    and final norm) and the layer's own with its fp32 reduce copy; in the loss's backward the LM head's; at
    the end the larger of the embedding's and the root's reduce-scatter (:func:`end_of_backward_grads`).
    fp32 on one rank: the parameters and gradients are used in place."""
    if moment not in MOMENTS:
        raise ValueError(f"moment {moment!r}: choose one of {', '.join(MOMENTS)}.")
    m, e, t = work.model, work.act_bytes, layout.tp
    shard = -(-m.params // (t * layout.fsdp_group))
    if layout.fsdp_group == 1 and e == MASTER and not work.fsdp_cpu_offload:
        return MASTER * shard, GRAD_SHARD * shard, ADAM * shard
    layer, root, head = (-(-n // t) for n in (layer_params(m), root_params(m), m.vocab * m.hidden))
    reduce_copy = 4 if e != 4 else 0  # FSDP copies the compute-dtype gradient into an fp32 reduce buffer
    if moment == "layer backward":
        unsharded = root * e + layer * (e + reduce_copy)
    elif moment == "loss backward":
        unsharded = head * e
    else:
        unsharded = max(end_of_backward_grads(work, layout).values())
    gathered = root + (0 if moment == "end of backward" else 2 * layer)
    if work.fsdp_cpu_offload:  # the shards live on the host; the gathered units' fp32 shards are copied in
        return gathered * e + MASTER * -(-gathered // layout.fsdp_group), unsharded, 0
    return MASTER * shard + gathered * e, GRAD_SHARD * shard + unsharded, ADAM * shard


def host_memory(work: Workload, layout: Layout) -> int:
    """Host bytes per GPU the techniques need: FSDP2's offloaded fp32 shards, gradients and AdamW moments,
    and the offloaded checkpointed inputs with the final norm's input, output and fp32 scale."""
    m, e = work.model, work.act_bytes
    host = 0
    if work.fsdp_cpu_offload:
        host += (MASTER + GRAD_SHARD + ADAM) * -(-m.params // (layout.tp * layout.fsdp_group))
    if work.offload_checkpoints:
        tokens = work.batch * local_tokens(work, layout)
        host += (m.layers + 2) * tokens * m.hidden * e + tokens * 4
    return host


def mlp_tile_tokens(work: Workload, layout: Layout) -> int:
    """Tokens of one MLP tile on one GPU, all ``batch`` sequences: each sequence's local tokens cut into
    tiles of at most ``hidden`` (``seqmesh.memory.tiled_mlp.tile_count``)."""
    local = local_tokens(work, layout)
    tiles = max(1, -(-local // work.model.hidden))
    return work.batch * -(-local // tiles)


def layer_saved_bytes(work: Workload, layout: Layout) -> int:
    """Bytes one layer saves for backward on one GPU (per step, all ``batch`` sequences).

    Per local token: RMSNorm inputs (2 x hidden) and their fp32 scales, the inputs of the q/k/v and
    gate/up projections (2 x hidden), gate, up, SiLU(gate) and the down projection's input (4 x
    intermediate); with Ulysses the output projection's input is a separate copy of the attention
    output (hidden). Inside attention, on the tokens and heads this GPU attends with: q, k, v, out and
    the fp32 LSE."""
    m, e = work.model, work.act_bytes
    tokens = work.batch * local_tokens(work, layout)
    hq, hk = _heads(work, layout)
    mlp = 0 if work.tiled_mlp else 4 * m.intermediate  # tiled: only the MLP's input, among the 4 x hidden
    per_token = e * (4 * m.hidden + mlp) + 2 * 4
    if layout.ulysses > 1:
        per_token += e * m.heads * m.head_dim
    attn_tokens = tokens * layout.ulysses * (layout.tp if layout.tp > 1 else 1)  # tokens seen inside attention
    attention = attn_tokens * (e * m.head_dim * (2 * hq + 2 * hk) + 4 * hq)
    saved = tokens * per_token + attention
    if m.linear_layers and layout.tp == 1:  # hybrid: the larger of the two kinds of layer
        saved = max(saved, linear_layer_saved_bytes(work, layout))
    return saved


LINEAR_CHUNK = 64  # tokens per chunk of the chunked gated delta rule


def linear_layer_saved_bytes(work: Workload, layout: Layout) -> int:
    """Bytes one Gated DeltaNet layer saves for backward on one GPU. Per local token as a full-attention
    layer (norms, projections' inputs, MLP) plus z and the out projection's input; inside the token mixer,
    over the whole sequence for this GPU's 1/P of the heads: the conv's input and output channels, beta,
    the decay, the output (activation dtype), and the float32 recurrent state entering every chunk of
    64 tokens (``linear_state_bytes`` per chunk: the torch reference keeps them all)."""
    m, e = work.model, work.act_bytes
    p = layout.ulysses * layout.ring
    tokens = work.batch * local_tokens(work, layout)
    whole = work.batch * padded_length(work.seq_len, layout.ulysses, layout.ring, work.layout)
    deal = HeadDeal(m.linear_value_heads, m.linear_key_heads, p)
    h, k = deal.max_q, deal.max_kv
    per_token = e * (4 * m.hidden + 4 * m.intermediate + 2 * m.linear_value_heads * m.linear_value_dim) + 2 * 4
    mixer = whole * e * (2 * (2 * k * m.linear_key_dim + h * m.linear_value_dim) + 2 * h + h * m.linear_value_dim)
    states = -(-whole // work.batch // LINEAR_CHUNK) * linear_state_bytes(m, work.batch, p)
    return tokens * per_token + mixer + states


def activation_memory(work: Workload, layout: Layout) -> int:
    """Activations inside the first layer's backward: what every layer saved (with checkpointing, each
    layer's input plus the recomputed layer's saved tensors) and one layer's backward buffers (gradients
    of the residual stream and of the MLP's intermediate tensors)."""
    m, e = work.model, work.act_bytes
    tokens = work.batch * local_tokens(work, layout)
    one_layer = layer_saved_bytes(work, layout)
    if work.tiled_mlp:  # one tile's recomputed MLP tensors and their backward buffers
        mlp_buffers = mlp_tile_tokens(work, layout) * e * 7 * m.intermediate
    else:
        mlp_buffers = tokens * e * 3 * m.intermediate
    backward_buffers = tokens * e * 2 * m.hidden + mlp_buffers
    if work.checkpointing:
        inputs = min(m.layers, OFFLOAD_PREFETCH + 1) if work.offload_checkpoints else m.layers
        kept = inputs * tokens * m.hidden * e + one_layer
    else:
        kept = m.layers * one_layer
    return kept + backward_buffers


def loss_activation_memory(work: Workload, layout: Layout) -> int:
    """Activations when the loss's backward runs: every layer's saved tensors (with checkpointing, their
    inputs) and the final norm's and LM head's inputs."""
    m, e = work.model, work.act_bytes
    tokens = work.batch * local_tokens(work, layout)
    if work.offload_checkpoints:  # only the LM head's input is left on the GPU
        return tokens * m.hidden * e
    per_layer = tokens * m.hidden * e if work.checkpointing else layer_saved_bytes(work, layout)
    return m.layers * per_layer + 2 * tokens * m.hidden * e


def attention_working_set(work: Workload, layout: Layout) -> int:
    """Peak bytes the attention call allocates beyond its saved tensors (max of forward and backward)."""
    m, e = work.model, work.act_bytes
    u, r = layout.ulysses, layout.ring
    local = local_tokens(work, layout)
    hq, hk = _heads(work, layout)
    d, b = m.head_dim, work.batch
    block_tokens = b * local * u * (layout.tp if layout.tp > 1 else 1)  # queries / keys of one ring block
    kv_block = 2 * block_tokens * hk * d * e
    blocks_in_flight = 2 if r > 1 else 1
    a2a = 0
    if u > 1:
        deal = HeadDeal(m.heads, m.kv_heads, u)
        rows = sum(deal.q(v) + 2 * deal.kv(v) for v in range(u))
        a2a = b * local * rows * d * e  # packed send buffer (the receive buffer is what attention saves)
    forward = a2a + block_tokens * hq * (4 * d + 4) + blocks_in_flight * kv_block + block_tokens * hq * d * e
    dq = block_tokens * hq * d * 4
    dkv = 2 * block_tokens * hk * d * 4 * (2 if r > 1 else 1)  # this step's partial and the incoming one
    kernel_grads = block_tokens * (hq + 2 * hk) * d * e
    dout = block_tokens * hq * d * e
    backward = dq + dkv + blocks_in_flight * kv_block + kernel_grads + dout + 2 * a2a
    return max(forward, backward)


def logits_memory(work: Workload, layout: Layout) -> int:
    """Full logits of the local tokens (compute dtype + fp32 copy + fp32 gradient), or one chunk of them
    and the chunked backward's fp32 accumulator of the head's weight gradient (vocab x hidden floats;
    in fp32 it is the gradient itself, counted under grads)."""
    m, e = work.model, work.act_bytes
    tokens = work.batch * local_tokens(work, layout)
    if not work.chunked_loss:
        return tokens * m.vocab * (e + 4 + 4)
    accumulator = -(-m.vocab * m.hidden // layout.tp) * 4 if e != 4 else 0
    return min(tokens, work.loss_chunk) * m.vocab * (e + 4 + 4) + accumulator


def memory_at(work: Workload, layout: Layout, moment: str) -> MemoryBreakdown:
    """What one GPU holds at ``moment`` (one of MOMENTS; see the module docstring)."""
    weights, grads, optimizer = parameter_memory(work, layout, moment)
    activations = attention = logits = 0
    if moment == "layer backward":
        activations, attention = activation_memory(work, layout), attention_working_set(work, layout)
    elif moment == "loss backward":
        activations, logits = loss_activation_memory(work, layout), logits_memory(work, layout)
    return MemoryBreakdown(weights, grads, optimizer, activations, attention, logits, work.reserve_bytes, moment)


def memory_per_gpu(work: Workload, layout: Layout) -> MemoryBreakdown:
    """The peak: the moment of backward at which one GPU holds the most."""
    return max((memory_at(work, layout, moment) for moment in MOMENTS), key=lambda b: b.total)
