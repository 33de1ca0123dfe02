"""What a layer whose mixer is a diagonal recurrence costs on the busiest rank, as the runtime runs it: RecurrentGemma's
recurrent block (``seqmesh.hf.rg_lru``; shape from :mod:`seqmesh.model.recurrent_gemma`) and Jamba's Mamba (v1) mixer
(``seqmesh.hf.mamba``; :mod:`seqmesh.model.jamba`). Each runs its projections on the local tokens, a depthwise conv
of width ``K`` and the recurrence (``seqmesh.linear_attention.selective_scan.diagonal_scan``) over them, and two
collectives, each an all-gather forward and its reduce-scatter backward (the same bytes): the conv's halo (``K - 1``
rows of the conv's channels before each run the rank holds, :func:`seqmesh.linear_attention.choice.halo_bytes`) and
every run's ``[S_0 | T]`` (:func:`seqmesh.linear_attention.selective_scan.diagonal_state_bytes`, in float32, float64
for float64 inputs), both the runtime's own formulas. There is no other design. The conv waits for its halo and the
states' read for theirs, so the layer's time is :func:`.layer_cost.serial_layer_seconds`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..linear_attention.choice import halo_bytes
from ..linear_attention.selective_scan import diagonal_state_bytes
from ..linear_attention.passing import rerun_state_bytes
from ..model.hybrid_shape import MAMBA1, RG_LRU, RWKV, XLSTM
from ..rules.degrees import Degrees
from .activations import decoder_layer_saved_bytes, norm_saved, tokens
from .hardware import HardwareSpec
from .layer_cost import phases, serial_layer_seconds
from .network import axis_groups, gather_seconds, link_name
from .traffic import Collective, RankTraffic, dtype_bytes
from .workload import Workload

HALO, STATES = "rg_lru_halo_gather", "rg_lru_state_gather"
RWKV_SHIFT, RWKV_STATES = "rwkv_shift_gather", "rwkv_state_gather"
MLSTM_STATES = "mlstm_state_gather"
MAMBA_HALO, MAMBA_STATES = "mamba_halo_gather", "mamba_state_gather"
SCAN_FLOPS = 12  # elementwise operations a state value and token of the gates' tail and the two-level scan (an estimate)
BACKWARD_TENSORS = 4  # |X|-sized gradients the scan's backward holds at once (decay, input, chunk states, states)


@dataclass(frozen=True)
class _DiagonalLayer:
    """The costs every diagonal-recurrence layer shares; a subclass names its mixer, its collectives' keys, its conv's
    and its state's widths, its per-token multiply-adds and what it saves."""

    work: Workload
    layout: Degrees
    ffn: str = "mlp"
    beside_attention: bool = False  # Zamba's hybrid layer: the mixer alone, its norm with the shared block's attention

    # a subclass's: MIXER (its hybrid block name), KEYS (halo, states), kernel(), conv_channels(), state_values()
    # (|X|, the recurrence's values a token), macs() (a token's multiply-adds at the matmul rate, the conv's included)
    # and saved_per_token(e, s) (the mixer's bytes a token, norms and feed-forward aside)
    MIXER = ""
    KEYS = ("", "")

    def params(self) -> int:
        m = self.work.model
        if self.beside_attention:
            return m.hybrid.layer_params((self.MIXER, ""), m.hidden, m.attention_params) - m.hybrid.norms * m.hidden
        return m.hybrid.layer_params((self.MIXER, self.ffn), m.hidden, m.attention_params)

    def _state_bytes(self) -> int:
        return 8 if dtype_bytes(self.work.torch_dtype) == 8 else 4

    def sent(self) -> dict[str, int]:
        """Bytes each rank sends forward in each all-gather (its reduce-scatter the same backward)."""
        w, lay, (halo, states) = self.work, self.layout, self.KEYS
        where = dict(batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout)
        kernel = self.kernel()
        return {halo: halo_bytes(self.conv_channels(), kernel, dtype_bytes=dtype_bytes(w.torch_dtype), **where),
                states: diagonal_state_bytes(self.state_values(), state_bytes=self._state_bytes(), **where)}

    def ranks(self) -> list[RankTraffic]:
        """Each sequence rank's traffic in one layer: the two all-gathers forward, their reduce-scatters backward."""
        lay, sent = self.layout, self.sent()
        calls = tuple(Collective(kind, phase, 1, sent[key]) for key in self.KEYS
                      for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def traffic(self) -> dict[str, dict[str, int]]:
        """Each collective's bytes by phase, on the busiest rank (each rank sends the same here)."""
        sent = self.sent()
        return phases(dict(sent), dict(sent), self.work.checkpointing)

    def links(self, hw: HardwareSpec) -> dict[str, str]:
        link = link_name(hw, axis_groups(self.layout, "sequence")[:1])
        return {key: link for key in self.KEYS}

    def saved_bytes(self) -> int:
        """Bytes saved for backward: per token the norms (:meth:`norms`), the mixer's (:meth:`saved_per_token`), the
        feed-forward's."""
        w, m = self.work, self.work.model
        e = w.act_bytes
        if self.beside_attention:  # the whole Zamba hybrid layer: the attention layer's (its norm included) beside it
            return (tokens(w, self.layout) * self.saved_per_token(e, self._state_bytes())
                    + decoder_layer_saved_bytes(w, self.layout))
        per_token = (self.norms() * norm_saved(m, e, w.efficient_norm) + self.saved_per_token(e, self._state_bytes())
                     + e * m.hybrid.ffn(self.ffn).kept)
        return tokens(w, self.layout) * per_token

    def norms(self) -> int:
        """RMSNorms of the hidden size a layer."""
        return 2

    def backward_bytes(self) -> int:
        """Bytes the layer's backward holds at once beyond what it saved (:func:`.memory.activation_memory` adds the
        largest layer kind's): the gradients of the recurrence's decay, input, chunk states and states, four tensors
        of ``|X|`` values a token in its state dtype (measured on the CPU: tests/planner/test_planner_measured.py)."""
        return tokens(self.work, self.layout) * BACKWARD_TENSORS * self.state_values() * self._state_bytes()

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` seconds of one layer: the projections, the conv (at the matmul rate:
        an upper bound on its speed) and the feed-forward, and the recurrence (:data:`SCAN_FLOPS` a state value) on
        the local tokens, backward twice; the two gathers, which nothing overlaps."""
        work, m = self.work, self.work.model
        rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
        local = tokens(work, self.layout)
        fwd = (2 * local * (self.macs() + m.hybrid.ffn(self.ffn).macs) + SCAN_FLOPS * local * self.state_values()) / rate
        group = axis_groups(self.layout, "sequence")[0]
        comm = sum(gather_seconds(sent, hw, group) for sent in self.sent().values())  # each way, one call each
        return serial_layer_seconds(self, hw, fsdp_ranks, (fwd, 2 * fwd), (comm, comm))


@dataclass(frozen=True)
class RgLruLayer(_DiagonalLayer):
    """A RecurrentGemma layer whose temporal block is recurrent, with its MLP and two RMSNorms."""

    MIXER = RG_LRU
    KEYS = (HALO, STATES)

    def kernel(self) -> int:
        return self.work.model.hybrid.rg_lru.conv

    def conv_channels(self) -> int:
        return self.work.model.hybrid.rg_lru.width

    def state_values(self) -> int:
        return self.work.model.hybrid.rg_lru.width

    def macs(self) -> int:
        block = self.work.model.hybrid.rg_lru
        return block.matmul_params(self.work.model.hidden) + block.width * block.conv

    def saved_per_token(self, e: int, s: int) -> int:
        """The block's input, linear_y's output before and after its activation, linear_x's and the conv's outputs,
        the two gates, the decay, the normaliser and the gated input, linear_out's input; the recurrence's decay,
        input and states and the scan's chunk terms in its state dtype (checked against tracked CPU peaks,
        tests/planner/test_planner_measured.py: within 3% of three RecurrentGemma runs)."""
        w = self.work.model.hybrid.rg_lru.width
        return e * (self.work.model.hidden + 10 * w) + 6 * s * w


@dataclass(frozen=True)
class Mamba1Layer(_DiagonalLayer):
    """A Jamba layer whose mixer is Mamba (v1), with its MLP or MoE block and two RMSNorms; a pure Mamba's or
    FalconMamba's, its mixer and one RMSNorm; Zamba's, its multi-head mixer and one RMSNorm (``beside_attention``: a
    hybrid layer's mixer, its norm counted with the shared block's attention)."""

    MIXER = MAMBA1
    KEYS = (MAMBA_HALO, MAMBA_STATES)

    def kernel(self) -> int:
        return self.work.model.hybrid.mamba1.conv

    def conv_channels(self) -> int:
        return self.work.model.hybrid.mamba1.inner

    def state_values(self) -> int:
        mixer = self.work.model.hybrid.mamba1
        return mixer.inner * mixer.state

    def macs(self) -> int:
        mixer = self.work.model.hybrid.mamba1
        return mixer.matmul_params(self.work.model.hidden) + mixer.inner * mixer.conv

    def saved_per_token(self, e: int, s: int) -> int:
        """in_proj's input and output (x | z), the conv's output, x_proj's output and the norms' of dt, B and C,
        dt, the gated output and out_proj's input; the scan's :data:`SCAN_SAVED` tensors of ``inner x state`` values in
        its state dtype, and across ranks two more, the state pass's read-in (each token's decay since its run's start
        and the corrected states). Checked against tracked CPU peaks (tests/planner/test_planner_measured.py: within
        2.1% of three Jamba runs with checkpointing, and of pure Mamba's with and without); without checkpointing the
        layers below the one in backward count as the largest kind, a Mamba layer, which over-estimates a Jamba. The
        split between what a layer keeps and what its backward holds was measured on pure Mamba without checkpointing,
        where the layers below keep theirs: one, two and three layers, at two state sizes and two widths, a layer
        keeping one ``inner x state`` tensor and six ``inner`` ones more than the scan's six (:data:`MAMBA_SCAN_SAVED`,
        :data:`MAMBA_WIDE`), its backward that much less (:data:`MAMBA_BACKWARD`)."""
        mixer = self.work.model.hybrid.mamba1
        i, n = mixer.inner, mixer.state
        tensors = MAMBA_SCAN_SAVED + (2 if self.layout.ulysses * self.layout.ring > 1 else 0)
        # its output (Zamba's: each head's), and the norms' (pure Mamba: none)
        x_proj = (2 if mixer.norms else 1) * mixer.heads * (mixer.dt_rank + 2 * n)
        return e * (self.work.model.hidden + 6 * i + x_proj) + s * (2 + MAMBA_WIDE) * i + tensors * s * i * n

    def backward_bytes(self) -> int:
        """What the layer's backward holds beyond what it saved: :data:`MAMBA_BACKWARD` ``inner x state`` tensors, less
        :data:`MAMBA_WIDE` ``inner``-wide ones, in the state dtype (measured with :meth:`saved_per_token`, below)."""
        i, n = self.work.model.hybrid.mamba1.inner, self.work.model.hybrid.mamba1.state
        return tokens(self.work, self.layout) * self._state_bytes() * i * max(0, MAMBA_BACKWARD * n - MAMBA_WIDE)

    def norms(self) -> int:
        return self.work.model.hybrid.norms


SCAN_SAVED = 6  # inner x state tensors the scan keeps a token: decay, input, chunk states, their decays, states, read
# a Mamba layer as measured (Mamba1Layer.saved_per_token): inner x state tensors it keeps a token, inner-wide float32
# ones beside them, and the inner x state tensors its backward holds beyond what it keeps (less the inner-wide ones)
MAMBA_SCAN_SAVED, MAMBA_WIDE, MAMBA_BACKWARD = SCAN_SAVED + 1, 6, BACKWARD_TENSORS - 1


@dataclass(frozen=True)
class RwkvLayer(_DiagonalLayer):
    """An RWKV-4 block: its time mix (``seqmesh.hf.rwkv``), its channel mix (the feed-forward) and two LayerNorms. Each
    mix shifts its input by a token (a halo of one row of the hidden size, one all-gather each); the time mix's WKV
    recurrence passes every run's ``[a0 | b0 | p0 | log T]`` (four values a channel) in one all-gather
    (:func:`seqmesh.linear_attention.passing.rerun_state_bytes`), and each run that receives a state runs again from
    it: twice the recurrence on those runs, whose values are kept for backward twice."""

    MIXER = RWKV
    KEYS = (RWKV_SHIFT, RWKV_STATES)
    SHIFTS = 2  # the time mix's and the channel mix's token shifts, each its own halo gather
    RUN_VALUES = 4  # a run's [a0 | b0 | p0 | log T] a channel

    def kernel(self) -> int:
        return 2

    def conv_channels(self) -> int:
        return self.work.model.hidden

    def state_values(self) -> int:
        return self.work.model.hybrid.rwkv.attention

    def macs(self) -> int:
        return self.work.model.hybrid.rwkv.matmul_params(self.work.model.hidden)

    def sent(self) -> dict[str, int]:
        """Bytes each rank sends forward in the two shifts' all-gathers and the states' (reduce-scatters backward)."""
        w, lay = self.work, self.layout
        where = dict(batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout)
        shift = halo_bytes(self.conv_channels(), self.kernel(), dtype_bytes=dtype_bytes(w.torch_dtype), **where)
        states = rerun_state_bytes(self.RUN_VALUES * self.state_values(), state_bytes=self._state_bytes(), **where)
        return {RWKV_SHIFT: self.SHIFTS * shift, RWKV_STATES: states}

    def ranks(self) -> list[RankTraffic]:
        lay, sent = self.layout, self.sent()
        calls = tuple(Collective(kind, phase, n, sent[key] // n)
                      for key, n in ((RWKV_SHIFT, self.SHIFTS), (RWKV_STATES, 1))
                      for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """As the other diagonal layers', the recurrence twice (the first pass and the reruns), three gathers."""
        work, m = self.work, self.work.model
        rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
        local = tokens(work, self.layout)
        passes = 2 if self.layout.ulysses * self.layout.ring > 1 else 1
        fwd = (2 * local * (self.macs() + m.hybrid.ffn(self.ffn).macs)
               + passes * SCAN_FLOPS * local * self.state_values()) / rate
        group = axis_groups(self.layout, "sequence")[0]
        sent = self.sent()
        comm = (self.SHIFTS * gather_seconds(sent[RWKV_SHIFT] // self.SHIFTS, hw, group)
                + gather_seconds(sent[RWKV_STATES], hw, group))
        return serial_layer_seconds(self, hw, fsdp_ranks, (fwd, 2 * fwd), (comm, comm))

    def saved_per_token(self, e: int, s: int) -> int:
        """The time mix's input and its three mixes, key's, value's and receptance's outputs, the sigmoid, the WKV
        output and output's input; the recurrence's per-token values in its state dtype (:data:`WKV_SAVED` a channel),
        twice where runs receive a state and run again."""
        h, a = self.work.model.hidden, self.state_values()
        passes = 2 if self.layout.ulysses * self.layout.ring > 1 else 1
        return e * (4 * h + 6 * a) + passes * WKV_SAVED * s * a


WKV_SAVED = 7  # values a channel and token the WKV loop keeps for backward (measured: two RWKV lengths on one CPU rank)


@dataclass(frozen=True)
class XlstmLayer(_DiagonalLayer):
    """An xLSTM block: its mLSTM layer (``seqmesh.hf.xlstm``), its gated feed-forward and two RMSNorms. The memory
    passes every run's ``[C0 | n0 | m0 | F]`` (:attr:`seqmesh.model.hybrid_shape.XlstmShape.state_values`) in one
    all-gather (:func:`seqmesh.linear_attention.passing.rerun_state_bytes`; no conv, no token shift), and each run that
    receives a state runs again from it through the layer's own backend, as RWKV's: twice the memory's work on those
    runs, and its values kept twice."""

    MIXER = XLSTM
    KEYS = (MLSTM_STATES,)

    def state_values(self) -> int:
        return self.work.model.hybrid.xlstm.state_values

    def macs(self) -> int:
        return self.work.model.hybrid.xlstm.matmul_params(self.work.model.hidden)

    def memory_macs(self) -> int:
        """The chunkwise kernel's multiply-adds a token, every head (an estimate): its chunk's scores and their values
        (``chunk x (dk + dv)``), the memory's read and its write (``2 dk dv``)."""
        x = self.work.model.hybrid.xlstm
        dk, dv = x.qk // x.heads, x.v // x.heads
        return x.heads * (x.chunk * (dk + dv) + 2 * dk * dv)

    def _passes(self) -> int:
        return 2 if self.layout.ulysses * self.layout.ring > 1 else 1

    def sent(self) -> dict[str, int]:
        """Bytes each rank sends forward in the states' all-gather (its reduce-scatter the same backward)."""
        w, lay = self.work, self.layout
        where = dict(batch=w.batch, ulysses=lay.ulysses, ring=lay.ring, layout=w.layout)
        return {MLSTM_STATES: rerun_state_bytes(self.state_values(), state_bytes=self._state_bytes(), **where)}

    def ranks(self) -> list[RankTraffic]:
        lay, sent = self.layout, self.sent()
        calls = tuple(Collective(kind, phase, 1, sent[MLSTM_STATES])
                      for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")))
        return [RankTraffic(r % lay.ulysses, r // lay.ulysses, calls) for r in range(lay.ulysses * lay.ring)]

    def seconds(self, hw: HardwareSpec, fsdp_ranks: list[int]) -> dict[str, float]:
        """The projections, the feed-forward and the memory (twice on the runs that receive a state) at the matmul
        rate on the local tokens, backward twice; the one gather, which nothing overlaps."""
        work, m = self.work, self.work.model
        rate = hw.flops_for(work.dtype) * hw.matmul_efficiency
        local = tokens(work, self.layout)
        fwd = 2 * local * (self.macs() + m.hybrid.ffn(self.ffn).macs + self._passes() * self.memory_macs()) / rate
        group = axis_groups(self.layout, "sequence")[0]
        comm = gather_seconds(self.sent()[MLSTM_STATES], hw, group)
        return serial_layer_seconds(self, hw, fsdp_ranks, (fwd, 2 * fwd), (comm, comm))

    def saved_per_token(self, e: int, s: int) -> int:
        """The layer's input, and what the mLSTM layer keeps a token as measured (saved-tensor hooks on transformers'
        layer, float32, in chunkwise mode, at two lengths, varying each size in turn): 8.5 values a value channel, 5 a
        query/key channel, 2.5 a head and chunk position (the chunk's scores), 40 a head, in the state dtype (an upper
        bound under bf16, where the projections' outputs are half as wide); twice where runs receive a state and run
        again. The whole layer, with :meth:`backward_bytes`, is an estimate: against tracked one-rank CPU peaks of
        six xLSTM configs (hidden 128 and 256, feed-forward factors 2.667 and 5, 1,024 and 2,048 tokens) the
        predicted peak is 0.90x to 1.06x the measured one (docs/planner.md)."""
        x, h = self.work.model.hybrid.xlstm, self.work.model.hidden
        per_pass = s * (MLSTM_SAVED_V * x.v + MLSTM_SAVED_QK * x.qk + MLSTM_SAVED_CHUNK * x.heads * x.chunk
                        + MLSTM_SAVED_HEAD * x.heads) // 2
        return e * h + self._passes() * per_pass

    def backward_bytes(self) -> int:
        """The layer's backward beyond what it saved: :data:`MLSTM_BACKWARD` value channels a token in the state
        dtype (an estimate; :meth:`saved_per_token` says how far it is from tracked peaks)."""
        x = self.work.model.hybrid.xlstm
        return tokens(self.work, self.layout) * self._state_bytes() * MLSTM_BACKWARD * x.v


# what an mLSTM layer keeps a token, as twice the values (XlstmLayer.saved_per_token): a value channel, a query/key
# channel, a head and chunk position, a head
MLSTM_SAVED_V, MLSTM_SAVED_QK, MLSTM_SAVED_CHUNK, MLSTM_SAVED_HEAD = 17, 10, 5, 80
MLSTM_BACKWARD = 4  # values a value channel and token the backward holds at once (an estimate)
