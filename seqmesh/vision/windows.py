"""Towers whose placeholder tokens each take one ``k x k`` window of an image's patches (Gemma 3's average
pool, ``seqmesh.vision.pooled``; InternVL's pixel shuffle, ``seqmesh.vision.shuffled``): the tower's
sequence in window order, cut into equal shares of whole windows.

Fixed-size images of ``side x side`` patches, one document per image, learned positions added before the
encoder. Attention inside an image does not care about the order of its tokens once the positions are
added, so each window's ``k * k`` patches are put next to each other (row-major inside the window, which
is the order both the pool and the pixel shuffle read them in), windows in the row-major order of the
``side/k x side/k`` token grid. The sequence is then cut into ``P`` equal contiguous shares of whole
windows: every window is on one rank, its token's row is made there, and only that row travels to the
rank holding the placeholder token, ``k * k`` times fewer rows than the patches.

A class token (InternVL) is one place more per image, which would break the cut into whole windows. It
gets a window of its own, at its image's start, whose first ``k * k - 1`` places are padding outside any
image (a document of their own, attended to and then dropped), so the image's document is
``[class, window 0, window 1, ...]`` and every share still holds whole windows. A class window yields no
token (InternVL drops the class token's features); it costs ``k * k - 1`` places per image (3 of 1028 for a
448-pixel tile of 14-pixel patches).

    tower sequence, k = 2, class token:  | pad pad pad | cls w0 w0 w0 w0 w1 w1 w1 w1 ... | pad pad pad | cls ...
                                           own document  one image's document
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo
from .route import FixedSizeShard, routing

PADDING, CLASS = -2, -1  # what window_places gives a place that holds no patch


@dataclass(frozen=True)
class WindowGrid:
    """The geometry of one fixed-size image of a window tower."""

    side: int  # patches per image side
    kernel: int  # the window's side in patches: side = kernel * tokens per side
    patch: int  # pixels per patch side
    channels: int
    class_token: bool  # each image starts with a class token (InternVL, LLaVA) in a window of its own
    class_routed: bool = False  # the class token's row yields the image's first placeholder token (LLaVA's "full")

    @property
    def tokens(self) -> int:
        """Placeholder tokens (windows that yield one) per image."""
        return (self.side // self.kernel) ** 2 + self.class_routed

    @property
    def windows(self) -> int:
        """Windows of ``kernel * kernel`` places per image, the class window included."""
        return (self.side // self.kernel) ** 2 + self.class_token


def patch_pixels(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """``(images * N, C, p, p)``: each image's patches in the order the convolution emits them (row-major)."""
    n, c, h, w = pixel_values.shape
    grid = pixel_values.reshape(n, c, h // patch, patch, w // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, c, patch, patch)


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


def window_places(grid: WindowGrid, images: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(patches, tokens)``: for every place of the tower's sequence, window by window, the patch it holds
    (its row-major index in its image; ``CLASS`` or ``PADDING`` for none), ``(images * windows * k * k,)``;
    and for every window the placeholder token it yields, counted over the batch (-1: a class window whose row
    is dropped),
    ``(images * windows,)``."""
    k, pooled = grid.kernel, grid.side // grid.kernel
    token, inside = torch.arange(pooled * pooled)[:, None], torch.arange(k * k)[None]  # (tokens, 1), (1, k*k)
    row, col = (token // pooled) * k + inside // k, (token % pooled) * k + inside % k
    patches = (row * grid.side + col).reshape(-1)  # (tokens * k * k,) one image, window by window
    tokens = torch.arange(pooled * pooled) + int(grid.class_routed)
    if grid.class_token:
        lead = torch.full((k * k,), PADDING)
        lead[-1] = CLASS
        patches, tokens = torch.cat([lead, patches]), torch.cat([torch.tensor([0 if grid.class_routed else -1]), tokens])
    image_tokens = torch.where(tokens >= 0, torch.arange(images)[:, None] * grid.tokens + tokens, -1)
    return patches.repeat(images), image_tokens.reshape(-1)


def image_documents(grid: WindowGrid, images: int) -> tuple[int, ...]:
    """``cu_seqlens`` of the tower's sequence: each image, and before it its class window's padding."""
    per_image = grid.windows * grid.kernel ** 2
    pad = grid.kernel ** 2 - 1 if grid.class_token else 0
    starts = [i * per_image for i in range(images)]
    return tuple(sorted({*starts, *(s + pad for s in starts), images * per_image}))


def window_shard(batch, mesh: SPMesh, grid: WindowGrid, images: int, units_of: torch.Tensor, lay,
                 device: torch.device) -> FixedSizeShard:
    """This rank's places of the tower's sequence and the routing of its windows' rows (module docstring).
    ``units_of``: ``(B, padded_len)`` the placeholder token each token is (counted over the batch), -1: none."""
    p, me = mesh.sp_size, mesh.sp_rank
    per_window = grid.kernel ** 2
    windows = images * grid.windows
    per_rank = max(-(-windows // p), 1)  # padding only when another replica's batch has images
    patch_of, window_tokens = window_places(grid, images)
    length, places = patch_of.numel(), per_rank * per_window
    patch_of = F.pad(patch_of, (0, places * p - length), value=PADDING)
    mine = torch.arange(me * places, (me + 1) * places)
    local_patch = patch_of[mine]  # (places,)
    is_patch = local_patch >= 0
    pixels = batch.get("pixel_values")
    local = torch.zeros(places, grid.channels, grid.patch, grid.patch,
                        dtype=pixels.dtype if pixels is not None else torch.float32, device=device)
    if bool(is_patch.any()):
        image = mine[is_patch] // (grid.windows * per_window)
        index = image * grid.side ** 2 + local_patch[is_patch]  # the patch's row in patch_pixels' order
        local[is_patch.to(device)] = patch_pixels(pixels, grid.patch)[index.to(pixels.device)].to(device)
    positions = (local_patch + int(grid.class_token)).clamp(min=0)  # the class token's row 0; padding's unused
    if images:
        info = SequenceInfo(seq_len=length, cu_seqlens=image_documents(grid, images), layout="contiguous")
    else:  # padding only: one document, attended to and then dropped
        info = SequenceInfo(seq_len=places * p, cu_seqlens=None, layout="contiguous")
    window_tokens = F.pad(window_tokens, (0, per_rank * p - windows), value=-1)
    send_index, send_rows, recv_rows, recv_order = routing(units_of, window_tokens, per_rank, lay, p, me)
    token_units = units_of[:, lay.indices()].reshape(units_of.shape[0], p, lay.local_len)[:, me]
    return FixedSizeShard(
        patches=local, is_class=(local_patch == CLASS).to(device), positions=positions.to(device), images=info,
        send_index=send_index.to(device), send_rows=send_rows, recv_rows=recv_rows, recv_order=recv_order.to(device),
        visual_mask=(token_units >= 0).to(device), has_media=images > 0,
    )


# The method through which the tower runners call a layer they run from its own modules (SigLIP's and InternViT's
# layers do not hand the ``seqmesh`` entry on to their attention): FSDP2 registers it as a forward method of the
# layer's unit, so the layer's parameters are gathered around it as around the layer's own forward.
LAYER_METHOD = "seqmesh_layer"
LayerStep = Callable[[nn.Module, torch.Tensor, SequenceInfo], torch.Tensor]  # (layer, hidden (1, n, C), images)


def _checkpointed(layer: nn.Module, step: LayerStep, hidden: torch.Tensor, images: SequenceInfo) -> torch.Tensor:
    """``step`` on ``layer``, recomputed in backward when the model's gradient checkpointing is on (transformers
    sets ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` on each layer), as the layer's own forward
    would be; inside FSDP2's gather, as transformers keeps module hooks outside the checkpoint."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(step, layer, hidden, images)
    return step(layer, hidden, images)


def attach_layer_steps(layers: Sequence[nn.Module], step: LayerStep) -> None:
    """Give each of ``layers`` the method ``LAYER_METHOD``: ``step`` on that layer, checkpointed where the model
    is (an attribute, not a parameter or submodule: the model's state dict is unchanged)."""
    for layer in layers:
        setattr(layer, LAYER_METHOD, functools.partial(_checkpointed, layer, step))


def run_layers(layers: Sequence[nn.Module], step: LayerStep, hidden: torch.Tensor, images: SequenceInfo) -> torch.Tensor:
    """``hidden`` (1, n, C) through every layer, each by its ``LAYER_METHOD`` where it has one (under FSDP2), else
    by ``step`` itself, checkpointed where the model is."""
    for layer in layers:
        method = getattr(layer, LAYER_METHOD, None)
        hidden = method(hidden, images) if method is not None else _checkpointed(layer, step, hidden, images)
    return hidden
