"""What a family derives from the whole input's positions, made from the whole sequence on every rank.

transformers computes a few position-dependent quantities from what one call is given. Called on a shard, each
rank would decide from its own tokens and train silently wrong, so seqmesh gives the model the whole sequence's:

- **rotary scaling decided by the largest position** (``rope_type`` ``dynamic``: NTK scaling once the input
  passes ``max_position_embeddings``; ``longrope``: the long or short factors past
  ``original_max_position_embeddings``). transformers' ``dynamic_rope_update`` decides from
  ``max(position_ids) + 1`` of each call. :func:`install` makes every such rotary embedding of the decoder skip
  that per-call decision; a forward pre-hook of the decoder makes it once per batch, with transformers' own
  update, from :attr:`SequenceInfo.max_position` (the whole batch's largest position, from ``shard_batch``).
  The module's state (dynamic NTK's cached length) then evolves batch by batch as on one process.
- **positions a family numbers itself** (RoBERTa, XLM-R, CamemBERT, Data2Vec-text, X-MOD: from ``padding_idx + 1``,
  padding tokens kept at ``padding_idx``). :func:`own_positions` runs the family's own rule on the whole batch
  for ``seqmesh.shard_batch(..., model=model)``; a batch sharded without the model is refused at the decoder.
- **positions a decoder numbers from 0 on each call** (the decoders of encoder-decoder families as causal LMs:
  BART, mBART, Marian, Pegasus, Blenderbot, PLBart, BigBird-Pegasus, MusicGen take no position_ids and number
  ``cache_length .. cache_length + L - 1``). Their position module is run by its own rule over the spans of
  positions this rank's tokens hold, and each token takes its own row (:func:`_renumbered`): their indices in
  their documents, so packed documents count from 0 each. BigBird-Pegasus's decoder builds its self-attentions
  without ``is_causal`` and makes them causal by its mask; seqmesh, which builds no mask, sets the flag.
- **Llama 4's attention temperature** on its no-RoPE layers: ``log1p(floor((i + 1) / floor_scale)) * attn_scale
  + 1`` of each token's index ``i`` in the row, which transformers takes from ``arange`` over the call's tokens
  (and a cache). Those layers get an instance-level ``forward`` (:func:`_temperature_forward`; the class is
  untouched) that takes ``i`` from the layout: each local token's index in the whole sequence, as transformers
  computes on the whole row (packed documents included: the row index, not the document position).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..model.lm import decoder_of
from ..sequence.batch import SequenceInfo, document_places
from ..sequence.sharding import sequence_positions
from ..tensor_values import real_tensors

_ATTR = "_seqmesh_positions"
_CAUSAL = "_seqmesh_made_causal"


@functools.lru_cache(maxsize=1)
def _update_code():
    """The code object every ``dynamic_rope_update``-decorated forward shares (None where transformers has none)."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _update_wrapper(module: nn.Module):
    """The ``dynamic_rope_update`` wrapper of ``module``'s class forward, under any decorators above it
    (transformers 5.15 puts ``torch.no_grad()`` on top), or None."""
    forward = getattr(type(module), "forward", None)
    while forward is not None and _update_code() is not None:
        if getattr(forward, "__code__", None) is _update_code():
            return forward
        forward = getattr(forward, "__wrapped__", None)
    return None


def _scaled_kinds(module: nn.Module) -> list[str | None]:
    """The layer types (None: the module's only one) whose rotary tables ``module`` rescales from the largest
    position of each call: transformers' ``dynamic_rope_update`` rule (``dynamic`` in the type, or ``longrope``)."""
    if _update_wrapper(module) is None:
        return []
    kinds = module.rope_type
    named = kinds.items() if isinstance(kinds, dict) else [(None, kinds)]
    return [layer for layer, kind in named if "dynamic" in kind or kind == "longrope"]


def scaled_rotaries(model: nn.Module) -> list[nn.Module]:
    """The rotary embeddings of ``model`` whose tables depend on the largest position they are given."""
    return [m for m in model.modules() if _scaled_kinds(m)]


