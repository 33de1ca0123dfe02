"""Hugging Face transformers models through their attention interface.

``parallelize(model, mesh)`` registers a named attention implementation with transformers'
``AttentionInterface`` (its public registration API) whose function calls ``seqmesh.attention`` on
the model's mesh, and switches the model to it with ``set_attn_implementation``; nothing inside
transformers is patched. ``unparallelize(model)`` switches back and removes the registration.

The model is then called with the output of ``seqmesh.shard_batch``: its ``position_ids`` give RoPE
every local token's global position (within its document), and its ``seqmesh`` entry travels down
the model's ``**kwargs`` to the attention function with the sequence length, document boundaries and
image blocks (Gemma 3: the tokens of one image see each other both ways).
No attention mask is built (transformers skips mask creation for implementations it does not know).
"""

from __future__ import annotations

import inspect

import torch.nn as nn

from ..comm.ranks import local_part
from ..sharded_attention.api import attention
from . import own_attention, xlm
from . import block_sparse_attention, compressed_attention, indexed_attention, inkling, inkling2, qsa_attention
from . import mixers
from .mixer_kind import CHUNK_ATTR
from . import positions
from .async_ulysses import check_async, install as install_async, uninstall as uninstall_async
from ..rules.overlap import ASYNC_PIECES
from .layers import (SUPPORTED, callees, check_layers, chunked_layers, chunks_per_document, entry_dropped,
                     has_attention, takes_kwargs)
from ..sequence.batch import SequenceInfo
from ..mesh import SPMesh
from ..model.lm import decoder_of
from ..versions import require
from ..rules.degrees import check_tensor_parallel_sizes, workable_degrees
from ..vision.families import is_multimodal, vision_family

_ATTR = "_seqmesh_attention"
_CHUNK = CHUNK_ATTR  # on the attention module of a chunked-attention layer (Llama 4): its chunk



def check_heads(q_heads: int, kv_heads: int, mesh: SPMesh, what: str = "the model") -> None:
    """Raise a ValueError that lists the degrees that would work if the model's heads cannot be split.
    ``q_heads``: the heads each Ulysses group deals (a tensor-parallel rank's share, under TP)."""
    if mesh.ulysses <= q_heads:
        return
    options = ", ".join(f"ulysses={u} x ring={r}" for u, r in workable_degrees(q_heads, mesh.sp_size))
    raise ValueError(
        f"{what} has {q_heads} query heads ({kv_heads} kv heads), too few for ulysses={mesh.ulysses}. "
        f"For a sequence degree of {mesh.sp_size} use one of: {options}."
    )


def refuse_unsupported(module: nn.Module, kwargs: dict, causal: bool) -> None:
    """Variants of attention seqmesh does not compute raise here, before any work, naming the layer,
    the variant and what seqmesh supports; nothing is silently replaced by full attention. The messages are
    built only to raise: under per-layer torch.compile ``layer_idx`` is a symbolic int, which no f-string takes
    without a graph break."""
    bidirectional_window = kwargs.get("sliding_window") is not None and not causal
    if not bidirectional_window and all(kwargs.get(n) is None for n in ("attention_chunk_size", "chunk_size")):
        return
    layer = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    supported = f"seqmesh supports {SUPPORTED}."
    window = kwargs.get("sliding_window")
    if window is not None and not causal:
        raise ValueError(f"{layer} uses a bidirectional sliding window (sliding_window={window}, is_causal=False), "
                         f"which seqmesh does not compute; {supported}")
    for name in ("attention_chunk_size", "chunk_size"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{layer} uses chunked attention ({name}={kwargs[name]!r}); {supported}")


def _make_attention(mesh: SPMesh, backend: str):
    def seqmesh_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
        # query (B, Hq, L, D), key/value (B, Hk, L, D) -> ((B, L, Hq, D), None)
        info: SequenceInfo | None = kwargs.get("seqmesh")
        if info is None:
            raise ValueError(
                "this model runs seqmesh attention but was called without the 'seqmesh' entry; call it with the "
                "batch returned by seqmesh.shard_batch (model(**batch)), or seqmesh.hf.unparallelize(model) first."
            )
        if dropout:
            raise ValueError(f"attention dropout ({dropout}) is not supported by seqmesh; set the config's attention "
                             "dropout to 0 (attention_dropout; GPT-2's attn_pdrop, BERT's attention_probs_dropout_prob)"
                             ", or call model.eval().")
        intercept = getattr(info, "intercept_attention", None)  # seqmesh.inference's entries: a prefill keeps this
        if intercept is not None:                               # rank's keys and values, a decode step attends
            done = intercept(module, query, key, value, mesh, scaling, kwargs)  # to its share of the cache
            if done is not None:
                return done, None
        if attention_mask is not None:  # transformers builds none for a registered implementation; a model
            raise ValueError(           # that makes its own expresses a variant seqmesh would silently drop
                f"{type(module).__name__} passed its own attention mask (shape {tuple(attention_mask.shape)}); seqmesh "
                "computes causal attention within the documents of seqmesh.shard_batch and cannot apply an arbitrary "
                "mask. Describe padding and packed documents through shard_batch instead."
            )
        causal = getattr(module, "is_causal", True)
        refuse_unsupported(module, kwargs, causal)
        first = id(mesh) not in info.validated  # ranks agree on the inputs once per batch: one small sync
        chunk = getattr(module, _CHUNK, None)
        if chunk is not None and info.cu_seqlens is not None and not chunks_per_document():
            raise ValueError(f"{type(module).__name__} attends in chunks of {chunk} and the batch packs documents: this "
                             "transformers counts the chunks from the row's start across the documents, which seqmesh "
                             "does not compute (transformers 5.24 counts them from each document's start, as seqmesh "
                             "does). Upgrade transformers, or do not pack documents for this model.")
        sinks = kwargs.get("s_aux")  # gpt-oss: a learned logit per query head, in the denominator only
        if sinks is not None:  # under tensor parallelism, this rank's heads' sinks
            sinks = local_part(sinks)
        out = attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mesh,
            causal=causal, layout=info.layout, cu_seqlens=info.cu_seqlens,
            seq_len=info.seq_len if info.cu_seqlens is None else None, softmax_scale=scaling, backend=backend,
            validate=first, window=kwargs.get("sliding_window"), sinks=sinks, image_blocks=info.image_blocks,
            chunk=chunk, softcap=kwargs.get("softcap"),
        )
        info.validated.add(id(mesh))
        return out, None

    return seqmesh_attention


