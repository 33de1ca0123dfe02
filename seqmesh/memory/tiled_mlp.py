"""The MLP of every decoder layer computed in sequence tiles, its forward recomputed in backward.

An MLP acts on each token alone, so tiles along the sequence give the same output; what changes is
memory. Untiled, autograd keeps four ``(B, L, intermediate)`` tensors per layer (gate, its activation,
up, their product); tiled, it keeps only the ``(B, L, hidden)`` input, and the ``(B, L/T, intermediate)``
working set of one tile at a time exists in forward and backward. Each tile is recomputed once in
backward (one extra MLP forward per layer, as DeepSpeed's ALST does).

Parameter gradients are the sum over tiles of each tile's gradient, so they equal the untiled ones up
to fp32 summation order. transformers is not edited: :func:`enable_tiled_mlp` sets an instance
``forward`` on each layer's ``mlp`` and :func:`disable_tiled_mlp` deletes it, restoring the class's.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.ranks import is_dtensor, partial_local, summed_to_slices
from ..model.doge import TILED_MLP_REFUSAL, is_doge_moe
from ..model.lm import decoder_layers


def tile_count(tokens: int, hidden: int) -> int:
    """Tiles for ``tokens`` local tokens: tiles of about ``hidden`` tokens, so a tile's
    ``(tile, intermediate)`` working set is about the size of one MLP weight (ALST's choice)."""
    return max(1, math.ceil(tokens / max(hidden, 1)))


class TiledMLPFunction(torch.autograd.Function):
    """Forward: the MLP tile by tile, keeping only its input; backward: each tile recomputed, then differentiated."""

    @staticmethod
    def forward(ctx, mlp: Callable, params: list[torch.Tensor], tiles: int, x: torch.Tensor, *weights):
        # x: (B, L, hidden); weights: the tensors ``params`` lists, passed so autograd routes their gradients
        ctx.mlp, ctx.params, ctx.tiles = mlp, params, tiles
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp(part) for part in x.tensor_split(tiles, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast  # recompute as forward ran
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[4:]) if need]
        dx = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        dweights: list[torch.Tensor | None] = [None] * len(wanted)
        start = 0
        for part, dpart in zip(x.tensor_split(ctx.tiles, dim=1), grad.tensor_split(ctx.tiles, dim=1)):
            stop = start + part.shape[1]
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                leaf = part.detach().requires_grad_(dx is not None)
                out = ctx.mlp(leaf)  # (B, tile, hidden)
            inputs = ([leaf] if dx is not None else []) + wanted
            grads = list(torch.autograd.grad(out, inputs, dpart, allow_unused=True))
            if dx is not None:
                dx[:, start:stop] = grads.pop(0)
            dweights = [g if acc is None else acc if g is None else acc + g for acc, g in zip(dweights, grads)]
            start = stop
        flat = iter(dweights)
        dparams = [next(flat) if need else None for need in ctx.needs_input_grad[4:]]
        return None, None, None, dx, *dparams


class TiledForward:
    """An MLP's ``forward`` in ``tiles`` sequence tiles (None: :func:`tile_count` of each input)."""

    def __init__(self, mlp: nn.Module, tiles: int | None):
        self.mlp, self.tiles = mlp, tiles

    def original(self, x: torch.Tensor) -> torch.Tensor:
        """The class's forward (the instance's is this object)."""
        return type(self.mlp).forward(self.mlp, x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.tiles or tile_count(x.shape[1], x.shape[-1])  # x: (B, L, hidden)
        tiles = min(tiles, x.shape[1])
        if is_dtensor(x):  # tensor parallelism: x gathered over the group (a replicated DTensor)
            return self.tensor_parallel(x, tiles)
        if tiles <= 1:
            return self.original(x)
        if not torch.is_grad_enabled():
            return torch.cat([self.original(part) for part in x.tensor_split(tiles, dim=1)], dim=1)
        params = list(self.mlp.parameters())  # FSDP2's gathered parameters while the layer runs
        return TiledMLPFunction.apply(self.original, params, tiles, x, *params)


    def tensor_parallel(self, x, tiles: int):
        """Under tensor parallelism: this rank's ``intermediate / T`` columns of gate and up and rows of down, tile
        by tile on the gathered ``(B, L, hidden)`` input, summed over the group once for the whole sequence (the
        reduce-scatter row-wise down would make), to ``(B, L/T, hidden)`` slices. The input's gradient is this
        rank's part of a sum over the group, as the column-parallel projections' is."""
        m = self.mlp
        projections = (m.gate_proj, m.up_proj, m.down_proj)
        if any(p.bias is not None for p in projections):
            raise ValueError(f"{type(m).__name__} has biases, which the tiled MLP under tensor parallelism does not add; "
                             "turn off tiled_mlp with tp > 1 for this model.")
        mesh = x.device_mesh
        gate, up, down = (p.weight.to_local() for p in projections)  # (I/T, H), (I/T, H), (H, I/T)

        def local(part: torch.Tensor) -> torch.Tensor:  # (B, tile, H) -> this rank's share of the output
            return F.linear(m.act_fn(F.linear(part, gate)) * F.linear(part, up), down)

        tokens = partial_local(x)  # (B, L, H)
        if torch.is_grad_enabled() and tiles > 1:
            out = TiledMLPFunction.apply(local, [gate, up, down], tiles, tokens, gate, up, down)
        else:
            out = torch.cat([local(part) for part in tokens.tensor_split(max(tiles, 1), dim=1)], dim=1)
        return summed_to_slices(out, mesh)


def enable_tiled_mlp(model: nn.Module, tiles: int | None = None) -> None:
    """Compute every decoder layer's ``mlp`` (of a transformers causal LM) in sequence tiles."""
    if tiles is not None and tiles < 1:
        raise ValueError(f"tiles must be at least 1 (None: chosen from the shapes), got {tiles}.")
    layers = decoder_layers(model)
    for layer in layers:  # every layer checked before any is changed
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ValueError(f"{type(layer).__name__} has no 'mlp' submodule to tile.")
        if is_doge_moe(mlp):
            raise ValueError(f"{type(mlp).__name__}: {TILED_MLP_REFUSAL}.")
        inputs = [p.name for p in list(inspect.signature(type(mlp).forward).parameters.values())[1:]
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(inputs) != 1:
            raise ValueError(f"{type(mlp).__name__}'s forward takes {', '.join(inputs)}: the tiled MLP tiles an MLP of "
                             "the hidden states alone (BLOOM's adds the residual inside it); train this model without "
                             "tiled_mlp.")
    for layer in layers:
        layer.mlp.forward = TiledForward(layer.mlp, tiles)


def disable_tiled_mlp(model: nn.Module) -> None:
    """Undo :func:`enable_tiled_mlp`: each ``mlp`` runs its class's forward again."""
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and isinstance(mlp.__dict__.get("forward"), TiledForward):
            del mlp.forward
