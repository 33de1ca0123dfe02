"""The delta rule's state carried across chunks, shared by Gated DeltaNet's rule (:mod:`.gated_delta`: a decay a head)
and KDA's (:mod:`.kda`: one a key channel), which differ only in how they decay within a chunk.

:func:`carry_chunks` is one autograd function (:class:`_CarryChunks`). Its two loops over the chunks run as torch
operators a chunk (:func:`_forward_loop`, :func:`_reverse_loop`), or, on a GPU, as one Triton launch each
(:mod:`.carry_triton`, chosen by :func:`carry_kernel` after its probe has held it to the torch loops on that device).
The products over every chunk at once are torch's either way.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..kernels.probe import Kernel, KernelProbe, float32_loop_kernel, triton_module
from .choice import LINEAR_CHUNK as CHUNK


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


def carry_kernel(x: torch.Tensor) -> ModuleType | None:
    """The Triton form of the carry's loops (:mod:`.carry_triton`) where it runs for tensors like ``x``
    (:func:`seqmesh.kernels.probe.float32_loop_kernel`; its backward adds ``k_write``'s gradient atomically), else
    None: the torch loops run."""
    return float32_loop_kernel(CARRY_PROBE, "carry", x, atomic=True)


def _kernel_forward(kernel: ModuleType, u, w, k_write, chunk_decay, initial, first_chunks):
    """:func:`_forward_loop` in one launch of ``kernel`` (:mod:`.carry_triton`)."""
    b, h, n, c, dv = u.shape
    dk = w.shape[-1]
    states, v_new = u.new_empty(n, b * h, dk, dv), u.new_empty(n, b * h, c, dv)
    finals = u.new_empty(len(first_chunks), b * h, dk, dv)
    start, end = kernel.segment_flags(first_chunks, n, u.device)
    kernel.forward(_by_chunk(u), _by_chunk(w), _by_chunk(k_write), _by_chunk(chunk_decay), initial, start, end,
                   states, v_new, finals)
    return states, v_new, finals


def _kernel_reverse(kernel: ModuleType, w, q_read, intra, k_write, chunk_decay, states, v_new, d_out, d_final,
                    d_initial, first_chunks):
    """:func:`_reverse_loop` in one launch of ``kernel`` (:mod:`.carry_triton`)."""
    start, end = kernel.segment_flags(first_chunks, states.shape[0], states.device)
    return kernel.backward(d_out, _by_chunk(intra), _by_chunk(k_write), _by_chunk(w), _by_chunk(q_read),
                           _by_chunk(chunk_decay), states, v_new, d_final, start, end, d_initial)


def _probe_carry(kernel: ModuleType, device: torch.device, generator: torch.Generator) -> None:
    """The kernel's two loops held to the torch loops' in float64 (no TF32 reference): 3 segments over 4 chunks of the
    rules' 64 tokens, heads of 128 keys and values (the layers' sizes), a decay a head and one a state row, from
    initial states and from zero (each its own compiled form)."""
    n, c, dk, dv, firsts = 4, CHUNK, 128, 128, (0, 1, 3)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device) * 0.1

    for rows in (1, dk):
        u, w, k_write, q_read = rand(1, 1, n, c, dv), rand(1, 1, n, c, dk), rand(1, 1, n, c, dk), rand(1, 1, n, c, dk)
        intra = rand(1, 1, n, c, c).tril()  # causal, as the rules' (the kernel skips the blocks above the diagonal)
        decay = torch.rand(1, 1, n, rows, 1, generator=generator, device=device)
        d_out, d_final = rand(n, 1, c, dv), rand(len(firsts), 1, dk, dv)
        for initial in (rand(len(firsts), 1, dk, dv), None):
            got = list(_kernel_forward(kernel, u, w, k_write, decay, initial, firsts))
            wide = [x.double() for x in (u, w, k_write, decay)]
            want = list(_forward_loop(*wide, None if initial is None else initial.double(), firsts))
            kernel_reverse = lambda *args: _kernel_reverse(kernel, *args)  # noqa: E731
            for loop, results, dtype in ((kernel_reverse, got, torch.float32), (_reverse_loop, want, torch.float64)):
                states, v_new = (x.to(dtype) for x in results[:2])
                d_initial = None if initial is None else torch.empty(initial.shape, dtype=dtype, device=device)
                ins = [x.to(dtype) for x in (w, q_read, intra, k_write, decay)]
                results += [*loop(*ins, states, v_new, d_out.to(dtype), d_final.to(dtype), d_initial, firsts)]
                results += [] if d_initial is None else [d_initial]
            for a, z in zip(got, want):
                if not torch.allclose(a.double(), z, rtol=1e-4, atol=1e-4):
                    raise RuntimeError(f"the carry kernel's loops (decay rows {rows}, "
                                       f"{'from initial states' if initial is not None else 'from zero'}) differ "
                                       "from the torch loops'")


CARRY_PROBE = KernelProbe({"carry": Kernel("triton", lambda: triton_module("linear_attention.carry_triton"),
                                             _probe_carry)})


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
        kernel = carry_kernel(u)
        if kernel is not None:  # the loop in one launch
            states, v_new, finals = _kernel_forward(kernel, u, w, k_write, chunk_decay, initial, first_chunks)
        else:
            states, v_new, finals = _forward_loop(u, w, k_write, chunk_decay, initial, first_chunks)
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
        kernel = carry_kernel(states)
        args = (w, q_read, intra, k_write, chunk_decay, states, v_new, d_out, d_final, d_initial, first_chunks)
        d_new, d_k, d_decay = _kernel_reverse(kernel, *args) if kernel is not None else _reverse_loop(*args)
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
