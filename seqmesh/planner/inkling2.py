"""An Inkling 2 layer (the shape: :mod:`seqmesh.model.inkling`) as ``seqmesh.hf.inkling2`` runs it: Inkling's layer
(:class:`.relative_attention.RelativeAttention`: the same gathers, the same blocks of queries over the row) with what
Inkling 2 adds, which keeps far more a token in float32 (counted against a rehearsal's saved tensors, layer by
layer, within 1%):

- **depth attention**: each of a layer's two (one in the first layer) normalizes the stack of block states and the
  partial one in float32 and attends over it, keeping the stack and its normed copy (``2 x 4 s E`` bytes for a
  stack of ``s``) and its output (``4 q E`` for ``q`` queries: three before a full layer's attention);
- **norms**: a full layer's attention has three (its queries', keys' and values' inputs), each keeping its float32
  normalized input and its output in the compute dtype;
- **projections**: the queries' and the relative states' learned scale and clip in float32 (two float32 copies
  each beside the compute-dtype result), the keys' clip and the values' RMS norm in float32, the sink logits;
  ``o_proj``'s gate (its float32 sigmoid and the attention's output in float32);
- **convolutions**: a sliding layer's key and value convolutions static (``K`` float32 copies of their input, as
  Inkling's), a full layer's dynamic (its lagged windows and their per-token taps, ``2 K`` copies each);
- **experts**: the float32 router's input and scores, and per routed slot its input, its gate and up products, their
  soft-capped SwiGLU in float32 (six ``I``-wide float32 tensors) and its output.

Its working set in backward is a block's, as Inkling's, with the sink's float32 column, a third compute-dtype copy
of the pairs (the probabilities cut from beside the sink column) and the gradients of block states it holds; or,
first of its backward, its last convolution's. Checkpointing keeps, besides each layer's input, each block's stack of
states once (every layer of the block takes the same tensor): :mod:`.depth_states`.

Inkling2-Loop's looped layers, called again in each pass after the first, are a kind of their own (``gated``): their
four message gates keep their float32 tensors, and a gated sliding layer's attention has three norms as a full one.

An Inkling or Inkling 2 model's layer kinds (:func:`relative_layer_kinds`) and, without checkpointing, what its
layers keep (:func:`layers_saved_bytes`) are made here, above both layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..model.inkling import FULL, SLIDING
from ..rules.degrees import Degrees
from .activations import tokens
from .depth_states import F32, depth_bytes
from .relative_attention import INT64, RelativeAttention
from .workload import Workload


@dataclass(frozen=True)
class Inkling2Layer(RelativeAttention):
    """An Inkling 2 layer of ``kind`` over the whole sequence group: what differs from Inkling's; ``gated``: an
    Inkling2-Loop looped layer's call after the first pass, its inputs mixed with messages through its four gates."""

    gated: bool = False

    def _macs(self) -> int:
        """Inkling's, with ``o_proj``'s gate, the sink logits, a full layer's dynamic taps and the message gates."""
        m = self.work.model
        h, hk, d = self._heads()
        taps = m.hidden * 2 * hk * m.inkling.kernel if self.kind == FULL else 0
        gates = 4 * 4 * m.hidden * m.inkling.gate_rank if self.gated else 0
        return super()._macs() + m.hidden * (h * d + h) + taps + gates

    def _stacks(self) -> tuple[int, int]:
        return self.work.model.inkling.stacks(self.kind, self.gated)

    def _gate_bytes(self) -> int:
        """Bytes a token keeps for one message gate (a ``gated`` call's): the message in float32, its two tanh gates,
        ``1 - forget`` and its output (five float32 tensors of ``E``: the norm after it keeps the output), the normed
        pair cast to the compute dtype for its down projection (``2E``) and that projection's float32 output
        (``r``)."""
        m = self.work.model
        return 5 * F32 * m.hidden + 2 * self.work.act_bytes * m.hidden + F32 * m.inkling.gate_rank

    def _experts_bytes(self) -> int:
        """Bytes a token's experts keep: the router's float32 input and scores, and each of its ``k`` slots'
        input, gate and up products, six float32 ``I``-wide tensors of the soft-capped SwiGLU and its output."""
        m, e = self.work.model, self.work.act_bytes
        k, i = m.experts_per_token or 1, m.intermediate
        return F32 * (m.hidden + m.experts) + k * (e * m.hidden + 3 * e * i + 6 * F32 * i + 3 * INT64)

    def _attention_bytes(self) -> int:
        """Bytes a token keeps from its attention's norms to its blocks' inputs (module docstring), the row apart."""
        m, e, ink = self.work.model, self.work.act_bytes, self.work.model.inkling
        h, hk, d = self._heads()
        norms = (3 if self.kind == FULL or self.gated else 1) * (F32 + e) * m.hidden  # a gated sliding layer's three
        gates = 3 * self._gate_bytes() if self.gated else 0  # the queries', keys' and values' inputs
        scaled = (2 * F32 + e) * h * (d + ink.d_rel)  # the queries and the relative states
        convs = (2 if self.kind == FULL else 1) * ink.kernel * 2 * hk * d * F32
        clips = 2 * hk * d * F32
        return norms + gates + scaled + e * h * ink.extent(self.kind) + convs + clips + e * h  # profiles, sinks

    def _after_blocks(self) -> int:
        """Bytes a token keeps for what runs after the blocks in forward (and so before them in backward):
        ``o_proj``'s gate, the two convolutions of ``E`` channels, the second norm, the depth attention before the
        MLP, the experts."""
        m, e, ink = self.work.model, self.work.act_bytes, self.work.model.inkling
        h, _, d = self._heads()
        gate = 2 * F32 * h * d + e * h * d
        depth = depth_bytes(self.work, self._stacks()[1], 1)
        return (gate + 2 * ink.kernel * m.hidden * F32 + (F32 + e) * m.hidden + depth + self._experts_bytes()
                + (self._gate_bytes() if self.gated else 0))  # the MLP's message gate

    def saved_bytes(self) -> int:
        """Bytes the layer keeps for backward (module docstring): a token's depth attention before the attention,
        the attention's, and what runs after its blocks; the row's keys and values."""
        w, m, e = self.work, self.work.model, self.work.act_bytes
        _, hk, d = self._heads()
        before = depth_bytes(w, self._stacks()[0], m.inkling.depth_queries(self.kind))
        return tokens(w, self.layout) * (before + self._attention_bytes() + self._after_blocks()) \
            + 2 * self._row() * hk * d * e

    def backward_bytes(self) -> int:
        """The larger of the layer's two moments in backward beyond what it keeps: its blocks' (:meth:`_block_bytes`)
        and, first of its backward, the convolution after its MLP's: ``2 K`` float32 tensors of ``E`` a token (the
        gradient through the ``1 / sqrt(K + 1)`` scale, the halo's lags and their sum)."""
        return max(self._block_bytes(), self._conv_bytes())

    @property
    def backward_op(self) -> str:
        return "relative attention block" if self._block_bytes() >= self._conv_bytes() else "short convolution"

    def _conv_bytes(self) -> int:
        """The last convolution's backward (:meth:`backward_bytes`)."""
        m = self.work.model
        return tokens(self.work, self.layout) * 2 * m.inkling.kernel * m.hidden * F32

    def _block_bytes(self) -> int:
        """Peak bytes of one block beyond what the layer keeps, in its backward (at its softmax's), as Inkling's
        (:meth:`RelativeAttention.backward_bytes`) with a third compute-dtype copy of the pairs and a fourth mask;
        no log-scaled bias moment (Inkling 2 scales the relative states, not their profiles)."""
        w, m, e = self.work, self.work.model, self.work.act_bytes
        h, hk, d = self._heads()
        t, extent = tokens(w, self.layout), m.inkling.extent(self.kind)
        pairs = w.batch * self._queries() * h * w.seq_len
        repeated = 2 * w.batch * h * w.seq_len * d * e
        block = pairs * (3 * e + 2 * F32) + self._queries() * w.seq_len * (2 * INT64 + 4)
        summed = t * h * (extent + d) * e
        peak = repeated + block + summed + 2 * self._row() * hk * d * e + t * self._stack_gradients()
        return max(0, peak - t * self._after_blocks())

    def _stack_gradients(self) -> int:
        """Bytes a token holds of block states' gradients in a layer's blocks (the compute dtype): the stack's
        before its attention, from the depth attention before its MLP, and, above the first layer, the final
        stack's, from the loss's backward, whose views the layers' block states take as their gradients."""
        m, ink = self.work.model, self.work.model.inkling
        final = ink.entries(m.layers) + 1 if ink.planned_layer != 0 else 0
        return self.work.act_bytes * m.hidden * (self._stacks()[0] + final)


