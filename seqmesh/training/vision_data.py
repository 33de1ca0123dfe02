"""The built-in task for vision-language models: name the symbol an image shows.

Every image shows one symbol: each of its merged units (``merge x merge`` patches, one language-model
token) carries that symbol's fixed random pixel code, plus noise. After the image the sequence names
the symbol, and only that token is scored. Nothing in the text predicts it: a model must carry what
the tower saw, through the routed embeddings, to the decoder; a model blind to its images stays at
chance, ``1 / symbols``. Rows hold as many images as fit, of several sizes, so images straddle the
sequence shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.shapes import VisionShape
from ..sequence.batch import IGNORE_INDEX
from .datasets import FIRST_SYMBOL, HELD_OUT_STEP

FILLER = FIRST_SYMBOL - 1  # closes a row that no further image fits in; not scored
UNIT_GRIDS = ((1, 2, 2), (1, 2, 4), (1, 4, 2), (1, 4, 4))  # (t, h, w) in merged units: 4, 8, 8 and 16 symbols
CODE_SEED = 12345  # the symbols' pixel codes are the same for every run and step
NOISE = 0.1


@dataclass(frozen=True)
class ImageCopy:
    """``seq_len`` tokens per row; ``tokens``: the model's (image, vision start, vision end) token ids."""

    seq_len: int
    vision: VisionShape
    tokens: tuple[int, int, int]
    symbols: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if FIRST_SYMBOL + self.symbols > min(self.tokens):
            raise ValueError(f"the image task's {self.symbols} symbols take tokens {FIRST_SYMBOL}..{FIRST_SYMBOL + self.symbols - 1}, "
                             f"which reach the model's image tokens ({min(self.tokens)} and up); lower --symbols.")
        shortest = min(self._length(g) for g in self._grids)
        if self.seq_len < shortest:
            raise ValueError(f"the image task needs at least {shortest} tokens per row (one image and its symbols), "
                             f"got seq_len={self.seq_len}; raise --seq-len.")

    @property
    def _grids(self) -> tuple[tuple[int, int, int], ...]:
        m = self.vision.merge
        return tuple((t, h * m, w * m) for t, h, w in UNIT_GRIDS)  # in patches

    def _units(self, grid) -> int:
        t, h, w = grid
        return t * h * w // (self.vision.merge ** 2)

    def _length(self, grid) -> int:
        return 3 + self._units(grid)  # start, placeholders, end, then the symbol

    @property
    def codes(self) -> torch.Tensor:
        """``(symbols, merge**2, patch_features)``: each symbol's pixels, fixed."""
        g = torch.Generator().manual_seed(CODE_SEED)
        return torch.randn(self.symbols, self.vision.merge ** 2, self.vision.patch_features, generator=g)

    def _row(self, g: torch.Generator, codes: torch.Tensor):
        image, start, end = self.tokens
        ids, labels, pixels, grids = [], [], [], []
        while True:
            grid = self._grids[int(torch.randint(len(self._grids), (1,), generator=g))]
            if len(ids) + self._length(grid) > self.seq_len:
                break
            n = self._units(grid)
            symbol = int(torch.randint(self.symbols, (1,), generator=g))
            ids += [start] + [image] * n + [end, symbol + FIRST_SYMBOL]
            labels += [IGNORE_INDEX] * (n + 2) + [symbol + FIRST_SYMBOL]
            noise = NOISE * torch.randn(n, *codes.shape[1:], generator=g)
            pixels.append((codes[symbol] + noise).reshape(-1, codes.shape[-1]))  # units' patches, consecutive
            grids.append(grid)
        pad = self.seq_len - len(ids)
        return ids + [FILLER] * pad, labels + [IGNORE_INDEX] * pad, pixels, grids

    def batch(self, step: int, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * dp_size + dp_rank)
        codes = self.codes
        rows = [self._row(g, codes) for _ in range(batch_size)]
        input_ids = torch.tensor([r[0] for r in rows])
        return {
            "input_ids": input_ids,
            "labels": torch.tensor([r[1] for r in rows]),
            "pixel_values": torch.cat([p for r in rows for p in r[2]]),
            "image_grid_thw": torch.tensor([grid for r in rows for grid in r[3]]),
            "mm_token_type_ids": (input_ids == self.tokens[0]).long(),
        }

    def eval_batch(self, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """A batch from a seed no training step draws."""
        return self.batch(HELD_OUT_STEP, dp_rank, batch_size, dp_size)


@dataclass(frozen=True)
class ImageRows:
    """Rows of ``seq_len`` tokens that each show ``images`` images of ``height x width`` pixels (one frame each, no
    video), then text: the workload ``seqmesh plan --images N --image-size HxW`` sizes, which ``seqmesh rehearse``
    runs with the same flags. Pixels and tokens are random (a step's memory does not depend on their values); every
    text token is scored."""

    seq_len: int
    vision: VisionShape
    tokens: tuple[int, int, int]  # the model's (image, vision start, vision end) token ids
    images: int
    height: int
    width: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.images < 1:
            raise ValueError(f"--images {self.images}: give 1 or more images per sequence.")
        if self.images * (self._units + 2) > self.seq_len:
            raise ValueError(f"{self.images} images of {self._units:,} tokens (and a start and an end token each) do "
                             f"not fit in --seq-len {self.seq_len:,}; give fewer or smaller images, or a longer "
                             "sequence.")

    @property
    def _grid(self) -> tuple[int, int, int]:
        return 1, self.height // self.vision.patch, self.width // self.vision.patch  # (t, h, w) in patches

    @property
    def _units(self) -> int:
        t, h, w = self._grid
        return t * h * w // self.vision.merge ** 2

    def batch(self, step: int, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * dp_size + dp_rank)
        image, start, end = self.tokens
        shown = ([start] + [image] * self._units + [end]) * self.images
        text = torch.randint(FIRST_SYMBOL, min(self.tokens), (batch_size, self.seq_len - len(shown)), generator=g)
        input_ids = torch.cat([torch.tensor(shown).expand(batch_size, -1), text], dim=1)
        labels = torch.where(input_ids == image, IGNORE_INDEX, input_ids)
        t, h, w = self._grid
        patches = batch_size * self.images * t * h * w
        return {
            "input_ids": input_ids,
            "labels": labels,
            "pixel_values": torch.randn(patches, self.vision.patch_features, generator=g),
            "image_grid_thw": torch.tensor([self._grid] * (batch_size * self.images)),
            "mm_token_type_ids": (input_ids == image).long(),
        }

    def eval_batch(self, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        return self.batch(HELD_OUT_STEP, dp_rank, batch_size, dp_size)
