"""Plain towers (LLaVA's CLIP): fixed-size images, a class token, learned positions, no merging.

The tower's sequence is every image's ``[class, patch 1, ..., patch N]``, one document per image, cut
into ``P`` equal contiguous shares (one token is the unit: nothing is merged). Each rank embeds its
patches (the patch embedding is a convolution whose stride is its kernel: one patch at a time), adds
each place's learned position, runs the encoder layers up to the one LLaVA reads (``vision_feature_layer``)
with attention over the sequence group, projects its rows, and sends each patch's row to the rank
holding its placeholder token; with the ``default`` strategy the class token's row stays home.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mesh import SPMesh
from .route import FixedSizeShard, route_rows
from .windows import WindowGrid, check_fixed_size_media, window_shard


def feature_layers(config) -> list[int]:
    """Indices into the tower's hidden states (0: the embeddings, i: after encoder layer i) that LLaVA reads."""
    layers = config.vision_feature_layer
    count = config.vision_config.num_hidden_layers + 1
    return [x % count for x in ([layers] if isinstance(layers, int) else layers)]


def tokens_per_image(config) -> int:
    """Placeholder tokens of one image: its patches, and its class token unless the strategy drops it."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    return side * side + (config.vision_feature_select_strategy != "default")


def check_plain(config) -> None:
    """Refuse, by name, the LLaVA settings seqmesh does not route."""
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not one seqmesh routes; it routes 'default' "
                         "(patches) and 'full' (patches and the class token).")
    if getattr(config.vision_config, "model_type", "") != "clip_vision_model":
        raise ValueError(f"LLaVA with a {config.vision_config.model_type} tower is not one seqmesh routes; it routes "
                         "CLIP towers.")


def check_plain_media(batch, input_ids: torch.Tensor, config) -> int:
    """The number of images, after checking their pixels and placeholder tokens."""
    return check_fixed_size_media(batch, input_ids, config, "LLaVA", config.vision_config.image_size,
                                  tokens_per_image(config), "")


def plain_grid(config) -> WindowGrid:
    """LLaVA's image as a window tower's: windows of one patch after the class token's, whose row yields the image's
    first placeholder token unless the ``default`` strategy drops it."""
    vision = config.vision_config
    return WindowGrid(side=vision.image_size // vision.patch_size, kernel=1, patch=vision.patch_size,
                      channels=vision.num_channels, class_token=True,
                      class_routed=config.vision_feature_select_strategy != "default")


def plain_shard(batch, mesh: SPMesh, config, images: int, units_of: torch.Tensor, lay,
                device: torch.device) -> FixedSizeShard:
    """This rank's places of the tower's sequence and the routing of their rows (module docstring): a window
    shard of windows of one patch (``seqmesh.vision.windows``)."""
    return window_shard(batch, mesh, plain_grid(config), images, units_of, lay, device)


def run_plain_tower(model: nn.Module, shard: FixedSizeShard, mesh: SPMesh | None) -> torch.Tensor:
    """``(V, D)``: the projected features of this rank's ``V`` placeholder tokens, in their row-major order."""
    inner = model.model
    tower = getattr(inner.vision_tower, "vision_model", inner.vision_tower)  # older releases nest it once more
    embeddings = tower.embeddings
    weight = embeddings.patch_embedding.weight
    patches = F.conv2d(shard.patches.to(weight.dtype), weight, stride=embeddings.patch_size).flatten(1)  # (n, C)
    cls = embeddings.class_embedding.to(patches.dtype).expand_as(patches)
    hidden = torch.where(shard.is_class[:, None], cls, patches) + embeddings.position_embedding(shard.positions)
    hidden = tower.pre_layrnorm(hidden)[None]  # (1, n, C): the encoder layers take a batch dimension
    wanted = feature_layers(inner.config)
    states = {0: hidden}
    for i, layer in enumerate(tower.encoder.layers[: max(wanted)], start=1):
        hidden = layer(hidden, attention_mask=None, seqmesh=shard.images)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        states[i] = hidden
    features = torch.cat([states[i] for i in wanted], dim=-1)[0]  # (n, C * layers)
    return route_rows(inner.multi_modal_projector(features), shard, mesh)  # every row: the projector runs on every rank
