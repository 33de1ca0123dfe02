"""How many ranks each parallelism gets: the one place ``auto`` degrees are resolved and refused.

The mesh is ``(dp_replicate, dp_shard, ring, ulysses, tp)``, outermost first (``seqmesh.mesh.AXES``): tensor
parallelism innermost, after ``ulysses``. The job, the Trainer and the
planner all resolve their degrees here, so they agree on what ``auto`` means and on every refusal.
Torch-free: ``seqmesh plan`` imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

Degree = Union[int, str]  # a positive int, or "auto"


def workable_degrees(q_heads: int, sp: int) -> list[tuple[int, int]]:
    """``(ulysses, ring)`` pairs with ``ulysses * ring == sp`` that a model with ``q_heads`` query heads
    can run (Ulysses needs at least one query head per rank; kv heads are replicated as needed)."""
    return [(u, sp // u) for u in range(1, sp + 1) if sp % u == 0 and u <= q_heads]


def kv_heads_fit(kv_heads: int, tp: int) -> bool:
    """Whether ``tp`` tensor-parallel ranks can hold ``kv_heads``: each a whole share of them (``tp`` divides them),
    or, with fewer kv heads than ranks (MQA, narrow GQA), each the one its query heads read (they divide ``tp``)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def tensor_parallel_degrees(*, heads: int, kv_heads: int | None = None, intermediate: int | None = None,
                            vocab: int | None = None, ulysses: int = 1, limit: int | None = None) -> list[int]:
    """Tensor-parallel degrees (up to ``limit``, default the heads) a model's sizes allow with ``ulysses``: each
    rank whole query heads (at least ``ulysses`` of them, which Ulysses then deals), kv heads that fit
    (:func:`kv_heads_fit`), whole MLP columns and an equal vocabulary slice. A size given as None is not known
    to the caller and not counted."""
    top = limit if limit is not None else heads
    splits = [n for n in (intermediate, vocab) if n is not None]
    return [t for t in range(1, top + 1) if heads % t == 0 and all(n % t == 0 for n in splits)
            and (kv_heads is None or kv_heads_fit(kv_heads, t)) and heads // t >= ulysses]


# what each size tensor parallelism splits is called (keyed by its config.json field)
TP_SIZE_NAMES = {"num_attention_heads": "query heads", "intermediate_size": "MLP intermediate size",
                 "vocab_size": "vocabulary", "num_key_value_heads": "kv heads"}


def tensor_parallel_misfits(tp: int, *, heads: int, kv_heads: int | None = None, intermediate: int | None = None,
                            vocab: int | None = None) -> dict[str, int]:
    """The sizes ``tp`` does not split into whole, equal parts, by config.json field (in :data:`TP_SIZE_NAMES`'s
    order): the query heads, the MLP's columns and the vocabulary divided by tp, the kv heads divided by tp or
    dividing it (replicated over the group). A size given as None is not checked. The one rule the job, the runtime
    and the planner apply (``check_tensor_parallel_sizes``, ``seqmesh.planner.tensor_parallel``)."""
    sizes = {"num_attention_heads": heads, "intermediate_size": intermediate, "vocab_size": vocab}
    bad = {k: v for k, v in sizes.items() if v is not None and v % tp}
    if kv_heads is not None and not kv_heads_fit(kv_heads, tp):
        bad["num_key_value_heads"] = kv_heads
    return bad


def check_tensor_parallel_sizes(tp: int, ulysses: int, *, heads: int, kv_heads: int | None = None,
                                intermediate: int | None = None, vocab: int | None = None) -> None:
    """Raise a ValueError naming tp, the sizes it does not fit and the degrees that would, for the job (before any
    mesh or model exists), the runtime and the planner alike. A size given as None is not checked (the caller
    does not know it: ``resolve_degrees`` knows only the heads)."""
    if tp == 1:
        return
    shape = dict(heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=vocab)
    fitting = ", ".join(map(str, tensor_parallel_degrees(**shape)[:8]))
    if tp > heads:  # before anything divides the heads by tp (0 heads a rank)
        raise ValueError(f"tp={tp} is more than the model's {heads} query heads (num_attention_heads): each tensor-parallel "
                         f"rank holds whole heads, at least one. Degrees that fit the model: {fitting}.")
    bad = tensor_parallel_misfits(tp, heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=vocab)
    if bad:
        listed = ", ".join(f"{TP_SIZE_NAMES[k]} ({k}) = {v}" for k, v in bad.items())
        raise ValueError(f"tp={tp} does not fit the model's {listed}: each tensor-parallel rank must hold whole "
                         f"heads (kv heads divided by tp, or dividing it), MLP columns and an equal vocabulary slice. "
                         f"Degrees that fit them all: {fitting}.")
    if heads // tp < ulysses:
        options = ", ".join(map(str, tensor_parallel_degrees(**shape, ulysses=ulysses))) or "none"
        raise ValueError(f"tp={tp} x ulysses={ulysses} needs at least one query head per rank, but the model has "
                         f"{heads} query heads: each tensor-parallel rank keeps {heads // tp} and Ulysses deals them over "
                         f"{ulysses} ranks. Lower ulysses to {heads // tp} or less (the ring takes the rest), or use a tp "
                         f"that leaves {ulysses} heads a rank: {options}.")


def resolve_degrees(world: int, *, ulysses: Degree = "auto", ring: Degree = "auto", dp: Degree = "auto",
                    dp_replicate: int = 1, q_heads: int | None = None, ranks_per_node: int | None = None,
                    seq_len: int | None = None, tp: int = 1) -> tuple[int, int, int]:
    """``(ulysses, ring, dp_shard)`` for ``world`` ranks, ``dp_replicate`` replicas of ``dp_shard x ring x
    ulysses x tp``; raises a ValueError that names the degrees that would work.

    ``tp`` (tensor parallelism, innermost) is taken first: the other degrees share ``world / tp`` ranks,
    a node holds ``ranks_per_node / tp`` Ulysses ranks, and each Ulysses group deals ``q_heads / tp`` heads.

    ``auto``: with both sequence degrees given, data parallelism takes the ranks left; otherwise dp is 1
    unless given, and Ulysses fills a node (``ranks_per_node``, default the world) up to the query heads
    while the ring takes the rest. ``q_heads`` and ``seq_len``, when given, are checked: at least one
    query head and one token per rank of the sequence group."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: the tensor-parallel degree is a positive number of ranks (1: none).")
    if world % (tp * dp_replicate):
        raise ValueError(f"tp={tp} x dp_replicate={dp_replicate} does not divide the {world} ranks; choose a tp that "
                         f"divides {world // dp_replicate if world % dp_replicate == 0 else world}.")
    if q_heads is not None:  # tp at or above the heads, before they are divided by it
        check_tensor_parallel_sizes(tp, ulysses if isinstance(ulysses, int) else 1, heads=q_heads)
    world //= tp
    model_heads, q_heads = q_heads, q_heads // tp if q_heads is not None else None
    ranks_per_node = max(ranks_per_node // tp, 1) if ranks_per_node is not None else None
    per_replica, rem = divmod(world, dp_replicate)
    if rem:
        raise ValueError(f"dp_replicate={dp_replicate} does not divide the {world} ranks.")
    fixed = {k: int(v) for k, v in (("ulysses", ulysses), ("ring", ring), ("dp", dp)) if v != "auto"}
    for name, value in fixed.items():
        if value < 1:
            raise ValueError(f"{name}={value}: a degree is a positive number of ranks, or auto.")
    dp_shard = fixed.get("dp", 1 if "ulysses" not in fixed or "ring" not in fixed else 0)
    if not dp_shard:  # both sequence degrees fixed: data parallelism takes what is left
        dp_shard, rem = divmod(per_replica, fixed["ulysses"] * fixed["ring"])
        if rem or dp_shard < 1:
            raise ValueError(f"ulysses={fixed['ulysses']} x ring={fixed['ring']} does not divide the {per_replica} "
                             f"ranks per replica; choose degrees whose product divides {per_replica}.")
    sp, rem = divmod(per_replica, dp_shard)
    if rem:
        raise ValueError(f"dp={dp_shard} does not divide the {per_replica} ranks per replica.")
    heads = q_heads if q_heads is not None else sp
    if "ulysses" in fixed:
        u = fixed["ulysses"]
    elif "ring" in fixed:
        u = sp // fixed["ring"]
    else:  # Ulysses inside a node, as wide as the heads allow; the ring takes the rest
        node = max(ranks_per_node if ranks_per_node is not None else world, 1)
        u = max(d for d in range(1, sp + 1) if sp % d == 0 and d <= heads and d <= node)
    r = fixed.get("ring", sp // max(u, 1))
    if u * r != sp:
        raise ValueError(f"ulysses={u} x ring={r} = {u * r} but the sequence group has {sp} ranks "
                         f"({world} ranks / dp {dp_shard} / dp_replicate {dp_replicate}).")
    if u > heads and model_heads is not None:
        check_tensor_parallel_sizes(tp, u, heads=model_heads)  # under TP: tp x ulysses named against the heads
    if u > heads:
        options = ", ".join(f"ulysses={a} ring={b}" for a, b in workable_degrees(heads, sp))
        raise ValueError(f"the model has {heads} query heads, too few for ulysses={u}; with {sp} sequence "
                         f"ranks use one of: {options}.")
    if seq_len is not None and seq_len < sp:
        raise ValueError(f"seq_len={seq_len} is smaller than the sequence degree {sp}; every rank needs a token.")
    return u, r, dp_shard


@dataclass(frozen=True)
class Degrees:
    """How the GPUs are split, as the planner compares them: ``tp`` tensor-parallel ranks inside each of the
    ``ulysses x ring`` sequence ranks (``seqmesh.tensor_parallel``), ``dp_shard`` groups of them. World rank =
    ``tp_rank + T*(ulysses_rank + U*(ring_rank + R*dp_rank))``: TP innermost, then Ulysses, ring, data-parallel.
    ``ep``: a mixture-of-experts layer's routed experts split over ``ep`` ranks that hold different tokens (the
    innermost ``ep`` of the ``dp_shard x ring x ulysses`` batch ranks, folded as Megatron does: attention keeps its
    groups), each expert sharded by FSDP over the ``fsdp_group / ep`` ranks holding it (1: no expert parallelism)."""

    ulysses: int
    ring: int
    dp_shard: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("ulysses", "ring", "dp_shard", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")

    @property
    def sp(self) -> int:
        """GPUs that share one sequence: ulysses x ring x tp."""
        return self.ulysses * self.ring * self.tp

    @property
    def gpus(self) -> int:
        return self.ulysses * self.ring * self.dp_shard * self.tp

    @property
    def fsdp_group(self) -> int:
        """Ranks FSDP shards the (TP-local) parameters over: dp_shard x ring x ulysses."""
        return self.dp_shard * self.ulysses * self.ring

    @property
    def runs_on_seqmesh(self) -> bool:
        """Every layout the planner lists runs on seqmesh (tensor parallelism included: it runs inside the sequence mesh)."""
        return True

    def label(self) -> str:
        tp = f" x TP{self.tp}" if self.tp > 1 else ""
        ep = f" x EP{self.ep}" if self.ep > 1 else ""
        return f"U{self.ulysses} x R{self.ring}{tp} x DP{self.dp_shard}{ep}"

    def as_dict(self) -> dict[str, int]:
        """The degrees by name; ``ep`` only where experts are split (a layout without it reads as before)."""
        out = {"ulysses": self.ulysses, "ring": self.ring, "dp_shard": self.dp_shard, "tp": self.tp}
        return out | ({"ep": self.ep} if self.ep > 1 else {})
