"""From a whole multimodal batch to this rank's inputs: tokens, 3-D positions, targets, its share of the
vision tower's patches, and the plan that routes each image's embeddings to the tokens that take them.

Everything that needs the whole sequence is computed first, on every rank alike: the targets (shifted
before slicing, nothing scored on an image or video placeholder unless the caller's labels say so),
the documents, and the M-RoPE position ids, by the model's own ``get_rope_index`` run on each packed
document whole (so they restart per document). Then the tokens are laid out and sliced exactly as
``seqmesh.shard_batch`` slices a text batch.

The tower's sequence is every patch of the batch (images, then videos), in the order the tower
attends in (Qwen2.5-VL: by windows), cut into ``P`` equal contiguous shares of whole merge units, so
the patch merger stays local. A merged unit is the embedding of exactly one placeholder token; the
rank that computed it sends it to the rank holding that token (:class:`VisionShard`'s plan), in one
uneven all-to-all whose backward returns the gradients the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..mesh import SPMesh
from ..sequence.batch import (IGNORE_INDEX, SequenceInfo, documents_from_positions, positions_in_documents,
                              real_lengths, shift_labels)
from ..sequence.layout import auto_layout
from ..sequence.sharding import sequence_layout, shard_sequence
from .families import VisionFamily, vision_family
from .plain import check_plain_media, plain_shard
from .pooled import check_pooled_media, image_blocks, pooled_shard
from .route import moved, routing
from .shuffled import check_shuffled_media, shuffled_shard
from .grid import bilinear_taps, frame_bounds, frame_sizes, patch_coordinates, unit_counts, window_order

VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


@dataclass(frozen=True)
class VisionShard:
    """This rank's share of the vision tower and the routing of its output (built by
    :func:`shard_multimodal_batch`, read by ``seqmesh.vision.tower``). ``n``: this rank's patches."""

    pixels: torch.Tensor  # (n, C*T*p*p) this rank's patches in tower order; zeros for padding
    coordinates: torch.Tensor  # (n, 2) row and column of each patch in its frame (rotary positions)
    taps: tuple[torch.Tensor, torch.Tensor] | None  # Qwen3-VL: (n, 4) learned-table entries and weights
    frames: SequenceInfo  # the tower's full-attention documents: one per frame
    windows: SequenceInfo | None  # Qwen2.5-VL's windowed blocks: one document per window
    send_index: torch.Tensor  # (rows sent,) this rank's merged units, sorted by destination rank
    send_rows: tuple[int, ...]  # merged units sent to each sequence rank
    recv_rows: tuple[int, ...]  # merged units received from each sequence rank
    recv_order: torch.Tensor  # received rows -> the order of this rank's placeholder tokens
    visual_mask: torch.Tensor  # (B, L) bool: this rank's image and video placeholder tokens
    has_media: bool  # whether the batch (this sequence group's) holds any image or video

    def to(self, device: torch.device | str) -> VisionShard:
        """The same shard with every tensor on ``device``."""
        return moved(self, device)


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model under a ``SequenceParallelLM`` (or the model itself)."""
    return getattr(model, "lm", model)


def _grid(batch: Mapping, key: str) -> torch.Tensor:
    grid = batch.get(key)
    if grid is None:
        return torch.zeros(0, 3, dtype=torch.long)
    grid = torch.as_tensor(grid).to("cpu", torch.long)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"{key} must be (media, 3) rows of (t, h, w), got shape {tuple(grid.shape)}.")
    return grid


def _check_media(batch: Mapping, input_ids: torch.Tensor, config, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The image and video grids, after checking them against the pixels and the placeholder tokens."""
    grids = {}
    for kind, pixels_key, grid_key, token in (("image", "pixel_values", "image_grid_thw", config.image_token_id),
                                              ("video", "pixel_values_videos", "video_grid_thw", config.video_token_id)):
        grid = _grid(batch, grid_key)
        pixels = batch.get(pixels_key)
        if (pixels is None) != (grid.shape[0] == 0):
            raise ValueError(f"{pixels_key} and {grid_key} come together: the batch has one without the other.")
        if grid.shape[0]:
            if bool(((grid[:, 1:] % merge) != 0).any()):
                raise ValueError(f"every {kind}'s grid height and width must be multiples of the spatial merge size "
                                 f"{merge}; {grid_key} has {grid.tolist()[:4]}.")
            patches = int(grid.prod(dim=1).sum())
            if pixels.dim() != 2 or pixels.shape[0] != patches:
                raise ValueError(f"{pixels_key} has shape {tuple(pixels.shape)} but {grid_key} describes {patches} "
                                 "patches; pass the processor's output unchanged.")
        tokens, units = int((input_ids == token).sum()), sum(unit_counts(grid, merge))
        if tokens != units:
            raise ValueError(f"the batch has {tokens} {kind} placeholder tokens (id {token}) but its {kind}s make "
                             f"{units} embeddings ({grid_key} / spatial_merge_size**2); each {kind} needs exactly one "
                             "placeholder token per embedding, as the model's processor writes them.")
        grids[kind] = grid
    return grids["image"], grids["video"]


