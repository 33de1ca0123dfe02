"""The token mixers that are not attention, one entry each: what ``parallelize`` asks of a mixer.

A transformers layer that mixes tokens outside the attention interface (a recurrence, a short
convolution, Doge's experts routed by other tokens' logits) gets an instance-level ``forward`` that runs it
sequence-parallel, exactly; the class
and transformers' code are untouched, and ``unparallelize`` deletes the forward again. Each kind
of mixer is one module of ``seqmesh.hf`` exposing a :class:`.mixer_kind.MixerKind`:

- ``find(model, mesh, design)``: its layers in ``model`` (path, module), checked for ``mesh`` and the
  design before anything is changed (a ValueError naming the fix);
- ``install(model, mesh, layers, design)`` / ``uninstall(model)``;
- ``layer_types``: the ``config.layer_types`` entries its layers carry, accepted once it has layers.

Every other mixer is refused by :func:`seqmesh.hf.layers.check_layers`. The math lives in
``seqmesh.linear_attention`` (the halo conv, the state pass, the all-to-all by heads); a module here
only reads a family's projections and parameters and calls it.
"""

from __future__ import annotations

import torch.nn as nn

from ..mesh import SPMesh
from ..model.lm import decoder_of
from . import (cca, doge_moe, inkling, inkling2, kda, lightning, linear_attention, mamba, mamba2, ngram_ple,
               own_attention, rg_lru, rwkv, short_conv, xlstm)
from .layers import calls_without_kwargs
from .mixer_kind import ENTRY_ATTR, REPLACED_ATTR, Layers, MixerKind


def _carrier(decoder: nn.Module, path: str) -> nn.Module | None:
    """The deepest module on ``path`` (from ``decoder``) whose callers all pass their ``**kwargs`` on, so that it
    receives the seqmesh entry; None when the mixer itself does at every call (a module that calls it once with and
    once without them carries it: the mixer prefers the entry of its own kwargs)."""
    module = decoder
    for child in path.split(".") if path else ():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) and calls_without_kwargs(type(module), child,
                                                                                         anywhere=True):
            return module
        module = getattr(module, child)
    return None


def carry_entry(model: nn.Module, found: dict[MixerKind, Layers]) -> list:
    """Forward pre-hooks that hand seqmesh's entry to mixers whose callers drop their ``**kwargs`` (Jamba's decoder
    layer calls its Mamba mixer with named arguments only; at transformers 5.15 LFM2's and Mamba2's do too): the
    deepest module on the mixer's path that still receives the entry (its *carrier*) sets it on its mixers at each of
    its calls, and it stays there until the next one: a checkpointed layer's recompute, in backward, runs the layer's
    forward again without its hooks (transformers checkpoints ``forward``, not ``__call__``), and its mixers must still
    find the entry of the forward being recomputed (the last one: seqmesh runs each forward's backward before the
    next forward). A call without an entry sets None, so a later plain call is refused, never given a stale entry. The
    hooks' handles."""
    decoder = decoder_of(model)
    where = next((p for p, m in model.named_modules() if m is decoder), "")
    held: dict[int, tuple[nn.Module, list[nn.Module]]] = {}
    for kind, layers in found.items():
        if kind is own_attention.KIND:  # reached as an attention module is, by seqmesh.hf._hook_entry's relays
            continue
        for path, mixer in layers:
            if where and not path.startswith(where + "."):
                continue  # outside the decoder: not a decoder's mixer
            carrier = _carrier(decoder, path[len(where) + 1:] if where else path)
            if carrier is not None:
                held.setdefault(id(carrier), (carrier, []))[1].append(mixer)

    def hand(mixers: list[nn.Module]):
        def give(module, args, kwargs):  # plain attribute writes, which torch.compile traces (2.9 cannot trace pop)
            for m in mixers:
                setattr(m, ENTRY_ATTR, kwargs.get("seqmesh"))

        return give

    return [carrier.register_forward_pre_hook(hand(mixers), with_kwargs=True) for carrier, mixers in held.values()]


def uninstall(model: nn.Module) -> None:
    """Every mixer's own forward again."""
    for module in model.modules():
        if getattr(module, REPLACED_ATTR, None) is not None:
            del module.forward
            delattr(module, REPLACED_ATTR)
        module.__dict__.pop(ENTRY_ATTR, None)


def has_mixers(model: nn.Module) -> bool:
    """Whether any layer of ``model`` runs one of seqmesh's sequence-parallel mixers."""
    return any(getattr(module, REPLACED_ATTR, None) is not None for module in model.modules())


def kinds() -> tuple[MixerKind, ...]:
    """Every mixer seqmesh runs sequence-parallel, in the order ``parallelize`` looks for them."""
    return (linear_attention.KIND, mamba2.KIND, mamba.KIND, rg_lru.KIND, lightning.KIND, short_conv.KIND, kda.KIND,
            cca.KIND, rwkv.KIND, xlstm.KIND, ngram_ple.KIND, inkling.KIND, inkling2.KIND, doge_moe.KIND,
            own_attention.KIND)


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
