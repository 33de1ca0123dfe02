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

from types import ModuleType

import torch

from ..kernels.probe import Kernel, KernelProbe, float32_loop_kernel, triton_module
from .choice import LINEAR_CHUNK as CHUNK
from .choice import runs_and_tails
from .gated_delta import chunk_layout, compute_dtype, without_autocast
from .halo import Placement
from .kernels import simple_gla
from .passing import pass_states


class _ChunkStates(torch.autograd.Function):
    """``S <- S * decay_i + written_i`` over the chunks, restarting (from ``initial[:, j]`` or zero) at each segment's
    first chunk: written (B, H, N, Dk, Dv), decay (B, H, N) -> (the states entering each chunk (B, H, N, Dk, Dv), each
    segment's final state (B, J, H, Dk, Dv)). One operator a chunk each way: the forward writes each state with one
    ``addcmul`` into the next chunk's slice of the output; the backward runs the recurrence in reverse the same way,
    the gradient of the state leaving chunk ``i`` being ``written_i``'s own, and takes the decays' gradients after the
    loop in one batched product (a GPU step of the per-chunk loop was bound by its launches). On a GPU each loop is one
    Triton kernel (:func:`scan_kernel`)."""

    @staticmethod
    def forward(ctx, written, decay, initial, firsts: tuple[int, ...], lasts: tuple[int, ...]):
        ctx.initial = None if initial is None else (initial.shape, initial.dtype)
        initial = None if initial is None else initial.to(written.dtype)  # the state's dtype, as the loop keeps it
        kernel = scan_kernel(written)
        loop = kernel.forward if kernel is not None else _forward_loop
        entering, finals = loop(written, decay, initial, firsts, lasts)
        ctx.save_for_backward(entering, decay)
        ctx.firsts, ctx.lasts = firsts, lasts
        return entering, finals

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_entering, d_finals):
        entering, decay = ctx.saved_tensors
        b, h, n, dk, dv = entering.shape
        d_initial = None if ctx.initial is None else entering.new_zeros(ctx.initial[0])
        kernel = scan_kernel(entering)
        loop = kernel.backward if kernel is not None else _reverse_loop
        d_written = loop(d_entering, decay, d_finals, ctx.firsts, ctx.lasts, d_initial)
        # d decay_i = sum(d leaving_i * entering_i), as one batched dot product a head and chunk
        d_decay = torch.bmm(d_written.view(-1, 1, dk * dv), entering.view(-1, dk * dv, 1)).view(b, h, n)
        return d_written, d_decay, None if d_initial is None else d_initial.to(ctx.initial[1]), None, None


def _forward_loop(written, decay, initial, firsts: tuple[int, ...], lasts: tuple[int, ...]):
    """:class:`_ChunkStates`' forward loop in torch: (entering (B, H, N, Dk, Dv), finals (B, J, H, Dk, Dv))."""
    b, h, n, dk, dv = written.shape
    entering = written.new_empty(written.shape)  # contiguous: the backward views it flat
    finals = written.new_empty(b, len(firsts), h, dk, dv)
    first_of, last_of = {c: j for j, c in enumerate(firsts)}, {c: j for j, c in enumerate(lasts)}
    states, writes = entering.unbind(2), written.unbind(2)
    decays = decay[..., None, None].unbind(2)  # each (B, H, 1, 1)
    for i in range(n):
        if i in first_of:
            states[i].zero_() if initial is None else states[i].copy_(initial[:, first_of[i]])
        leaving = finals[:, last_of[i]] if i in last_of else states[i + 1]
        torch.addcmul(writes[i], states[i], decays[i], out=leaving)
    return entering, finals


def _reverse_loop(d_entering, decay, d_finals, firsts: tuple[int, ...], lasts: tuple[int, ...], d_initial):
    """:class:`_ChunkStates`' backward loop in torch: the gradient of the state leaving each chunk (B, H, N, Dk, Dv),
    and ``d_initial`` (zeros) filled where given."""
    first_of, last_of = {c: j for j, c in enumerate(firsts)}, {c: j for j, c in enumerate(lasts)}
    n = d_entering.shape[2]
    d_written = d_entering.new_empty(d_entering.shape)  # contiguous: viewed flat after
    leaving, reads = d_written.unbind(2), d_entering.unbind(2)
    decays = decay[..., None, None].unbind(2)
    for i in reversed(range(n)):
        if i in last_of:  # a segment's last chunk: what leaves it is its final state, read by nothing else
            leaving[i].copy_(d_finals[:, last_of[i]])
        # (else chunk i + 1 wrote it: the gradient of the state entering i + 1)
        if i not in first_of:
            torch.addcmul(reads[i], leaving[i], decays[i], out=leaving[i - 1])
        elif d_initial is not None:  # (chunk i - 1 is a segment's last: nothing flows into it from here)
            torch.addcmul(reads[i], leaving[i], decays[i], out=d_initial[:, first_of[i]])
    return d_written


def scan_kernel(x: torch.Tensor) -> ModuleType | None:
    """The Triton form of the scan's loops (:mod:`.decay_scan_triton`) where it runs for tensors like ``x``
    (:func:`seqmesh.kernels.probe.float32_loop_kernel`), else None: the torch loops run."""
    return float32_loop_kernel(SCAN_PROBE, "scan", x)