def relative_layer_kinds(work: Workload, layout: Degrees) -> list[tuple[RelativeAttention, int]]:
    """An Inkling (:class:`.relative_attention.RelativeAttention`) or Inkling 2 (:class:`Inkling2Layer`) model's layers
    by kind, with how many calls a step makes of each (Inkling2-Loop's looped layers after the first pass as gated
    kinds)."""
    ink = work.model.inkling
    if not ink.second:
        return [(RelativeAttention(work, layout, kind), ink.count(kind)) for kind in (SLIDING, FULL) if ink.count(kind)]
    plain = [(Inkling2Layer(work, layout, kind), ink.count(kind)) for kind in (SLIDING, FULL) if ink.count(kind)]
    return plain + [(Inkling2Layer(work, layout, kind, gated=True), ink.gated_calls(kind)) for kind in (SLIDING, FULL)
                    if ink.gated_calls(kind)]


def layers_saved_bytes(work: Workload, layout: Degrees, count: int) -> int:
    """Bytes the first ``count`` layers of an Inkling model keep without checkpointing: each by its kind (Inkling
    2's with the stacks of block states at its own index)."""
    ink = work.model.inkling
    calls = [(index, kind, False) for index, kind in enumerate(ink.kinds[:count])]
    if count >= len(ink.kinds):  # Inkling2-Loop's passes after the first
        looped = range(ink.loop_start, min(ink.loop_end, len(ink.kinds)))
        calls += [(i, ink.kinds[i], True) for i in looped] * (ink.passes - 1) if ink.gate_rank else []
    total = 0
    for index, kind, gated in calls:
        at = replace(work, model=replace(work.model, inkling=replace(ink, planned_layer=index)))
        total += (Inkling2Layer(at, layout, kind, gated) if ink.second else RelativeAttention(at, layout, kind)
                  ).saved_bytes()
    return total
