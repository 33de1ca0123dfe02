"""The fastest recurrent-mixer kernels available, behind the signatures of the torch reference.

On CUDA, flash-linear-attention's ``chunk_gated_delta_rule`` and ``chunk_simple_gla`` and the ``causal-conv1d``
package are used when installed and when they run on the device: each is probed once per device before its first
use (:mod:`.probe`: a few tokens forward and backward; one that raises, as flash-linear-attention does on Hopper with
Triton 3.4 to 3.7.0, is replaced by the torch rule with one warning). All take variable-length documents (the batch
rows are laid end to end with ``cu_seqlens``). Everywhere else, on fake tensors (a rehearsal) and for shapes those
kernels refuse, the torch reference of ``gated_delta.py`` and ``decay_scan.py`` runs: same arguments, same results up
to rounding.
"""

from __future__ import annotations

import importlib.util

import torch

from . import gated_delta
from ..kernels.probe import Kernel, KernelProbe


def _fla_gated_delta():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _fla_simple_gla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return chunk_simple_gla


def _fla_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def _fla_refuses_gated_backward(device: torch.device) -> str | None:
    """flash-linear-attention's own refusal of its gated chunk backward (``chunk_bwd_dqkwg``: Hopper, Triton >= 3.4.0
    and < 3.7.1), read from its version flags where tilelang is not installed; None where the flags are not there
    (another release), tilelang is installed (the package may take another backend, by its own settings) or the
    condition does not hold: then the probe runs the kernel."""
    try:
        from fla.utils import env
    except ImportError:
        return None
    above_3_4, above_3_7_1 = (getattr(env, name, None) for name in ("TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1"))
    if above_3_4 is None or above_3_7_1 is None or device.type != "cuda":
        return None
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if hopper and above_3_4 and not above_3_7_1 and importlib.util.find_spec("tilelang") is None:
        return ("RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
                "chunk_bwd_dqkwg (flash-linear-attention's own check, read from its flags before compiling)")
    return None


def _causal_conv1d():
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


def row_bounds(bounds: tuple[int, ...], rows: int, device: torch.device, dtype=torch.int32) -> torch.Tensor:
    """The segments of ``rows`` batch rows laid end to end, as flash-linear-attention's cu_seqlens."""
    length = bounds[-1]
    cuts = [r * length + c for r in range(rows) for c in bounds[:-1]] + [rows * length]
    return torch.tensor(cuts, dtype=dtype, device=device)


# --- each package's call, as the layers make it (the probe makes the same) -----------------------------------------
def _call_gated_delta(rule, q, k, v, g, beta, bounds, initial_state=None):
    """flash-linear-attention's gated delta rule over the batch rows laid end to end: (out (B, S, H, Dv), final
    states (B, N, H, Dk, Dv) when ``initial_state`` (B, N, H, Dk, Dv) is given, else None)."""
    b, s, h, _ = q.shape
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, beta)]
    state = {} if initial_state is None else {"initial_state": initial_state.float().flatten(0, 1),
                                              "output_final_state": True}  # (B*N, H, Dk, Dv)
    out, final = rule(*flat[:3], g=g.reshape(1, b * s, h).float(), beta=flat[3], scale=q.shape[-1] ** -0.5,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=row_bounds(bounds, b, q.device, torch.long), **state)
    final = None if initial_state is None else final.reshape(b, initial_state.shape[1], *final.shape[1:])
    return out.reshape(b, s, h, -1), final


def _call_kda(rule, q, k, v, g, beta, bounds, initial_state=None):
    """flash-linear-attention's ``chunk_kda`` over the batch rows laid end to end, as :func:`_call_gated_delta` with
    ``g`` (B, S, H, Dk) a log decay per key channel."""
    b, s, h, dk = q.shape
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, beta)]
    state = {} if initial_state is None else {"initial_state": initial_state.float().flatten(0, 1),
                                              "output_final_state": True}  # (B*N, H, Dk, Dv)
    out, final = rule(*flat[:3], g=g.reshape(1, b * s, h, dk).float(), beta=flat[3], scale=dk ** -0.5,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=row_bounds(bounds, b, q.device, torch.long), **state)
    final = None if initial_state is None else final.reshape(b, initial_state.shape[1], *final.shape[1:])
    return out.reshape(b, s, h, -1), final