def numbering_embeddings(model: nn.Module) -> nn.Module | None:
    """The embeddings module of ``model`` that numbers positions itself from the input ids when none are given
    (``create_position_ids_from_input_ids`` with a ``padding_idx``: RoBERTa-style offsets), or None."""
    for module in model.modules():
        if callable(getattr(module, "create_position_ids_from_input_ids", None)) and \
                isinstance(getattr(module, "padding_idx", None), int):
            return module
    return None


def own_positions(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """``(B, S)`` the positions ``model``'s family gives the whole batch ``input_ids`` ``(B, S)`` when it is given
    none, by the family's own rule; None for a family that counts from 0 (seqmesh's own positions are its)."""
    embeddings = numbering_embeddings(model)
    if embeddings is None:
        return None
    return embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx)


def counting_embeddings(model: nn.Module) -> nn.Module | None:
    """The position embedding of a decoder that takes no position_ids and numbers each call's tokens from its cache
    length (``embed_positions(input, cache_length)``; ``past_key_values_length`` in transformers 5.15): the decoders
    of the encoder-decoder families, BART, mBART, Marian, Pegasus, Blenderbot, PLBart, BigBird-Pegasus, MusicGen; or
    None."""
    decoder = decoder_of(model)
    if "position_ids" in inspect.signature(decoder.forward).parameters:
        return None
    # the decoder's own, or its encoder's (RoFormer's sinusoidal table, given to every layer's attention)
    module = getattr(decoder, "embed_positions", None) or getattr(getattr(decoder, "encoder", None), "embed_positions",
                                                                 None)
    forward = getattr(type(module), "forward", None)
    if forward is None or hasattr(module, "create_position_ids_from_input_ids"):
        return None  # none, or one that numbers around padding tokens (TrOCR's sinusoidal table): not by span
    counted_from = set(inspect.signature(forward).parameters) & {"cache_length", "past_key_values_length"}  # 5.2x, 5.15
    return module if counted_from else None


def _spans(needed: torch.Tensor, length: int) -> list[int]:
    """Starts of the fewest ``length``-position spans that cover the sorted positions ``needed``, each ending at a
    needed position (so no span reaches past the largest position the whole sequence embeds)."""
    starts, i = [], needed.numel() - 1
    values = needed.tolist()
    while i >= 0:
        start = max(values[i] - length + 1, 0)
        starts.append(start)
        while i >= 0 and values[i] >= start:
            i -= 1
    return starts[::-1]


def _renumbered(model_name: str, mesh: SPMesh):
    """The decoder's pre- and post-hooks and its position module's forward hook for :func:`counting_embeddings`:
    the module, which numbers the call's ``L`` tokens ``c .. c + L - 1`` from its ``cache_length`` ``c``, is run by
    its own rule on the spans of positions this rank's tokens hold (their indices in their documents, from the
    layout; the layout's padding at 0), and each token takes its own position's row."""
    call: dict = {}

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        call.clear()
        info: SequenceInfo | None = kwargs.get("seqmesh")
        if info is None:
            return  # the attention refuses the call, naming the fix
        # (L,) each token's index in its document (the layout's padding at 0), every row alike: as one call per
        # document numbers them (transformers reads no position_ids here)
        with real_tensors():  # on the host, from the layout alone: values even in a rehearsal's fake mode
            call["positions"] = document_places(mesh, info)[1]

    def after(module: nn.Module, args: tuple, kwargs: dict, output):
        call.clear()

    def embed(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        # output (B, L, E) or (L, E): positions 0 .. L-1 as the module numbers them -> (L, E) the tokens' own
        positions = call.get("positions")
        if positions is None:
            return output
        first = args[0] if args else next(iter(kwargs.values()))
        length = positions.shape[-1]
        with real_tensors():  # the spans from the host's values (a rehearsal's fake tensors hold none)
            starts = _spans(torch.unique(positions.flatten()), length)  # unique: sorted
            host = positions.tolist()
        positions = torch.tensor(host, device=output.device)
        numbered = "position_ids" in inspect.signature(type(module).forward).parameters  # as the decoder calls it
        table = torch.cat([
            type(module).forward(module, first, start, **({"position_ids": torch.arange(
                start, start + length, device=positions.device)} if numbered else {})
            ).reshape(-1, length, output.shape[-1])[0]
            for start in starts])  # (len(starts) * L, E)
        where = torch.searchsorted(torch.tensor(starts, device=positions.device), positions, right=True) - 1
        rows = where * length + positions - torch.tensor(starts, device=positions.device)[where]
        return table[rows]

    return before, after, embed


def _causal_by_mask(decoder: nn.Module) -> list[nn.Module]:
    """The self-attentions of a decoder that makes them causal through the mask it builds
    (``create_causal_mask``), though they say ``is_causal=False`` (BigBird-Pegasus's decoder: transformers
    constructs its self-attention without the flag). seqmesh builds no mask and reads the flag."""
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return []
    if "create_causal_mask(" not in source:
        return []
    return [layer.self_attn for layer in getattr(decoder, "layers", [])
            if getattr(getattr(layer, "self_attn", None), "is_causal", True) is False]


def _temperature_layers(model: nn.Module) -> list[nn.Module]:
    """Llama 4's no-RoPE attention layers with temperature tuning (the attention scaled by each token's index)."""
    return [m for m in model.modules()
            if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)
            and hasattr(m, "floor_scale")]


