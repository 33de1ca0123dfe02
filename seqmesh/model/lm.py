"""Building transformers models from shapes, and the module whose forward is the training loss."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.ranks import is_dtensor
from .head import logit_head, without_projection
from .loss import chunked_linear_cross_entropy
from .materialize import materialize
from .router_aux import RouterAux, load_balancing_loss, router_aux
from ..sequence.batch import IGNORE_INDEX, real_tokens
from ..mesh import SPMesh
from ..tensor_values import real_tensors
from .presets import MODELS, model_shape
from .shapes import ModelShape

if TYPE_CHECKING:  # annotations only: the model reads what shard_batch built, it never builds one
    from ..sequence.batch import SequenceInfo


def hf_config(shape: ModelShape, *, max_positions: int = 1 << 20):
    """A transformers config of ``shape``'s family with its sizes (random initialisation follows)."""
    from transformers import AutoConfig

    sizes = dict(
        sliding_window=shape.sliding_window,  # None: full attention (Mistral's configs default to a window)
        use_sliding_window=shape.sliding_window is not None,
    )
    if shape.family != "mistral":  # Mistral has one window for every layer and no layer_types
        sizes["layer_types"] = list(shape.layer_types)
    if shape.experts:
        sizes.update(num_local_experts=shape.experts, num_experts_per_tok=shape.experts_per_token)
    if shape.full_attention_interval:  # Gated DeltaNet layers between the full-attention ones
        sizes.update(linear_num_key_heads=shape.linear_key_heads, linear_num_value_heads=shape.linear_value_heads,
                     linear_key_head_dim=shape.linear_key_dim, linear_value_head_dim=shape.linear_value_dim,
                     linear_conv_kernel_dim=shape.linear_conv)
    text = dict(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tie_embeddings,
        rope_theta=shape.rope_theta,
        max_position_embeddings=max_positions,
        attention_dropout=0.0,
        **sizes,
        **dict(shape.extra),
    )
    if shape.vision is None:
        return AutoConfig.for_model(shape.family, **text)
    return AutoConfig.for_model(shape.family, text_config=_mrope_text(shape, text), vision_config=shape.vision.config(shape.family),
                                tie_word_embeddings=shape.tie_embeddings, **_media_token_ids(shape))


def _mrope_text(shape: ModelShape, text: dict) -> dict:
    """A Qwen-VL decoder's config entries: M-RoPE splits the rotary frequencies between time, height and
    width (Qwen2.5-VL: a quarter to time, as its [16, 24, 24] of 64; Qwen3-VL: 3/8, interleaved, as its
    [24, 20, 20])."""
    half = shape.head_dim // 2
    t = half * 3 // 8 if shape.family == "qwen3_vl" else half // 4
    h = (half - t) // 2
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta, "mrope_section": [t, h, half - t - h]}
    if shape.family == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text = {k: v for k, v in text.items() if k not in ("rope_theta", "sliding_window", "use_sliding_window", "layer_types")}
    if shape.vocab <= max(QWEN_TEXT_TOKENS):  # Qwen's BOS/EOS ids lie past a tiny vocabulary: none (transformers warned
        text.update(bos_token_id=None, eos_token_id=None)  # of ids out of the vocabulary, on every rank)
    return {**text, "rope_parameters": rope}


# the published Qwen ids of <|endoftext|> (BOS) and <|im_end|> (EOS), Qwen2-VL's and Qwen2.5-VL's defaults
QWEN_TEXT_TOKENS = (151643, 151645)


# the published Qwen-VL ids of the image, video, vision-start and vision-end tokens
QWEN_MEDIA_TOKENS = (151655, 151656, 151652, 151653)


def _media_token_ids(shape: ModelShape) -> dict:
    """The media tokens' ids: the published ones, or the vocabulary's last four when it is too small."""
    ids = QWEN_MEDIA_TOKENS if shape.vocab > max(QWEN_MEDIA_TOKENS) else tuple(range(shape.vocab - 4, shape.vocab))
    return dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), ids))


