"""Where every vision patch sits, from the media grids alone: the tower's sequence, its documents and
its positions.

A Qwen-VL processor cuts an image (or a video's pair of frames) into a ``(t, h, w)`` grid of patches and
emits them in *merge-block* order: the ``m x m`` patches that the patch merger later fuses into one
language-model token (one *unit*) are consecutive. Every function here computes, on every rank and for
the whole batch, integer tables over that order (a few bytes per patch): nothing depends on pixel
values, so each rank can cut its own share of the tower's sequence without any communication.
"""

from __future__ import annotations

import torch

Grid = torch.Tensor  # (n_media, 3) int: (t, h, w) in patches per image or video, in the batch's order


def unit_counts(grid: Grid, merge: int) -> list[int]:
    """Language-model tokens (merged units) of each image or video: ``t * h * w / merge**2``."""
    return [int(t * h * w) // (merge * merge) for t, h, w in grid.tolist()]


def frame_bounds(grid: Grid) -> tuple[int, ...]:
    """``(0, e1, ..., en)`` patch boundaries of every frame (a video contributes ``t`` frames): the
    documents of the tower's full-attention blocks, in merge-block order and in window order alike
    (windows never cross a frame)."""
    sizes = [h * w for t, h, w in grid.tolist() for _ in range(t)]
    return tuple(torch.tensor([0] + sizes).cumsum(0).tolist())


def patch_coordinates(grid: Grid, merge: int) -> torch.Tensor:
    """``(N, 2)`` long: the (row, column) of every patch inside its frame, in merge-block order
    (rotary and learned position embeddings read them)."""
    rows = []
    for t, h, w in grid.tolist():
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        # block-major: (block row, block column, row in block, column in block)
        rc = torch.stack([r.permute(0, 2, 1, 3).reshape(-1), c.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        rows.append(rc.repeat(t, 1))
    return torch.cat(rows) if rows else torch.zeros(0, 2, dtype=torch.long)


def window_order(grid: Grid, merge: int, window_units: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Qwen2.5-VL's windowed blocks: the order of the units when grouped into windows of
    ``window_units x window_units`` units (frame by frame, windows row-major, units row-major inside a
    window; edge windows are smaller), and the windows' patch boundaries in that order.

    Returns ``(order, bounds)``: ``order[k]`` is the merge-block-order unit at window-order place ``k``."""
    order, sizes, first = [], [], 0
    k = window_units
    for t, h, w in grid.tolist():
        rows, cols = h // merge, w // merge
        across, down = -(-cols // k), -(-rows // k)
        f = torch.arange(t).view(t, 1, 1)
        i = torch.arange(rows).view(1, rows, 1)
        j = torch.arange(cols).view(1, 1, cols)
        window = (f * down + i // k) * across + j // k  # (t, rows, cols) window id, frame-major
        key = window * (k * k) + (i % k) * k + (j % k)
        order.append(key.reshape(-1).argsort() + first)
        counts = torch.bincount(window.reshape(-1), minlength=t * down * across)
        sizes += counts[counts > 0].tolist()
        first += t * rows * cols
    unit = merge * merge
    bounds = tuple(torch.tensor([0] + sizes, dtype=torch.long).cumsum(0).mul(unit).tolist())
    return (torch.cat(order) if order else torch.zeros(0, dtype=torch.long)), bounds


def bilinear_taps(coordinates: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's learned position table (``side x side``) resampled to each frame's grid, as
    ``F.interpolate(mode="bilinear", align_corners=True)`` would: for every patch the four table
    entries it blends and their weights.

    ``coordinates``: ``(N, 2)`` (row, column) of each patch; ``sizes``: ``(N, 2)`` its frame's (h, w).
    Returns ``(index (N, 4) long, weight (N, 4) float32)``."""
    taps, weights = [], []
    for axis in (0, 1):
        x = coordinates[:, axis].to(torch.float32)  # float32, as F.interpolate computes source places
        src = x * (side - 1) / (sizes[:, axis] - 1).clamp(min=1)  # align_corners: ends map onto ends
        low = src.floor()
        frac = src - low
        low = low.long().clamp(0, side - 1)
        high = (low + 1).clamp(max=side - 1)
        taps.append(torch.stack([low, high], dim=-1))
        weights.append(torch.stack([1 - frac, frac], dim=-1))
    index = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
    weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
    return index, weight


def frame_sizes(grid: Grid) -> torch.Tensor:
    """``(N, 2)`` long: the (h, w) of the frame each patch belongs to, in merge-block order."""
    counts = torch.tensor([t * h * w for t, h, w in grid.tolist()], dtype=torch.long)
    return torch.repeat_interleave(grid[:, 1:].to(torch.long), counts, dim=0)
