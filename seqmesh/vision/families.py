"""The vision-language families seqmesh runs exactly, and how each one's tower and decoder are reached.

A family names the transformers modules seqmesh drives (the tower, its embedding pieces, the language
model) and what differs between them: the order of the tower's sequence (Qwen2.5-VL's windows), what
the decoder receives besides its input embeddings (Qwen3-VL's DeepStack features), learned positions,
a plain tower (LLaVA's CLIP, ``seqmesh.vision.plain``), a pooled one whose image tokens see each other
both ways (Gemma 3's SigLIP, ``seqmesh.vision.pooled``) and a pixel-shuffled one (InternVL's InternViT,
``seqmesh.vision.shuffled``). Every other multimodal model is refused by name
(:func:`vision_family`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

# model_type of the top-level config -> the families below
SUPPORTED_VISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "llava", "gemma3",
                    "internvl")
# multimodal model types seqmesh recognises but does not run yet, and why
REFUSED_VISION = {
    "llava_onevision": "LLaVA-OneVision's tower is not yet routed through seqmesh",
}


@dataclass(frozen=True)
class VisionFamily:
    name: str
    windows: bool  # Qwen2.5-VL: most tower blocks attend within windows of units
    deepstack: bool  # Qwen3-VL: features of some tower blocks are added to the first decoder layers
    learned_positions: bool  # Qwen3-VL: a learned position table resampled to each frame
    plain: bool = False  # LLaVA: fixed-size images through a CLIP tower with a class token (seqmesh.vision.plain)
    pooled: bool = False  # Gemma 3: fixed-size images through SigLIP, pooled per token, seen both ways (.pooled)
    shuffled: bool = False  # InternVL: fixed-size tiles, a class token, k x k patches concatenated per token (.shuffled)

    @property
    def fixed_size(self) -> bool:
        """Images of one size, no grid, one position per decoder token (LLaVA, Gemma 3, InternVL)."""
        return self.plain or self.pooled or self.shuffled

    @staticmethod
    def inner(model: nn.Module) -> nn.Module:
        """The ``*Model`` inside a ``*ForConditionalGeneration`` (it holds ``visual`` and ``language_model``)."""
        inner = getattr(model, "model", None)
        return inner if inner is not None and hasattr(inner, "language_model") else model

    def check(self, config) -> None:
        """Refuse, by name, settings of this family seqmesh does not route."""
        if self.plain:
            from .plain import check_plain

            check_plain(config)
        if self.pooled:
            from .pooled import check_pooled

            check_pooled(config)
        if self.shuffled:
            from .shuffled import check_shuffled

            check_shuffled(config)

    def layer_step(self):
        """The function that runs one layer of this family's tower from the layer's own modules
        (``windows.LayerStep``: SigLIP's and InternViT's layers do not hand ``seqmesh`` on to their attention), or
        None where the layer's own forward is called."""
        if self.pooled:
            from .pooled import encoder_layer

            return encoder_layer
        if self.shuffled:
            from .shuffled import encoder_layer

            return encoder_layer
        return None

    def attach_layer_steps(self, layers: list[nn.Module]) -> str | None:
        """Give the tower ``layers`` that seqmesh runs from their modules the method it calls them through, and
        return its name (for FSDP2 to register as a forward); None where the layers' own forward runs."""
        step = self.layer_step()
        if step is None:
            return None
        from .windows import LAYER_METHOD, attach_layer_steps

        attach_layer_steps(layers, step)
        return LAYER_METHOD

    def tower(self, model: nn.Module) -> nn.Module:
        inner = self.inner(model)
        return inner.vision_tower if self.fixed_size else inner.visual

    def language_model(self, model: nn.Module) -> nn.Module:
        return self.inner(model).language_model


FAMILIES = {
    # Qwen2-VL: Qwen2.5-VL's tower without windows (every block per frame; LayerNorm blocks, 2-D rotary)
    "qwen2_vl": VisionFamily("Qwen2-VL", windows=False, deepstack=False, learned_positions=False),
    "qwen2_5_vl": VisionFamily("Qwen2.5-VL", windows=True, deepstack=False, learned_positions=False),
    "qwen3_vl": VisionFamily("Qwen3-VL", windows=False, deepstack=True, learned_positions=True),
    "qwen3_vl_moe": VisionFamily("Qwen3-VL-MoE", windows=False, deepstack=True, learned_positions=True),
    # Qwen3.5: Qwen3-VL's tower without DeepStack, before a decoder of Gated DeltaNet and attention layers
    "qwen3_5": VisionFamily("Qwen3.5", windows=False, deepstack=False, learned_positions=True),
    "qwen3_5_moe": VisionFamily("Qwen3.5-MoE", windows=False, deepstack=False, learned_positions=True),  # MoE MLPs
    "llava": VisionFamily("LLaVA", windows=False, deepstack=False, learned_positions=False, plain=True),
    "gemma3": VisionFamily("Gemma 3", windows=False, deepstack=False, learned_positions=False, pooled=True),
    "internvl": VisionFamily("InternVL", windows=False, deepstack=False, learned_positions=False, shuffled=True),
}


def is_multimodal(config) -> bool:
    """Whether ``config`` describes a model with a vision tower."""
    return getattr(config, "vision_config", None) is not None


def vision_family(config) -> VisionFamily:
    """The family of a multimodal ``config``, or a ValueError naming why seqmesh refuses it."""
    return family_of(getattr(config, "model_type", None))


def family_of(kind: str | None) -> VisionFamily:
    """The family of a multimodal model of ``model_type`` ``kind`` (a config.json's, read before its sizes), or a
    ValueError naming why seqmesh refuses it."""
    if kind in FAMILIES:
        return FAMILIES[kind]
    why = REFUSED_VISION.get(kind, f"its vision tower ({kind}) is not one seqmesh routes")
    raise ValueError(f"seqmesh cannot run this multimodal model exactly: {why}. seqmesh runs the vision-language "
                     f"models {', '.join(SUPPORTED_VISION)}; train the others' language model alone, or without "
                     "sequence parallelism.")
