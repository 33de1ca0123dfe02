"""The Gated DeltaNet token mixer on whole sequences, in plain PyTorch: the reference every faster
kernel is compared with, and the CPU path.

Per value head, a state ``S`` (Dk x Dv) runs over the sequence::

    S_t = exp(g_t) * S_{t-1}                          # decay
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T    # delta rule: write the part of v_t S_t misses
    o_t = S_t^T q_t                                   # q, k L2-normalised, q scaled by Dk^-1/2

Packed documents are *segments*: ``bounds = (0, b1, ..., S)``; the state and the short causal conv
both restart at every bound, so a document never sees another one's tokens.

The chunked form (as in flash-linear-attention) processes ``C`` tokens at a time: inside a chunk
the delta-rule updates solve one unit-lower-triangular system; across chunks the state is carried.
Segments are laid out so that each starts a new chunk (zero-padded to a multiple of ``C``; a
padded slot has beta = 0 and g = 0, so it leaves the state untouched), and the carried state is
zeroed at the first chunk of each segment: all documents run in the same batched matmuls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..kernels.probe import Kernel, KernelProbe
from .choice import LINEAR_CHUNK as CHUNK  # tokens per chunk: the one value, which the planner reads too


def segment_bounds(total: int, cu_seqlens: Sequence[int] | None, seq_len: int | None = None) -> tuple[int, ...]:
    """``(0, ..., total)``: document starts from ``cu_seqlens`` (global), plus ``seq_len`` where the
    layout's padding begins, so padding is a segment of its own and never reaches a real token."""
    cuts = {0, total}
    if cu_seqlens is not None:
        cuts.update(int(c) for c in cu_seqlens if 0 < c < total)
    if seq_len is not None and 0 < seq_len < total:
        cuts.add(seq_len)
    return tuple(sorted(cuts))


def positions_in_segments(bounds: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """``(S,)`` int64: each token's offset from the start of its segment."""
    return _positions(bounds, torch.device(device))


@functools.lru_cache(maxsize=64)
def _positions(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]).to(device)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bounds: tuple[int, ...], activation: str = "silu"
) -> torch.Tensor:
    """Depthwise causal conv, restarting at every segment bound. ``x`` (B, S, C), ``weight`` (C, K).

    ``out[t] = sum_s weight[:, K-1-s] * x[t-s]`` over the shifts ``s`` that stay inside t's segment
    (what ``F.conv1d(x, w, padding=K-1)[..., :S]`` computes on each document alone)."""
    b, s, c = x.shape
    kernel = weight.shape[-1]
    pos = positions_in_segments(bounds, x.device)  # (S,)
    out = x * weight[:, kernel - 1]
    for shift in range(1, min(kernel, s)):
        keep = (pos[shift:] >= shift).to(x.dtype)[None, :, None]  # (1, S-shift, 1)
        shifted = x[:, :-shift] * keep * weight[:, kernel - 1 - shift]  # (B, S-shift, C)
        out = out + F.pad(shifted, (0, 0, shift, 0))
    if bias is not None:
        out = out + bias
    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is None:
        return out
    raise ValueError(f"conv activation {activation!r} is not supported; seqmesh's Gated DeltaNet takes 'silu'.")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrence runs in float32 for half-precision inputs, otherwise in the input's dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types seqmesh runs that have an autocast


def without_autocast(rule):
    """``rule(q, ...)`` in its own compute dtype under any autocast its caller holds (``seqmesh train --bf16`` without
    FSDP2, transformers' Trainer in bf16, checkpointing's recomputation): autocast would run the recurrence's float32
    products in bf16, and mix dtypes inside its autograd functions, whose in-place products refuse them."""

    @functools.wraps(rule)
    def run(q: torch.Tensor, *args, **kwargs):
        # a fixed list, not torch.amp.is_autocast_available: torch 2.9's dynamo cannot trace that call
        if q.device.type not in AUTOCAST_DEVICES:
            return rule(q, *args, **kwargs)
        with torch.autocast(q.device.type, enabled=False):
            return rule(q, *args, **kwargs)

    return run


