"""Diagonal linear recurrences, whole and with the sequence sharded over ``P = ring x ulysses`` ranks: Mamba's
(v1) selective scan and RecurrentGemma's RG-LRU are both one.

:func:`diagonal_scan` is the recurrence itself, elementwise over any trailing shape ``X``::

    h_t = exp(log_decay_t) h_{t-1} + inp_t        log_decay_t <= 0

restarting from zero (or a given state) at every segment start (packed documents, the layout's padding), in two
levels, stable in any dtype (no ``exp`` of a positive number): a token-by-token pass inside chunks of ``chunk``
tokens, all chunks at once from zero, then the chunks' states chained one chunk at a time and added back through
each token's decay since its chunk start. Mamba's scan is it with ``X = (C, N)``::

    log_decay_t[c, n] = dt_t[c] A[c, n],  inp_t[c, n] = dt_t[c] B_t[n] x_t[c],  y_t[c] = sum_n C_t[n] h_t[c, n]

and the RG-LRU with ``X = (C,)``, ``log_decay = log a_t`` and ``inp`` its gated, normalised input.

Sharded (:func:`state_passing_diagonal_scan`), the recurrence is affine in the state entering a run::

    S_out = T * S_in + S_0       T = exp(sum_run log_decay), elementwise
    h_t   = h_t(0) + exp(cum_t) S_in      cum_t = sum_{s <= t in run} log_decay_s

so, with no rank waiting for another: the conv with its halo (``halo.halo_causal_conv``, one all-gather,
done by the caller), the scan of the rank's runs from zero, then ``passing.pass_states`` with each run's
``[S_0 | T]`` (B, 2 X) in one all-gather and ``h += read(S_in)``. Traffic per layer and rank:
``(P - 1) R B 2 |X|`` values received (R runs per rank: 2 zigzag, 1 contiguous), whatever the length.
"""

from __future__ import annotations

import torch

from .choice import runs_and_tails
from .gated_delta import compute_dtype
from .halo import Placement
from .passing import pass_states, rerun_state_bytes

CHUNK = 32  # tokens per chunk of the two-level scan: about sqrt of the sequence lengths one rank holds


def _starts(bounds: tuple[int, ...], length: int, device: torch.device) -> torch.Tensor:
    """(L,) bool: the first token of every segment."""
    starts = torch.zeros(length, dtype=torch.bool, device=device)
    starts[list(bounds[:-1])] = True
    return starts


