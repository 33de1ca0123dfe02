"""A fixed global batch: how many sequences one optimizer step must see, and which layouts give it.

A layout with ``dp_shard`` data-parallel groups, each running a micro-batch of ``b`` sequences, sees
``dp_shard x b`` sequences per forward/backward pass (a micro-step). A global batch of ``N`` sequences
needs ``N / (dp_shard x b)`` micro-steps with gradients accumulated between them; a layout for which
that is not a whole number cannot give the batch and is set aside with the reason. The optimizer step
then takes that many micro-steps: each repeats FSDP's all-gathers and its gradient reduce-scatter (FSDP2
reduces every backward unless gradient sync is switched off, and seqmesh's trainer has no accumulation
loop that would), so its time is ``accumulation x`` the micro-step's, and tokens/s are unchanged.

``one_group`` asks for one sequence group over the whole cluster: ``ulysses x ring = GPUs`` (or the
tensor-parallel reference over all of them), ``dp_shard = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .workload import Layout


@dataclass(frozen=True)
class GlobalBatch:
    """What one optimizer step must process over the whole cluster."""

    sequences: int | None = None  # sequences per optimizer step; None: no fixed global batch
    one_group: bool = False  # only layouts whose one sequence group spans every GPU

    def __post_init__(self) -> None:
        if self.sequences is not None and self.sequences < 1:
            raise ValueError(f"--global-batch-seqs {self.sequences}: a global batch needs at least 1 sequence.")

    def accumulation(self, layout: Layout, micro_batch: int) -> int:
        """Micro-steps per optimizer step: ``sequences / (dp_shard x micro_batch)`` (1 without a target)."""
        if self.sequences is None:
            return 1
        return self.sequences // (layout.dp_shard * micro_batch)

    def why_not(self, layout: Layout, micro_batch: int) -> str | None:
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
