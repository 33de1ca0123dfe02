"""The configuration of a training run (no torch import, so the command line starts fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..rules.settings import RunSettings, settings_values

if TYPE_CHECKING:
    from ..compose import ParallelPlan


@dataclass(frozen=True, kw_only=True)
class TrainConfig(RunSettings):
    """One training run: the run's settings (degrees, kernels, techniques: :class:`seqmesh.rules.settings.RunSettings`,
    checked there) and what only the job needs (the model, data, schedule and files). Degrees given as ``"auto"``
    are chosen from the world size and heads.

    ``seqmesh train`` has one flag per field (``seq_len`` is ``--seq-len``), generated from the
    annotation, default and docstring below and in ``RunSettings`` (``seqmesh.rules.flags``): a new field needs
    nothing more."""

    model: str = "llama-tiny"
    """A preset (llama-tiny, qwen3-tiny, llama3-8b, qwen3-0.6b, ...), a config.json, or a local checkpoint
    folder."""
    seq_len: int = 8192
    """Tokens per sequence."""
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

        return ParallelPlan(**{**settings_values(self), "fsdp": fsdp})

    def uses_fsdp(self, world: int) -> bool:
        """Whether a run on ``world`` processes shards with FSDP2: ``fsdp`` when given, else on more than one
        process, for FSDP2's CPU offload, or for bf16 (FSDP2's mixed precision: the residual stream in bf16, as
        on every rank of a larger run; autocast would keep it in float32, 16% more memory for Llama-3.2-1B at
        131,072 tokens on one GPU)."""
        if self.fsdp is not None:
            return self.fsdp
        return world > 1 or self.fsdp_cpu_offload or self.bf16

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_runnable()
        for name in ("seq_len", "steps", "batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
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
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 (omit it to keep every checkpoint), got "
                             f"{self.keep_checkpoints}.")
        if self.data and self.batch != 1:
            raise ValueError(
                f"packed text data takes one sequence per data-parallel rank (batch=1, got {self.batch}): its rows "
                "carry different document boundaries. Raise --dp or --seq-len instead."
            )
