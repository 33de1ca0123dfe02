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
from ..model.lm import decoder_of
from .layers import calls_without_kwargs

Layers = list[tuple[str, nn.Module]]
_ATTR = "_seqmesh_mixer"  # on a module whose forward seqmesh replaced: the kind's name
_ENTRY = "_seqmesh_entry"  # on a mixer, during its carrier's call: the seqmesh entry the carrier received


@dataclass(frozen=True)
class MixerKind:
    name: str  # as a user knows it ("Gated DeltaNet", "Mamba2")
    layer_types: tuple[str, ...]  # config.layer_types entries of its layers
    find: Callable[[nn.Module, SPMesh, str], Layers]
    make_forward: Callable[[nn.Module, SPMesh, str], Callable]  # (module, mesh, design) -> forward(self, ...)

    def install(self, layers: Layers, mesh: SPMesh, design: str) -> int:
        for _, module in layers:
            module.forward = types.MethodType(_taking_entry(self.make_forward(module, mesh, design)), module)
            setattr(module, _ATTR, self.name)
        return len(layers)


def _taking_entry(forward: Callable) -> Callable:
    """``forward`` given the seqmesh entry its carrier handed over (:func:`carry_entry`) where its caller passed none."""
    def with_entry(self, *args, **kwargs):
        held = getattr(self, _ENTRY, None)
        if kwargs.get("seqmesh") is None and held is not None:
            kwargs["seqmesh"] = held
        return forward(self, *args, **kwargs)

    return with_entry


def _carrier(decoder: nn.Module, path: str) -> nn.Module | None:
    """The deepest module on ``path`` (from ``decoder``) whose callers all pass their ``**kwargs`` on, so that it
    receives the seqmesh entry; None when the mixer itself does."""
    module = decoder
    for child in path.split(".") if path else ():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) and calls_without_kwargs(type(module), child):
            return module
        module = getattr(module, child)
    return None


def carry_entry(model: nn.Module, found: dict[MixerKind, Layers]) -> list:
    """Forward hooks that hand seqmesh's entry to mixers whose callers drop their ``**kwargs`` (Jamba's decoder layer
    calls its Mamba mixer with named arguments only; at transformers 5.15 LFM2's and Mamba2's do too): the deepest
    module on the mixer's path that still receives the entry (its *carrier*) holds it on its mixers for the length of
    its own call (a checkpointed layer's recompute calls it again). The hooks' handles."""
    decoder = decoder_of(model)
    where = next((p for p, m in model.named_modules() if m is decoder), "")
    held: dict[int, tuple[nn.Module, list[nn.Module]]] = {}
    for _, layers in found.items():
        for path, mixer in layers:
            if where and not path.startswith(where + "."):
                continue  # outside the decoder: not a decoder's mixer
            carrier = _carrier(decoder, path[len(where) + 1:] if where else path)
            if carrier is not None:
                held.setdefault(id(carrier), (carrier, []))[1].append(mixer)

    def hand(mixers: list[nn.Module]):
        def give(module, args, kwargs):  # plain attribute writes, which torch.compile traces (2.9 cannot trace pop)
            for m in mixers:
                setattr(m, _ENTRY, kwargs.get("seqmesh"))

        def take_back(module, args, kwargs, output):
            for m in mixers:
                setattr(m, _ENTRY, None)

        return give, take_back

    handles = []
    for carrier, mixers in held.values():
        give, take_back = hand(mixers)
        handles += [carrier.register_forward_pre_hook(give, with_kwargs=True),
                    carrier.register_forward_hook(take_back, with_kwargs=True, always_call=True)]
    return handles


def uninstall(model: nn.Module) -> None:
    """Every mixer's own forward again."""
    for module in model.modules():
        if getattr(module, _ATTR, None) is not None:
            del module.forward
            delattr(module, _ATTR)
        module.__dict__.pop(_ENTRY, None)


def kinds() -> tuple[MixerKind, ...]:
    """Every mixer seqmesh runs sequence-parallel, in the order ``parallelize`` looks for them."""
    from . import kda, lightning, linear_attention, mamba, mamba2, short_conv

    return (linear_attention.KIND, mamba2.KIND, mamba.KIND, lightning.KIND, short_conv.KIND, kda.KIND)


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