def _probe_scan(kernel: ModuleType, device: torch.device, generator: torch.Generator) -> None:
    """The kernel's two loops held to the torch loops' in float64: 3 segments over 5 chunks, from initial states and
    from zero (each its own compiled form), a state of 40 x 30 (past one block of the kernel's)."""
    b, h, n, dk, dv = 1, 2, 5, 40, 30
    firsts, lasts = (0, 2, 3), (1, 2, 4)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    written, decay = rand(b, h, n, dk, dv), torch.rand(b, h, n, generator=generator, device=device)
    d_entering, d_finals = rand(b, h, n, dk, dv), rand(b, len(firsts), h, dk, dv)
    for initial in (rand(b, len(firsts), h, dk, dv), None):
        wide = None if initial is None else initial.double()
        got = list(kernel.forward(written, decay, initial, firsts, lasts))
        want = list(_forward_loop(written.double(), decay.double(), wide, firsts, lasts))
        for loop, results, dtype in ((kernel.backward, got, torch.float32), (_reverse_loop, want, torch.float64)):
            d_initial = None if initial is None else torch.zeros(initial.shape, dtype=dtype, device=device)
            results.append(loop(d_entering.to(dtype), decay.to(dtype), d_finals.to(dtype), firsts, lasts, d_initial))
            results += [] if d_initial is None else [d_initial]
        for a, z in zip(got, want):
            if not torch.allclose(a.double(), z, rtol=1e-5, atol=1e-5):
                raise RuntimeError("the scan kernel's loops differ from the torch loops'")


SCAN_PROBE = KernelProbe({"scan": Kernel("triton", lambda: triton_module("linear_attention.decay_scan_triton"),
                                           _probe_scan)})


@without_autocast
def chunk_decay_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, bounds: tuple[int, ...],
                     initial: torch.Tensor | None = None, *, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, S, H, Dk), v (B, S, H, Dv), g (B, S, H) over the segments ``bounds``, each starting from
    ``initial[:, i]`` (B, N, H, Dk, Dv) or zero -> (out (B, S, H, Dv) in v's dtype, final states (B, N, H, Dk, Dv)
    in the compute dtype: float32 for half precision, else the input's)."""
    out_dtype, dt = v.dtype, compute_dtype(q.dtype)
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    dest, total, first_chunks = chunk_layout(bounds, chunk, q.device)
    n = total // chunk
    last_chunks = [c - 1 for c in first_chunks[1:]] + [n - 1]

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, *D) -> (B, H, N, C, *D), segments chunk-aligned
        # heads first, one copy: the cast makes it contiguous; already in dt, the cast returns the strided input
        x = x.transpose(1, 2).to(dt, memory_format=torch.contiguous_format).contiguous()
        if total != s:  # a segment ends inside a chunk: zero-padded to the chunk's end
            x = x.new_zeros(b, h, total, *x.shape[3:]).index_copy(2, dest, x)
        return x.reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g = (to_chunks(x) for x in (q, k, v, g))
    gc = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk's start to each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, H, N, C, C)
    intra = (q @ k.transpose(-1, -2) * decay) @ v  # (B, H, N, C, Dv): the chunk's own tokens
    q_read = q * gc.exp()[..., None]  # reads the state entering the chunk
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # writes decayed to the chunk's end
    written = k_write.transpose(-1, -2) @ v  # (B, H, N, Dk, Dv): each chunk's state from zero
    states, finals = _ChunkStates.apply(written, gc[..., -1].exp(), initial, tuple(first_chunks),
                                        tuple(last_chunks))  # (B, H, N, Dk, Dv), (B, J, H, Dk, Dv)
    out = (intra + q_read @ states).reshape(b, h, total, dv).transpose(1, 2)  # (B, T, H, Dv)
    if total != s:
        out = out.index_select(1, dest)
    return out.to(out_dtype), finals  # (B, S, H, Dv), (B, N, H, Dk, Dv)


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
    pieces, at = [], 0
    for i in mine.incoming:  # exp(G_t) q_t, G from the run's start: cumulated per run, never across the shard
        a, e = seg[i], seg[i + 1]
        # q in its own dtype times float32 decays: the product is float32 and saves q itself, not a float32 copy
        pieces += [q.new_zeros(b, a - at, h, dk, dtype=dt), q[:, a:e] * g[:, a:e].to(dt).cumsum(1).exp()[..., None]]
        at = e
    pieces.append(q.new_zeros(b, q.shape[1] - at, h, dk, dtype=dt))
    lift = torch.cat(pieces, dim=1)  # (B, L, H, Dk), zero where a run receives no state

    def carry(run: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        written, decay = run.split([h * dk * dv, h], dim=-1)
        return decay.view(b, h, 1, 1) * state + written.view(b, h, dk, dv)

    def read(lift_t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthk,bhkv->bthv", lift_t, state)

    return pass_states(out, lift, packed, place, finals.new_zeros(b, h, dk, dv), carry=carry, read=read, keep=keep)