def check_positions(model: nn.Module, by_layout: frozenset[int] = frozenset()) -> None:
    """Refuse, by name, a position-dependent quantity seqmesh would not make from the whole sequence.
    ``by_layout``: the ids of the modules of the layers seqmesh runs itself from the layout (BLOOM's and MPT's ALiBi,
    RWKV's time mix, every recurrent mixer), which read no position_ids."""
    decoder = decoder_of(model)
    from .layers import has_attention  # a model without attention (Mamba2) reads no position at all

    table = getattr(decoder, "embed_positions", None)  # a table the decoder numbers itself
    takes_positions = "position_ids" in inspect.signature(decoder.forward).parameters
    if not takes_positions and hasattr(table, "create_position_ids_from_input_ids"):
        raise ValueError(f"seqmesh cannot run {type(model).__name__} exactly: its decoder's position table "
                         f"({type(table).__name__}) numbers each call's tokens around its padding ids, which each rank "
                         "would count in its own shard only; use its learned table (TrOCR: "
                         "use_learned_position_embeddings=True), which seqmesh renumbers.")
    if not takes_positions and counting_embeddings(model) is None \
            and (table is not None or has_attention(model, by_layout)):
        raise ValueError(f"seqmesh cannot run {type(model).__name__} exactly: its decoder ({type(decoder).__name__}) "
                         "takes no position_ids and numbers the tokens of each call from 0 without a position "
                         "module seqmesh can renumber (an embed_positions whose forward takes cache_length, as "
                         "BART's), so each rank would give its shard the first positions. seqmesh runs decoders that "
                         "read position_ids or number them in such a module.")
    inside = {id(m) for m in decoder.modules()}
    outside = [r for r in scaled_rotaries(model) if id(r) not in inside]
    if outside:
        raise ValueError(f"{type(model).__name__}: {type(outside[0]).__name__} rescales its rotary tables by the longest "
                         "position it is given and lies outside the decoder, where seqmesh cannot give it the whole "
                         "sequence's; use a rope type that does not depend on the length (rope_type default, linear, "
                         "yarn, llama3).")
    for layer in _temperature_layers(model):
        cls = type(layer).__name__
        if cls != "Llama4TextAttention" or hasattr(layer, "qk_norm"):
            raise ValueError(f"{cls} (layer {getattr(layer, 'layer_idx', '?')}) scales its attention by each token's "
                             "position (attn_temperature_tuning), which seqmesh reproduces for Llama4TextAttention "
                             "without qk_norm only; set config.attn_temperature_tuning = False to train without it.")


