"""Pooled towers (Gemma 3's SigLIP): fixed-size images, no class token, learned positions, then an average
pool of ``k x k`` patches per placeholder token, an RMS norm and a projection.

The tower's sequence is every image's patches, one document per image, with each pooling window's
``k x k`` patches next to each other (a *unit*: the patches that become one placeholder token), units in
the order of the pooled grid (row-major, as the projector flattens it). Attention inside an image does
not care about the order of its tokens (the positions are added before the encoder), so this order
computes what the model computes, and the sequence can be cut into ``P`` equal contiguous shares of
whole units: every pooling window is on one rank, the pool is local, and each rank sends only its pooled
rows, ``k * k`` times fewer than its patches, to the ranks holding their placeholder tokens. Gathering the
patches before pooling would move all of them instead.

The decoder's mask comes from ``token_type_ids`` (1: an image token), as in transformers: each maximal
run of image tokens inside a document is an image block whose tokens see each other both ways
(:func:`image_blocks`), carried to attention by ``SequenceInfo.image_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.collectives import exchange_rows
from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo
from .plain import patch_pixels
from .route import moved, routing


@dataclass(frozen=True)
class PooledShard:
    """This rank's share of a pooled tower (``n = units x k x k`` patches) and the routing of its rows."""

    patches: torch.Tensor  # (n, C, p, p) pixels of each patch (zeros for padding), unit by unit
    positions: torch.Tensor  # (n,) index of the patch in its image (row-major): its learned position
    images: SequenceInfo  # one document per image over the tower's sequence
    send_index: torch.Tensor
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    recv_order: torch.Tensor
    visual_mask: torch.Tensor  # (B, L) bool: this rank's image placeholder tokens
    has_media: bool

    def to(self, device: torch.device | str) -> PooledShard:
        """The same shard with every tensor on ``device``."""
        return moved(self, device)


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
    if batch.get("pixel_values_videos") is not None:
        raise ValueError("Gemma 3 takes images only; the batch holds pixel_values_videos.")
    pixels = batch.get("pixel_values")
    size, channels = config.vision_config.image_size, config.vision_config.num_channels
    if pixels is not None and (pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size)):
        raise ValueError(f"pixel_values must be (images, {channels}, {size}, {size}) for this Gemma 3 tower, got "
                         f"{tuple(pixels.shape)}; pass the processor's output unchanged.")
    images = 0 if pixels is None else pixels.shape[0]
    tokens, per_image = int((input_ids == config.image_token_id).sum()), config.mm_tokens_per_image
    if tokens != images * per_image:
        raise ValueError(f"the batch has {tokens} image placeholder tokens (id {config.image_token_id}) but its {images} "
                         f"image(s) make {images * per_image} embeddings (mm_tokens_per_image={per_image} each); each "
                         "image needs exactly that many placeholder tokens, as the model's processor writes them.")
    return images


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


def pooled_places(config, images: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, units)`` of every patch of the tower's sequence, unit by unit: the patch's index in its
    image (row-major, its learned position) and the unit (placeholder token, counted over the batch) it
    pools into. ``(images * side**2,)`` each."""
    side, pooled, kernel = pooled_sizes(config)
    unit, inside = torch.arange(pooled * pooled).repeat_interleave(kernel * kernel), torch.arange(kernel * kernel).repeat(pooled * pooled)
    row = (unit // pooled) * kernel + inside // kernel
    col = (unit % pooled) * kernel + inside % kernel
    positions = (row * side + col).repeat(images)
    units = (torch.arange(images)[:, None] * pooled * pooled + unit).reshape(-1)
    return positions, units


def pooled_shard(batch, mesh: SPMesh, config, images: int, units_of: torch.Tensor, lay,
                 device: torch.device) -> PooledShard:
    """This rank's patches of the tower's sequence and the routing of their pooled rows (module docstring)."""
    p, me = mesh.sp_size, mesh.sp_rank
    side, _, kernel = pooled_sizes(config)
    per_unit = kernel * kernel
    units = images * config.mm_tokens_per_image
    per_rank = max(-(-units // p), 1)  # padding only when another replica's batch has images
    positions, unit_of_patch = pooled_places(config, images)
    patches_per_rank = per_rank * per_unit
    mine = torch.arange(me * patches_per_rank, (me + 1) * patches_per_rank)
    real = mine < positions.numel()
    patch = config.vision_config.patch_size
    pixels = batch.get("pixel_values")
    local = torch.zeros(patches_per_rank, config.vision_config.num_channels, patch, patch,
                        dtype=pixels.dtype if pixels is not None else torch.float32, device=device)
    local_positions = torch.zeros(patches_per_rank, dtype=torch.long)
    if bool(real.any()):
        index = unit_of_patch[mine[real]] // config.mm_tokens_per_image * side * side + positions[mine[real]]
        local[real.to(device)] = patch_pixels(pixels, patch)[index.to(pixels.device)].to(device)
        local_positions[real] = positions[mine[real]]
    length = positions.numel()
    if images:
        info = SequenceInfo(seq_len=length, cu_seqlens=tuple(range(0, length + 1, side * side)), layout="contiguous")
    else:  # padding only: one document, attended to and then dropped
        info = SequenceInfo(seq_len=patches_per_rank * p, cu_seqlens=None, layout="contiguous")
    places = torch.cat([torch.arange(units), torch.full((per_rank * p - units,), -1, dtype=torch.long)])
    send_index, send_rows, recv_rows, recv_order = routing(units_of, places, per_rank, lay, p, me)
    token_units = units_of[:, lay.indices()].reshape(units_of.shape[0], p, lay.local_len)[:, me]
    return PooledShard(
        patches=local, positions=local_positions.to(device), images=info, send_index=send_index.to(device),
        send_rows=send_rows, recv_rows=recv_rows, recv_order=recv_order.to(device),
        visual_mask=(token_units >= 0).to(device), has_media=images > 0,
    )


def _encoder_layer(layer: nn.Module, hidden: torch.Tensor, images: SequenceInfo) -> torch.Tensor:
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


def run_pooled_tower(model: nn.Module, shard: PooledShard, mesh: SPMesh | None) -> torch.Tensor:
    """``(V, D)``: the projected features of this rank's ``V`` placeholder tokens, in their row-major order."""
    inner = model.model
    tower = getattr(inner.vision_tower, "vision_model", inner.vision_tower)  # older releases nest it once more
    embeddings = tower.embeddings
    conv = embeddings.patch_embedding
    hidden = conv(shard.patches.to(conv.weight.dtype)).flatten(1)  # (n, C): stride = kernel, one patch at a time
    hidden = (hidden + embeddings.position_embedding(shard.positions))[None]  # (1, n, C): layers take a batch dim
    for layer in tower.encoder.layers:
        hidden = _encoder_layer(layer, hidden, shard.images)
    hidden = tower.post_layernorm(hidden)[0]  # (n, C)
    projector = inner.multi_modal_projector
    pooled = hidden.unflatten(0, (-1, projector.kernel_size ** 2)).mean(dim=1)  # (units, C): one pooling window each
    rows = (projector.mm_soft_emb_norm(pooled) @ projector.mm_input_projection_weight).type_as(hidden)
    rows = rows[shard.send_index]  # every row: the projector is used on every rank
    if mesh is not None and mesh.sp_size > 1:
        rows = exchange_rows(rows, mesh.sp_group, shard.send_rows, shard.recv_rows)
    return rows[shard.recv_order]
