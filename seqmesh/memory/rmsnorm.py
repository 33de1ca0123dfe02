"""transformers' Llama-style RMSNorm with a lean backward: the same forward, bit for bit, keeping only
the input and one float32 scale per token, and a backward in sequence tiles.

transformers' eager RMSNorm is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.
Autograd through it keeps the float32 input (in bf16 a copy), the float32 scale and the normalized
tensor, and its backward makes several ``(tokens, hidden)`` float32 temporaries at once. Here
:class:`RMSNormFunction` runs those same ops in forward (so the output is bitwise equal), keeps ``x`` in
its own dtype and ``rstd`` (float32, one per token), and in backward recomputes the normalized tensor
one tile of tokens at a time, so the float32 temporaries are one tile's. The weight's gradient is
summed over tiles in float32 and cast to the weight's dtype once.

Only modules whose forward is that formula are replaced: the class must be one of
:data:`LLAMA_STYLE_NORMS` and a probe (a shallow copy of the module with fresh random weights, fp32 and bf16
inputs; its own tensors, real even in a rehearsal) must give bitwise the output of the class's own forward.
Anything else (Gemma's ``1 + weight``, norms that cast before the weight, gated norms) is skipped and reported.
transformers is not edited: :func:`enable_efficient_norm` sets an instance ``forward`` on each norm and
:func:`disable_efficient_norm` deletes it, restoring the class's.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

from ..comm.ranks import is_dtensor, partial_local
from ..tensor_values import real_tensors

from .tiled_mlp import tile_count

# transformers' RMSNorm classes written as weight * normalize(x.float()).to(x.dtype)
LLAMA_STYLE_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm",
})


def rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ops: the normalized ``x`` in float32 and ``rstd = rsqrt(mean(x^2) + eps)``."""
    x32 = x.to(torch.float32)  # (..., H)
    variance = x32.pow(2).mean(-1, keepdim=True)  # (..., 1)
    rstd = torch.rsqrt(variance + eps)
    return x32 * rstd, rstd


def tile_backward(x_t: torch.Tensor, g_t: torch.Tensor, r_t: torch.Tensor, weight: torch.Tensor,
                  dweight: torch.Tensor | None, want_x: bool) -> torch.Tensor | None:
    """One tile's input gradient in float32 (None unless ``want_x``), adding its weight gradient into the
    float32 ``dweight``. The ops autograd runs through transformers' norm, on ``n`` tokens: at most three
    ``(n, H)`` float32 tensors live at once (two in fp32, where ``x.float()`` is ``x`` itself)."""
    x32 = x_t.to(torch.float32)  # (n, H)
    if dweight is not None:  # (grad * normalized.to(dtype)) summed over tokens, here in float32
        dweight += (g_t * (x32 * r_t).to(x_t.dtype)).sum(0, dtype=torch.float32)
    if not want_x:
        return None
    hidden = x_t.shape[-1]
    dn = (g_t * weight).to(torch.float32)  # (n, H)
    dr = (dn * x32).sum(-1, keepdim=True)  # (n, 1): through x * rstd
    dvariance = dr * -0.5 * r_t.pow(3) / hidden  # through rsqrt, then the mean
    return dn.mul_(r_t).add_((x32 * 2).mul_(dvariance))  # dx = dn * rstd + 2x * dvariance


