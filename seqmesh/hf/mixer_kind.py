"""What one kind of token mixer that is not attention gives ``parallelize`` (a :class:`MixerKind`), and the
refusals every such mixer shares (:func:`check_mixer_context`). Each kind's module (``kda``, ``lightning``,
``linear_attention``, ``mamba``, ``mamba2``, ``rg_lru``, ``short_conv``) imports this; :mod:`.mixers` lists the kinds and
finds, installs and removes them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from ..mesh import SPMesh

Layers = list[tuple[str, nn.Module]]
REPLACED_ATTR = "_seqmesh_mixer"  # on a module whose forward seqmesh replaced: the kind's name
ENTRY_ATTR = "_seqmesh_entry"  # on a mixer, during its carrier's call: the seqmesh entry the carrier received
CHUNK_ATTR = "_seqmesh_chunk"  # on the attention module of a chunked-attention layer (Llama 4): its chunk


@dataclass(frozen=True)
class MixerKind:
    name: str  # as a user knows it ("Gated DeltaNet", "Mamba2")
    layer_types: tuple[str, ...]  # config.layer_types entries of its layers
    find: Callable[[nn.Module, SPMesh, str], Layers]
    make_forward: Callable[[nn.Module, SPMesh, str], Callable]  # (module, mesh, design) -> forward(self, ...)

    def install(self, layers: Layers, mesh: SPMesh, design: str) -> int:
        for _, module in layers:
            module.forward = types.MethodType(taking_entry(self.make_forward(module, mesh, design)), module)
            setattr(module, REPLACED_ATTR, self.name)
        return len(layers)


def taking_entry(forward: Callable) -> Callable:
    """``forward`` given the seqmesh entry its carrier handed over (:func:`.mixers.carry_entry`) where its caller
    passed none."""
    def with_entry(self, *args, **kwargs):
        held = getattr(self, ENTRY_ATTR, None)
        if kwargs.get("seqmesh") is None and held is not None:
            kwargs["seqmesh"] = held
        return forward(self, *args, **kwargs)

    return with_entry


def refuse_tensor_parallel(layers: Layers, mesh: SPMesh, what: str) -> None:
    """A ValueError, before anything is changed, where ``mesh`` has tensor parallelism and ``layers`` (a kind's, found)
    are some: ``what`` says what the first one is and why seqmesh's tensor parallelism does not split it."""
    if layers and getattr(mesh, "tp", 1) > 1:
        path, module = layers[0]
        raise ValueError(f"{path} ({type(module).__name__}) {what}; train this model with tp=1 (its sequence "
                         "parallelism is exact).")


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
