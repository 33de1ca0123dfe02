"""Inkling 2's block states as the planner counts them (:mod:`.inkling2` prices its layers): what one depth
attention keeps, what checkpointing keeps of the states themselves, and the depth attention before the final norm.
Below :mod:`.activations` and :mod:`.memory`, which add them to the moments of the step.
"""

from __future__ import annotations

from .workload import Workload

F32 = 4


def depth_bytes(work: Workload, stacked: int, queries: int) -> int:
    """Bytes a token keeps for one depth attention over ``stacked`` states with ``queries`` learned queries (none
    when ``stacked`` is 0): the stack in float32, its normed copy, the output (module docstring)."""
    return F32 * work.model.hidden * (2 * stacked + queries) if stacked else 0


def block_states_bytes(work: Workload, layers: int) -> int:
    """Bytes a token's block states take where checkpointing keeps the inputs of the first ``layers`` layers (all:
    at the loss, and in the last layer's backward): each block's stack once, in the compute dtype (Inkling2-Loop's
    looped blocks once a pass, when every layer's inputs are kept)."""
    ink = work.model.inkling
    if ink is None or not ink.second or not layers:
        return 0
    if layers >= work.model.layers:
        return work.act_bytes * work.model.hidden * sum(ink.boundary_tensors())
    n = ink.entries(layers - 1)
    return work.act_bytes * work.model.hidden * n * (n + 1) // 2


def messages_bytes(work: Workload) -> int:
    """Bytes a token keeps, all step, for Inkling2-Loop's messages: each call of a looped layer after the first
    pass takes four (its queries', keys', values' and MLP's, ``4 x E`` in the compute dtype, which FSDP2 casts
    its input to and checkpointing keeps) from a depth attention of its own over the previous pass's states
    (:func:`depth_bytes` without its output, which the cast replaces)."""
    ink, m = work.model.inkling, work.model
    if ink is None or not ink.gate_rank:
        return 0
    calls = ink.extra_passes
    return calls * (depth_bytes(work, ink.message_stack, 0) + 4 * m.hidden * work.act_bytes)


def final_depth_bytes(work: Workload) -> int:
    """Bytes a token keeps for the depth attention before the final norm (the model's last block states, the last
    layer's output): :func:`depth_bytes`."""
    ink = work.model.inkling
    if ink is None or not ink.second:
        return 0
    return depth_bytes(work, ink.entries(work.model.layers) + 1, 1)
