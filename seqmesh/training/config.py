"""The configuration of a training run (no torch import, so the command line starts fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    """One training run. Degrees given as ``"auto"`` are chosen from the world size and heads."""

    model: str = "llama-tiny"  # a preset name, a config.json, or a local checkpoint directory
    seq_len: int = 8192  # tokens per sequence
    ulysses: int | str = "auto"  # Ulysses degree (all-to-all, innermost ranks)
    ring: int | str = "auto"  # ring degree
    dp: int | str = "auto"  # data-parallel shard degree (FSDP shards over dp x ulysses x ring)
    dp_replicate: int = 1  # HSDP replicas (weights replicated across them)
    steps: int = 200
    lr: float = 1e-3  # peak learning rate (AdamW)
    warmup: int = 20  # linear warm-up steps, then cosine decay to min_lr_ratio x lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm (0 disables)
    batch: int = 1  # sequences per data-parallel rank per step
    bf16: bool = False  # bf16 compute, fp32 reduction and master weights
    checkpointing: bool = False  # recompute each decoder layer in backward
    fsdp: bool = True  # shard weights, gradients and optimizer state with FSDP2
    data: list[str] = field(default_factory=list)  # .txt / .jsonl files; empty: the built-in copy task
    tokenizer: str | None = None  # local tokenizer folder; None: UTF-8 bytes
    text_key: str = "text"  # JSONL field holding the text
    symbols: int = 32  # alphabet of the built-in copy task
    copy_period: int | None = None  # its period (default: seq_len // 4)
    layout: str = "zigzag"
    backend: str = "auto"  # attention kernel
    loss_chunk: int = 4096  # tokens per LM-head tile in the loss
    out: str = "runs/seqmesh"  # metrics.jsonl, loss_curve.png and checkpoints/
    log_every: int = 10
    eval_every: int = 50  # held-out accuracy (0: only at the end)
    save_every: int = 0  # checkpoint interval in steps (0: only at the end)
    resume: bool = False  # continue from the newest intact checkpoint in out/checkpoints
    overwrite: bool = False  # a fresh run may replace the checkpoints and metrics already in out
    allow_config_change: bool = False  # resume even if settings that change the run differ (recorded)
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: stop (naming the step) or skip the step
    timeout: float = 300.0  # seconds a collective may wait before the job ends (a stalled or lost rank)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "steps", "batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be at least 1 (1: no replicas), got {self.dp_replicate}.")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: only at the end), got {getattr(self, name)}.")
        if self.copy_period is not None and not 1 <= self.copy_period < self.seq_len:
            raise ValueError(f"copy_period must be in [1, {self.seq_len - 1}] (below seq_len={self.seq_len}), got "
                             f"{self.copy_period}; omit it for seq_len // 4.")
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
        if self.data and self.batch != 1:
            raise ValueError(
                f"packed text data takes one sequence per data-parallel rank (batch=1, got {self.batch}): its rows "
                "carry different document boundaries. Raise --dp or --seq-len instead."
            )