def _rope_index(inner: nn.Module):
    """The model's own M-RoPE function, called with the arguments this transformers version takes."""
    rope = inner.get_rope_index
    accepted = set(inspect.signature(rope).parameters)
    return lambda **kw: rope(**{k: v for k, v in kw.items() if k in accepted})[0]


def reads_token_types(model: nn.Module) -> bool:
    """Whether the model's M-RoPE function takes ``mm_token_type_ids``: transformers then computes 3-D positions only
    when a batch carries them (5.24: without them every token, an image's too, gets a text position), where earlier
    releases found each token's modality in ``input_ids``."""
    rope = VisionFamily.inner(_inner(model)).get_rope_index
    return "mm_token_type_ids" in inspect.signature(rope).parameters


def missing_token_types(family: str, images: int, videos: int) -> str:
    """The refusal of a batch with media but no ``mm_token_type_ids`` for a model that needs them."""
    import transformers

    media = " and ".join(f"{n} {kind}{'s' if n > 1 else ''}" for n, kind in ((images, "image"), (videos, "video")) if n)
    return (f"the batch holds {media} but no mm_token_type_ids: {family} in transformers {transformers.__version__} "
            "computes its 3-D M-RoPE positions only when mm_token_type_ids is given, and without it gives every token, "
            "an image's too, a plain text position. Pass the processor's mm_token_type_ids with the "
            "batch (1 on image placeholder tokens, 2 on video ones, 0 elsewhere).")


def mrope_positions(model: nn.Module, input_ids: torch.Tensor, token_types: torch.Tensor, image_grid: torch.Tensor,
                    video_grid: torch.Tensor, seconds: torch.Tensor | None, cu: tuple[int, ...] | None) -> torch.Tensor:
    """``(3, B, S)`` M-RoPE ids of the whole batch: the model's ``get_rope_index`` on every packed
    document of every row on its own (positions restart per document), each taking its own images and
    videos, in the batch's order."""
    family_model = VisionFamily.inner(_inner(model))
    rope = _rope_index(family_model)
    merge = _inner(model).config.vision_config.spatial_merge_size
    b, s = input_ids.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    bounds = cu if cu is not None else (0, s)
    if bounds[-1] < s:
        bounds = (*bounds, s)
    used = {1: 0, 2: 0}  # media consumed so far, per modality (images 1, videos 2)
    grids, units = {1: image_grid, 2: video_grid}, {1: unit_counts(image_grid, merge), 2: unit_counts(video_grid, merge)}
    for row in range(b):
        for a, e in zip(bounds, bounds[1:]):
            types = token_types[row : row + 1, a:e]
            take = {}
            for kind in (1, 2):
                need, n = int((types == kind).sum()), used[kind]
                while need > 0 and n < len(units[kind]):
                    need -= units[kind][n]
                    n += 1
                if need != 0:
                    raise ValueError(f"row {row}, document [{a}, {e}) holds part of an image or video: a packed "
                                     "document must hold each of its images and videos whole (every placeholder "
                                     "token of it); move the document boundary (position_ids restarting at 0).")
                take[kind] = (used[kind], n)
            args = dict(input_ids=input_ids[row : row + 1, a:e].cpu(), mm_token_type_ids=types.cpu(), attention_mask=None,
                        image_grid_thw=grids[1][slice(*take[1])] if take[1][1] > take[1][0] else None,
                        video_grid_thw=grids[2][slice(*take[2])] if take[2][1] > take[2][0] else None)
            if seconds is not None and take[2][1] > take[2][0]:
                args["second_per_grid_ts"] = seconds[slice(*take[2])]
            out[:, row, a:e] = rope(**args)[:, 0]
            used = {kind: take[kind][1] for kind in (1, 2)}
    return out