def chunk_layout(bounds: tuple[int, ...], chunk: int,
                  device: torch.device) -> tuple[torch.Tensor, int, list[int]]:
    """Where each token goes when every segment starts a chunk: ``(dest (S,), padded, the chunk each segment starts
    at)``; the last as plain integers, so torch.compile traces them as constants."""
    dest, offset, firsts = [], 0, []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = -(-(b - a) // chunk)
        dest.append(torch.arange(b - a) + offset)
        firsts.append(offset // chunk)
        offset += n * chunk
    return torch.cat(dest).to(device), offset, firsts


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: tuple[int, ...],
    *,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The gated delta rule over segments. q, k (B, S, H, Dk) (not yet normalised; one key head per
    value head), v (B, S, H, Dv), g and beta (B, S, H) -> (B, S, H, Dv) in v's dtype."""
    return chunk_gated_delta_rule_states(q, k, v, g, beta, bounds, None, chunk=chunk)[0]


@without_autocast
def chunk_gated_delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: tuple[int, ...],
    initial_state: torch.Tensor | None,
    *,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`chunk_gated_delta_rule`, each segment starting from ``initial_state[:, i]`` (B, N, H, Dk, Dv)
    (zero when None) instead of zero: ``(out (B, S, H, Dv) in v's dtype, final states (B, N, H, Dk, Dv) in the
    compute dtype)`` for the ``N = len(bounds) - 1`` segments."""
    out_dtype = v.dtype
    dt = compute_dtype(q.dtype)
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    q = l2norm(q.to(dt)) * dk**-0.5
    k = l2norm(k.to(dt))
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)

    dest, total, first_chunks = chunk_layout(bounds, chunk, q.device)
    n = total // chunk

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, *D) -> (B, H, N, C, *D), segments chunk-aligned
        padded = x.new_zeros(b, total, *x.shape[2:]).index_copy(1, dest, x)
        return padded.transpose(1, 2).reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))
    gc = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk start to each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, H, N, C, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # unit lower-triangular system of the chunk's delta-rule updates
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, dtype=dt, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # (B, H, N, C, Dv)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    intra = q @ k.transpose(-1, -2) * decay  # (B, H, N, C, C)
    q_read = q * gc.exp()[..., None]  # reads the state entering the chunk
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # writes decayed to the chunk's end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    out, finals = carry_chunks(u, w, q_read, intra, k_write, chunk_decay, first_chunks, initial_state)
    return out.index_select(1, dest).to(out_dtype), finals  # (B, S, H, Dv), (B, N, H, Dk, Dv)


def carry_chunks(u: torch.Tensor, w: torch.Tensor, q_read: torch.Tensor, intra: torch.Tensor, k_write: torch.Tensor,
                 chunk_decay: torch.Tensor, first_chunks: list[int],
                 initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's state carried across chunks, shared by the scalar decay (Gated DeltaNet) and the per-channel
    one (KDA), which differ only in how they decay within a chunk. Per chunk ``i`` of (B, H, N, C, ...) tensors:
    ``v_new = u - w S``, output ``q_read S + intra v_new``, then ``S <- S * chunk_decay + k_write^T v_new``
    (``chunk_decay`` (B, H, N, 1 or Dk, 1)); the state restarts (from ``initial_state[:, j]`` or zero) at each
    segment's first chunk (``first_chunks``) -> (out (B, T, H, Dv) in chunk order, each segment's final state
    (B, N, H, Dk, Dv))."""
    assert sorted(set(first_chunks)) == list(first_chunks) and first_chunks[0] == 0 and first_chunks[-1] < u.shape[2], \
        f"every segment must start its own chunk: {u.shape[2]} chunks, segments starting at {first_chunks}"
    return _CarryChunks.apply(u, w, q_read, intra, k_write, chunk_decay, initial_state, tuple(first_chunks))


def carry_kernel(x: torch.Tensor):
    """The Triton form of the carry's loops (:mod:`.carry_triton`) where it runs for tensors like ``x``: float32 on a
    CUDA device where Triton is installed and the kernel passed its probe there; not while torch.compile traces, nor
    on fake tensors. None elsewhere: the torch loops run."""
    if x.device.type != "cuda" or x.dtype != torch.float32 or torch.compiler.is_compiling() \
            or torch._subclasses.fake_tensor.is_fake(x):
        return None
    return CARRY_PROBE.load("carry") if CARRY_PROBE.works("carry", x.device) else None



def _carry_loaded():
    try:
        from . import carry_triton
    except ImportError:  # no Triton
        return None
    return carry_triton


def _probe_carry(kernel, device: torch.device, generator: torch.Generator) -> None:
    """The kernel's two loops held to the torch loops': 3 segments over 5 chunks of 16 (each from an initial state),
    a decay a head and one a state row, value columns past one block of the kernel's."""
    b, h, n, c, dk, dv = 1, 2, 5, 16, 24, 40
    firsts = (0, 2, 3)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device) * 0.3

    for rows in (1, dk):
        u, w, k_write, q_read = rand(b, h, n, c, dv), rand(b, h, n, c, dk), rand(b, h, n, c, dk), rand(b, h, n, c, dk)
        intra, decay = rand(b, h, n, c, c), torch.rand(b, h, n, rows, 1, generator=generator, device=device)
        initial = rand(len(firsts), b * h, dk, dv)
        forward = [_forward_loop(u, w, k_write, decay, initial, firsts),
                   _kernel_forward(u, w, k_write, decay, initial, firsts)]
        states, v_new, _ = forward[0]
        d_out, d_final = rand(n, b * h, c, dv), rand(len(firsts), b * h, dk, dv)
        backward = [(*loop(w, q_read, intra, k_write, decay, states, v_new, d_out, d_final, d_initial, firsts),
                     d_initial)
                    for loop, d_initial in ((_reverse_loop, torch.empty_like(initial)),
                                            (_kernel_reverse, torch.empty_like(initial)))]
        for got, want in zip(forward[1] + backward[1], forward[0] + backward[0]):
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"the carry kernel's loops (decay rows {rows}) differ from the torch loops'")


