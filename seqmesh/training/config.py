"""The configuration of a training run (no torch import, so the command line starts fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..compose import ParallelPlan


@dataclass
class TrainConfig:
    """One training run. Degrees given as ``"auto"`` are chosen from the world size and heads.

    ``seqmesh train`` has one flag per field (``seq_len`` is ``--seq-len``), generated from the
    annotation, default and docstring below (``seqmesh.tools.flags``): a new field needs nothing more."""

    model: str = "llama-tiny"
    """A preset (llama-tiny, qwen3-tiny, llama3-8b, qwen3-0.6b, ...), a config.json, or a local checkpoint
    folder."""
    seq_len: int = 8192
    """Tokens per sequence."""
    ulysses: int | Literal["auto"] = "auto"
    """Ulysses degree (all-to-all over the innermost ranks), or auto."""
    ring: int | Literal["auto"] = "auto"
    """Ring degree, or auto."""
    dp: int | Literal["auto"] = "auto"
    """Data-parallel shard degree, or auto; FSDP shards over dp x ulysses x ring."""
    dp_replicate: int = 1
    """HSDP replicas (weights replicated across them)."""
    tp: int = 1
    """Tensor-parallel degree, innermost (inside Ulysses): projections, embedding and LM head sharded over tp ranks
    that share a sequence shard, norms and residuals sequence-parallel between them (1: none)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's routed experts split over groups of ep ranks that hold different
    tokens, tokens sent to their experts and back by all-to-alls (exact); needs FSDP2, tp 1 and no compile; it must
    divide the experts and the ranks (world / tp) (1: every rank holds every expert, FSDP2 shards them)."""
    steps: int = 200
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    warmup: int = 20
    """Linear warm-up steps, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: float = 0.1
    """Where the cosine decay ends, as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    batch: int = 1
    """Sequences per data-parallel rank per step."""
    bf16: bool = False
    """bf16 compute, fp32 reductions and master weights."""
    checkpointing: bool = False
    """Recompute each decoder layer in backward (activation checkpointing)."""
    compile: bool = False
    """torch.compile each decoder layer (as torchtitan does), after the memory techniques and before FSDP2;
    seqmesh's attention is one graph node in it (seqmesh.sharded_attention.compiled)."""
    fsdp: bool | None = None
    """Shard weights, gradients and optimizer state with FSDP2 over every rank (--fsdp), or replicate them
    and sum the gradients after backward (--no-fsdp). Unset: FSDP2 on more than one process, none on one
    (nothing to shard there, and FSDP2's per-step copies cost time), unless --fsdp-cpu-offload needs it, or --bf16
    without CUDA asks for it (FSDP2's mixed precision rather than CPU autocast; --no-fsdp autocasts there too)."""
    tiled_mlp: bool = False
    """Compute each decoder layer's MLP in sequence tiles, recomputed in backward (exact; keeps only the MLP's
    input for backward)."""
    efficient_norm: bool = False
    """Run transformers' Llama-style RMSNorms through seqmesh.memory.rmsnorm (exact: the same forward ops;
    keeps only the norm's input and a float32 scale per token, and computes its backward in sequence tiles)."""
    async_ulysses: bool = False
    """Overlap the Ulysses all-to-alls with the attention's q/k/v and output projections, forward and backward
    (exact; seqmesh.hf.async_ulysses). Llama, Mistral, Qwen2/3, gpt-oss and Gemma 3 attention, without TP."""
    mlp_tiles: int | None = None
    """Tiles per MLP with --tiled-mlp; none: local tokens / hidden size, rounded up."""
    offload_checkpoints: bool = False
    """Keep each checkpointed decoder layer's input in (pinned) host memory until backward; needs
    --checkpointing."""
    fsdp_cpu_offload: bool = False
    """FSDP2 keeps sharded parameters, gradients and optimizer state in host memory; the optimizer steps on
    the CPU."""
    track_memory: bool = False
    """Count each step's peak live tensor bytes by category (parameters, gradients, optimizer, activations,
    transient) into metrics.jsonl; costs Python work per operator."""
    data: list[str] = field(default_factory=list)
    """.txt or .jsonl files; none: the built-in copy task. A vision-language model (Qwen-VL) takes .jsonl records
    {"text": "a cat <image> on a mat", "images": ["cat.npy"]}, each image an (H, W, 3) uint8 or [0, 1] float .npy
    array (docs/vision.md); none: the built-in image task."""
    tokenizer: str | None = None
    """Local tokenizer folder; none: UTF-8 bytes."""
    text_key: str = "text"
    """JSONL field holding the text."""
    symbols: int = 32
    """Alphabet of the built-in copy task."""
    copy_period: int | None = None
    """Period of the built-in copy task; none: seq_len // 4."""
    layout: Literal["auto", "zigzag", "contiguous", "per_document"] = "auto"
    """How the sequence is split over the ranks: zigzag balances causal work, per_document balances each packed
    document's own; auto takes per_document when documents are packed, zigzag otherwise."""
    backend: Literal["auto", "flash_attn", "cuda_flash", "cuda_cudnn", "cuda_efficient", "cpu_flash", "math"] = "auto"
    """Attention kernel; auto takes the first that supports the call, in this order."""
    loss_chunk: int = 4096
    """Tokens per LM-head tile in the loss (smaller: less memory for logits)."""
    linear_attention: Literal["auto", "all_to_all", "state_passing"] = "auto"
    """Gated DeltaNet layers across the sequence ranks: one all-to-all (heads dealt to ranks), passing the
    recurrent state between them, or auto: the cheaper for the shapes (seqmesh.linear_attention.choice)."""
    out: str = "runs/seqmesh"
    """Folder for metrics.jsonl, loss_curve.png and checkpoints/."""
    log_every: int = 10
    """Steps between progress lines."""
    eval_every: int = 50
    """Steps between held-out accuracy checks (0: only at the end)."""
    save_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int | None = None
    """Keep only the newest N checkpoints, deleting older ones after each save (the one a resumed run started
    from is kept too); none: keep them all."""
    export: bool = True
    """At the end, write the trained model to out/model in transformers' format (config.json, safetensors,
    the tokenizer's files): AutoModelForCausalLM.from_pretrained loads it."""
    resume: bool = False
    """Continue from the newest intact checkpoint in out/checkpoints."""
    overwrite: bool = False
    """Let a fresh run replace the checkpoints and metrics already in out."""
    allow_config_change: bool = False
    """Resume even if settings that change the run (lr, seq_len, data, seed, ...) differ; recorded in metrics."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN or inf loss or gradient norm: stop, naming the step, or skip that step."""
    timeout: float = 300.0
    """Seconds a collective may wait for a stalled or lost rank before the job ends."""
    seed: int = 0
    """Seed of the weights and the data."""

    def degrees(self) -> dict:
        """The degrees as given (``auto`` kept), as keywords of :func:`seqmesh.rules.degrees.resolve_degrees`."""
        return {"ulysses": self.ulysses, "ring": self.ring, "dp": self.dp, "dp_replicate": self.dp_replicate, "tp": self.tp}

    def parallel_plan(self, fsdp: bool) -> ParallelPlan:
        """What ``seqmesh.compose.parallelize_model`` applies for this run (``fsdp``: :meth:`uses_fsdp`)."""
        from ..compose import ParallelPlan

        return ParallelPlan(backend=self.backend, linear_attention=self.linear_attention, loss_chunk=self.loss_chunk,
                            checkpointing=self.checkpointing, compile=self.compile,
                            tiled_mlp=self.tiled_mlp, mlp_tiles=self.mlp_tiles, efficient_norm=self.efficient_norm,
                            fsdp=fsdp, bf16=self.bf16, fsdp_cpu_offload=self.fsdp_cpu_offload,
                            async_ulysses=self.async_ulysses, ep=self.ep)

    def uses_fsdp(self, world: int, cuda: bool) -> bool:
        """Whether a run on ``world`` processes (on CUDA devices or not) shards with FSDP2: ``fsdp`` when
        given, else on more than one process, for FSDP2's CPU offload, or for bf16 without CUDA."""
        if self.fsdp is not None:
            return self.fsdp
        return world > 1 or self.fsdp_cpu_offload or (self.bf16 and not cuda)

    def __post_init__(self) -> None:
        for name in ("seq_len", "steps", "batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        for name in ("ulysses", "ring", "dp"):
            value = getattr(self, name)
            if value != "auto" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}.")
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be at least 1 (1: no replicas), got {self.dp_replicate}.")
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1 (1: no tensor parallelism), got {self.tp}.")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive integer (1: no expert parallelism), got {self.ep!r}.")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: only at the end), got {getattr(self, name)}.")
        if self.copy_period is not None and not 1 <= self.copy_period < self.seq_len - 1:
            raise ValueError(f"copy_period must be in [1, {self.seq_len - 2}] (a token after the first block must be "
                             f"left to score at seq_len={self.seq_len}), got {self.copy_period}; omit it for "
                             "seq_len // 4.")
        if self.symbols < 1:
            raise ValueError(f"symbols must be at least 1, got {self.symbols}.")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}.")
        for name, low, high in (("lr", 0.0, None), ("grad_clip", 0.0, None), ("weight_decay", 0.0, None),
                                ("min_lr_ratio", 0.0, 1.0), ("timeout", 0.0, None)):
            value = getattr(self, name)
            if not math.isfinite(value) or value < low or (high is not None and value > high) or (
                    name in ("lr", "timeout") and value == 0):
                bound = f"in [{low:g}, {high:g}]" if high is not None else ("> 0" if name in ("lr", "timeout") else ">= 0")
                raise ValueError(f"{name} must be a finite number {bound}, got {value}.")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}.")
        if self.offload_checkpoints and not self.checkpointing:
            raise ValueError("offload_checkpoints moves the inputs checkpointed layers keep; add --checkpointing.")
        if self.fsdp_cpu_offload and self.fsdp is False:
            raise ValueError("fsdp_cpu_offload offloads FSDP2's shards; drop --no-fsdp or --fsdp-cpu-offload.")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 (omit it to keep every checkpoint), got "
                             f"{self.keep_checkpoints}.")
        if self.mlp_tiles is not None and self.mlp_tiles < 1:
            raise ValueError(f"mlp_tiles must be at least 1 (omit it to choose from the shapes), got {self.mlp_tiles}.")
        if self.data and self.batch != 1:
            raise ValueError(
                f"packed text data takes one sequence per data-parallel rank (batch=1, got {self.batch}): its rows "
                "carry different document boundaries. Raise --dp or --seq-len instead."
            )
