"""Pixel-shuffled towers (InternVL's InternViT): fixed-size tiles, a class token, learned positions, layer
scale; the features of one layer, without the class token, then a pixel shuffle that concatenates each
``k x k`` window of patches into one placeholder token's row (``k = 1 / downsample_ratio``), and a projector.

The processor cuts every image (and every video frame) into tiles of one size and writes each tile's
``(side / k)**2`` placeholder tokens in the order of ``pixel_values``: to the model, a tile is an image.
The tower's sequence is every tile's class token and patches in window order, cut into equal shares of
whole windows (``seqmesh.vision.windows``, the class token in a window of its own): each rank embeds its
places, runs the encoder layers up to the one InternVL reads with attention over the sequence group, and
concatenates each window's rows locally, as the pixel shuffle does (row-major inside the window). Only the
projected rows travel, ``k * k`` times fewer than the patches.

InternViT's encoder layer does not pass keyword arguments to its attention, but the attention passes
them on to the attention function, so each layer is run here from its own modules, in its order, with
the images as documents (the ``seqmesh`` entry) given to the attention module.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo
from .windows import check_fixed_size_media
from .route import route_rows
from .route import FixedSizeShard
from .windows import WindowGrid, run_layers, window_shard


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def shuffle_kernel(config) -> int:
    """``k``: the side of the window of patches one placeholder token concatenates (``1 / downsample_ratio``)."""
    return max(round(1 / config.downsample_ratio), 1)


def check_shuffled(config) -> None:
    """Refuse, by name, the InternVL settings seqmesh does not route."""
    vision = config.vision_config
    if getattr(vision, "model_type", "") != "internvl_vision":
        raise ValueError(f"InternVL with a {vision.model_type} tower is not one seqmesh routes; it routes InternViT "
                         "towers (vision_config.model_type 'internvl_vision').")
    strategy = config.vision_feature_select_strategy
    if strategy != "default":
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not one seqmesh routes for InternVL: its pixel "
                         "shuffle takes a square of patches, so the class token must be dropped; set it to 'default'.")
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: InternVL reads one layer's features; seqmesh routes one int "
                         "(-1: the last layer, after the tower's final norm).")
    size, patch = _pair(vision.image_size), _pair(vision.patch_size)
    if size[0] != size[1] or patch[0] != patch[1] or size[0] % patch[0]:
        raise ValueError(f"image_size={size} and patch_size={patch}: seqmesh routes square tiles of whole square "
                         "patches, as InternVL's pixel shuffle and position table take them.")
    ratio, kernel, side = config.downsample_ratio, shuffle_kernel(config), size[0] // patch[0]
    if kernel * ratio != 1 or side % kernel:
        raise ValueError(f"downsample_ratio={ratio} must be 1/k for a whole k dividing the {side} patches of a tile side, "
                         "so each placeholder token concatenates a whole k x k window of patches (published InternVL: "
                         "0.5).")


def shuffled_grid(config) -> WindowGrid:
    """The windows of one InternVL tile: one per placeholder token, after the class token's."""
    vision = config.vision_config
    size, patch = _pair(vision.image_size)[0], _pair(vision.patch_size)[0]
    return WindowGrid(side=size // patch, kernel=shuffle_kernel(config), patch=patch, channels=vision.num_channels,
                      class_token=True)


def check_shuffled_media(batch, input_ids: torch.Tensor, config) -> int:
    """The number of tiles, after checking their pixels and placeholder tokens."""
    return check_fixed_size_media(batch, input_ids, config, "InternVL", _pair(config.vision_config.image_size)[0],
                                  shuffled_grid(config).tokens, "(image_size / patch_size * downsample_ratio)**2=")


def shuffled_shard(batch, mesh: SPMesh, config, images: int, units_of: torch.Tensor, lay,
                   device: torch.device) -> FixedSizeShard:
    """This rank's places of the tower's sequence and the routing of their shuffled rows (module docstring)."""
    return window_shard(batch, mesh, shuffled_grid(config), images, units_of, lay, device)


def encoder_layer(layer: nn.Module, hidden: torch.Tensor, images: SequenceInfo) -> torch.Tensor:
    """One InternViT layer on ``hidden`` (1, n, C): norm, attention over the images as documents, layer scale,
    residual; norm, MLP, dropout, layer scale, residual."""
    attended, _ = layer.attention(layer.layernorm_before(hidden), seqmesh=images)
    hidden = hidden + layer.lambda_1 * attended
    return hidden + layer.lambda_2 * layer.dropout(layer.mlp(layer.layernorm_after(hidden)))


def run_shuffled_tower(model: nn.Module, shard: FixedSizeShard, mesh: SPMesh | None) -> torch.Tensor:
    """``(V, D)``: the projected features of this rank's ``V`` placeholder tokens, in their row-major order."""
    inner = model.model
    tower = inner.vision_tower
    embeddings = tower.embeddings
    conv = embeddings.patch_embeddings.projection
    patches = conv(shard.patches.to(conv.weight.dtype)).flatten(1)  # (n, C): stride = kernel, one patch at a time
    cls = embeddings.cls_token.reshape(1, -1).to(patches.dtype).expand_as(patches)
    hidden = torch.where(shard.is_class[:, None], cls, patches)
    if embeddings.position_embeddings is not None:  # a tile's own size: the table as it is, no interpolation
        hidden = hidden + embeddings.position_embeddings[0, shard.positions]
    hidden = embeddings.dropout(hidden)[None]  # (1, n, C): the layers take a batch dimension
    layers = tower.encoder.layer
    read = inner.config.vision_feature_layer  # -1: after the last layer and the tower's final norm
    hidden = run_layers(layers[: read % (len(layers) + 1)] if read != -1 else layers, encoder_layer, hidden, shard.images)
    if read == -1:
        hidden = tower.layernorm(hidden)
    rows = hidden[0].reshape(-1, shuffle_kernel(inner.config) ** 2 * hidden.shape[-1])  # (windows, k*k*C): the shuffle
    return route_rows(inner.multi_modal_projector(rows), shard, mesh)  # every row: the projector runs on every rank
