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
from ..sequence.batch import SequenceInfo
from .route import FixedSizeShard, route_rows, routing


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


def plain_places(config, images: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, units)`` of every place of the tower's sequence: the place's index in its image, and
    the unit (placeholder token, counted over the batch) it yields, -1 for a class token LLaVA drops."""
    per_image = tokens_per_image(config)
    side = config.vision_config.image_size // config.vision_config.patch_size
    positions = torch.arange(side * side + 1).repeat(images)
    keep = config.vision_feature_select_strategy != "default"
    units = torch.full_like(positions, -1)
    yields = (positions > 0) | keep
    units[yields] = torch.arange(int(yields.sum()))  # per_image * images of them
    return positions, units


def check_fixed_size_media(batch, input_ids: torch.Tensor, config, family: str, size: int, per_image: int,
                           counted: str) -> int:
    """The number of fixed-size images (or tiles) of a batch, after checking their pixels ``(images, C, size,
    size)`` and that each has ``per_image`` placeholder tokens (``counted``: the setting that says so, as ``"name="``)."""
    if batch.get("pixel_values_videos") is not None:
        raise ValueError(f"{family} takes images only; the batch holds pixel_values_videos.")
    pixels = batch.get("pixel_values")
    images = 0 if pixels is None else pixels.shape[0]
    channels = config.vision_config.num_channels
    if pixels is not None and (pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size)):
        raise ValueError(f"pixel_values must be (images, {channels}, {size}, {size}) for this {family} tower, got "
                         f"{tuple(pixels.shape)}; pass the processor's output unchanged.")
    tokens = int((input_ids == config.image_token_id).sum())
    if tokens != images * per_image:
        raise ValueError(f"the batch has {tokens} image placeholder tokens (id {config.image_token_id}) but its {images} "
                         f"image(s) make {images * per_image} embeddings ({counted}{per_image} each); each image needs "
                         "exactly that many placeholder tokens, as the model's processor writes them.")
    return images


def check_plain_media(batch, input_ids: torch.Tensor, config) -> int:
    """The number of images, after checking their pixels and placeholder tokens."""
    return check_fixed_size_media(batch, input_ids, config, "LLaVA", config.vision_config.image_size,
                                  tokens_per_image(config), "")


def plain_shard(batch, mesh: SPMesh, config, images: int, units_of: torch.Tensor, lay,
                device: torch.device) -> FixedSizeShard:
    """This rank's places of the tower's sequence and the routing of their rows (module docstring)."""
    p, me = mesh.sp_size, mesh.sp_rank
    positions, units = plain_places(config, images)
    places = positions.numel()
    per_rank = max(-(-places // p), 1)  # padding only when another replica's batch has images
    positions = F.pad(positions, (0, per_rank * p - places))
    units = F.pad(units, (0, per_rank * p - places), value=-1)
    real = torch.arange(per_rank * p) < places
    mine = slice(me * per_rank, (me + 1) * per_rank)
    patch = config.vision_config.patch_size
    channels = config.vision_config.num_channels
    side = config.vision_config.image_size // patch
    pixels = batch.get("pixel_values")
    local = torch.zeros(per_rank, channels, patch, patch, dtype=pixels.dtype if pixels is not None else torch.float32,
                        device=device)
    is_patch = real[mine] & (positions[mine] > 0)
    if bool(is_patch.any()):
        image = torch.arange(per_rank * p)[mine] // (side * side + 1)
        index = image * side * side + positions[mine] - 1  # the patch's row in patch_pixels' order
        rows = patch_pixels(pixels, patch)[index[is_patch].to(pixels.device)]
        local[is_patch.to(device)] = rows.to(device)  # only this rank's patches reach its device
    cu = tuple(range(0, places + 1, side * side + 1)) if images else None
    info = SequenceInfo(seq_len=places if images else per_rank * p, cu_seqlens=cu, layout="contiguous")
    send_index, send_rows, recv_rows, recv_order = routing(units_of, units, per_rank, lay, p, me)
    token_units = units_of[:, lay.indices()].reshape(units_of.shape[0], p, lay.local_len)[:, me]
    return FixedSizeShard(
        patches=local, is_class=(real[mine] & (positions[mine] == 0)).to(device), positions=positions[mine].to(device),
        images=info, send_index=send_index.to(device), send_rows=send_rows, recv_rows=recv_rows,
        recv_order=recv_order.to(device), visual_mask=(token_units >= 0).to(device), has_media=images > 0,
    )


def patch_pixels(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """``(images * N, C, p, p)``: each image's patches in the order the convolution emits them (row-major)."""
    n, c, h, w = pixel_values.shape
    grid = pixel_values.reshape(n, c, h // patch, patch, w // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, c, patch, patch)


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
