"""Pooled towers (Gemma 3's SigLIP): fixed-size images, no class token, learned positions, then an average
pool of ``k x k`` patches per placeholder token, an RMS norm and a projection.

The tower's sequence is every image's patches, one document per image, each pooling window's ``k x k``
patches next to each other, cut into ``P`` equal contiguous shares of whole windows
(``seqmesh.vision.windows``): the pool is local, and each rank sends only its pooled rows, ``k * k`` times
fewer than its patches, to the ranks holding their placeholder tokens. Gathering the patches before
pooling would move all of them instead.

The decoder's mask comes from ``token_type_ids`` (1: an image token), as in transformers: each maximal
run of image tokens inside a document is an image block whose tokens see each other both ways
(:func:`image_blocks`), carried to attention by ``SequenceInfo.image_blocks``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo
from .windows import check_fixed_size_media
from .route import route_rows
from .route import FixedSizeShard
from .windows import WindowGrid, run_layers, window_shard


def pooled_sizes(config) -> tuple[int, int, int]:
    """``(side, pooled_side, kernel)``: patches per image side, placeholder tokens per side, and the pooling
    window's side (``side = pooled_side * kernel``)."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    pooled = int(round(config.mm_tokens_per_image ** 0.5))
    return side, pooled, side // pooled


def check_pooled(config) -> None:
    """Refuse, by name, the Gemma 3 settings seqmesh does not route."""
    side, pooled, kernel = pooled_sizes(config)
    if pooled * pooled != config.mm_tokens_per_image or pooled * kernel != side:
        raise ValueError(f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side divides the "
                         f"{side} patches of an image side (image_size / patch_size), so each token pools whole "
                         "patches; seqmesh routes such towers only.")
    if getattr(config.vision_config, "model_type", "") != "siglip_vision_model":
        raise ValueError(f"Gemma 3 with a {config.vision_config.model_type} tower is not one seqmesh routes; it routes "
                         "SigLIP towers.")


def check_pooled_media(batch, input_ids: torch.Tensor, config) -> int:
    """The number of images, after checking their pixels and placeholder tokens."""
    return check_fixed_size_media(batch, input_ids, config, "Gemma 3", config.vision_config.image_size,
                                  config.mm_tokens_per_image, "mm_tokens_per_image=")


def image_blocks(token_type_ids: torch.Tensor | None, cu: tuple[int, ...] | None) -> tuple[tuple[int, int], ...] | None:
    """``[start, stop)`` of every maximal run of image tokens (``token_type_ids == 1``) inside a document, as
    transformers' Gemma 3 groups them (each packed document alone); None without ``token_type_ids``, where
    transformers' mask is plainly causal. ``token_type_ids``: ``(B, S)``; every row must have the same blocks."""
    if token_type_ids is None:
        return None
    image = (token_type_ids == 1).cpu()
    if not torch.equal(image, image[:1].expand_as(image)):
        raise ValueError("the rows of token_type_ids place their images differently; seqmesh attention shares one "
                         "mask across the batch. Pack the documents into one row (batch size 1), or give every row its "
                         "images at the same positions.")
    row = image[0].to(torch.int8)
    edges = torch.diff(F.pad(row, (1, 1))).nonzero().flatten().tolist()  # starts (+1) and stops (-1), alternating
    cuts = set(cu or ())
    blocks = []
    for a, b in zip(edges[0::2], edges[1::2]):
        inner = sorted(c for c in cuts if a < c < b)  # a run across a document boundary is two blocks
        blocks += list(zip([a, *inner], [*inner, b]))
    return tuple(blocks)


def pooled_grid(config) -> WindowGrid:
    """The windows of a Gemma 3 image: one per placeholder token, no class token."""
    side, _, kernel = pooled_sizes(config)
    return WindowGrid(side=side, kernel=kernel, patch=config.vision_config.patch_size,
                      channels=config.vision_config.num_channels, class_token=False)


def pooled_shard(batch, mesh: SPMesh, config, images: int, units_of: torch.Tensor, lay,
                 device: torch.device) -> FixedSizeShard:
    """This rank's patches of the tower's sequence and the routing of their pooled rows (module docstring)."""
    return window_shard(batch, mesh, pooled_grid(config), images, units_of, lay, device)


def encoder_layer(layer: nn.Module, hidden: torch.Tensor, images: SequenceInfo) -> torch.Tensor:
    """One SigLIP encoder layer on ``hidden`` (1, n, C), its attention through the function ``seqmesh.hf``
    registered: SigLIP's attention does not pass its keyword arguments on to that function, so the ``seqmesh``
    entry (the images as documents) is given here, and the layer's other steps are its own modules in its order."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = layer.self_attn
    x = layer.layer_norm1(hidden)
    q, k, v = (proj(x).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)  # (1, H, n, D)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    attend = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
    out, _ = attend(attn, q, k, v, None, dropout=attn.dropout if attn.training else 0.0, scaling=attn.scale,
                    seqmesh=images)  # (1, n, H, D)
    hidden = hidden + attn.out_proj(out.flatten(2))
    return hidden + layer.mlp(layer.layer_norm2(hidden))


def run_pooled_tower(model: nn.Module, shard: FixedSizeShard, mesh: SPMesh | None) -> torch.Tensor:
    """``(V, D)``: the projected features of this rank's ``V`` placeholder tokens, in their row-major order."""
    inner = model.model
    tower = getattr(inner.vision_tower, "vision_model", inner.vision_tower)  # older releases nest it once more
    embeddings = tower.embeddings
    conv = embeddings.patch_embedding
    hidden = conv(shard.patches.to(conv.weight.dtype)).flatten(1)  # (n, C): stride = kernel, one patch at a time
    hidden = (hidden + embeddings.position_embedding(shard.positions))[None]  # (1, n, C): layers take a batch dim
    hidden = run_layers(tower.encoder.layers, encoder_layer, hidden, shard.images)
    hidden = tower.post_layernorm(hidden)[0]  # (n, C)
    projector = inner.multi_modal_projector
    pooled = hidden.unflatten(0, (-1, projector.kernel_size ** 2)).mean(dim=1)  # (units, C): one pooling window each
    rows = (projector.mm_soft_emb_norm(pooled) @ projector.mm_input_projection_weight).type_as(hidden)
    return route_rows(rows, shard, mesh)  # every row: the projector runs on every rank
