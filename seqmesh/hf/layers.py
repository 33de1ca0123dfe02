"""Which layers of a transformers model seqmesh computes exactly, and a clear refusal for the rest.

``parallelize`` swaps the attention function transformers calls through its ``AttentionInterface``.
Everything else in a decoder runs per token on the local shard, which is exact only for per-token
layers (norms, MLPs, MoE, projections). A layer that mixes tokens some other way (a Mamba/SSM
mixer, a short convolution, a recurrent block, linear attention) or an attention variant seqmesh does
not compute would run on the local shard alone: silently wrong. :func:`check_layers` finds such
layers before any work and raises a ValueError naming the layer, the variant and what is supported.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from collections.abc import Sequence

import torch.nn as nn

from ..model.head import forward_source
from ..model.lm import decoder_of
from ..rules.families import FAMILY_REASONS, config_reason  # noqa: F401 (FAMILY_REASONS: read by the tests)
from .mixer_kind import REPLACED_ATTR

OWN_ATTENTION = "attention of its own"  # seqmesh.hf.own_attention's kind, by name (that module imports this one)

# config.layer_types entries seqmesh computes: attention through the interface, and per-token MLPs ("mlp": the MLP
# blocks of every released Nemotron-H, the "-" of its pattern)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "attention", "dense", "sparse", "moe", "mlp")
# module class names that mix tokens outside the attention interface, matched at the end of the name so the
# mixer itself is named, not the model or decoder layer that holds it (MambaModel, MambaBlock)
TOKEN_MIXER_NAMES = re.compile(r"(Mixer|ShortConv|DeltaNet|DeltaAttention|LinearAttention|LightningAttention"
                               r"|RecurrentBlock|Rglru|Retention|SSM|Rwkv\w*Attention|Mamba\d*"
                               r"|(LSTM|Lstm)(Layer|Cell|Block|Model)?)$")  # xLSTM's mLSTM layer and its containers
# parameters that carry a recurrence's decay (Mamba, Gated DeltaNet): their module has state along the sequence
STATE_PARAMS = ("A_log", "dt_bias", "time_mix_key")  # Mamba's decay; RWKV's token shift (its time and channel mix)
# layer types seqmesh refuses with their own reason: what the layer computes that seqmesh does not, and what would
# make it computable (from transformers 5.24's code)
_COMPRESSED = ("adds to its sliding window's keys one compressed entry per {what} of the row, counted from the row's "
               "start, {then}; seqmesh computes it as transformers 5.24 lays it out (seqmesh.hf.compressed_attention: "
               "an attention module with a compressor, sinks and a grouped output projection) and found no such "
               "module for this layer: use transformers 5.24's DeepseekV4 classes")
LAYER_TYPE_REASONS = {
    "deepseek_sparse_attention": "DeepSeek Sparse Attention as older transformers lay it out (5.15); seqmesh computes "
                                 "the indexed_attention layers of transformers 5.24: upgrade transformers",
    "heavily_compressed_attention": "DeepSeek-V4's heavily compressed attention, which " + _COMPRESSED.format(
        what="window of compress_rates['heavily_compressed_attention'] tokens (a softmax-gated sum)",
        then="seen by every later query"),
    "compressed_sparse_attention": "DeepSeek-V4's compressed sparse attention, which " + _COMPRESSED.format(
        what="overlapping window of 2 x compress_rates['compressed_sparse_attention'] tokens",
        then="of which a lightning indexer keeps each query's top index_topk"),
}
SUPPORTED = ("full causal or bidirectional attention through transformers' AttentionInterface, causal sliding "
             "windows (sliding_window), attention sinks (s_aux), logit soft-capping (Gemma 2), chunked attention "
             "(Llama 4's chunked_attention layers), DeepSeek Sparse Attention (the indexed_attention layers of "
             "DeepSeek-V3.2, GLM-5, HY-V4, A.X-K2 and dots.llm3), Qwen4-Exp's QSA and n-gram PLE layers, "
             "MiniMax-M3's block-sparse layers, MHA/GQA/MQA, "
             "DeepSeek-V4's heavily compressed and compressed sparse attention (one document per row), MLA head dims, "
             "packed documents; per-token layers (MLP, MoE, norms); the Gated DeltaNet layers of "
             "Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo-hybrid; the Mamba2 layers of Nemotron-H, Granite-4 "
             "hybrid, Bamba, Falcon-H1 and Mamba2; the Mamba (v1) layers of "
             "Jamba, Mamba, Falcon-Mamba and Zamba; the RG-LRU blocks of RecurrentGemma; RWKV-4's time and channel "
             "mixes; xLSTM's mLSTM layers; Inkling's short convolutions and relative-bias attention; the lightning "
             "attention layers "
             "of MiniMax-01; the gated short convolutions of LFM2, LFM2-MoE and LFM3; the Kimi Delta Attention layers "
             "of Kimi Linear and Bailing hybrid; ZAYA's compressed convolutional attention; the ALiBi attention of "
             "BLOOM and MPT; Falcon's rotary attention; GPT-Neo's global and local attention; the attention of "
             "OpenAI-GPT, XGLM and GPT-NeoX-Japanese; Doge's dynamic mask within keep_window_size; the BERT-style "
             "attention of RemBERT, MegatronBERT, RoFormer and BigBird (attention_type='original_full'); the decoders of BART, mBART, Marian, Pegasus, Blenderbot, PLBart, "
             "BigBird-Pegasus, MusicGen, MVP and TrOCR")


def mixes_tokens(module: nn.Module) -> bool:
    """Whether ``module`` mixes tokens outside the attention interface: a convolution over the sequence,
    a class named as a recurrent or linear-attention mixer (unless its forward calls the attention interface:
    Kimi Linear's MLA is a ``KimiLinearAttention``), or one that owns a recurrence's decay parameters."""
    name = type(module).__name__
    own = {n for n, _ in module.named_parameters(recurse=False)}
    named = bool(TOKEN_MIXER_NAMES.search(name)) and not _calls_interface(type(module))
    return isinstance(module, nn.Conv1d) or named or any(p in own for p in STATE_PARAMS)


def has_attention(model: nn.Module, skip: set[int] = frozenset()) -> bool:
    """Whether ``model`` has an attention module (a class named ``...Attention``) outside the modules ``skip`` names
    (by id): a pure state space model (Mamba2) has none, and then no attention to route."""
    return any(type(m).__name__.endswith("Attention") for m in model.modules() if id(m) not in skip)


def _calls_interface(cls: type) -> bool:
    """Whether ``cls``'s forward looks its attention function up in transformers' ``AttentionInterface``."""
    source = forward_source(cls)
    return "ALL_ATTENTION_FUNCTIONS" in source or "get_interface" in source


def _routes_through_interface(model: nn.Module) -> bool:
    """Whether ``model``'s attention goes through ``AttentionInterface``: the class says so
    (``_supports_attention_backend``), or its attention modules look their function up there (Qwen3.5
    does without setting the flag)."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    return any(_calls_interface(cls) for cls in {type(m) for m in model.modules() if type(m).__name__.endswith("Attention")})


def _is_self_child(node: ast.AST, child: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == child and isinstance(node.value, ast.Name)
            and node.value.id == "self")


@functools.lru_cache(maxsize=256)
def calls_without_kwargs(cls: type, child: str, anywhere: bool = False) -> bool:
    """Whether ``cls``'s forward calls ``self.<child>(...)`` and never passes it ``**kwargs`` (the way seqmesh's entry
    travels from the model's call down to the attention function); ``anywhere``: whether any one of its calls does
    not (Nemotron-H's block at transformers 5.15 passes them to its attention, not to its Mamba2 mixer, both
    ``self.mixer``)."""
    source = forward_source(cls)
    if not source:
        return False
    tree = ast.parse(source)
    # the layers a loop takes from the child (for layer in self.layers[: n], for i, block in enumerate(self.h)) are
    # called by their name
    names = {target.id for loop in ast.walk(tree) if isinstance(loop, ast.For)
             and any(isinstance(n, ast.Attribute) and n.attr == child and isinstance(n.value, ast.Name)
                     and n.value.id == "self" for n in ast.walk(loop.iter))
             for target in ast.walk(loop.target) if isinstance(target, ast.Name)}
    # ... or by their index (XLM: self.attentions[i](...))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        _is_self_child(node.func.value if isinstance(node.func, ast.Subscript) else node.func, child)
        or (isinstance(node.func, ast.Name) and node.func.id in names))]
    passes = [any(k.arg is None for k in call.keywords) for call in calls]
    return bool(calls) and (not all(passes) if anywhere else not any(passes))