# the names a transformers model takes its cache under (``past_key_values`` renamed ``cache`` in 5.x)
CACHE_ARGUMENTS = ("cache", "past_key_values")


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a parallelized model: its layers keep no cache (each rank holds a slice of the
    sequence), so a call that does not choose runs with ``use_cache=False`` rather than
    ``config.use_cache`` (True in most configs, for generation), and transformers builds no cache, which
    Gated DeltaNet layers refuse and attention layers would fill with one rank's keys. The config is
    left as it is. A call that asks for a cache is refused."""
    cache = next((kwargs[n] for n in CACHE_ARGUMENTS if kwargs.get(n) is not None), None)
    if kwargs.get("use_cache") or cache is not None:
        asked = "use_cache=True" if cache is None else f"a {type(cache).__name__}"
        raise ValueError(f"{type(module).__name__} is parallelized by seqmesh and keeps no cache (each rank holds a "
                         f"slice of the sequence), but was called with {asked}. Train and evaluate without one "
                         "(leave use_cache unset); to generate, call seqmesh.hf.unparallelize(model) first.")
    return args, {**kwargs, "use_cache": False}


def _hook_calls(model: nn.Module) -> list:
    """:func:`_without_cache` on ``model`` and on its decoder (``get_decoder()``, called directly by
    ``SequenceParallelLM``); the hooks' handles."""
    decoder = decoder_of(model)
    called = [model] + ([decoder] if decoder is not model else [])
    return [m.register_forward_pre_hook(_without_cache, with_kwargs=True) for m in called if _takes_use_cache(m)]


def _give(held: dict):
    """A forward pre-hook that passes ``held["entry"]`` as seqmesh's entry to a call made without one."""
    def give(module, args, kwargs):
        if kwargs.get("seqmesh") is None and held.get("entry") is not None:
            return args, {**kwargs, "seqmesh": held["entry"]}
        return None

    return give


def _carry_entry(source: nn.Module, targets: list[nn.Module]) -> list:
    """Forward hooks that hand seqmesh's entry given to ``source``'s call to each of ``targets``' calls made without
    one, during ``source``'s forward. The handles."""
    held: dict = {}

    def take(module, args, kwargs):
        held["entry"] = kwargs.get("seqmesh")

    def drop(module, args, kwargs, output):
        held.pop("entry", None)

    return [source.register_forward_pre_hook(take, with_kwargs=True),
            source.register_forward_hook(drop, with_kwargs=True),
            *(t.register_forward_pre_hook(_give(held), with_kwargs=True) for t in targets)]