def shard_multimodal_batch(batch: Mapping[str, torch.Tensor], mesh: SPMesh, model: nn.Module, *,
                           layout: str = "auto", ignore_index: int = IGNORE_INDEX) -> dict:
    """This rank's inputs for a vision-language model from the whole batch (the same on every sequence
    rank): what ``seqmesh.shard_batch`` returns for text, with ``position_ids`` ``(3, B, L)`` M-RoPE ids,
    plus ``seqmesh_vision``, this rank's :class:`VisionShard`.

    ``batch``: the model's processor output: ``input_ids``, ``pixel_values`` / ``image_grid_thw``,
    ``pixel_values_videos`` / ``video_grid_thw`` (and ``second_per_grid_ts`` for Qwen2.5-VL videos),
    ``mm_token_type_ids`` (needed with images or videos where the model's M-RoPE reads them, as transformers 5.24's
    does: :func:`reads_token_types`; Gemma 3: ``token_type_ids``, whose runs of 1 are the image blocks its
    decoder sees both ways; without them its mask is causal, as transformers'), ``labels`` (default: the inputs, with no loss on image or video
    placeholder tokens), ``position_ids`` restarting at 0 per packed document, or ``attention_mask`` of
    right padding. ``model``: the parallelized transformers model (or its ``SequenceParallelLM``)."""
    lm = _inner(model)
    config = lm.config
    family = vision_family(config)
    vision = config.vision_config
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}.")
    b, s = input_ids.shape
    if s < mesh.sp_size:
        raise ValueError(f"the sequence has {s} tokens but the sequence-parallel degree is {mesh.sp_size}; use "
                         f"sequences of at least {mesh.sp_size} tokens or a smaller degree.")
    if family.fixed_size:
        check = check_plain_media if family.plain else check_pooled_media if family.pooled else check_shuffled_media
        images = check(batch, input_ids, config)
        is_image, is_video = input_ids == config.image_token_id, torch.zeros_like(input_ids, dtype=torch.bool)
    else:
        image_grid, video_grid = _check_media(batch, input_ids, config, vision.spatial_merge_size)
        is_image, is_video = input_ids == config.image_token_id, input_ids == config.video_token_id
    labels = batch.get("labels")
    if labels is None:  # nothing scored on a placeholder: its "next token" is an image, not text
        labels = input_ids.masked_fill(is_image | is_video, ignore_index)
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}.")
    positions = batch.get("position_ids")
    if positions is not None and positions.dim() != 2:
        raise ValueError(f"position_ids must be (batch, sequence) positions restarting at 0 per packed document, got "
                         f"shape {tuple(positions.shape)}; seqmesh computes the 3-D M-RoPE ids itself, per document.")
    cu = documents_from_positions(positions) if positions is not None else None
    lengths = real_lengths(batch["attention_mask"]) if batch.get("attention_mask") is not None else None
    if family.fixed_size:  # one position per token, restarting per document, as for text
        rope = positions.to(torch.long).cpu().expand(b, s) if positions is not None else positions_in_documents(s, cu).expand(b, s)
    else:
        token_types = batch.get("mm_token_type_ids")
        if token_types is None:
            if image_grid.shape[0] + video_grid.shape[0] and reads_token_types(lm):
                raise ValueError(missing_token_types(family.name, image_grid.shape[0], video_grid.shape[0]))
            token_types = is_image.long() + 2 * is_video.long()  # a release whose M-RoPE reads them from input_ids
        seconds = batch.get("second_per_grid_ts")
        seconds = torch.as_tensor(seconds).cpu() if seconds is not None else None  # the M-RoPE ids are built on the CPU
        rope = mrope_positions(lm, input_ids.cpu(), token_types.cpu(), image_grid, video_grid, seconds, cu)
    targets = shift_labels(labels, cu, lengths, ignore_index)
    numbered = "caller" if positions is not None else "documents" if family.fixed_size else "model"
    largest = int(rope.max())  # (3, B, S) M-RoPE ids or (B, S): transformers' rotary scaling reads their largest

    if layout == "auto":
        layout = auto_layout(mesh.ring, mesh.ulysses, s, cu)
    lay = sequence_layout(mesh, s, layout, cu)
    pad = lay.padded_len - s
    units_of = torch.full((b, s), -1, dtype=torch.long)
    n_image = int(is_image.sum())
    units_of[is_image.cpu()] = torch.arange(n_image)
    units_of[is_video.cpu()] = n_image + torch.arange(int(is_video.sum()))
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
        targets = torch.nn.functional.pad(targets, (0, pad), value=ignore_index)
        rope = torch.cat([rope, rope[..., -1:] + torch.arange(1, pad + 1)], dim=-1)
        units_of = torch.nn.functional.pad(units_of, (0, pad), value=-1)
    device = input_ids.device
    blocks = image_blocks(batch.get("token_type_ids"), cu) if family.pooled else None  # Gemma 3's mask
    if family.plain:
        vision_shard = plain_shard(batch, mesh, config, images, units_of, lay, device)
    elif family.pooled:
        vision_shard = pooled_shard(batch, mesh, config, images, units_of, lay, device)
    elif family.shuffled:
        vision_shard = shuffled_shard(batch, mesh, config, images, units_of, lay, device)
    else:
        vision_shard = _vision_shard(batch, mesh, family, vision, image_grid, video_grid, units_of, lay, device)
    shard = lambda t, dim=1: shard_sequence(t, mesh, dim=dim, layout=layout, cu_seqlens=cu)  # noqa: E731
    return {
        "input_ids": shard(input_ids),
        "position_ids": shard(rope.contiguous().to(device), dim=rope.dim() - 1),
        "shift_labels": shard(targets),
        "seqmesh": SequenceInfo(seq_len=s, cu_seqlens=cu, layout=layout, ignore_index=ignore_index, image_blocks=blocks,
                                lengths=tuple(lengths) if lengths is not None else None, max_position=largest,
                                positions=numbered),
        "seqmesh_vision": vision_shard,
    }