def _interface_attention(module: nn.Module) -> bool:
    """An attention module seqmesh's entry must reach: one that calls the interface, or one whose forward seqmesh
    runs itself (BLOOM's, MPT's, Falcon's and GPT-Neo's, once ``seqmesh.hf.own_attention`` installed it)."""
    own = getattr(module, REPLACED_ATTR, None) == OWN_ATTENTION
    return own or (type(module).__name__.endswith("Attention") and _calls_interface(type(module)))


def takes_kwargs(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes ``**kwargs`` (the way seqmesh's entry travels)."""
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(module.forward).parameters.values())


def entry_dropped(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every ``(path, module, child)`` where ``module`` (in the decoder) calls its attention module ``child``, or its
    list of layers ``child`` holding one (or, inside the decoder, a module holding one), without passing its
    ``**kwargs`` on (Nemotron's and StableLM's layers, Moshi's decoder at transformers 5.15, RemBERT's layers and
    attention blocks): seqmesh's entry would not reach the attention function. The decoder's
    only: a vision tower's layers are run by seqmesh itself from their modules (``seqmesh.vision``)."""
    found = []
    inside = {id(m) for m in decoder_of(model).modules()}
    for path, module in model.named_modules():
        if id(module) not in inside and module is not model:
            continue
        for child, sub in module.named_children():
            # a list of layers, or inside the decoder any module, that holds one (RemBERT's layer calls its
            # attention block, which calls its self-attention, each without **kwargs)
            within = isinstance(sub, nn.ModuleList) or module is not model
            holds = within and any(_interface_attention(m) for m in sub.modules())
            if (_interface_attention(sub) or holds) and calls_without_kwargs(type(module), child):
                found.append((path, module, child))
    return found


def callees(module: nn.Module, child: str) -> list[nn.Module]:
    """What ``module`` calls as ``child``: the module, or each layer of a list."""
    sub = getattr(module, child)
    return list(sub) if isinstance(sub, nn.ModuleList) else [sub]


def attention_without_entry(model: nn.Module) -> list[str]:
    """The classes of ``model`` that drop seqmesh's entry (:func:`entry_dropped`) where seqmesh cannot hand it on
    itself: the module does not receive ``**kwargs`` (so the entry never reaches it), or what it calls takes none.
    Where both do, ``seqmesh.hf`` carries the entry across with hooks. One line each."""
    found = {}
    for path, module, child in entry_dropped(model):
        cls = type(module)
        if cls not in found and not (takes_kwargs(module) and all(map(takes_kwargs, callees(module, child)))):
            found[cls] = f"{path or 'the model'} ({cls.__name__}) calls its {child} without passing its **kwargs on"
    return list(found.values())


def _configs(model: nn.Module):
    config = model.config
    yield config
    text = getattr(config, "text_config", None)
    if text is not None and text is not config:
        yield text


def _chunk(config) -> int | None:
    """The chunk of a config whose layer types include chunked attention (Llama 4), or None."""
    chunk = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" not in (getattr(config, "layer_types", None) or ()) or isinstance(chunk, bool) \
            or not isinstance(chunk, int) or chunk < 1:
        return None
    return chunk


@functools.lru_cache(maxsize=1)
def chunks_per_document() -> bool:
    """Whether the installed transformers counts chunked attention's chunks from each packed document's start (its
    masks read packed documents' own positions, 5.2x) rather than from the row's start (5.15)."""
    from transformers import masking_utils

    return hasattr(masking_utils, "remap_positions_for_packed_sequence")


def chunked_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The attention modules of ``model``'s chunked-attention layers (``config.layer_types``: Llama 4) and their
    chunk: transformers gives them a chunked mask, which a registered attention function never sees, so seqmesh
    reads the chunk from the layer. A layer whose module is not found is refused by :func:`check_layers`."""
    found = []
    for config in _configs(model):
        chunk = _chunk(config)
        if chunk is None:
            continue
        chunked = {i for i, kind in enumerate(config.layer_types) if kind == "chunked_attention"}
        found += [(m, chunk) for m in model.modules() if type(m).__name__.endswith("Attention")
                  and getattr(m, "config", None) is config and getattr(m, "layer_idx", None) in chunked]
    return found


def family_reason(model: nn.Module) -> str | None:
    """Why ``model``'s family is refused, precisely (:data:`seqmesh.rules.families.FAMILY_REASONS`), or None."""
    return config_reason(getattr(model, "config", None))


def check_layers(model: nn.Module, handled: Sequence[nn.Module] = (), indexed: Sequence[nn.Module] = (),
                 handled_types: Sequence[str] = ()) -> None:
    """Raise a ValueError naming every layer or variant of ``model`` seqmesh would not compute exactly.
    ``handled``: token-mixing layers seqmesh runs sequence-parallel itself (:mod:`seqmesh.hf.mixers`); they, and
    their ``handled_types`` of ``config.layer_types``, are then accepted.
    ``indexed``: the attention modules of ``indexed_attention`` layers seqmesh runs itself
    (:mod:`seqmesh.hf.indexed_attention`); a layer of that type whose module is not among them is refused."""
    name = type(model).__name__
    reason = family_reason(model)
    if reason is not None:
        raise ValueError(f"seqmesh cannot run {name} exactly: {reason}.")
    problems = []
    supported = SUPPORTED_LAYER_TYPES + tuple(handled_types)
    indexed_at = [(id(getattr(m, "config", None)), getattr(m, "layer_idx", None)) for m in indexed]
    inside_handled = {id(part) for layer in handled for part in layer.modules()}
    handled_ids = {id(layer) for layer in handled}
    # a decoder layer that holds a handled layer (OlmoHybridLinearAttentionDecoderLayer) is its container
    inside_handled |= {id(m) for m in model.modules() if handled_ids & {id(d) for d in m.modules()}}
    chunked = [(id(m.config), m.layer_idx) for m, _ in chunked_layers(model)]
    explained = set()
    for config in _configs(model):
        kinds = getattr(config, "layer_types", None) or ()
        for i, kind in enumerate(kinds):
            if kind == "chunked_attention" and _chunk(config) is not None:
                if chunked.count((id(config), i)) != 1:
                    problems.append(f"layer {i} is a chunked-attention layer whose attention module seqmesh cannot find")
            elif kind == "indexed_attention" and indexed:
                if indexed_at.count((id(config), i)) != 1:
                    problems.append(f"layer {i} is an indexed-attention layer whose attention module seqmesh cannot find")
            elif kind not in supported:  # a kind's reason once, with its first layer
                reason = LAYER_TYPE_REASONS.get(kind) if kind not in explained else None
                explained.add(kind)
                problems.append(f"layer {i} is a {kind!r} layer" + (f" ({reason})" if reason else ""))
        chunk = getattr(config, "attention_chunk_size", None)
        if chunk and _chunk(config) is None:
            problems.append(f"its attention is chunked (attention_chunk_size={chunk}). Set config.attention_chunk_size = "
                            "None to train it with full attention")
        both_ways = getattr(config, "use_bidirectional_attention", False)
        # "vision" (Gemma 4 unified): both ways within an image's tokens only, none in a text batch
        if both_ways and both_ways != "vision" and getattr(config, "sliding_window", None):
            problems.append(f"its sliding windows are bidirectional (use_bidirectional_attention={both_ways!r})")
    mixers = [(path, type(m).__name__) for path, m in model.named_modules()
              if path and id(m) not in inside_handled and mixes_tokens(m)]
    seen = set()
    for path, cls in mixers:  # the outermost match names the layer (a Mamba mixer, not the conv inside it)
        if cls not in seen and not any(path.startswith(other + ".") for other, _ in mixers):
            seen.add(cls)
            problems.append(f"{path} is a {cls}, which mixes tokens outside the attention interface (run on a "
                            "shard it would compute another recurrence or convolution)")
    dropping = attention_without_entry(model)
    if dropping:
        problems.append(f"{'; '.join(dropping)}, so the sequence information seqmesh's attention needs never "
                        "reaches it (transformers' layer would have to pass **kwargs to its attention)")
    if has_attention(model, inside_handled) and not _routes_through_interface(model):
        problems.append("it does not route its attention through transformers' AttentionInterface, so seqmesh cannot "
                        "replace it (each rank would attend within its own shard only)")
    if problems:
        listed = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise ValueError(f"seqmesh cannot run {name} exactly: {listed}. seqmesh supports {SUPPORTED}.")