def diagonal_scan(log_decay: torch.Tensor, inp: torch.Tensor, bounds: tuple[int, ...],
                  initial: torch.Tensor | None = None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonal recurrence ``h_t = exp(log_decay_t) h_{t-1} + inp_t`` (elementwise) over every segment of
    ``bounds`` (0, ..., L), from zero or ``initial`` (B, S, *X) at each segment's start: ``log_decay`` / ``inp``
    (B, L, *X), ``log_decay <= 0`` -> every state (B, L, *X) and each segment's final state (B, S, *X), in float32
    for half-precision inputs, otherwise the inputs' dtype. Two levels, stable in any dtype (no ``exp`` of a
    positive number): token by token inside chunks of ``chunk`` tokens, all chunks at once from zero; then the
    chunks' states chained one chunk at a time and added back through each token's decay since its chunk start."""
    batch, length = inp.shape[:2]
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"segment bounds {bounds} must run from 0 to the sequence's {length} tokens.")
    dtype = compute_dtype(inp.dtype)
    log_decay, inp = log_decay.to(dtype), inp.to(dtype)
    tail = (1,) * (inp.dim() - 2)  # broadcasts a (L,) flag over (B, L, *X)
    decay = torch.exp(log_decay)
    starts = _starts(bounds, length, inp.device)
    first = list(bounds[:-1])
    if initial is not None:  # a segment's first token reads its entering state through its own decay
        inp = inp.index_add(1, torch.tensor(first, device=inp.device), decay[:, first] * initial.to(dtype))
    decay = decay * (~starts).to(dtype).view(1, length, *tail)  # nothing crosses a segment start

    chunks = -(-length // chunk)
    pad = chunks * chunk - length

    def to_chunks(t: torch.Tensor) -> torch.Tensor:  # (B, L, ...) -> (B, K, Q, ...)
        t = torch.nn.functional.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad)) if pad else t
        return t.reshape(batch, chunks, chunk, *t.shape[2:])

    # unbound once: indexing a step inside the loop would make backward fill a whole-size gradient per step
    decay_q, inp_q = to_chunks(decay).unbind(2), to_chunks(inp).unbind(2)  # Q x (B, K, *X)
    state, local = inp_q[0], [inp_q[0]]
    for q in range(1, chunk):  # 1. inside every chunk at once, from zero
        state = decay_q[q] * state + inp_q[q]
        local.append(state)
    local = torch.stack(local, dim=2)  # (B, K, Q, *X)
    # each token's decay since its chunk's start, zero once a segment started in between (or at the chunk's start)
    counts = torch.nn.functional.pad(torch.cumsum(starts.to(torch.int64), 0), (0, pad)).view(chunks, chunk)
    before = counts[:, :1] - torch.nn.functional.pad(starts.to(torch.int64), (0, pad)).view(chunks, chunk)[:, :1]
    open_ = (counts == before).to(dtype).view(1, chunks, chunk, *tail)  # (1, K, Q, 1...)
    cum = torch.exp(torch.cumsum(to_chunks(log_decay), dim=2)) * open_  # (B, K, Q, *X)

    through, leaving = cum[:, :, -1].unbind(1), local[:, :, -1].unbind(1)  # K x (B, *X)
    entering = [torch.zeros_like(leaving[0])]  # 2. the chunks' states, one chunk at a time
    for k in range(1, chunks):
        entering.append(through[k - 1] * entering[-1] + leaving[k - 1])
    states = local + cum * torch.stack(entering, dim=1)[:, :, None]  # (B, K, Q, *X)
    states = states.reshape(batch, chunks * chunk, *inp.shape[2:])[:, :length]  # (B, L, *X)
    return states, states[:, [e - 1 for e in bounds[1:]]]


def diagonal_state_bytes(channels: int, *, batch: int, ulysses: int, ring: int, layout: str,
                         state_bytes: int = 4) -> int:
    """Bytes each rank sends forward in :func:`state_passing_diagonal_scan`'s all-gather (its reduce-scatter the same
    backward) for a state of ``channels`` values (``|X|``): every run's ``[S_0 | T]``, ``(P - 1) x runs x B x 2 |X|``
    values, ``runs`` the busiest rank's (``choice.runs_and_tails``), whatever the sequence's length."""
    return rerun_state_bytes(2 * channels, batch=batch, ulysses=ulysses, ring=ring, layout=layout,
                             state_bytes=state_bytes)


def state_passing_diagonal_scan(log_decay: torch.Tensor, inp: torch.Tensor, place: Placement,
                                keep: dict | None = None) -> torch.Tensor:
    """The states of :func:`diagonal_scan` over the whole sequence at this rank's tokens (shard order, placed as
    ``place`` says): ``log_decay`` / ``inp`` (B, L, *X) -> states (B, L, *X), exactly what :func:`diagonal_scan`
    gives on the unsharded sequence. One all-gather forward of every run's [S_0 | T] over ``place.group``
    (T = exp(sum_run log_decay), elementwise), its reduce-scatter backward; each token then reads the state
    entering its run through its decay since the run's start. ``keep`` (a prefill's): ``keep["end"]``, the local
    index of the row's last real token where this rank holds it (None elsewhere), is given ``keep["state"]`` (B, *X),
    the state after it, on every rank (:func:`.passing.pass_states`)."""
    mine = place.mine
    batch, shape = inp.shape[0], inp.shape[2:]
    states, finals = diagonal_scan(log_decay, inp, mine.segment_bounds)  # from zero; S_0 (B, S, *X)
    log_decay = log_decay.to(states.dtype)
    transitions = torch.zeros_like(finals)  # T: zero for a segment that does not receive a state
    for segment in mine.incoming:
        a, e = mine.segment_bounds[segment], mine.segment_bounds[segment + 1]
        transitions[:, segment] = torch.exp(log_decay[:, a:e].sum(1))
    packed = torch.cat([finals.flatten(2), transitions.flatten(2)], dim=-1)  # (B, S, 2 X)

    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # (B, 2 X), (B, *X)
        s0, t = run.view(batch, 2, *shape).unbind(1)
        return t * state + s0

    def read(lift: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # (B, t, *X), (B, *X) -> (B, t, *X)
        return torch.exp(torch.cumsum(lift, dim=1)) * state[:, None]  # the run's decay up to t

    return pass_states(states, log_decay, packed, place, finals.new_zeros(batch, *shape), carry=carry, read=read,
                       keep=keep)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   bounds: tuple[int, ...], initial: torch.Tensor | None = None,
                   chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of every segment of ``bounds`` (0, ..., L): ``x`` (B, L, C), ``dt`` (B, L, C) after
    softplus, ``A`` (C, N) (negative), ``B`` / ``C`` (B, L, N); ``initial`` (B, S, C, N) the state entering each
    of the S segments (zero if None) -> ``y`` (B, L, C) without the skip ``D x``, and each segment's final
    state (B, S, C, N), in float32 for half-precision inputs, otherwise the inputs' dtype."""
    log_decay, inp = selective_terms(x, dt, A, B)
    states, finals = diagonal_scan(log_decay, inp, bounds, initial, chunk)
    return torch.einsum("blcn,bln->blc", states, C.to(states.dtype)), finals


def selective_terms(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan's ``log_decay = dt A`` and ``inp = dt x B`` (B, L, C, N), in the compute dtype: what
    :func:`diagonal_scan` and :func:`state_passing_diagonal_scan` run (``seqmesh.hf.mamba``)."""
    dtype = compute_dtype(x.dtype)
    x, dt, A, B = (t.to(dtype) for t in (x, dt, A, B))
    return dt[..., None] * A, (dt * x)[..., None] * B[:, :, None, :]
