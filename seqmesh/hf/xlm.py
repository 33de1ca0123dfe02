"""XLM's padding rule made from the whole row (transformers' ``xlm``; its attention layers are
:mod:`seqmesh.hf.own_attention`'s).

XLM decides which tokens are padding by counting, not by looking: ``get_masks`` keeps the first ``n`` tokens of a
call, ``n`` its count of ids that are not ``pad_index`` (wherever they stand), zeroes the hidden states of the rest
after the embeddings and every layer, and, attending both ways (``causal=False``, its default: a masked language
model), hides their keys too. On a shard each rank would count and keep its own tokens. A forward pre-hook of the
parallelized ``XLMModel`` gathers the row's ids (one all-gather of ``(B, T)`` integers), counts them per document
(each packed document as a call of its own would: the reference the census holds it to), and hands the model this
rank's share of the kept tokens as its ``attention_mask``, which ``get_masks`` takes instead of its count:

    kept[t] = (t's index in its document) < (its document's ids that are not pad_index)       (B, L) bool

A causal XLM ignores the mask in attention (its layers attend causally), so only the zeroing follows it; one
attending both ways is computed where nothing is hidden (no ``pad_index`` in the row) and refused otherwise, on every
rank alike (each holds the row). ``lengths``, ``langs`` and ``token_type_ids`` are refused by name: seqmesh shards
none of them; so is a cache (XLM makes an empty one each call, which its layers, run by seqmesh, leave empty).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..rules.own_attention import LAYER_CLASSES
from ..sequence.batch import SequenceInfo, document_places
from .indexed_attention import whole_row
from .own_attention import family_key


def kept_tokens(ids: torch.Tensor, pad: int, mesh: SPMesh, info: SequenceInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, L)`` bool: which of this rank's tokens XLM keeps, by its count over each document of the row; and the
    row's ``(B, T)`` bool of ids that are not ``pad`` (the same on every rank)."""
    real = whole_row(ids, mesh, info) != pad  # (B, T)
    counted = torch.nn.functional.pad(real.long().cumsum(dim=1), (1, 0))  # (B, T + 1): real ids before each index
    bounds = torch.tensor(info.cu_seqlens or (0, info.seq_len), device=ids.device)
    start, index, _ = document_places(mesh, info, ids.device)  # (L,) each
    end = bounds[1:][torch.bucketize(start, bounds[1:], right=True)]  # (L,) where each token's document ends
    count = counted[:, end] - counted[:, start]  # (B, L): its document's real ids
    return index[None, :] < count, real


def _refuse_inputs(kwargs: dict) -> None:
    if kwargs.get("cache") is not None:
        raise ValueError("XLM was called with a cache, which its layers run by seqmesh neither read nor fill; call the "
                         "parallelized model without one (to generate, seqmesh.hf.unparallelize(model) first).")
    given = [n for n in ("lengths", "langs", "token_type_ids") if kwargs.get(n) is not None]
    if given:
        raise ValueError(f"XLM was called with {', '.join(given)}, which seqmesh does not shard along the sequence (a "
                         "shard would read the whole row's); call it without them (XLM counts each row's padding from "
                         "its ids).")


def _mark_padding(mesh: SPMesh):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        # the XLMModel's call: input_ids (B, L) in shard order -> attention_mask (B, L), the tokens XLM keeps
        _refuse_inputs(kwargs)
        info = kwargs.get("seqmesh")
        ids = args[0] if args else kwargs.get("input_ids")
        if info is None or ids is None:  # embeddings given: XLM keeps every token, as on one process
            return None
        kept, real = kept_tokens(ids, module.pad_index, mesh, info)
        if not module.causal and not bool(real.all()):  # read on the host only where it decides (no sync if causal)
            raise ValueError(f"XLM attends both ways (causal=False) and this row holds its padding id "
                             f"(pad_index={module.pad_index}), whose count hides the last keys of each row, which "
                             "seqmesh's attention (no mask of keys) does not compute; give rows without that id, or "
                             "train XLM as a causal model (causal=True).")
        return args, {**kwargs, "attention_mask": kept}

    return hook


def install(decoder: nn.Module, found: list, mesh: SPMesh) -> list:
    """The padding hook on ``decoder`` (an XLMModel) where ``found``, the layers seqmesh runs itself, are XLM's;
    its handle, or none. Registered after :func:`seqmesh.hf.own_attention.refuse_padding_masks`, which refuses a
    caller's own mask first."""
    if not any(family_key(m) == LAYER_CLASSES["xlm"] for _, m in found):
        return []
    return [decoder.register_forward_pre_hook(_mark_padding(mesh), with_kwargs=True)]