def _call_simple_gla(rule, q, k, v, g, bounds, initial):
    """flash-linear-attention's ``chunk_simple_gla`` (no scale) over the batch rows laid end to end."""
    b, s, h, _ = q.shape
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v)]
    out, final = rule(*flat, g=g.reshape(1, b * s, h).float(), scale=1.0, initial_state=initial.float().flatten(0, 1),
                      output_final_state=True, cu_seqlens=row_bounds(bounds, b, q.device, torch.long))
    return out.reshape(b, s, h, -1).to(v.dtype), final.reshape(b, initial.shape[1], *final.shape[1:])


def _call_conv(fn, x, weight, bias, bounds, activation):
    """causal-conv1d over ``x`` (B, S, C), restarting at each segment of ``bounds``."""
    b, s, c = x.shape
    pos = gated_delta.positions_in_segments(bounds, x.device)
    seq_idx = (torch.cumsum((pos == 0).to(torch.int32), 0) - 1).expand(b, s).contiguous()  # segment of each token
    # causal-conv1d wants channel-last memory as a (B, C, S) view, and a segment index per token
    return fn(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation).transpose(1, 2)


# --- the probes: two documents in 128 tokens, two heads of 64, in bf16 as a training step runs them ---------------
BOUNDS = (0, 48, 128)


def _mixer_inputs(device: torch.device, generator: torch.Generator) -> list[torch.Tensor]:
    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device=device).to(dtype).requires_grad_()

    q, k, v = (rand(1, BOUNDS[-1], 2, 64) for _ in range(3))
    g = (-torch.rand(1, BOUNDS[-1], 2, generator=generator, device=device)).requires_grad_()  # decays in (0, 1]
    beta = torch.rand(1, BOUNDS[-1], 2, generator=generator, device=device).to(torch.bfloat16).requires_grad_()
    initial = rand(1, len(BOUNDS) - 1, 2, 64, 64, dtype=torch.float32)
    return [q, k, v, g, beta, initial]


def _probe_gated_delta(rule, device: torch.device, generator: torch.Generator) -> None:
    q, k, v, g, beta, initial = _mixer_inputs(device, generator)
    plain, _ = _call_gated_delta(rule, q, k, v, g, beta, BOUNDS)  # the all-to-all design's call
    out, final = _call_gated_delta(rule, q, k, v, g, beta, BOUNDS, initial)  # state passing's
    (plain.float().sum() + out.float().sum() + final.float().sum()).backward()


def _probe_kda(rule, device: torch.device, generator: torch.Generator) -> None:
    """chunk_kda's output, final states and every gradient held to seqmesh's torch rule on the same bf16 values
    (within 5% of each one's largest; a kernel that runs but answers otherwise fails too: its backward is not the
    gated one flash-linear-attention refuses on Hopper with Triton 3.4 to 3.7.0, so it would not raise there)."""
    from .kda import chunk_kda_states

    q, k, v, _, beta, initial = _mixer_inputs(device, generator)
    g = (-0.2 * torch.rand(*q.shape, generator=generator, device=device)).requires_grad_()  # per key channel
    inputs = [q, k, v, g, beta, initial]
    results = []
    for call in (lambda *x: _call_kda(rule, *x[:5], BOUNDS, x[5]),
                 lambda *x: chunk_kda_states(*x[:5], BOUNDS, x[5])):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out, final = call(*leaves)
        weights = torch.linspace(-1, 1, out.numel(), device=device).view(out.shape)
        ((out.float() * weights).sum() + final.float().sum()).backward()
        results.append([out, final] + [x.grad for x in leaves])
    for got, want in zip(*results):
        got, want = got.detach().float(), want.detach().float()
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        if not error < 0.05:
            raise RuntimeError(f"chunk_kda's results are {error:.3g} (relative) from seqmesh's torch rule's")


def _probe_simple_gla(rule, device: torch.device, generator: torch.Generator) -> None:
    q, k, v, g, _, initial = _mixer_inputs(device, generator)
    out, final = _call_simple_gla(rule, q, k, v, g, BOUNDS, initial)
    (out.float().sum() + final.float().sum()).backward()


def _probe_conv(fn, device: torch.device, generator: torch.Generator) -> None:
    x = torch.randn(1, BOUNDS[-1], 64, generator=generator, device=device).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(64, 4, generator=generator, device=device).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(64, generator=generator, device=device).to(torch.bfloat16).requires_grad_()
    _call_conv(fn, x, weight, bias, BOUNDS, "silu").float().sum().backward()


