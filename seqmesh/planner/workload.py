"""What is being planned: a layout of the GPUs, a training workload on a model shape, and a fixed
global batch (which layouts give it, with how much gradient accumulation; docs/planner.md).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Literal

from ..rules.positions import position_problem
from ..model.doge import TILED_MLP_REFUSAL
from ..rules.degrees import Degrees, resolve_degrees
from ..rules.own_attention import DOGE_WINDOW, NOT_CHECKPOINTED, checkpointing_refusal, doge_window_problem
from ..experts.rules import check_expert_parallel as runtime_rule
from ..model.shapes import ModelShape
from .media import Media
from ..rules.settings import RunSettings, settings_values

GiB = 2**30
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# AdamW's paths in torch: the fused kernel (seqmesh train's), foreach (torch's default on CUDA) and per-tensor
# (its default on the CPU); memory.optimizer_temporaries says what each holds at the step
OPTIMIZER_PATHS = ("fused", "foreach", "per_tensor")


def keep_attention_unplanned(m: ModelShape, media: bool) -> str | None:
    """What of ``m`` the planner does not count under ``keep_attention``: Inkling's layer kinds, a vision tower run on
    images (its blocks keep theirs too); None where it counts every kept output (each seqmesh-attention layer's, each
    indexer's selection; the compressed, block-sparse and QSA layers' own kernels keep none)."""
    parts = [name for name, on in (("Inkling's layer kinds", m.inkling is not None),
                                   ("a vision tower's blocks", media)) if on]
    return ", ".join(parts) or None


@dataclass(frozen=True)
class Workload(RunSettings):
    """One training step of ``model`` on sequences of ``seq_len`` tokens: each sequence-parallel group processes
    ``batch`` sequences (its micro-batch), so a step of ``dp_shard`` groups processes ``dp_shard * batch``.

    The run's settings are the record a run has (:class:`seqmesh.rules.settings.RunSettings`, checked there), with
    the planner's defaults: bf16, activation checkpointing, the zigzag layout and every tensor-parallel degree. A
    degree given as a number plans only the layouts with it; ``ep='auto'`` plans every degree a layout can take.
    Below them, what only the planner models."""

    model: ModelShape
    seq_len: int
    batch: int = 1
    _: KW_ONLY
    tp: int | Literal["auto"] = "auto"
    """Tensor-parallel degree of the layouts planned, or auto: every degree the model's sizes take."""
    layout: Literal["zigzag", "contiguous", "per_document"] = "zigzag"
    """Sequence layout (zigzag balances causal work; per_document each packed document's own)."""
    bf16: bool = True
    """bf16 compute (mixed precision, fp32 master weights); off: fp32."""
    checkpointing: bool = True
    """Full activation checkpointing of every decoder layer."""
    chunked_loss: bool = True
    """Cross-entropy over chunks of tokens, never the full logits."""
    causal: bool = True
    reduce_dtype: str = "float32"  # FSDP gradient reduce-scatter dtype (torchtitan's default)
    reserve_bytes: int = 2 * GiB  # CUDA context, NCCL buffers and allocator slack per GPU
    validate: bool = True  # seqmesh.attention's input check (a tiny all-gather per call)
    offload_prefetch: int = 2  # offloaded inputs fetched back to the device ahead of use (0: used in place, CPU)
    optimizer: str = "fused"  # AdamW's path (OPTIMIZER_PATHS): seqmesh train's fused kernel (make_optimizer)
    media: Media | None = None  # images and video per sequence for a vision-language model's tower (None: text)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model.unplanned:
            raise ValueError(f"{self.model.name}: {self.model.unplanned}")
        if self.model.family == "doge":  # the runtime's rule (seqmesh.hf.own_attention refuses the same)
            problem = doge_window_problem(self.seq_len, dict(self.model.extra).get("keep_window_size", DOGE_WINDOW))
            if problem:
                raise ValueError(f"{self.model.name}: {problem}.")
        if self.checkpointing and self.model.family in NOT_CHECKPOINTED:  # the runtime's rule (model.fsdp)
            raise ValueError(f"{self.model.name}: {checkpointing_refusal(self.model.family)}.")
        problem = position_problem(self.seq_len, self.model.position_rows, self.model.family)
        if problem:  # the runtime's rule (seqmesh train and verify refuse the same)
            raise ValueError(f"{self.model.name}: {problem}.")
        unplanned = keep_attention_unplanned(self.model, self.media is not None) if self.keep_attention else None
        if unplanned:
            raise ValueError(f"{self.model.name}: --keep-attention is not planned for {unplanned}; plan without it "
                             "(a run takes it: the planner would count too little of what the layers keep).")
        if self.model.cross_domain is not None and self.tiled_mlp:  # the runtime's rule (seqmesh.memory.tiled_mlp)
            raise ValueError(f"{self.model.name}: {TILED_MLP_REFUSAL}.")
        if self.seq_len < 1:
            raise ValueError(f"--seq-len {self.seq_len}: a sequence needs at least 1 token.")
        if self.batch < 1:
            raise ValueError(f"--batch {self.batch}: the micro-batch needs at least 1 sequence.")
        if self.fsdp is False:
            raise ValueError("the planner models FSDP2 runs (fsdp=False asks for none); drop --no-fsdp to compare "
                             "with it.")
        if self.dp_replicate != 1:
            raise ValueError(f"dp_replicate={self.dp_replicate}: the planner models one FSDP2 group "
                             "(dp_replicate=1).")
        if self.media is not None:
            self.media.check(self.model, self.seq_len)
        if self.optimizer not in OPTIMIZER_PATHS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {', '.join(OPTIMIZER_PATHS)}.")
        if self.offload_prefetch < 0:
            raise ValueError(f"offload_prefetch={self.offload_prefetch} must be >= 0.")
        if self.ep != "auto":
            check_expert_parallel(self.model, self.ep)

    @property
    def dtype(self) -> str:
        """The compute dtype as the planner's options name it ("bf16", "fp32")."""
        return "bf16" if self.bf16 else "fp32"

    @property
    def torch_dtype(self) -> str:
        """The compute dtype as torch names it ("bfloat16", "float32")."""
        return COMPUTE_DTYPES[self.dtype]

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations and unsharded parameters."""
        return 2 if self.bf16 else 4

    def admits(self, layout: Degrees) -> bool:
        """Whether ``layout`` has every degree this workload gives as a number (``auto``: any)."""
        return all(given == "auto" or given == value for given, value in
                   ((self.ulysses, layout.ulysses), (self.ring, layout.ring), (self.dp, layout.dp_shard),
                    (self.tp, layout.tp)))


def layer_params(m: ModelShape) -> int:
    """Parameters of one transformer layer: q, k, v, o projections (MLA's, with its indexer), gated MLP (or all its
    experts), RMSNorms, and what it holds but a text step never multiplies (TrOCR's cross-attention)."""
    return m.attention_params + m.mlp_params + m.norm_params + m.idle_params


def layer_matmul_params(m: ModelShape) -> int:
    """Parameters of one layer that multiply every token (the projections; of an MoE layer, the
    experts a token is routed to, the shared experts and the router). MLA's ``kv_b_proj`` multiplies every token
    (dense: the keys and values of every head) or, as indexed attention runs it, every query (its two halves
    absorbed into the query and the output): the same products. A Mamba2 hybrid's attention layer: its attention
    and its own feed-forward (none in Nemotron-H); ZAYA's, its CCA convs too. DeepSeek-V4: its sliding layers';
    MiniMax-M3: its full layers'."""
    if m.hybrid is not None:  # ZAYA's CCA convs: a multiply-add a weight and token, as a matmul's
        convs = m.hybrid.cca.conv_params() if m.hybrid.cca is not None else 0
        return m.attention_params + convs + m.hybrid.ffn(m.hybrid.attention_ffn()).macs
    # DeepSeek-V4's sliding layers (its compressed ones count their own: seqmesh.planner.compressed); MiniMax-M3's
    # full layers (its block-sparse ones add their indexer: seqmesh.planner.block_sparse); Qwen4-Exp's QSA layers
    # without their indexer (seqmesh.planner.qsa) and with their gated residuals
    attention = m.kind_attention_params("sliding_attention") if m.compressed is not None else m.attention_params
    if m.block_sparse is not None:
        attention -= m.block_sparse.indexer_params(m.hidden)
    if m.qwen_exp is not None:
        attention -= m.qwen_exp.indexer_params(m.hidden)
    return attention + mlp_matmul_params(m) + m.residual_macs


def mlp_matmul_params(m: ModelShape) -> int:
    """The MLP's share of :func:`layer_matmul_params`: a dense MLP's matrices (and Doge's cross-domain experts' products
    beside them), or the experts a token is routed to, the shared experts and the router."""
    if not m.experts:
        dense = m.mlp_matrices * m.hidden * m.intermediate
        return dense + (m.cross_domain.matmul_params(m.hidden) if m.cross_domain is not None else 0)
    mlp = m.mlp_matrices * m.hidden * m.intermediate * (m.experts_per_token or 1) + m.shared_expert_params
    return mlp + m.experts * m.hidden  # the router


def plan_inputs(cfg, world: int, *, device: str = "cuda", reserve_bytes: int = 0,
                media: Media | None = None) -> tuple[Workload, Degrees]:
    """The planner's ``(Workload, Degrees)`` for a ``seqmesh train`` run (a ``TrainConfig``) on ``world`` ranks, so a
    prediction and a measured run compare like with like; ``reserve_bytes`` 0 because a tensor count
    (``seqmesh.memory.MemoryTracker``) does not see the CUDA context; ``media``: the images each sequence shows a
    vision-language model's tower (None: the tower is not sized)."""
    from ..model.presets import model_shape

    if not cfg.uses_fsdp(world):
        raise ValueError("the planner models FSDP2 runs; drop --no-fsdp to compare with it (on one process in "
                         "fp32, where seqmesh train does not shard unless asked, pass --fsdp).")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: choose 'cuda' or 'cpu'.")
    shape = model_shape(cfg.model)
    ulysses, ring, dp = resolve_degrees(world, **cfg.degrees(), q_heads=shape.fewest_heads, seq_len=cfg.seq_len)
    # on the CPU host and device are one memory: FSDP2's CPU offload moves nothing and the activation offload's host
    # copies are used in place (nothing fetched back)
    on_cpu = device == "cpu"
    layout = cfg.layout if cfg.layout != "auto" else ("per_document" if cfg.data else "zigzag")
    settings = {**settings_values(cfg), "layout": layout, "fsdp_cpu_offload": cfg.fsdp_cpu_offload and not on_cpu}
    work = Workload(shape, cfg.seq_len, batch=cfg.batch, **settings, reserve_bytes=reserve_bytes,
                    offload_prefetch=0 if on_cpu else 2, media=media)
    return work, Degrees(ulysses, ring, dp, cfg.tp, cfg.ep)


@dataclass(frozen=True)
class GlobalBatch:
    """What one optimizer step must process over the whole cluster."""

    sequences: int | None = None  # sequences per optimizer step; None: no fixed global batch
    one_group: bool = False  # only layouts whose one sequence group spans every GPU

    def __post_init__(self) -> None:
        if self.sequences is not None and self.sequences < 1:
            raise ValueError(f"--global-batch-seqs {self.sequences}: a global batch needs at least 1 sequence.")

    def accumulation(self, layout: Degrees, micro_batch: int) -> int:
        """Micro-steps per optimizer step: ``sequences / (dp_shard x micro_batch)`` (1 without a target)."""
        return 1 if self.sequences is None else self.sequences // (layout.dp_shard * micro_batch)

    def why_not(self, layout: Degrees, micro_batch: int) -> str | None:
        """Why ``layout`` cannot give this batch, or None when it can."""
        if self.one_group and layout.dp_shard > 1:
            return f"--one-group: {layout.dp_shard} data-parallel groups, not one sequence group over every GPU"
        if self.sequences is not None and self.sequences % (layout.dp_shard * micro_batch):
            return (f"global batch {self.sequences} is not a whole number of steps of dp_shard {layout.dp_shard} x "
                    f"micro-batch {micro_batch} sequences")
        return None


def global_batch_from(sequences: int | None, tokens: int | None, seq_len: int | None, micro_batch: int,
                      one_group: bool = False) -> GlobalBatch:
    """``--global-batch-seqs`` / ``--global-batch-tokens`` / ``--one-group`` checked against the sequence length
    and the micro-batch; raises ValueError naming the number and the fix."""
    if sequences is not None and tokens is not None:
        raise ValueError(f"give --global-batch-seqs {sequences} or --global-batch-tokens {tokens}, not both.")
    if tokens is not None:
        if seq_len is None:
            raise ValueError(f"--global-batch-tokens {tokens} needs --seq-len (tokens per sequence) to count "
                             "sequences; with --max-seq-len give --global-batch-seqs instead.")
        if tokens < 1 or tokens % seq_len:
            lower, upper = max(seq_len, tokens // seq_len * seq_len), -(-max(tokens, 1) // seq_len) * seq_len
            raise ValueError(f"--global-batch-tokens {tokens} is not a whole number of {seq_len}-token sequences; "
                             f"use {lower:,}" + (f" or {upper:,}" if upper != lower else "")
                             + " or --global-batch-seqs.")
        sequences = tokens // seq_len
    if sequences is not None and sequences % micro_batch:
        raise ValueError(f"--global-batch-seqs {sequences} is not a multiple of the micro-batch --batch {micro_batch}; "
                         f"use a multiple of {micro_batch} or --batch 1.")
    return GlobalBatch(sequences, one_group)


def check_expert_parallel(m: ModelShape, ep: int) -> None:
    """Refuse an ``ep`` no layout of ``m`` can take, naming the model's numbers and the fix: the runtime's rule
    (:func:`seqmesh.experts.rules.check_expert_parallel`) on the model alone, and what the planner does not model."""
    if ep == 1:
        return
    if m.experts and m.hybrid is not None:
        raise ValueError(f"--ep {ep}: the planner does not model expert parallelism in {m.name}'s hybrid layers "
                         "(Mamba2, short conv, KDA, lightning) yet; use --ep 1.")
    runtime_rule(ep, experts=m.experts, token_ranks=None, model=m.name)
