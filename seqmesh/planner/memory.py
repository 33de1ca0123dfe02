"""Bytes one GPU holds at its peak during a training step, by what they are for.

Assumptions (each figure's docstring says what it counts):

- Mixed precision as FSDP2 does it: the sharded parameters are the fp32 master weights; each FSDP unit
  (one transformer layer, the embedding, the LM head) is all-gathered into compute-dtype copies just
  before use; two units are unsharded at once (the current one and the prefetched next one).
  Gradients are reduce-scattered to fp32 shards; AdamW keeps two fp32 moments per parameter. So
  4 + 4 + 8 bytes per parameter, divided by the FSDP group (dp_shard x ring x ulysses; x TP for the
  reference layouts), plus the unsharded working copies.
- Activations follow a Llama-style block with flash attention (no S^2 term), fused RMSNorm (saves its
  input and one fp32 scale per token) and a SwiGLU MLP; PyTorch autograd saves what each op needs.
- With full activation checkpointing only each layer's input is kept, and one layer is recomputed
  (and its saved tensors live) at a time during backward.
- The attention working set is seqmesh's: all-to-all send/receive buffers, two K/V blocks in flight,
  float32 output/LSE accumulators forward and float32 dQ and dK/dV partials backward.
- Logits: without chunking, the local tokens' full-vocabulary logits in the compute dtype plus an fp32
  copy and an fp32 gradient (10 bytes per logit in bf16); with chunking, one chunk of that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .traffic import HeadDeal, padded_length
from .workload import Layout, Workload, embedding_params, head_params, layer_params

MASTER, GRAD_SHARD, ADAM = 4, 4, 8  # bytes per parameter held sharded


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one GPU. ``total`` adds them all; activations-like terms peak together in backward."""

    weights: int  # fp32 master shard + the unsharded compute-dtype copies of two FSDP units
    grads: int  # fp32 gradient shard + one unit's unsharded gradient (and its fp32 reduce copy)
    optimizer: int  # AdamW first and second moments, fp32, sharded
    activations: int  # tensors saved for backward (all layers, or layer inputs + one layer) + backward buffers
    attention: int  # the attention call's own working set beyond what it saves
    logits: int  # LM-head logits and the cross-entropy working set
    reserved: int  # CUDA context, communication buffers, allocator slack

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.attention + self.logits + self.reserved

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


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


def parameter_memory(work: Workload, layout: Layout) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per GPU."""
    m, e = work.model, work.act_bytes
    shard = -(-m.params // (layout.tp * layout.fsdp_group))
    unit = max(layer_params(m), embedding_params(m), head_params(m)) // layout.tp
    if layout.fsdp_group == 1 and e == MASTER:  # fp32, nothing sharded: the parameters are used in place
        return MASTER * shard, GRAD_SHARD * shard, ADAM * shard
    weights = MASTER * shard + 2 * unit * e
    grads = GRAD_SHARD * shard + unit * (e + (4 if e != 4 else 0))
    return weights, grads, ADAM * shard


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
    per_token = e * (4 * m.hidden + 4 * m.intermediate) + 2 * 4
    if layout.ulysses > 1:
        per_token += e * m.heads * m.head_dim
    attn_tokens = tokens * layout.ulysses * (layout.tp if layout.tp > 1 else 1)  # tokens seen inside attention
    attention = attn_tokens * (e * m.head_dim * (2 * hq + 2 * hk) + 4 * hq)
    return tokens * per_token + attention


def activation_memory(work: Workload, layout: Layout) -> int:
    """Saved activations plus one layer's backward buffers (gradients of the residual stream and of
    the MLP's intermediate tensors)."""
    m, e = work.model, work.act_bytes
    tokens = work.batch * local_tokens(work, layout)
    one_layer = layer_saved_bytes(work, layout)
    backward_buffers = tokens * e * (2 * m.hidden + 3 * m.intermediate)
    final = 2 * tokens * m.hidden * e  # final norm input and LM-head input
    if work.checkpointing:
        kept = m.layers * tokens * m.hidden * e + one_layer
    else:
        kept = m.layers * one_layer
    return kept + backward_buffers + final


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
    """Full logits of the local tokens (compute dtype + fp32 copy + fp32 gradient), or one chunk of them."""
    m, e = work.model, work.act_bytes
    tokens = work.batch * local_tokens(work, layout)
    if work.chunked_loss:
        tokens = min(tokens, work.loss_chunk)
    return tokens * m.vocab * (e + 4 + 4)


def memory_per_gpu(work: Workload, layout: Layout) -> MemoryBreakdown:
    weights, grads, optimizer = parameter_memory(work, layout)
    return MemoryBreakdown(
        weights=weights, grads=grads, optimizer=optimizer,
        activations=activation_memory(work, layout),
        attention=attention_working_set(work, layout),
        logits=logits_memory(work, layout),
        reserved=work.reserve_bytes,
    )
