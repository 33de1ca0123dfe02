"""Linear attention with a scalar decay per head and token, in plain PyTorch: Mamba2's state space
dual (SSD) and MiniMax's lightning attention are both this recurrence. Per head, a state ``S``
(Dk x Dv) runs over the sequence::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T        g_t <= 0: the log decay (Mamba2: dt_t A; lightning: -slope)
    o_t = S_t^T q_t                           (Mamba2: q = C, k = B, v = dt x)

Packed documents are segments ``bounds = (0, b1, ..., S)``; the state restarts from zero (or from
``initial[:, i]``) at each. The chunked form takes ``C`` tokens at a time: inside a chunk the output
is a masked, decayed attention, ``(q k^T * exp(G_t - G_s))_{s <= t} v``; across chunks the state is
carried. Segments start chunks (zero-padded; a padded slot has k = 0 and g = 0).

The state pass across ranks (:mod:`seqmesh.linear_attention.passing`) is simple here: over a run the
transition is one scalar per head, ``exp(sum g)``, and the entering state is read through
``exp(G_t) q_t``, ``G_t`` the log decay from the run's start to ``t``.
"""

from __future__ import annotations

import torch

from .choice import LINEAR_CHUNK as CHUNK
from .choice import runs_and_tails
from .gated_delta import chunk_layout, compute_dtype
from .halo import Placement
from .kernels import simple_gla
from .passing import pass_states


def chunk_decay_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, bounds: tuple[int, ...],
                     initial: torch.Tensor | None = None, *, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, S, H, Dk), v (B, S, H, Dv), g (B, S, H) over the segments ``bounds``, each starting from
    ``initial[:, i]`` (B, N, H, Dk, Dv) or zero -> (out (B, S, H, Dv) in v's dtype, final states (B, N, H, Dk, Dv)
    in the compute dtype: float32 for half precision, else the input's)."""
    out_dtype, dt = v.dtype, compute_dtype(q.dtype)
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    dest, _, total, first_chunks = chunk_layout(bounds, chunk, q.device)
    n = total // chunk
    last_chunks = [c - 1 for c in first_chunks[1:]] + [n - 1]

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, *D) -> (B, H, N, C, *D), segments chunk-aligned
        padded = x.to(dt).new_zeros(b, total, *x.shape[2:]).index_copy(1, dest, x.to(dt))
        return padded.transpose(1, 2).reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g = (to_chunks(x) for x in (q, k, v, g))
    gc = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk's start to each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, H, N, C, C)
    intra = (q @ k.transpose(-1, -2) * decay) @ v  # (B, H, N, C, Dv): the chunk's own tokens
    q_read = q * gc.exp()[..., None]  # reads the state entering the chunk
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # writes decayed to the chunk's end
    written = k_write.transpose(-1, -2) @ v  # (B, H, N, Dk, Dv): each chunk's state from zero
    chunk_decay = gc[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    entering = {c: i for i, c in enumerate(first_chunks)}
    leaving = set(last_chunks)

    state = q.new_zeros(b, h, dk, dv)
    states, finals = [], []
    # each chunk's slices taken once: indexing per chunk would make backward write a whole-size zeroed gradient each
    per_chunk = zip(chunk_decay.unbind(2), written.unbind(2), strict=True)
    for i, (decay_i, written_i) in enumerate(per_chunk):  # the states entering each chunk
        if i in entering:  # a segment starts: its own initial state, or zero
            state = initial[:, entering[i]].to(dt) if initial is not None else state.new_zeros(b, h, dk, dv)
        states.append(state)
        state = state * decay_i + written_i
        if i in leaving:
            finals.append(state)
    inter = q_read @ torch.stack(states, 2)  # (B, H, N, C, Dv)
    out = (intra + inter).reshape(b, h, total, dv).transpose(1, 2)  # (B, T, H, Dv)
    return out.index_select(1, dest).to(out_dtype), torch.stack(finals, 1)  # (B, N, H, Dk, Dv)


def decay_scan_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, bounds: tuple[int, ...],
                      initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`chunk_decay_scan`, by flash-linear-attention's ``chunk_simple_gla`` on CUDA where it is installed
    (batch rows laid end to end as variable-length documents, no scale), else by the torch reference."""
    done = simple_gla(q, k, v, g, bounds, initial)
    return chunk_decay_scan(q, k, v, g, bounds, initial) if done is None else done


def decay_state_bytes(heads: int, key_dim: int, value_dim: int, *, batch: int, ulysses: int, ring: int, layout: str,
                      state_bytes: int = 4) -> int:
    """Bytes each rank sends forward in :func:`pass_decay_states`'s all-gather (its reduce-scatter the same backward):
    every run's ``[S_0 | exp(sum g)]``, ``(P - 1) x runs x B x H x (Dk Dv + 1)`` state values, ``runs`` the busiest
    rank's (``choice.runs_and_tails``), whatever the sequence's length."""
    runs, _ = runs_and_tails(ulysses, ring, layout)
    return (ulysses * ring - 1) * batch * runs * heads * (key_dim * value_dim + 1) * state_bytes


def pass_decay_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      place: Placement, keep: dict | None = None) -> torch.Tensor:
    """The recurrence of the whole sequence at this rank's tokens, by state passing: q, k (B, L, H, Dk), v (B, L, H, Dv),
    g (B, L, H) in shard order -> (B, L, H, Dv). One all-gather of every run's [S_0 | exp(sum g)] forward. ``keep``
    (a prefill's): :func:`.passing.pass_states`'s, the state (B, H, Dk, Dv) after the row's last real token."""
    mine = place.mine
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    out, finals = decay_scan_states(q, k, v, g, mine.segment_bounds)  # every run from zero
    dt = finals.dtype
    # the transition of each segment: its total decay where it receives a state, zero where it restarts
    seg = mine.segment_bounds
    incoming = set(mine.incoming)
    totals = torch.stack([g[:, a:e].to(dt).sum(1).exp() if i in incoming else g.new_zeros(b, h, dtype=dt)
                          for i, (a, e) in enumerate(zip(seg[:-1], seg[1:]))], 1)  # (B, N, H)
    packed = torch.cat([finals.flatten(2), totals], dim=-1)  # (B, N, H Dk Dv + H)
    lift = torch.zeros(b, q.shape[1], h, dk, dtype=dt, device=q.device)
    pieces, at = [], 0
    for i in mine.incoming:  # exp(G_t) q_t, G from the run's start: cumulated per run, never across the shard
        a, e = seg[i], seg[i + 1]
        pieces += [lift[:, at:a], q[:, a:e].to(dt) * g[:, a:e].to(dt).cumsum(1).exp()[..., None]]
        at = e
    lift = torch.cat(pieces + [lift[:, at:]], dim=1) if pieces else lift

    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        written, decay = run.split([h * dk * dv, h], dim=-1)
        return decay.view(b, h, 1, 1) * state + written.view(b, h, dk, dv)

    def read(lift_t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthk,bhkv->bthv", lift_t, state)

    return pass_states(out, lift, packed, place, finals.new_zeros(b, h, dk, dv), carry=carry, read=read, keep=keep)