# the names a family's config gives its attention dropout: most families', GPT-2's (and GPT-BigCode's, GPT-J's,
# CodeGen's, the original GPT's), BERT's
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def load_config(path: str):
    """The transformers config in ``path`` (a ``config.json`` file, or a folder holding one) exactly as
    written (norm epsilon, biases, activation, RoPE scaling, sliding window...), with no download;
    only its attention dropout (:data:`ATTENTION_DROPOUT`, by the family's name for it) is set to 0, as seqmesh's
    exact attention has no dropout."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no transformers config at {file!r}; give a preset name, a config.json or a folder holding one.")
    config = AutoConfig.from_pretrained(file, local_files_only=True)
    config.attention_dropout = 0.0
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        for name in ATTENTION_DROPOUT:
            if isinstance(getattr(part, name, None), float):
                setattr(part, name, 0.0)
    return config


def has_weights(path: str) -> bool:
    """Whether ``path`` is a local checkpoint folder (weights to load, not to initialise)."""
    return os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


class ModelSource(NamedTuple):
    """A run's model as read once: the preset, ``config.json`` or checkpoint folder as given, its shape, transformers'
    config (a preset's :func:`hf_config`; a user's as written, :func:`load_config`) and whether the folder holds
    weights. The job reads it once and hands it to its data, its mesh and its model."""

    name: str
    shape: ModelShape
    config: object
    pretrained: bool


def read_model(name_or_path: str) -> ModelSource:
    """``name_or_path`` read once (unknown names, sizes out of range and unreadable configs fail here)."""
    shape = model_shape(name_or_path)
    config = hf_config(shape) if name_or_path in MODELS else load_config(name_or_path)
    return ModelSource(name_or_path, shape, config, has_weights(name_or_path))


def build_model(model: str | ModelSource, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", values: bool = True):
    """A causal LM: a preset, or a ``config.json`` (file or folder without weights) with random
    weights (the same for a given ``seed`` whatever the device or, after sharding, the mesh), or a local
    checkpoint folder (config.json plus weights) loaded whole without any download. On the meta device a
    checkpoint folder gives its config's model, weights unread: ``pretrained.load_pretrained`` reads
    each rank's shards after FSDP.

    A user's config is taken as written (see :func:`load_config`); presets use :func:`hf_config`. ``model``: a name or
    path, or the :class:`ModelSource` a job read once (its config is copied, never changed). ``values=False``: random
    weights are allocated but not drawn (a rehearsal's fake tensors, which hold none; see :func:`materialize`)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    source = model if isinstance(model, ModelSource) else read_model(model)
    name_or_path, shape = source.name, source.shape
    auto = AutoModelForImageTextToText if shape.vision is not None else AutoModelForCausalLM
    config = copy.deepcopy(source.config)
    if type(config) not in auto._model_mapping:
        raise ValueError(f"{name_or_path}: transformers has no {auto.__name__} for model type {config.model_type!r}; "
                         "seqmesh trains decoder-only causal language models (Llama, Qwen, Mistral, Gemma 3, gpt-oss, "
                         "...). Give one of those, or a preset.")
    if source.pretrained and torch.device(device).type != "meta":  # on meta: see pretrained.load_pretrained
        model = auto.from_pretrained(  # its config as load_config reads it: no attention dropout, by any name
            name_or_path, config=config, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
        )
        check_causal(model, name_or_path)
        return model.to(device)
    # the single-device reference runs transformers' own attention: SDPA, or eager for models without an
    # SDPA path (gpt-oss: its sinks); seqmesh.hf replaces either
    sdpa = auto._model_mapping[type(config)]._supports_sdpa
    # built on the meta device outside a rehearsal's fake mode: a model whose __init__ converts a module (HY-V4's and
    # DeepSeek-V4's hyper-connections: ``.to(torch.float32)``) cannot swap fake parameters (fake mode's weak
    # references); real meta tensors hold no memory either, and materialize makes them fake on the fake device
    with real_tensors(), torch.device("meta"):
        model = auto.from_config(config, dtype=dtype, attn_implementation="sdpa" if sdpa else "eager")
    check_causal(model, name_or_path)
    if torch.device(device).type != "meta":  # values from (seed, module name): see initialize_by_name
        materialize(model, device, seed, values=values)
    return model


def check_causal(model: nn.Module, name: str) -> None:
    """Refuse a model whose decoder attends both ways (BERT and its kin: transformers builds them as "causal LMs" but
    their attention, without ``is_decoder``, sees every token): seqmesh's loss predicts each token from those
    before it, and such a model would see the answer. Names the layer and the fix."""
    decoder = decoder_of(model)  # a vision tower's blocks left out
    both_ways = next((n for n, m in decoder.named_modules()
                      if (getattr(m, "is_causal", True) is False and not attends_over_depth(m))
                      or ("SelfAttention" in type(m).__name__ and getattr(m, "is_decoder", True) is False)), None)
    if both_ways is not None:
        raise ValueError(f"{name}: {type(model).__name__}'s attention ({both_ways}) sees the whole sequence both ways "
                         f"(is_causal=False, or is_decoder=False): {model.config.model_type} is an encoder, not a causal decoder. seqmesh trains "
                         "causal language models, each token predicted from those before it: give a decoder-only model "
                         "(Llama, Qwen, Mistral, Gemma 3, gpt-oss, ...).")


def attends_over_depth(module: nn.Module) -> bool:
    """Whether ``module`` attends over each token's own stack of states (Inkling 2's block and message residuals:
    learned queries over the block states a token keeps), never over the tokens, which ``is_causal=False`` says
    nothing about."""
    name = type(module).__name__
    return name.startswith("Inkling2") and name.endswith(("BlockAttentionResidual", "MessageAttentionResidual")) \
        and hasattr(module, "query")


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder of a transformers causal LM: the module whose forward returns ``last_hidden_state``.
    ``get_decoder()``, except where transformers' lookup returns the causal LM itself (Llama 4's text model, whose
    ``base_model_prefix`` names an attribute it does not have), or the LM's output projection, a Linear named
    ``decoder`` (ModernBERT-decoder's, which ``get_decoder`` finds by that name): then its ``model``."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    inner = getattr(model, "model", None)
    if (base is model and hasattr(model, "lm_head") or isinstance(base, nn.Linear)) and isinstance(inner, nn.Module):
        return inner
    return base


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (the unit of FSDP and checkpointing)."""
    base = decoder_of(model)

    def found(path: str):
        owner = base
        for name in path.split("."):
            owner = getattr(owner, name, None)
        return owner if isinstance(owner, nn.ModuleList) else None

    layers = next((found(path) for path in LAYER_LISTS if found(path) is not None), None)
    split = [found(path) for path in SPLIT_LAYER_LISTS]
    if layers is None and all(part is not None and len(part) == len(split[0]) for part in split):
        return [unit for units in zip(*split) for unit in units]  # XLM: each layer's attention, then its MLP
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; expected a list of blocks named "
                         f"{', '.join(LAYER_LISTS)}.")
    return list(layers)


# transformers' name, and the older families' (GPT-2 and BLOOM: h; MPT: blocks; the BERT-style decoders: encoder.layer)
LAYER_LISTS = ("layers", "h", "blocks", "encoder.layer")
# a decoder that keeps its layers' halves in lists of their own (XLM: attentions, ffns, and the norms between, which
# its model applies itself): the units are each attention and each MLP, in the order the model calls them
SPLIT_LAYER_LISTS = ("attentions", "ffns")


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a vision-language model's vision tower (Qwen-VL's ``model.model.visual.blocks``, the encoder
    layers of LLaVA's CLIP, Gemma 3's SigLIP, InternVL's InternViT), or none for a text model: FSDP units of their
    own, like decoder layers."""
    inner = getattr(model, "model", model)
    visual = getattr(inner, "visual", None)
    if visual is not None:
        return list(getattr(visual, "blocks", None) or ())
    tower = getattr(inner, "vision_tower", None)
    tower = getattr(tower, "vision_model", tower)  # CLIP's and SigLIP's transformer (older releases nest it once more)
    encoder = getattr(tower, "encoder", None)
    return list(getattr(encoder, "layers", None) or getattr(encoder, "layer", None) or ())  # InternViT: encoder.layer


class LossTerms(NamedTuple):
    """A batch's loss in its terms: the mean next-token cross-entropy, and ``router_aux_loss_coef`` x the
    routers' load-balancing loss (None where the model adds none)."""

    cross_entropy: torch.Tensor  # ()
    router: torch.Tensor | None  # ()


class SequenceParallelLM(nn.Module):
    """Wraps a transformers causal LM; ``forward(**shard_batch(...))`` returns the loss.

    The loss is the one-device mean next-token cross-entropy of the whole batch (see
    ``seqmesh.model.loss``), plus an MoE model's router load-balancing term where its config asks for it
    (``seqmesh.model.router_aux``), computed with a chunked LM head so full-vocabulary logits never exist for the
    whole local shard. It lives in a module's forward so FSDP2 has the LM head's weight gathered.
    """

    def __init__(self, lm: nn.Module, mesh: SPMesh | None, *, chunk: int = 4096):
        super().__init__()
        router_aux(lm)  # a router loss seqmesh does not reproduce is refused now, before any batch (forward reads it again)
        # what the model does to its logits (a constant scale, a final soft-cap), refused now where the loss would not
        (self.logit_scale, self.logit_softcap, transform, self.logit_projection, self.logit_vocab,
         self.logit_column_scale) = logit_head(lm)
        # a per-token prediction head before the output projection (ModernBERT-decoder's; BERT's cls without its
        # projection, logit_projection), by name: a submodule of lm
        self.logit_transform = transform
        self.lm = lm
        self.mesh = mesh
        self.chunk = chunk

    def decode(self, input_ids, position_ids, seqmesh: SequenceInfo | None = None, *, router_logits: bool = False):
        """The decoder's output: ``last_hidden_state`` ``(B, L, hidden)`` and, with ``router_logits``, the
        ``router_logits`` of every MoE layer (``(B * L, E)`` each)."""
        extra = {} if seqmesh is None else {"seqmesh": seqmesh}
        if router_logits:
            extra["output_router_logits"] = True
        return decoder_of(self.lm)(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)

    def hidden_states(self, input_ids, position_ids, seqmesh: SequenceInfo | None = None) -> torch.Tensor:
        return self.decode(input_ids, position_ids, seqmesh).last_hidden_state  # (B, L, hidden)

    def forward(self, input_ids, position_ids, shift_labels, seqmesh: SequenceInfo | None = None) -> torch.Tensor:
        """The loss (the same on every rank)."""
        aux = router_aux(self.lm)
        out = self.decode(input_ids, position_ids, seqmesh, router_logits=aux is not None)
        return self.loss_of(out, shift_labels, seqmesh, aux)

    def loss_of(self, out, shift_labels, seqmesh: SequenceInfo | None, aux: RouterAux | None) -> torch.Tensor:
        """The loss of the decoder's output: the cross-entropy, plus ``aux`` (``router_aux(self.lm)``: the routers'
        load-balancing term, where the model adds one), both pooled over the batch group."""
        terms = self.loss_terms(out, shift_labels, seqmesh, aux)
        return terms.cross_entropy if terms.router is None else terms.cross_entropy + terms.router

    def loss_terms(self, out, shift_labels, seqmesh: SequenceInfo | None, aux: RouterAux | None) -> LossTerms:
        """The two terms of :meth:`loss_of` apart (the Trainer weights only the cross-entropy by its micro-batch's
        share of the step's targets, as transformers' Trainer does)."""
        loss = self.loss_from_hidden(out.last_hidden_state, shift_labels, seqmesh)
        if aux is None:
            return LossTerms(loss, None)
        group = self.mesh.batch_group if self.mesh is not None else None
        real = real_tokens(seqmesh, self.mesh, tuple(shift_labels.shape), shift_labels.device)
        return LossTerms(loss, (aux.coef * load_balancing_loss(out.router_logits, aux, real, group)).to(loss.dtype))

    def _projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output embedding's weight ``(V, hidden)`` and bias ``(V,)`` (or None), its rows scaled by the head's
        learned scale of each logit (Dory's: ``(x W^T) s = x (s W)^T``), cut to the leading logits the model keeps
        (Inkling's padded vocabulary)."""
        head = self.lm.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if self.logit_column_scale is not None:
            if is_dtensor(weight):
                raise ValueError(f"{type(self.lm).__name__} scales each logit by a learned weight of its head, which "
                                 "seqmesh's vocabulary-parallel loss under tensor parallelism does not; use tp=1.")
            name, factor = self.logit_column_scale
            weight = weight * (getattr(head, name) * factor).to(weight.dtype)[:, None]  # (V, hidden)
        if self.logit_vocab is None:
            return weight, bias
        if is_dtensor(weight):
            raise ValueError(f"{type(self.lm).__name__} keeps the first {self.logit_vocab} of its {weight.shape[0]} "
                             "logits (a padded vocabulary), which seqmesh's vocabulary-parallel loss under tensor "
                             "parallelism does not; use tp=1.")
        return weight[: self.logit_vocab], None if bias is None else bias[: self.logit_vocab]

    def loss_from_hidden(self, hidden: torch.Tensor, shift_labels, seqmesh: SequenceInfo | None) -> torch.Tensor:
        """The loss of the final hidden states ``(B, L, hidden)``: chunked LM head and cross-entropy."""
        hidden = self._scaled(hidden)
        weight, bias = self._projection()
        group = self.mesh.batch_group if self.mesh is not None else None
        ignore = seqmesh.ignore_index if seqmesh is not None else IGNORE_INDEX  # the one shard_batch used
        if is_dtensor(weight):  # tensor parallelism: a vocabulary-parallel head over sequence-sharded states
            from .vocab_parallel import vocab_parallel_loss

            if self.logit_softcap is not None or bias is not None or self.logit_transform is not None:
                what = (f"soft-caps its logits (final_logit_softcapping={self.logit_softcap})"
                        if self.logit_softcap is not None else "adds a bias to its logits"
                        if self.logit_transform is None else f"has a prediction head ({self.logit_transform})")
                raise ValueError(f"{type(self.lm).__name__} {what}, which seqmesh's vocabulary-parallel loss under "
                                 "tensor parallelism does not; use tp=1.")
            return vocab_parallel_loss(hidden, weight, shift_labels, group, chunk=self.chunk, ignore_index=ignore)
        return chunked_linear_cross_entropy(hidden, weight, shift_labels, group, chunk=self.chunk, ignore_index=ignore,
                                            softcap=self.logit_softcap, bias=bias)

    @torch.no_grad()
    def score(self, input_ids, position_ids, shift_labels, seqmesh: SequenceInfo | None = None) -> torch.Tensor:
        """``[correct, counted]`` argmax predictions of this rank's valid targets (float64); sum them over
        the ranks for the accuracy. Under FSDP2 ``apply_fsdp`` registers it as a forward method, so it
        gathers the weights as ``forward`` does."""
        return self.score_from_hidden(self.hidden_states(input_ids, position_ids, seqmesh), shift_labels, seqmesh)

    def _scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` through the model's per-token prediction head where it has one (ModernBERT-decoder), times its
        constant logit scale (Cohere, Granite): ``(s x) W^T`` is its logits."""
        if self.logit_transform is not None:
            transform = getattr(self.lm, self.logit_transform)
            if self.logit_projection is not None:
                transform = without_projection(transform, self.logit_projection)
            hidden = transform(hidden)
        return hidden if self.logit_scale == 1.0 else hidden * self.logit_scale

    @torch.no_grad()
    def score_from_hidden(self, hidden: torch.Tensor, shift_labels, seqmesh: SequenceInfo | None) -> torch.Tensor:
        hidden = self._scaled(hidden)
        labels = shift_labels.reshape(-1)
        keep = labels != (seqmesh.ignore_index if seqmesh is not None else IGNORE_INDEX)
        weight, bias = self._projection()
        if is_dtensor(weight):  # tensor parallelism: every rank of the group scores the same tokens, counted once
            from .vocab_parallel import gathered_tokens, vocab_parallel_argmax

            tokens = gathered_tokens(hidden)
            local = weight.to_local()
            start = weight.device_mesh.get_local_rank() * local.shape[0]
            guess = vocab_parallel_argmax(tokens.reshape(-1, tokens.shape[-1])[keep], local, start,
                                          weight.device_mesh.get_group(), self.chunk)
            return torch.tensor([float((guess == labels[keep]).sum()), float(keep.sum())], dtype=torch.float64,
                                device=tokens.device)
        picked = hidden.reshape(-1, hidden.shape[-1])[keep]
        correct = sum(
            int((F.linear(picked[i : i + self.chunk], weight, bias).argmax(-1) == labels[keep][i : i + self.chunk]).sum())
            for i in range(0, picked.shape[0], self.chunk)
        )
        return torch.tensor([float(correct), float(keep.sum())], dtype=torch.float64, device=hidden.device)