CARRY_PROBE = KernelProbe({"carry": Kernel("triton", _carry_loaded, _probe_carry)})


def _by_chunk(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, ...) -> (N, B*H, ...) contiguous: each chunk's slice is one contiguous batch of matrices."""
    b, h, n = x.shape[:3]
    return x.permute(2, 0, 1, *range(3, x.dim())).reshape(n, b * h, *x.shape[3:])


def _from_chunks(x: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """(N, B*H, ...) -> (B, H, N, ...), a view."""
    n = x.shape[0]
    return x.view(n, b, h, *x.shape[2:]).permute(1, 2, 0, *range(3, x.dim() + 1))


def _segment_chunks(first_chunks: tuple[int, ...], n: int) -> tuple[dict[int, int], dict[int, int]]:
    """Each segment's first chunk and its last, each mapped to the segment's index."""
    entering = {chunk: j for j, chunk in enumerate(first_chunks)}
    ends = {chunk - 1: j for j, chunk in enumerate(first_chunks[1:])} | {n - 1: len(first_chunks) - 1}
    return entering, ends


class _CarryChunks(torch.autograd.Function):
    """:func:`carry_chunks` in one autograd node. The loop over chunks carries only what depends on the state: the
    forward computes each chunk's ``v_new`` and the state it leaves (two batched products and a scaling), and keeps
    the state entering each chunk; the outputs' reads (``q_read S``, ``intra v_new``) run after the loop as two
    products over every chunk. The backward runs the recurrence in reverse the same way (``dv_new``, k_write's and the
    decay's gradients and the gradient of the state entering each chunk: six batched products and a scaling), then
    w's, q_read's and intra's gradients in products over all chunks. Autograd over the loop recorded some 70
    operators a chunk (a GPU step of small launches); this is 3 forward and 7 backward, and on a GPU each loop is one
    Triton kernel (:func:`carry_kernel`)."""

    @staticmethod
    def forward(ctx, u, w, q_read, intra, k_write, chunk_decay, initial_state, first_chunks):
        b, h, n, c, dv = u.shape
        initial = None if initial_state is None else \
            initial_state.to(u.dtype).transpose(0, 1).reshape(len(first_chunks), b * h, *initial_state.shape[-2:])
        loop = _kernel_forward if carry_kernel(u) is not None else _forward_loop
        states, v_new, finals = loop(u, w, k_write, chunk_decay, initial, first_chunks)
        out = torch.bmm(_by_chunk(q_read).flatten(0, 1), states.flatten(0, 1))
        out.baddbmm_(_by_chunk(intra).flatten(0, 1), v_new.flatten(0, 1))
        ctx.save_for_backward(w, q_read, intra, k_write, chunk_decay, states, v_new)
        ctx.first_chunks, ctx.initial_dtype = first_chunks, None if initial_state is None else initial_state.dtype
        out = _from_chunks(out.view(n, b * h, c, dv), b, h).reshape(b, h, n * c, dv).transpose(1, 2)
        # (B, T, H, Dv), (B, N, H, Dk, Dv)
        return out, finals.view(len(first_chunks), b, h, *finals.shape[-2:]).transpose(0, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_finals):
        w, q_read, intra, k_write, chunk_decay, states, v_new = ctx.saved_tensors
        first_chunks = ctx.first_chunks
        b, h, n, c, dk = w.shape
        dv = v_new.shape[-1]
        d_out = _by_chunk(d_out.transpose(1, 2).reshape(b, h, n, c, dv))  # (N, B*H, C, Dv)
        d_final = d_finals.transpose(0, 1).reshape(len(first_chunks), b * h, dk, dv)  # (zeros where unused)
        d_initial = None if ctx.initial_dtype is None else states.new_empty(len(first_chunks), b * h, dk, dv)
        loop = _kernel_reverse if carry_kernel(states) is not None else _reverse_loop
        d_new, d_k, d_decay = loop(w, q_read, intra, k_write, chunk_decay, states, v_new, d_out, d_final, d_initial,
                                   first_chunks)
        return _input_gradients(d_new, d_k, d_decay, d_initial, d_out, states, v_new, b, h, ctx.initial_dtype)


def _forward_loop(u, w, k_write, chunk_decay, initial, first_chunks):
    """:class:`_CarryChunks`' forward loop over chunks in torch, on (B, H, N, ...) inputs and ``initial`` (J, B*H, Dk,
    Dv) or None: (the state entering each chunk (N, B*H, Dk, Dv), v_new (N, B*H, C, Dv), each segment's final state
    (J, B*H, Dk, Dv))."""
    b, h, n, c, dv = u.shape
    dk = w.shape[-1]
    entering, ends = _segment_chunks(first_chunks, n)
    states, v_new = u.new_empty(n, b * h, dk, dv), u.new_empty(n, b * h, c, dv)
    finals = u.new_empty(len(first_chunks), b * h, dk, dv)
    us, ws, ks = (_by_chunk(x).unbind(0) for x in (u, w, k_write.transpose(-1, -2)))
    decays = _by_chunk(chunk_decay).unbind(0)  # each (B*H, 1 or Dk, 1)
    state_in, new = states.unbind(0), v_new.unbind(0)
    for i in range(n):
        if i in entering:
            state_in[i].zero_() if initial is None else state_in[i].copy_(initial[entering[i]])
        torch.baddbmm(us[i], ws[i], state_in[i], alpha=-1, out=new[i])
        leaving = finals[ends[i]] if i in ends else state_in[i + 1]
        torch.mul(state_in[i], decays[i], out=leaving).baddbmm_(ks[i], new[i])
    return states, v_new, finals


def _kernel_forward(u, w, k_write, chunk_decay, initial, first_chunks):
    """:func:`_forward_loop` in one Triton launch (:mod:`.carry_triton`)."""
    kernel = _carry_loaded()
    b, h, n, c, dv = u.shape
    dk = w.shape[-1]
    states, v_new = u.new_empty(n, b * h, dk, dv), u.new_empty(n, b * h, c, dv)
    finals = u.new_empty(len(first_chunks), b * h, dk, dv)
    start, end = kernel.segment_flags(first_chunks, n, u.device)
    kernel.forward(_by_chunk(u), _by_chunk(w), _by_chunk(k_write), _by_chunk(chunk_decay), initial, start, end,
                   states, v_new, finals)
    return states, v_new, finals


def _kernel_reverse(w, q_read, intra, k_write, chunk_decay, states, v_new, d_out, d_final, d_initial, first_chunks):
    """:func:`_reverse_loop` in one Triton launch (:mod:`.carry_triton`)."""
    kernel = _carry_loaded()
    start, end = kernel.segment_flags(first_chunks, states.shape[0], states.device)
    return kernel.backward(d_out, _by_chunk(intra), _by_chunk(k_write), _by_chunk(w), _by_chunk(q_read),
                           _by_chunk(chunk_decay), states, v_new, d_final, start, end, d_initial)


def _reverse_loop(w, q_read, intra, k_write, chunk_decay, states, v_new, d_out, d_final, d_initial, first_chunks):
    """:class:`_CarryChunks`' backward loop over chunks in torch: (d_v_new (N, B*H, C, Dv), d_k_write (N, B*H, C, Dk),
    d_decay (N, B*H, 1 or Dk, 1)), and ``d_initial`` filled where given."""
    b, h, n, c, dk = w.shape
    entering, ends = _segment_chunks(first_chunks, n)
    ws_t, qs_t, intra_t = (_by_chunk(x).transpose(-1, -2).unbind(0) for x in (w, q_read, intra))
    ks, decays, outs = _by_chunk(k_write).unbind(0), _by_chunk(chunk_decay).unbind(0), d_out.unbind(0)
    rows = chunk_decay.shape[-2]  # 1 (one decay a head) or Dk (one a state row)
    dv = v_new.shape[-1]
    d_new, d_k = torch.empty_like(v_new), states.new_empty(n, b * h, c, dk)
    d_decay = states.new_empty(n, b * h, rows, 1)
    # the gradients of the state leaving chunk i and of the one entering it, in turns: one a chunk would be a
    # Dk x Dv state a chunk more at the backward's peak
    turns = states.new_empty(2, b * h, dk, dv)
    new, d_v, d_ks, d_decays = v_new.unbind(0), d_new.unbind(0), d_k.unbind(0), d_decay.unbind(0)
    state_in = states.unbind(0)
    for i in reversed(range(n)):
        d_state = turns[i % 2]
        if i in ends:  # the segment's final state: its own gradient; nothing flows on into the next segment
            d_state.copy_(d_final[ends[i]])
        # (else chunk i + 1 wrote it: the gradient of the state entering i + 1)
        torch.bmm(intra_t[i], outs[i], out=d_v[i]).baddbmm_(ks[i], d_state)
        torch.bmm(new[i], d_state.transpose(-1, -2), out=d_ks[i])
        # d decay = sum(d_state * state) over what the decay multiplies (a state's rows, or the whole state)
        torch.bmm(d_state.view(-1, 1, dk * dv // rows), state_in[i].view(-1, dk * dv // rows, 1),
                  out=d_decays[i].view(-1, 1, 1))
        if i in entering:
            if d_initial is None:
                continue
            d_entering = d_initial[entering[i]]
        else:
            d_entering = turns[(i - 1) % 2]
        torch.mul(d_state, decays[i], out=d_entering).baddbmm_(qs_t[i], outs[i])
        d_entering.baddbmm_(ws_t[i], d_v[i], alpha=-1)
    return d_new, d_k, d_decay


def _input_gradients(d_new, d_k, d_decay, d_initial, d_out, states, v_new, b: int, h: int, initial_dtype):
    """:class:`_CarryChunks`' gradients of its inputs from the reverse loop's: w's, q_read's and intra's as products
    over every chunk at once, all laid out as the inputs (B, H, N, ...)."""
    n, _, _, dk = d_k.shape
    flat = lambda x: x.flatten(0, 1)  # noqa: E731  (N * B*H, ...)
    states_t = flat(states).transpose(-1, -2)
    d_w = -torch.bmm(flat(d_new), states_t)
    d_q = torch.bmm(flat(d_out), states_t)
    d_intra = torch.bmm(flat(d_out), flat(v_new).transpose(-1, -2))
    grads = [_from_chunks(x.view(n, b * h, *x.shape[1:]), b, h)
             for x in (d_new.flatten(0, 1), d_w, d_q, d_intra, d_k.flatten(0, 1))]
    d_decay = _from_chunks(d_decay, b, h)
    if d_initial is not None:
        d_initial = d_initial.view(-1, b, h, dk, states.shape[-1]).transpose(0, 1).to(initial_dtype)
    return (*grads, d_decay, d_initial, None)