class _EntryRelay:
    """``module``'s class swapped for a subclass whose forward keeps the entry it is given, and a hook on each of
    ``targets`` that gives it to their calls made without one. Inside the forward, not a hook on the call:
    transformers' checkpointing recomputes a layer by calling its forward again (its hooks stay outside), and the
    recompute must find the entry too. The entry stays held after the forward returns, until the next call sets its
    own: where ``module`` is the model calling its checkpointed blocks (BLOOM, MPT, Falcon, GPT-Neo), the blocks are
    recomputed in backward, after its forward, and transformers 5.15 runs their hooks inside the checkpoint.
    ``remove()`` puts the class back."""

    def __init__(self, module: nn.Module, targets: list[nn.Module]):
        held: dict = {}
        original = type(module)
        accepts = takes_kwargs(module)  # OpenAI-GPT's blocks take no **kwargs: the entry stops at the relay

        def forward(self, *args, **kwargs):
            held["entry"] = kwargs.get("seqmesh")  # None for a call without one: never an earlier call's
            if not accepts:
                kwargs.pop("seqmesh", None)
            return super(relay, self).forward(*args, **kwargs)

        relay = type(original.__name__, (original,), {"forward": forward, "__module__": original.__module__,
                                                      "__qualname__": original.__qualname__})
        module.__class__ = relay
        self.module, self.original, self.relay = module, original, relay
        self.handles = [t.register_forward_pre_hook(_give(held), with_kwargs=True) for t in targets]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if type(self.module) is self.relay:
            self.module.__class__ = self.original


def _hook_entry(model: nn.Module) -> list:
    """Seqmesh's entry carried wherever a forward drops its ``**kwargs``: the model's call to its decoder
    (:func:`_carry_entry`: Mamba2ForCausalLM calls its backbone with named arguments only), and each layer that calls
    its attention without them (:class:`_EntryRelay`: StableLM's and Nemotron's; ``seqmesh.hf.layers.entry_dropped``;
    those where the entry cannot be carried were refused by ``check_layers``). The handles (``remove()``)."""
    handles = []
    decoder = decoder_of(model)
    named = inspect.signature(decoder.forward).parameters
    if decoder is not model and "seqmesh" not in named and takes_kwargs(decoder):
        handles += _carry_entry(model, [decoder])
    handles += [_EntryRelay(module, callees(module, child)) for _, module, child in entry_dropped(model)]
    return handles


