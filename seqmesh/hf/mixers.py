"""The token mixers that are not attention, one entry each: what ``parallelize`` asks of a mixer.

A transformers layer that mixes tokens outside the attention interface (a recurrence, a short
convolution) gets an instance-level ``forward`` that runs it sequence-parallel, exactly; the class
and transformers' code are untouched, and ``unparallelize`` deletes the forward again. Each kind
of mixer is one module of ``seqmesh.hf`` exposing a :class:`MixerKind`:

- ``find(model, mesh, design)``: its layers in ``model`` (path, module), checked for ``mesh`` and the
  design before anything is changed (a ValueError naming the fix);
- ``install(model, mesh, layers, design)`` / ``uninstall(model)``;
- ``layer_types``: the ``config.layer_types`` entries its layers carry, accepted once it has layers.

Every other mixer is refused by :func:`seqmesh.hf.layers.check_layers`. The math lives in
``seqmesh.linear_attention`` (the halo conv, the state pass, the all-to-all by heads); a module here
only reads a family's projections and parameters and calls it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from ..mesh import SPMesh

Layers = list[tuple[str, nn.Module]]
_ATTR = "_seqmesh_mixer"  # on a module whose forward seqmesh replaced: the kind's name


@dataclass(frozen=True)
class MixerKind:
    name: str  # as a user knows it ("Gated DeltaNet", "Mamba2")
    layer_types: tuple[str, ...]  # config.layer_types entries of its layers
    find: Callable[[nn.Module, SPMesh, str], Layers]
    make_forward: Callable[[nn.Module, SPMesh, str], Callable]  # (module, mesh, design) -> forward(self, ...)

    def install(self, layers: Layers, mesh: SPMesh, design: str) -> int:
        for _, module in layers:
            module.forward = types.MethodType(self.make_forward(module, mesh, design), module)
            setattr(module, _ATTR, self.name)
        return len(layers)


def uninstall(model: nn.Module) -> None:
    """Every mixer's own forward again."""
    for module in model.modules():
        if getattr(module, _ATTR, None) is not None:
            del module.forward
            delattr(module, _ATTR)


def kinds() -> tuple[MixerKind, ...]:
    """Every mixer seqmesh runs sequence-parallel, in the order ``parallelize`` looks for them."""
    from . import lightning, linear_attention, mamba, mamba2, short_conv

    return (linear_attention.KIND, mamba2.KIND, mamba.KIND, lightning.KIND, short_conv.KIND)


def mixer_layers(model: nn.Module, mesh: SPMesh, design: str) -> dict[MixerKind, Layers]:
    """Each kind's layers in ``model`` (kinds without layers left out), checked."""
    found = {}
    taken: set[int] = set()
    for kind in kinds():
        layers = [(path, m) for path, m in kind.find(model, mesh, design) if id(m) not in taken]
        taken |= {id(m) for _, m in layers}
        if layers:
            found[kind] = layers
    return found


def check_mixer_context(module: nn.Module, info, cache, attention_mask) -> None:
    """The refusals every sequence-parallel mixer shares: a call without seqmesh's entry, with a cache, or with a
    padding mask."""
    name = type(module).__name__
    if info is None:
        raise ValueError(
            f"{name} runs sequence-parallel but was called without the 'seqmesh' entry; call the model "
            "with the batch returned by seqmesh.shard_batch (model(**batch)), or seqmesh.hf.unparallelize(model) first.")
    if cache is not None:
        raise ValueError(f"{name} runs sequence-parallel and keeps no cache, but was given a {type(cache).__name__}: "
                         "call the parallelized model without one (leave use_cache unset); to generate, call "
                         "seqmesh.hf.unparallelize(model) first.")
    if attention_mask is not None:
        raise ValueError(
            f"{name} received a padding mask of shape {tuple(attention_mask.shape)}; seqmesh describes padding and "
            "packed documents through shard_batch instead (pass position_ids, not attention_mask).")
