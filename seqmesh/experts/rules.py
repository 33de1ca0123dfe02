"""When expert parallelism can run, written once (no torch): ``parallelize_model`` and the planner both call
:func:`check_expert_parallel`, so a layout the planner offers is one the runtime accepts."""

from __future__ import annotations


def check_expert_parallel(ep: int, *, experts: int | None, token_ranks: int | None, tp: int = 1, fsdp: bool = True,
                          compile: bool = False, model: str = "the model") -> None:
    """Refuse an ``ep`` degree that cannot run, naming the value and the fix.

    ``experts``: the routed experts of each MoE layer (None or 0: the model has none); ``token_ranks``: the ranks
    that hold different tokens (dp_replicate x dp_shard x ring x ulysses), which the expert groups are cut from (None:
    not known yet, e.g. the planner checking a model before its layouts).
    """
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}.")
    if ep == 1:
        return
    if not experts:
        raise ValueError(f"ep={ep}: {model} has no routed experts to split; use ep=1.")
    if experts % ep:
        fits = [d for d in range(1, experts + 1) if experts % d == 0 and (token_ranks or d) % d == 0]
        raise ValueError(f"ep={ep} does not divide the {experts} routed experts of {model}: each rank must hold the "
                         f"same number. Use one of {fits}.")
    if token_ranks is not None and token_ranks % ep:
        fits = [d for d in range(1, token_ranks + 1) if token_ranks % d == 0 and experts % d == 0]
        raise ValueError(f"ep={ep} does not divide the {token_ranks} ranks that hold different tokens (dp_replicate x "
                         f"dp x ring x ulysses): the expert groups are cut from them. Use one of {fits}, or change "
                         "the other degrees.")
    if tp > 1:
        raise ValueError(f"ep={ep} with tp={tp}: seqmesh's tensor parallelism does not split mixture-of-experts "
                         "layers, and expert parallelism is folded into the ranks that hold different tokens only. "
                         "Use tp=1 with ep, or ep=1.")
    if not fsdp:
        raise ValueError(f"ep={ep} without FSDP2: the expert weights are sharded by FSDP2 over the ranks that hold the "
                         "same experts (and summed over them). Turn FSDP on (--fsdp), or use ep=1.")
    if compile:
        raise ValueError(f"ep={ep} with compile=True: each MoE layer's all-to-all sizes come from its router at run "
                         "time (dropless), which torch.compile would cut into many graphs. Turn compile off "
                         "(--no-compile), or use ep=1.")
