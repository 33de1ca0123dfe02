"""What a run is, apart from its model and data: its degrees, kernels and techniques, as one record validated once.

:class:`RunSettings` is that record. The job's config (``seqmesh.training.config.TrainConfig``), the plan
``seqmesh.compose.parallelize_model`` takes (``ParallelPlan``) and the planner's ``Workload`` are each this record plus
what only they need, so a setting is one field here: it becomes a flag of ``seqmesh train`` and ``seqmesh rehearse``
(``seqmesh.rules.flags``), of ``seqmesh plan`` unless the planner has no model of it (:data:`NOT_PLANNED`), and every
rule that ties settings together is checked here, once, for all three. A subclass may give a field another default
(the planner assumes checkpointing); it never adds a second copy of a setting.

Torch-free: ``seqmesh plan`` and the command line import it without torch.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

from .flags import literal_words

Kernel = Literal["auto", "flash_attn", "cuda_flash", "cuda_cudnn", "cuda_efficient", "triton_flash", "cpu_flash",
                 "math"]
LinearDesign = Literal["auto", "all_to_all", "state_passing"]
Layout = Literal["auto", "zigzag", "contiguous", "per_document"]
IndexerPrecision = Literal["float32", "bfloat16"]

NOT_PLANNED = ("backend", "compile", "fsdp", "dp_replicate", "indexer_precision")
"""Settings ``seqmesh plan`` has no model of (it plans FSDP2 over one replica, and its kernel and compile times are
calibrated rather than per kernel; the indexer's precision changes a kernel's speed, not what is held): no plan flag
for them."""


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Degrees, kernels and techniques of one run (each field's docstring is its flag's help)."""

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
    ep: int | Literal["auto"] = 1
    """Expert-parallel degree: each MoE layer's routed experts split over groups of ep ranks that hold different
    tokens, tokens sent to their experts and back by all-to-alls (exact); needs FSDP2, tp 1 and no compile; it must
    divide the experts and the ranks (world / tp) (1: every rank holds every expert, FSDP2 shards them). auto: the
    planner tries every degree a layout can take (a run needs a number)."""
    backend: Kernel = "auto"
    """Attention kernel; auto takes the first that supports the call, in this order."""
    linear_attention: LinearDesign = "auto"
    """Gated DeltaNet layers across the sequence ranks: one all-to-all (heads dealt to ranks), passing the
    recurrent state between them, or auto: the cheaper for the shapes (seqmesh.linear_attention.choice)."""
    indexer_precision: IndexerPrecision = "float32"
    """DeepSeek Sparse Attention's indexer scores (which keys each query attends to): float32, as transformers
    computes them, or bfloat16 inputs with float32 sums (on a GPU's tensor cores, where float32 runs without them; a
    pick may differ where two keys' scores are within bf16 rounding: docs/attention.md has the measured agreement)."""
    layout: Layout = "auto"
    """How the sequence is split over the ranks: zigzag balances causal work, per_document balances each packed
    document's own; auto takes per_document when documents are packed, zigzag otherwise."""
    bf16: bool = False
    """bf16 compute, fp32 reductions and master weights."""
    fsdp: bool | None = None
    """Shard weights, gradients and optimizer state with FSDP2 over every rank (--fsdp), or replicate them
    and sum the gradients after backward (--no-fsdp). Unset: FSDP2 on more than one process, none on one
    (nothing to shard there), unless --fsdp-cpu-offload needs it, or --bf16 asks for it: FSDP2's mixed precision
    keeps the residual stream in bf16, as every rank of a larger run does, where autocast (--bf16 --no-fsdp)
    keeps it in float32 (the CPU and one GPU alike)."""
    fsdp_cpu_offload: bool = False
    """FSDP2 keeps sharded parameters, gradients and optimizer state in host memory; the optimizer steps on
    the CPU."""
    checkpointing: bool = False
    """Recompute each decoder layer in backward (activation checkpointing)."""
    offload_checkpoints: bool = False
    """Keep each checkpointed decoder layer's input in (pinned) host memory until backward; needs
    --checkpointing."""
    keep_attention: bool = False
    """Keep each checkpointed layer's attention output and log-sum-exp (on the device) until its backward, so the
    recompute skips the attention's kernel and ring passes (seqmesh.sharded_attention.kept); needs
    --checkpointing."""
    tiled_mlp: bool = False
    """Compute each decoder layer's MLP in sequence tiles, recomputed in backward (exact; keeps only the MLP's
    input for backward)."""
    mlp_tiles: int | None = None
    """Tiles per MLP with --tiled-mlp; none: local tokens / hidden size, rounded up."""
    efficient_norm: bool = False
    """Run transformers' Llama-style RMSNorms through seqmesh.memory.rmsnorm (exact: the same forward ops;
    keeps only the norm's input and a float32 scale per token, and computes its backward in sequence tiles)."""
    loss_chunk: int = 4096
    """Tokens per LM-head tile in the loss (smaller: less memory for logits)."""
    compile: bool = False
    """torch.compile each decoder layer (as torchtitan does), after the memory techniques and before FSDP2;
    seqmesh's attention is one graph node in it (seqmesh.sharded_attention.compiled)."""
    async_ulysses: bool = False
    """Overlap the Ulysses all-to-alls with the attention's q/k/v and output projections, forward and backward
    (exact; seqmesh.hf.async_ulysses). Llama, Mistral, Qwen2/3, gpt-oss and Gemma 3 attention, without TP."""

    def __post_init__(self) -> None:
        for name, words in _word_choices(type(self)).items():
            value = getattr(self, name)
            if isinstance(value, str) and value not in words:
                raise ValueError(f"{name}={value!r} ({_flag(name)}): choose one of {', '.join(map(repr, words))}.")
        for name, auto in _degrees(type(self)).items():
            value = getattr(self, name)
            if value == "auto" and auto:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                if auto:
                    raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r} ({_flag(name)}).")
                raise ValueError(f"{name} must be at least 1 (1: none), got {value!r} ({_flag(name)}).")
        if self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be at least 1 token ({_flag('loss_chunk')}), got {self.loss_chunk}.")
        if self.mlp_tiles is not None and self.mlp_tiles < 1:
            raise ValueError(f"mlp_tiles must be at least 1 (omit it to choose from the shapes), got {self.mlp_tiles}.")
        if self.offload_checkpoints and not self.checkpointing:
            raise ValueError("offload_checkpoints (--offload-checkpoints) moves the inputs checkpointed layers keep; "
                             "add checkpointing (--checkpointing).")
        if self.keep_attention and not self.checkpointing:
            raise ValueError("keep_attention (--keep-attention) keeps the attention outputs checkpointed layers would "
                             "recompute; add checkpointing (--checkpointing).")
        if self.keep_attention and self.compile:
            raise ValueError("keep_attention=True with compile=True: torch.compile traces a checkpointed layer only "
                             "with torch's own selective contexts, not seqmesh's. Turn one off (--keep-attention or "
                             "--compile).")
        if self.fsdp_cpu_offload and self.fsdp is False:
            raise ValueError("fsdp_cpu_offload offloads FSDP2's shards; drop --no-fsdp (fsdp=False) or "
                             "--fsdp-cpu-offload.")
        if self.compile and self.async_ulysses:
            raise ValueError("compile=True with async_ulysses=True: async Ulysses waits on its all-to-alls between "
                             "pieces of the projections, which torch.compile cannot keep in one graph. Turn one off "
                             "(--compile or --async-ulysses).")

    def check_runnable(self) -> None:
        """Refuse what only the planner takes (``ep='auto'``: plan every degree), naming the fix."""
        if self.ep == "auto":
            raise ValueError("ep='auto' asks seqmesh plan to try every expert-parallel degree; a run needs a number: "
                             "run `seqmesh plan --ep auto` for the model and pass the degree it recommends (--ep N).")

    def settings(self) -> RunSettings:
        """The record alone, without what a subclass adds."""
        return RunSettings(**settings_values(self))


def settings_values(record: RunSettings) -> dict[str, Any]:
    """``{field: value}`` of :class:`RunSettings`' fields in ``record`` (a subclass's own fields left out)."""
    return {f.name: getattr(record, f.name) for f in fields(RunSettings)}


def setting_names(*, planned: bool = False) -> tuple[str, ...]:
    """The record's field names, in order; ``planned``: without :data:`NOT_PLANNED`."""
    return tuple(f.name for f in fields(RunSettings) if not (planned and f.name in NOT_PLANNED))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _word_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The fields of ``cls`` (this record or a subclass) whose annotation names words (a Literal), with them."""
    words = {f.name: literal_words(_hints(cls)[f.name]) for f in fields(cls)}
    return {name: allowed for name, allowed in words.items() if allowed}


@functools.cache
def _degrees(cls: type) -> dict[str, bool]:
    """The degree fields of ``cls`` and whether each takes ``auto``."""
    names = ("ulysses", "ring", "dp", "dp_replicate", "tp", "ep")
    return {name: "auto" in _word_choices(cls).get(name, ()) for name in names}