def _vision_shard(batch: Mapping, mesh: SPMesh, family: VisionFamily, vision, image_grid: torch.Tensor,
                  video_grid: torch.Tensor, units_of: torch.Tensor, lay, device: torch.device) -> VisionShard:
    """This rank's tower share and routing (see the module docstring)."""
    merge = vision.spatial_merge_size
    unit = merge * merge
    p, me = mesh.sp_size, mesh.sp_rank
    grid = torch.cat([image_grid, video_grid])
    media = [batch[k] for k in ("pixel_values", "pixel_values_videos") if batch.get(k) is not None]
    units = sum(unit_counts(grid, merge))
    if family.windows:
        window_units = vision.window_size // merge // vision.patch_size
        tower_order, windows = window_order(grid, merge, window_units)
    else:
        tower_order, windows = torch.arange(units), None
    per_rank = max(-(-units // p), 1)  # padding only when another replica's batch has media (VisionLanguageLM)
    mine = torch.arange(me * per_rank, (me + 1) * per_rank)
    real = mine < units
    patches = (tower_order[mine[real]][:, None] * unit + torch.arange(unit)).reshape(-1)  # merge-block order
    n = per_rank * unit
    features = media[0].shape[1] if media else vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.zeros(n, features, dtype=media[0].dtype if media else torch.float32, device=device)
    coordinates = torch.zeros(n, 2, dtype=torch.long)
    sizes = torch.ones(n, 2, dtype=torch.long)
    kept = patches.numel()
    if kept:
        whole = torch.cat(media) if len(media) > 1 else media[0]
        pixels[:kept] = whole[patches.to(whole.device)].to(device)  # only this rank's rows reach its device
        coordinates[:kept] = patch_coordinates(grid, merge)[patches]
        sizes[:kept] = frame_sizes(grid)[patches]
    taps = None
    if family.learned_positions:
        index, weight = bilinear_taps(coordinates, sizes, int(vision.num_position_embeddings ** 0.5))
        taps = (index.to(device), weight.to(device))
    total = per_rank * unit * p
    if units:
        frames = SequenceInfo(seq_len=units * unit, cu_seqlens=frame_bounds(grid), layout="contiguous")
        window_info = SequenceInfo(seq_len=units * unit, cu_seqlens=windows, layout="contiguous") if windows else None
    else:  # padding only: one document, attended to and then dropped
        frames = SequenceInfo(seq_len=total, cu_seqlens=None, layout="contiguous")
        window_info = frames if family.windows else None
    places = torch.cat([tower_order, torch.full((per_rank * p - units,), -1, dtype=torch.long)])  # padding: none
    send_index, send_rows, recv_rows, recv_order = routing(units_of, places, per_rank, lay, p, me)
    local = units_of[:, lay.indices()].reshape(units_of.shape[0], p, lay.local_len)[:, me]
    return VisionShard(
        pixels=pixels, coordinates=coordinates.to(device), taps=taps, frames=frames, windows=window_info,
        send_index=send_index.to(device), send_rows=send_rows, recv_rows=recv_rows, recv_order=recv_order.to(device),
        visual_mask=(local >= 0).to(device), has_media=units > 0,
    )
