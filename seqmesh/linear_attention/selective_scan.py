"""Mamba's (v1) selective scan, and the same scan with the sequence sharded over ``P = ring x ulysses`` ranks.

Per channel ``c`` and state ``n`` the scan is a diagonal linear recurrence::

    h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] B_t[n] x_t[c]
    y_t[c]    = sum_n C_t[n] h_t[c, n]

restarting from zero (or a given state) at every segment start (packed documents, the layout's padding).
:func:`selective_scan` runs it in two levels, stable in any dtype (no ``exp`` of a positive number): a
token-by-token pass inside chunks of ``chunk`` tokens, all chunks at once from zero, then the chunks'
states chained one chunk at a time and added back through each token's decay since its chunk start.

Sharded (:func:`state_passing_selective_scan`), the scan is affine in the state entering a run::

    S_out = T * S_in + S_0       T = exp(sum_run dt A) (C, N), elementwise
    y_t   = y_t(0) + sum_n C_t[n] exp(cum_t[c, n]) S_in[c, n]     cum_t = sum_{s <= t in run} dt_s A

so, with no rank waiting for another: the conv with its halo (``halo.halo_causal_conv``, one all-gather,
done by the caller), the scan of the rank's runs from zero, then ``passing.pass_states`` with each run's
``[S_0 | T]`` (B, C * N * 2) in one all-gather and ``y += read(S_in)``. Traffic per layer and rank:
``(P - 1) R B 2 C N`` values received (R runs per rank: 2 zigzag, 1 contiguous), whatever the length.
"""

from __future__ import annotations

import torch

from .gated_delta import compute_dtype
from .halo import Placement
from .passing import pass_states

CHUNK = 32  # tokens per chunk of the two-level scan: about sqrt of the sequence lengths one rank holds


def _starts(bounds: tuple[int, ...], length: int, device: torch.device) -> torch.Tensor:
    """(L,) bool: the first token of every segment."""
    starts = torch.zeros(length, dtype=torch.bool, device=device)
    starts[list(bounds[:-1])] = True
    return starts


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   bounds: tuple[int, ...], initial: torch.Tensor | None = None,
                   chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of every segment of ``bounds`` (0, ..., L): ``x`` (B, L, C), ``dt`` (B, L, C) after
    softplus, ``A`` (C, N) (negative), ``B`` / ``C`` (B, L, N); ``initial`` (B, S, C, N) the state entering each
    of the S segments (zero if None) -> ``y`` (B, L, C) without the skip ``D x``, and each segment's final
    state (B, S, C, N), in float32 for half-precision inputs, otherwise the inputs' dtype."""
    batch, length, channels = x.shape
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"segment bounds {bounds} must run from 0 to the sequence's {length} tokens.")
    dtype = compute_dtype(x.dtype)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    log_decay = dt[..., None] * A  # (B, L, C, N), <= 0
    decay = torch.exp(log_decay)
    inp = (dt * x)[..., None] * B[:, :, None, :]  # (B, L, C, N)
    starts = _starts(bounds, length, x.device)
    first = list(bounds[:-1])
    if initial is not None:  # a segment's first token reads its entering state through its own decay
        inp = inp.index_add(1, torch.tensor(first, device=x.device), decay[:, first] * initial.to(dtype))
    decay = decay * (~starts).to(dtype)[None, :, None, None]  # nothing crosses a segment start

    chunks = -(-length // chunk)
    pad = chunks * chunk - length

    def to_chunks(t: torch.Tensor) -> torch.Tensor:  # (B, L, ...) -> (B, K, Q, ...)
        t = torch.nn.functional.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad)) if pad else t
        return t.reshape(batch, chunks, chunk, *t.shape[2:])

    # unbound once: indexing a step inside the loop would make backward fill a whole-size gradient per step
    decay_q, inp_q = to_chunks(decay).unbind(2), to_chunks(inp).unbind(2)  # Q x (B, K, C, N)
    state, local = inp_q[0], [inp_q[0]]
    for q in range(1, chunk):  # 1. inside every chunk at once, from zero
        state = decay_q[q] * state + inp_q[q]
        local.append(state)
    local = torch.stack(local, dim=2)  # (B, K, Q, C, N)
    # each token's decay since its chunk's start, zero once a segment started in between (or at the chunk's start)
    counts = torch.nn.functional.pad(torch.cumsum(starts.to(torch.int64), 0), (0, pad)).view(chunks, chunk)
    before = counts[:, :1] - torch.nn.functional.pad(starts.to(torch.int64), (0, pad)).view(chunks, chunk)[:, :1]
    open_ = (counts == before).to(dtype)[None, :, :, None, None]  # (1, K, Q, 1, 1)
    cum = torch.exp(torch.cumsum(to_chunks(log_decay), dim=2)) * open_  # (B, K, Q, C, N)

    through, leaving = cum[:, :, -1].unbind(1), local[:, :, -1].unbind(1)  # K x (B, C, N)
    entering = [torch.zeros_like(leaving[0])]  # 2. the chunks' states, one chunk at a time
    for k in range(1, chunks):
        entering.append(through[k - 1] * entering[-1] + leaving[k - 1])
    states = local + cum * torch.stack(entering, dim=1)[:, :, None]  # (B, K, Q, C, N)
    states = states.reshape(batch, chunks * chunk, channels, -1)[:, :length]  # (B, L, C, N)
    y = torch.einsum("blcn,bln->blc", states, C)
    finals = states[:, [e - 1 for e in bounds[1:]]]  # (B, S, C, N)
    return y, finals


def state_passing_selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                 C: torch.Tensor, place: Placement) -> torch.Tensor:
    """The selective scan of the whole sequence at this rank's tokens (shard order, placed as ``place``
    says): ``x`` / ``dt`` (B, L, C), ``A`` (C, N), ``B`` / ``C`` (B, L, N) -> ``y`` (B, L, C) without ``D x``,
    exactly what :func:`selective_scan` gives on the unsharded sequence. One all-gather forward of every
    run's [S_0 | T] over ``place.group``, its reduce-scatter backward."""
    mine = place.mine
    batch, length, channels = x.shape
    states = A.shape[-1]
    y, finals = selective_scan(x, dt, A, B, C, mine.segment_bounds)  # y(0), S_0 (B, S, C, N)
    dtype = y.dtype
    A, dt, C = A.to(dtype), dt.to(dtype), C.to(dtype)
    transitions = torch.zeros_like(finals)  # T: zero for a segment that does not receive a state
    for segment in mine.incoming:
        a, e = mine.segment_bounds[segment], mine.segment_bounds[segment + 1]
        transitions[:, segment] = torch.exp(dt[:, a:e].sum(1)[..., None] * A)
    packed = torch.cat([finals, transitions], dim=-1).flatten(2)  # (B, S, C * 2N)

    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # (B, C * 2N), (B, C, N)
        s0, t = run.view(batch, channels, 2 * states).split(states, dim=-1)
        return t * state + s0

    def read(lift: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # (B, t, C + N), (B, C, N) -> (B, t, C)
        dt_t, c_t = lift.split([channels, states], dim=-1)
        decay = torch.exp(torch.cumsum(dt_t, dim=1)[..., None] * A)  # (B, t, C, N): the run's decay up to t
        return torch.einsum("btcn,btn,bcn->btc", decay, c_t, state.to(dtype))

    lift = torch.cat([dt, C], dim=-1)  # (B, L, C + N)
    return pass_states(y, lift, packed, place, packed.new_zeros(batch, channels, states), carry=carry, read=read)