class RMSNormFunction(torch.autograd.Function):
    """Forward: transformers' RMSNorm, keeping x and its float32 rstd; backward: dx and dweight tile by tile."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, tiles: int | None) -> torch.Tensor:
        # x: (..., H); weight: (H,)
        normalized, rstd = rms_normalize(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.tiles = tiles
        return weight * normalized.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)  # (N, H), a view where x is contiguous
        grads = grad.reshape(-1, hidden)  # (N, H), the output's dtype
        scales = rstd.reshape(-1, 1)  # (N, 1) float32
        tiles = min(ctx.tiles or tile_count(rows.shape[0], hidden), rows.shape[0])
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(rows) if want_x else None
        dweight = torch.zeros(hidden, dtype=torch.float32, device=x.device) if want_w else None
        start = 0
        for x_t, g_t, r_t in zip(rows.tensor_split(tiles), grads.tensor_split(tiles), scales.tensor_split(tiles)):
            stop = start + x_t.shape[0]
            dx_t = tile_backward(x_t, g_t, r_t, weight, dweight, want_x)  # (n, H) float32 or None
            if dx_t is not None:
                dx[start:stop] = dx_t
            del dx_t  # one tile's float32 temporaries at a time
            start = stop
        dx = dx.view_as(x) if want_x else None
        dweight = dweight.to(weight.dtype) if want_w else None
        return dx, dweight, None, None


class EfficientNormForward:
    """A norm's ``forward`` through :class:`RMSNormFunction` (the class's when nothing needs a gradient)."""

    def __init__(self, norm: nn.Module, eps: float, tiles: int | None):
        self.norm, self.eps, self.tiles = norm, eps, tiles

    def original(self, x: torch.Tensor) -> torch.Tensor:
        """The class's forward (the instance's is this object)."""
        return type(self.norm).forward(self.norm, x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.norm.weight  # FSDP2's gathered weight while the layer runs
        if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
            return self.original(x)
        if is_dtensor(x):  # tensor parallelism: x a DTensor sliced over the group, the weight replicated
            from torch.distributed.tensor import DTensor

            # each rank normalizes its own slice (per token: no traffic); the weight's gradient, summed over
            # its slice's tokens, is its part of a sum over the group
            out = RMSNormFunction.apply(x.to_local(), partial_local(weight), self.eps, self.tiles)
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
        return RMSNormFunction.apply(x, weight, self.eps, self.tiles)


def norm_epsilon(norm: nn.Module) -> float | None:
    """The module's epsilon (``variance_epsilon`` in transformers' Llama family), None if it has none."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def matches_llama_norm(norm: nn.Module) -> bool:
    """Whether ``norm``'s class forward equals :class:`RMSNormFunction`'s bitwise, on a CPU copy with random
    weights (meta or sharded modules included): fp32 and bf16 inputs, fp32 and bf16 weights."""
    eps, weight = norm_epsilon(norm), getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or norm._modules:
        return False
    with real_tensors():
        return _probe_agrees(norm, eps, weight)


def _probe_agrees(norm: nn.Module, eps: float, weight: torch.Tensor) -> bool:
    """:func:`matches_llama_norm`'s probe: a shallow copy of ``norm`` (its class and attributes, such as the epsilon)
    with fresh CPU tensors of its parameters' and buffers' shapes; the module itself is not copied or touched."""
    gen = torch.Generator().manual_seed(0)
    probe = copy.copy(norm)
    probe._parameters = {name: nn.Parameter(torch.empty(p.shape)) for name, p in norm._parameters.items()}
    probe._buffers = {name: torch.empty(b.shape, dtype=b.dtype) for name, b in norm._buffers.items()}
    for w_dtype, x_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.float32, torch.bfloat16)):
        probe.to(w_dtype)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(weight.shape[0], generator=gen) + 1)
        x = (torch.randn(2, 5, weight.shape[0], generator=gen) * 3).to(x_dtype)  # (B, L, H)
        with torch.no_grad():
            expected = type(norm).forward(probe, x)
            got = RMSNormFunction.apply(x, probe.weight, eps, None)
        if expected.dtype != got.dtype or not torch.equal(expected, got):
            return False
    return True


def enable_efficient_norm(model: nn.Module, tiles: int | None = None) -> int:
    """Replace the forward of every transformers Llama-style RMSNorm in ``model`` (layers' norms, q/k norms,
    the final norm) with :class:`RMSNormFunction`; returns how many. Norms of other kinds are left as
    they are and named in a warning. ``tiles``: backward tiles per norm; None: about ``hidden`` tokens per
    tile (:func:`~seqmesh.memory.tiled_mlp.tile_count`). Apply before FSDP2's ``fully_shard``."""
    if tiles is not None and tiles < 1:
        raise ValueError(f"tiles must be at least 1 (None: chosen from the shapes), got {tiles}.")
    replaced, skipped, verdicts = 0, set(), {}
    for module in model.modules():
        kind = type(module).__name__
        if "norm" not in kind.lower() or isinstance(module.__dict__.get("forward"), EfficientNormForward):
            continue
        if kind not in LLAMA_STYLE_NORMS:
            skipped.add(kind)
            continue
        key = (type(module), norm_epsilon(module), tuple(module.weight.shape))
        if key not in verdicts:
            verdicts[key] = matches_llama_norm(module)
        if not verdicts[key]:
            skipped.add(kind)
            continue
        module.forward = EfficientNormForward(module, norm_epsilon(module), tiles)
        replaced += 1
    if skipped:
        warnings.warn(f"efficient norm: left {', '.join(sorted(skipped))} as they are (not transformers' "
                      "Llama-style RMSNorm, weight * normalize(x.float()).to(x.dtype)).", stacklevel=2)
    return replaced


def disable_efficient_norm(model: nn.Module) -> int:
    """Undo :func:`enable_efficient_norm`: each norm runs its class's forward again; returns how many."""
    restored = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), EfficientNormForward):
            del module.forward
            restored += 1
    return restored
