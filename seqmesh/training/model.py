"""Building transformers models from shapes, and the module whose forward is the training loss."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from .data import SequenceInfo
from .loss import IGNORE_INDEX, chunked_linear_cross_entropy
from ..mesh import SPMesh
from .presets import MODELS, ModelShape, model_shape


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
    return AutoConfig.for_model(
        shape.family,
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


def load_config(path: str):
    """The transformers config in ``path`` (a ``config.json`` file, or a folder holding one) exactly as
    written (norm epsilon, biases, activation, RoPE scaling, sliding window...), with no download;
    only ``attention_dropout`` is set to 0, as seqmesh's exact attention has no dropout."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no transformers config at {file!r}; give a preset name, a config.json or a folder holding one.")
    config = AutoConfig.from_pretrained(file, local_files_only=True)
    config.attention_dropout = 0.0
    return config


def has_weights(path: str) -> bool:
    """Whether ``path`` is a local checkpoint folder (weights to load, not to initialise)."""
    return os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def build_model(name_or_path: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A causal LM: a preset, or a ``config.json`` (file or folder without weights) with random
    weights, or a local checkpoint folder (config.json plus weights) loaded without any download.

    A user's config is taken as written (see :func:`load_config`); presets use :func:`hf_config`."""
    from transformers import AutoModelForCausalLM

    if has_weights(name_or_path):
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, local_files_only=True, dtype=dtype, attn_implementation="sdpa", attention_dropout=0.0
        )
        return model.to(device)
    shape = model_shape(name_or_path)  # unknown names fail here, listing the presets
    config = hf_config(shape) if name_or_path in MODELS else load_config(name_or_path)
    torch.manual_seed(seed)
    with torch.device(device):
        # the single-device reference runs transformers' own attention: SDPA, or eager for models without
        # an SDPA path (gpt-oss: its sinks); seqmesh.hf replaces either
        sdpa = AutoModelForCausalLM._model_mapping[type(config)]._supports_sdpa
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa" if sdpa else "eager")
    return model


def _zero_padding_rows(lm: nn.Module) -> None:
    """Zero each embedding's ``padding_idx`` row in the shard that holds it. transformers' own init
    does ``weight[padding_idx].zero_()``, which on a sharded DTensor writes to a copy and is lost.
    FSDP2 shards dim 0 as ``torch.chunk`` does: shard i holds rows from ``i * ceil(rows / shards)``."""
    from torch.distributed.tensor import DTensor, Shard

    for module in lm.modules():
        pad = getattr(module, "padding_idx", None)
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Embedding) or pad is None or weight is None:
            continue
        with torch.no_grad():
            if not isinstance(weight, DTensor):
                weight[pad].zero_()
                continue
            local, offset = weight.to_local(), 0
            for axis, placement in enumerate(weight.placements):
                if isinstance(placement, Shard) and placement.dim == 0:
                    shards = weight.device_mesh.size(axis)
                    offset = weight.device_mesh.get_local_rank(axis) * -(-weight.shape[0] // shards)
            if offset <= pad < offset + local.shape[0]:
                local[pad - offset].zero_()


def materialize(root: nn.Module, device: torch.device | str, seed: int, shard_rank: int) -> None:
    """Allocate a model built on the meta device, after FSDP sharded ``root``, on ``device``, and initialise
    it as transformers does (``initialize_weights``: normal weights, unit norms, RoPE frequencies, zero
    padding rows).

    Every rank then holds only its shards: no rank ever materialises the whole model. On CUDA, DTensor's
    random-number tracker gives each shard its own stream from one shared seed. On CPU DTensor's random
    ops give every shard the same values, so there each shard draws from ``seed + shard_rank``:
    independent draws, while replicas of a shard (HSDP) agree."""
    device = torch.device(device)
    root.to_empty(device=device)  # the FSDP root (a SequenceParallelLM or the model itself)
    lm = getattr(root, "lm", root)
    for module in lm.modules():
        if getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = False
    torch.manual_seed(seed * 1_000_003 + (shard_rank if device.type == "cpu" else 0))
    lm.initialize_weights()
    _zero_padding_rows(lm)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (the unit of FSDP and checkpointing)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; expected a '.layers' list.")
    return list(layers)


class SequenceParallelLM(nn.Module):
    """Wraps a transformers causal LM; ``forward(**shard_batch(...))`` returns the loss.

    The loss is the one-device mean next-token cross-entropy of the whole batch (see
    ``seqmesh.training.loss``), computed with a chunked LM head so full-vocabulary logits never exist for the
    whole local shard. It lives in a module's forward so FSDP2 has the LM head's weight gathered.
    """

    def __init__(self, lm: nn.Module, mesh: SPMesh | None, *, chunk: int = 4096):
        super().__init__()
        self.lm = lm
        self.mesh = mesh
        self.chunk = chunk

    def hidden_states(self, input_ids, position_ids, seqmesh: SequenceInfo | None = None) -> torch.Tensor:
        extra = {} if seqmesh is None else {"seqmesh": seqmesh}
        out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        return out.last_hidden_state  # (B, L, hidden)

    def forward(self, input_ids, position_ids, shift_labels, seqmesh: SequenceInfo | None = None, *,
                score: bool = False) -> torch.Tensor:
        """The loss; with ``score=True`` instead ``[correct, counted]`` argmax predictions of this rank's
        valid targets (float64). Both go through forward so FSDP2 gathers the weights."""
        hidden = self.hidden_states(input_ids, position_ids, seqmesh)
        if score:
            return self._correct(hidden, shift_labels)
        weight = self.lm.get_output_embeddings().weight
        group = self.mesh.all_group if self.mesh is not None else None
        return chunked_linear_cross_entropy(hidden, weight, shift_labels, group, chunk=self.chunk)

    @torch.no_grad()
    def _correct(self, hidden: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        labels = shift_labels.reshape(-1)
        keep = labels != IGNORE_INDEX
        picked = hidden.reshape(-1, hidden.shape[-1])[keep]
        weight = self.lm.get_output_embeddings().weight
        correct = sum(
            int(((picked[i : i + self.chunk] @ weight.t()).argmax(-1) == labels[keep][i : i + self.chunk]).sum())
            for i in range(0, picked.shape[0], self.chunk)
        )
        return torch.tensor([float(correct), float(keep.sum())], dtype=torch.float64, device=hidden.device)