def _tower_called_whole(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a parallelized model's vision tower: its blocks attend over the sequence group,
    so the tower runs only through ``seqmesh.vision`` (each rank on its share of the patches, from
    ``shard_batch(batch, mesh, model=...)``), never on a whole image list inside the model's own forward,
    where its attention would be given the text's sequence and compute something else."""
    raise ValueError(f"{type(module).__name__} is the vision tower of a model parallelized by seqmesh and runs on "
                     "each rank's share of the patches only: call the model through seqmesh.compose.parallelize_model "
                     "with seqmesh.shard_batch(batch, mesh, model=model), not with pixel_values directly (or "
                     "seqmesh.hf.unparallelize(model) first).")


def _hook_tower(model: nn.Module) -> list:
    """:func:`_tower_called_whole` on a vision-language model's tower; the hook's handle (none for a text model)."""
    if not is_multimodal(model.config):
        return []
    return [vision_family(model.config).tower(model).register_forward_pre_hook(_tower_called_whole, with_kwargs=True)]


def _takes_use_cache(module: nn.Module) -> bool:
    return "use_cache" in inspect.signature(module.forward).parameters or takes_kwargs(module)


def attention_heads(text) -> list[tuple[int | None, int | None]]:
    """The (query heads, kv heads) of ``text``'s attention layers: the config's, or, in a config whose layers differ
    (transformers' per_layer_config: dots.llm3's sliding layers), each distinct pair of its layers', which
    transformers refuses to read as one global value."""
    try:
        q = getattr(text, "num_attention_heads", None)
        return [(q, getattr(text, "num_key_value_heads", None) or q)]
    except RuntimeError as err:  # transformers' AmbiguousGlobalPerLayerAttributeError
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        return sorted({(c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
                       for c in text.per_layer_config})


def parallelize(model: nn.Module, mesh: SPMesh, *, backend: str = "auto", linear_attention: str = "auto",
                async_ulysses: bool = False, async_pieces: int = ASYNC_PIECES,
                indexer_precision: str = "float32") -> nn.Module:
    """Make ``model`` (a transformers ``PreTrainedModel``) run its attention with ``seqmesh.attention``.

    Works for models that go through transformers' attention interface (Llama, Qwen2/3, Mistral,
    Gemma 3, gpt-oss, DeepSeek-V3 and most decoder-only models of transformers >= 5.0): causal
    attention with per-layer sliding windows (``sliding_window``, as transformers' masks: the last
    ``sliding_window`` tokens), attention sinks (``s_aux``) and MLA head dims. Layers it would not
    compute exactly (soft-capping, chunked attention, Mamba / convolution / other recurrent layers)
    raise here, before any work (:func:`seqmesh.hf.layers.check_layers`); variants that show only in a
    call's arguments raise at the first call. Both name the layer. Gated DeltaNet layers (Qwen3.5,
    Qwen3-Next, OLMo-hybrid) run sequence-parallel too, their forward replaced per instance
    (:mod:`seqmesh.hf.linear_attention`) by ``linear_attention``: ``all_to_all``, ``state_passing`` or
    ``auto`` (per call, from the shapes: :func:`seqmesh.linear_attention.choice.choose_design`), and so do
    the gated short convolutions of LFM2, LFM2-MoE and LFM3 (:mod:`seqmesh.hf.short_conv`, their halo).
    The model (and its decoder) then keeps no cache: a call that does not pass ``use_cache`` runs
    without one whatever ``config.use_cache`` says (the config is unchanged), and one that asks for a
    cache raises. Returns the same model. The attention switch is stored on ``model.config``: another
    model built from the same config object switches with it.

    ``async_ulysses``: the attention modules' q/k/v and output projections run in ``async_pieces`` pieces
    of tokens, each piece's all-to-all overlapped with the next piece's projection, forward and backward
    (:mod:`seqmesh.hf.async_ulysses`; families it does not know, and tensor parallelism, are refused here).

    ``indexer_precision``: DeepSeek Sparse Attention's indexer scores in ``float32`` (transformers' own) or from
    ``bfloat16`` inputs with float32 sums (:mod:`seqmesh.hf.indexed_attention`); refused for a model without one.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    require("transformers", "seqmesh.hf")
    config = model.config
    text = config.get_text_config()  # the config itself for a text model; the decoder's for a multimodal one
    mixer_layers = mixers.mixer_layers(model, mesh, linear_attention)  # recurrences and convs, each checked
    own_attention.check_backend(mixer_layers.get(own_attention.KIND, []), backend)
    indexed = indexed_attention.indexed_layers(model, mesh)  # DeepSeek Sparse Attention this seqmesh computes
    indexed_attention.check_precision(indexer_precision, indexed)
    sparse = block_sparse_attention.block_sparse_layers(model, mesh)  # MiniMax-M3's block-sparse attention
    compressed = compressed_attention.compressed_layers(model, mesh)  # DeepSeek-V4's HCA and CSA layers
    qsa = qsa_attention.qsa_layers(model, mesh)  # Qwen4-Exp's QSA layers
    relative = inkling.relative_attention_layers(model, mesh)  # Inkling's attention with its relative bias
    relative2 = inkling2.attention_layers(model, mesh)  # Inkling 2's, and its attention over each token's states
    depth = inkling2.depth_layers(model)
    check_layers(model, handled=[m for layers in mixer_layers.values() for _, m in layers], indexed=indexed + qsa,
                 handled_types=tuple(t for kind in mixer_layers for t in kind.layer_types)
                 + ((block_sparse_attention.LAYER_TYPE,) if sparse else ())
                 + (compressed_attention.LAYER_TYPES if compressed else ()))  # every other mixer refused
    heads = attention_heads(text)  # (query, kv) heads: each kind of layer's where they differ (dots.llm3's)
    q_heads = min(q for q, _ in heads) if all(isinstance(q, int) for q, _ in heads) else None
    handled = {id(part) for layers in mixer_layers.values() for _, m in layers for part in m.modules()}
    tp = getattr(mesh, "tp", 1)
    if mixer_layers and not has_attention(model, handled):  # no attention left to route: a pure state space model
        # (Mamba2), or one whose attention seqmesh runs itself (BLOOM, MPT, Falcon, GPT-Neo: their heads checked by
        # seqmesh.hf.own_attention)
        if tp > 1:
            raise ValueError(f"{type(model).__name__} has no attention layer and tp={tp}: seqmesh's tensor parallelism "
                             "splits attention heads and MLPs, not state space mixers; use tp=1.")
    elif not isinstance(q_heads, int) or q_heads < 1:
        raise ValueError(f"seqmesh cannot run {type(model).__name__}: its config has no attention heads "
                         f"(num_attention_heads={q_heads!r}); seqmesh shards attention layers by their heads "
                         "(Ulysses) or their keys (ring). Supported: " + SUPPORTED + ".")
    elif tp > 1:  # tp, and tp x ulysses, against the heads, as the job refuses them (seqmesh.tensor_parallel: the rest)
        for q, kv in heads:
            check_tensor_parallel_sizes(tp, mesh.ulysses, heads=q, kv_heads=kv)
    else:
        for q, kv in heads:
            check_heads(q, kv, mesh)
    if is_multimodal(config):  # the vision tower runs sequence-parallel too: its heads are dealt by Ulysses
        vision_family(config).check(config)  # a family or setting seqmesh does not route is refused by name here
        tower = config.vision_config
        heads = getattr(tower, "num_heads", None) or tower.num_attention_heads
        check_heads(heads, heads, mesh, "the vision tower")
    own = mixer_layers.get(own_attention.KIND, [])  # BLOOM, MPT, Falcon, GPT-Neo: their attention is their own
    # the attention layers seqmesh runs itself (its own attention, RWKV's time mix) read their positions from the layout
    positions.check_positions(model, frozenset(handled))
    async_layers = check_async(model, mesh) if async_ulysses else []
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model is already parallelized; call seqmesh.hf.unparallelize(model) first.")
    name = f"seqmesh_{id(model):x}"
    AttentionInterface.register(name, _make_attention(mesh, backend))
    # a mask function a collected model of the same id registered (MPT's, XGLM's below) would otherwise build this
    # model's masks: ids are reused, and a model dropped without unparallelize keeps its registrations
    AttentionMaskInterface._global_mapping.pop(name, None)
    previous = config._attn_implementation
    if not own:  # no switch for a model whose attention is its own
        model.set_attn_implementation(name)
    elif own_attention.needs_no_mask(own):
        # yet BLOOM, Falcon and GPT-Neo build their causal mask for the config's implementation: named seqmesh's, they
        # build no (L, L) mask the replaced attention would ignore
        config._attn_implementation = name
    else:  # MPT, XGLM, ...: they build their mask whatever the config names, so theirs is one element, not (L, L)
        AttentionMaskInterface.register(name, own_attention.token_mask)
        config._attn_implementation = name
    for module, chunk in chunked_layers(model):
        setattr(module, _CHUNK, chunk)
    for kind, layers in mixer_layers.items():  # attention of its own attends with the model's kernel, as its design
        kind.install(layers, mesh, backend if kind is own_attention.KIND else linear_attention)
    indexed_attention.install(indexed, mesh, indexer_precision)
    block_sparse_attention.install(sparse, mesh)
    compressed_attention.install(compressed, mesh)
    qsa_attention.install(qsa, mesh)
    inkling.install(relative, mesh)
    inkling2.install(relative2, depth, mesh)
    install_async(async_layers, mesh, backend, async_pieces)
    hooks = _hook_calls(model) + _hook_tower(model) + _hook_entry(model) + mixers.carry_entry(model, mixer_layers)
    hooks += positions.install(model, mesh)
    hooks += own_attention.refuse_padding_masks(decoder_of(model), mixer_layers.get(own_attention.KIND, []))
    hooks += xlm.install(decoder_of(model), own, mesh)  # XLM's padding, from the whole row
    hooks += inkling2.unread_distances(decoder_of(model), relative2)  # no (L, L) distances its attention ignores
    setattr(model, _ATTR, (name, previous, hooks))
    return model


def unparallelize(model: nn.Module) -> nn.Module:
    """Undo :func:`parallelize`: the previous attention implementation, no registration or cache hook left."""
    from transformers import AttentionInterface, AttentionMaskInterface

    state = getattr(model, _ATTR, None)
    if state is None:
        return model
    name, previous, hooks = state
    for hook in hooks:
        hook.remove()
    if not any(getattr(m, mixers.REPLACED_ATTR, None) == own_attention.NAME for m in model.modules()):
        model.set_attn_implementation(previous)
    elif model.config._attn_implementation == name:  # BLOOM's, Falcon's or MPT's, set by parallelize
        model.config._attn_implementation = previous
    # transformers 5.23 has no public way to remove a global registration (AttentionInterface.register
    # writes the class-wide mapping; ``del`` and set_attn_implementation act on local state only), so
    # the registration is dropped from that mapping directly.
    mixers.uninstall(model)
    indexed_attention.uninstall(model)
    block_sparse_attention.uninstall(model)
    compressed_attention.uninstall(model)
    qsa_attention.uninstall(model)
    inkling.uninstall(model)
    inkling2.uninstall(model)
    uninstall_async(model)
    positions.uninstall(model)
    for module in model.modules():
        if hasattr(module, _CHUNK):
            delattr(module, _CHUNK)
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)
    setattr(model, _ATTR, None)
    return model