KERNELS = {"chunk_gated_delta_rule": Kernel("flash-linear-attention", _fla_gated_delta, _probe_gated_delta,
                                             _fla_refuses_gated_backward),
           "chunk_kda": Kernel("flash-linear-attention", _fla_kda, _probe_kda),
           "chunk_simple_gla": Kernel("flash-linear-attention", _fla_simple_gla, _probe_simple_gla,
                                      _fla_refuses_gated_backward),
           "causal_conv1d": Kernel("causal-conv1d", _causal_conv1d, _probe_conv)}
PROBE = KernelProbe(KERNELS)  # the process's verdicts (a kernel that runs on a device keeps running there)


@torch.compiler.assume_constant_result
def _works(name: str, device: str) -> bool:  # answered once while torch.compile traces: the probe is never traced
    return PROBE.works(name, torch.device(device))


def kernel(name: str, x: torch.Tensor):
    """``KERNELS[name]``'s function where it is installed and runs on ``x``'s device, else None (the torch rule)."""
    if x.device.type not in PROBE.devices:
        return None
    if not torch.compiler.is_compiling() and torch._subclasses.fake_tensor.is_fake(x):
        return None  # a rehearsal's fake tensors: no kernel launches, the torch rule's memory is rehearsed
    return PROBE.load(name) if _works(name, str(x.device)) else None


def probe_kernels(device: torch.device) -> dict[str, bool]:
    """Each kernel's verdict on ``device`` (probing the ones not yet probed): a job calls it before its first step,
    so a kernel that fails there warns before the step, not inside it."""
    return PROBE.probe_all(device)


# --- the layers' entry points ------------------------------------------------------------------------------------
def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: tuple[int, ...]
) -> torch.Tensor:
    """As :func:`gated_delta.chunk_gated_delta_rule`: q, k (B, S, H, Dk), v (B, S, H, Dv), g, beta (B, S, H)."""
    rule = kernel("chunk_gated_delta_rule", q)
    if rule is None:
        return gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, bounds)
    return _call_gated_delta(rule, q, k, v, g, beta, bounds)[0]


def gated_delta_rule_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: tuple[int, ...],
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gated_delta.chunk_gated_delta_rule_states`: each of the ``N`` segments starts from
    ``initial_state`` (B, N, H, Dk, Dv) -> (out (B, S, H, Dv), final states (B, N, H, Dk, Dv) in float32 or float64)."""
    rule = kernel("chunk_gated_delta_rule", q)
    if rule is None:
        return gated_delta.chunk_gated_delta_rule_states(q, k, v, g, beta, bounds, initial_state)
    return _call_gated_delta(rule, q, k, v, g, beta, bounds, initial_state)


def kda_rule_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: tuple[int, ...],
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As :func:`.kda.chunk_kda_states` (q, k (B, S, H, Dk), v (B, S, H, Dv), g (B, S, H, Dk), beta (B, S, H)), by
    flash-linear-attention's ``chunk_kda`` where it runs on q's device: (out (B, S, H, Dv), the segments' final
    states (B, N, H, Dk, Dv) where ``initial_state`` is given; the kernel's are None without one)."""
    rule = kernel("chunk_kda", q)
    if rule is None:
        from .kda import chunk_kda_states

        return chunk_kda_states(q, k, v, g, beta, bounds, initial_state)
    return _call_kda(rule, q, k, v, g, beta, bounds, initial_state)


def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, bounds: tuple[int, ...],
               initial: torch.Tensor | None):
    """flash-linear-attention's ``chunk_simple_gla`` where it runs on q's device (None elsewhere: the caller's torch
    rule): q, k (B, S, H, Dk), v (B, S, H, Dv), g (B, S, H), ``initial`` (B, N, H, Dk, Dv) or None (zero) -> (out,
    final states)."""
    rule = kernel("chunk_simple_gla", q)
    if rule is None:
        return None
    if initial is None:
        initial = q.new_zeros(q.shape[0], len(bounds) - 1, q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
    return _call_simple_gla(rule, q, k, v, g, bounds, initial)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bounds: tuple[int, ...], activation: str = "silu"
) -> torch.Tensor:
    """As :func:`gated_delta.causal_conv1d`: x (B, S, C), weight (C, K)."""
    fn = kernel("causal_conv1d", x) if activation in ("silu", "swish", None) else None
    if fn is None:
        return gated_delta.causal_conv1d(x, weight, bias, bounds, activation)
    return _call_conv(fn, x, weight, bias, bounds, activation)