def _decide_rotary_scaling(rotaries: list[nn.Module], model_name: str):
    """Forward pre-hook of the decoder: transformers' own per-call update of each rotary in ``rotaries``, run once
    on the whole batch's largest position."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        info: SequenceInfo | None = kwargs.get("seqmesh")
        if info is None:
            return  # the attention refuses the call, naming the fix
        if info.max_position is None:
            raise ValueError(f"{model_name} scales its rotary embedding by the longest position it is given (rope_type "
                             "dynamic or longrope), but its SequenceInfo does not carry the whole batch's largest "
                             "position (max_position); shard the batch with seqmesh.shard_batch.")
        with torch.no_grad():
            for rotary in rotaries:
                probe = next(rotary.buffers())  # inv_freq: the device the tables live on
                largest = torch.full((1, 1), info.max_position, dtype=torch.long, device=probe.device)
                for layer_type in _scaled_kinds(rotary):  # transformers' own decision, on the whole batch's position
                    type(rotary).forward(rotary, probe[:0], largest, *(() if layer_type is None else (layer_type,)))

    return hook


def _numbered_by_model(model_name: str):
    """Forward pre-hook of the decoder of a family that numbers its positions itself: refuse a batch whose
    positions seqmesh numbered from 0 (``shard_batch`` without the model)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        info: SequenceInfo | None = kwargs.get("seqmesh")
        if info is not None and info.positions == "documents":
            raise ValueError(f"{model_name} numbers its positions itself (from padding_idx + 1, skipping padding "
                             "tokens), but this batch carries positions counted from 0: shard it with the model, "
                             "seqmesh.shard_batch(batch, mesh, model=model), or pass the position_ids you want.")

    return hook


def _temperature_forward(mesh: SPMesh):
    """Llama4TextAttention's forward on a no-RoPE layer, with the temperature of each token's index in the whole
    sequence (transformers: ``arange`` over the call's own tokens)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        # hidden_states (B, L, E) -> ((B, L, E), None)
        info: SequenceInfo | None = kwargs.get("seqmesh")
        if info is None:
            raise ValueError(f"{type(self).__name__} runs sequence-parallel but was called without the 'seqmesh' entry; "
                             "call the model with the batch returned by seqmesh.shard_batch (model(**batch)).")
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{type(self).__name__} runs sequence-parallel and keeps no cache: call the model without "
                             "one (leave use_cache unset).")
        shape = hidden_states.shape[:-1]  # (B, L)
        heads = (*shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads)  # (B, L, Hq, D)
        key = self.k_proj(hidden_states).view(heads).transpose(1, 2)  # (B, Hk, L, D)
        value = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        given = getattr(info, "row_positions", None)  # generation's decode step and prefill onto a kept cache
        index = given(hidden_states.device) if given is not None else sequence_positions(
            info.seq_len, mesh, layout=info.layout, device=hidden_states.device,
            cu_seqlens=info.cu_seqlens)  # (L,) each token's index in the whole row
        scales = torch.log1p(torch.floor((index.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales.view(1, -1, 1, 1).expand(*shape, 1, 1)).to(query.dtype).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, weights = interface(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights

    return forward


def install(model: nn.Module, mesh: SPMesh) -> list:
    """Make ``model``'s position-dependent quantities from the whole sequence (see the module docstring); returns
    the hooks' handles (:func:`uninstall` removes the rest). :func:`check_positions` first, before any change."""
    decoder = decoder_of(model)
    name = type(model).__name__
    rotaries = scaled_rotaries(model)
    hooks = []
    for rotary in rotaries:  # the class's forward without its per-call decision (functools.wraps keeps it)
        rotary.forward = types.MethodType(_update_wrapper(rotary).__wrapped__, rotary)
        setattr(rotary, _ATTR, True)
    if rotaries:
        hooks.append(decoder.register_forward_pre_hook(_decide_rotary_scaling(rotaries, name), with_kwargs=True))
    if numbering_embeddings(model) is not None:
        hooks.append(decoder.register_forward_pre_hook(_numbered_by_model(name), with_kwargs=True))
    counting = counting_embeddings(model)
    if counting is not None:
        before, after, embed = _renumbered(name, mesh)
        hooks.append(decoder.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(decoder.register_forward_hook(after, with_kwargs=True))
        hooks.append(counting.register_forward_hook(embed, with_kwargs=True))
        for attention in _causal_by_mask(decoder):
            attention.is_causal = True
            setattr(attention, _CAUSAL, True)
    forward = None
    for layer in _temperature_layers(model):
        forward = forward or _temperature_forward(mesh)
        layer.forward = types.MethodType(forward, layer)
        setattr(layer, _ATTR, True)
    return hooks


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`'s instance-level forwards (its hooks are removed by their handles)."""
    for module in model.modules():
        if getattr(module, _ATTR, False):
            del module.forward
            delattr(module, _ATTR)
        if getattr(module, _CAUSAL, False):
            module.is_causal = False
            delattr(module, _CAUSAL)
