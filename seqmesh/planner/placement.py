"""A workload placed on a layout: the sizes every formula of the planner reads, derived once per pair.

The planner evaluates each ``(Workload, Degrees)`` pair through dozens of formulas (memory, traffic, time, each layer
kind); each used to re-derive the padded length, the heads a rank deals and the parameters a TP rank holds.
:func:`placement` derives them once and caches the pair, so every formula reads the same numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

from ..model.shapes import ModelShape
from ..rules.degrees import Degrees
from ..rules.heads import HeadDeal
from ..rules.padding import padded_length
from .workload import Workload


def tp_heads(m: ModelShape, layout: Degrees) -> tuple[int, int]:
    """(query heads, kv heads) one TP rank projects (``tp`` divides both: the planner refuses other layouts)."""
    return m.heads // layout.tp, m.kv_heads // layout.tp


def ulysses_refusal(m: ModelShape, ulysses: int, tp: int) -> str | None:
    """Why ``ulysses`` cannot split ``m``'s heads (each of ``tp`` ranks keeps ``heads / tp``), or None: a model
    without attention (pure Mamba, RWKV) has none to split, its layers passing states over the whole sequence group
    whatever its split; otherwise at most one Ulysses rank a query head. The training and inference planners' rule."""
    if ulysses > 1 and m.hybrid is not None and not m.hybrid.attention_layers:
        return (f"ulysses {ulysses}: {m.name} has no attention layer whose heads Ulysses would split; its layers pass "
                "states over the whole sequence group, the same on any split of it: put the sequence degree on the "
                "ring")
    heads = m.fewest_heads // tp  # dots.llm3's sliding layers' own too (the runtime's check)
    if ulysses > heads:
        return (f"ulysses {ulysses} exceeds the {heads} query heads" + (f" each of the {tp} TP ranks keeps" if tp > 1
                                                                       else "") + "; put the rest on the ring")
    return None


def split_params(m: ModelShape, tp: int) -> dict[str, int]:
    """Parameters one TP rank holds before FSDP2 shards them: each projection, the embedding and the LM head
    ``1 / tp``; RMSNorm weights (and per-head q/k norms) whole on every TP rank. Keys: ``layer`` (one decoder
    layer; a Mamba2 hybrid's largest), ``root`` (final norm and LM head), ``embedding`` (0 when tied), ``total``,
    ``held``: Zamba's shared-block units, kept gathered across the layers that run them
    (:meth:`seqmesh.model.hybrid_shape.HybridShape.held_params`; 0 for another model); ``graded_layer`` and
    ``graded_total``: ``layer`` and ``total`` less what gets no gradient (TrOCR's cross-attention, never run)."""
    layer_split = m.attention_params + m.mlp_params
    head = m.vocab * m.hidden
    out = {"layer": -(-layer_split // tp) + m.norm_params + m.idle_params, "root": -(-head // tp) + m.hidden,
           "embedding": 0 if m.tie_embeddings else -(-head // tp)}
    # tp 1: every parameter (hybrid, gated or vision-language models have more than these units; TP refuses them)
    out["total"] = m.params if tp == 1 else m.layers * out["layer"] + out["root"] + out["embedding"]
    out["held"] = 0
    if m.hybrid is not None:  # a Mamba2 hybrid's layers differ: its largest (tp is 1); Zamba's shared-block units apart
        out["layer"] = m.hybrid.largest_unit(m.hidden, m.attention_params)
        out["held"] = m.hybrid.held_params(m.hidden, m.attention_params)
    out["graded_layer"] = out["layer"] - m.idle_params
    out["graded_total"] = out["total"] - m.layers * m.idle_params
    return out


@dataclass(frozen=True)
class Placement:
    """``work`` on ``layout``: each size below computed on first use, then kept."""

    work: Workload
    layout: Degrees

    @cached_property
    def padded(self) -> int:
        """The sequence padded for the layout, so that ``tp`` also divides each sequence rank's share."""
        w, lay = self.work, self.layout
        return padded_length(w.seq_len, lay.ulysses, lay.ring, w.layout, lay.tp)

    @cached_property
    def sequence_padded(self) -> int:
        """The sequence padded for ``ulysses x ring`` alone (the mixers, which tensor parallelism does not split)."""
        w, lay = self.work, self.layout
        return padded_length(w.seq_len, lay.ulysses, lay.ring, w.layout)

    @cached_property
    def sequence_share(self) -> int:
        """``L``: tokens of each sequence one sequence rank holds (its TP group together)."""
        return self.padded // (self.layout.ulysses * self.layout.ring)

    @cached_property
    def local_tokens(self) -> int:
        """Tokens of each sequence one GPU holds between the layers (``L / tp``)."""
        return self.padded // (self.layout.ulysses * self.layout.ring * self.layout.tp)

    @cached_property
    def heads(self) -> HeadDeal:
        """How Ulysses deals this TP rank's query and kv heads over its ranks."""
        return HeadDeal(*tp_heads(self.work.model, self.layout), self.layout.ulysses)

    @cached_property
    def split(self) -> dict[str, int]:
        """:func:`split_params` at this layout's ``tp``."""
        return split_params(self.work.model, self.layout.tp)


@functools.lru_cache(maxsize=4096)
def placement(work: Workload, layout: Degrees) -> Placement:
    """The one :class:`Placement` of ``work`` on ``layout`` (cached: every formula reads the same derived sizes)."""
    return Placement(work, layout)
