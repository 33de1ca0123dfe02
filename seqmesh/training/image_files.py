"""Your own images for ``seqmesh train``: JSONL records of text with ``<image>`` markers and ``.npy`` images.

Each line is ``{"text": "a cat <image> on a mat", "images": ["cat.npy"]}`` (paths relative to the
JSONL file): one ``<image>`` marker per image, in order. An image is an ``(H, W, 3)`` array, ``uint8`` (0-255)
or ``float16`` / ``float32`` / ``float64`` in [0, 1], never empty, NaN or inf. Its header (shape, dtype) is
read first and checked against the file's size and the sequence, so a damaged or oversized file is refused
before its pixels are read; the pixels are read with ``numpy.load(allow_pickle=False)``, so a file can hold
numbers only, never code. Images are normalised as the Qwen-VL and CLIP processors do and cut into the model's
patches; seqmesh does not resize: Qwen-VL images must be multiples of ``patch x merge`` pixels on each
side, LLaVA's exactly its tower's image size. Each record becomes one document; records are shuffled per
epoch and packed whole into rows (a record is never cut, so its images stay whole), the rest of a row
filled with an unscored document. Every 20th record (at least one) is held out for evaluation.
"""

from __future__ import annotations

import os

import torch

from ..sequence.batch import IGNORE_INDEX
from .datasets import held_out_documents, jsonl_records

MARKER = "<image>"
MEAN = (0.48145466, 0.4578275, 0.40821073)  # the CLIP normalisation the Qwen-VL and LLaVA processors apply
STD = (0.26862954, 0.26130258, 0.27577711)


ARCHIVE = b"PK\x03\x04"  # the start of a zip file: an .npz archive of arrays


def image_header(path: str) -> tuple[int, int]:
    """``(height, width)`` of the ``(H, W, 3)`` uint8 or float array in the ``.npy`` file ``path``, from its header
    alone, after checking the header against the file's size: nothing is allocated for a file whose header claims
    more pixels than it holds, and nothing is read before the caller has sized the image against the sequence.
    Raises a ValueError naming the file and what is wrong with it."""
    import numpy as np
    from numpy.lib import format as npy

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if f.read(4) == ARCHIVE:
                raise ValueError(f"image {path!r} is an archive of arrays; save each image alone with numpy.save.")
            f.seek(0)
            version = npy.read_magic(f)
            if version not in ((1, 0), (2, 0)):  # 3.0 only adds utf-8 field names: structured arrays, never an image
                raise ValueError(f".npy format version {version[0]}.{version[1]}, which numpy.save writes only for "
                                 "structured arrays")
            read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, _, dtype = read(f)  # a literal dict, parsed without running anything
            offset = f.tell()
    except ValueError as err:
        if str(err).startswith(f"image {path!r}"):
            raise
        raise ValueError(f"image {path!r} could not be read as a .npy array of numbers ({err}).") from None
    except OSError as err:
        raise ValueError(f"image {path!r} could not be read as a .npy array of numbers ({err}).") from None
    if dtype.hasobject:  # numpy.load would unpickle them: allow_pickle=False refuses, and so does this
        raise ValueError(f"image {path!r} could not be read as a .npy array of numbers: it holds Python objects "
                         f"({dtype}), which loading would unpickle.")
    if len(shape) != 3 or shape[2] != 3:
        raise ValueError(f"image {path!r} has shape {shape}; seqmesh reads (height, width, 3) RGB arrays.")
    if dtype != np.uint8 and dtype.kind != "f":
        raise ValueError(f"image {path!r} holds {dtype} values; save uint8 (0-255) or floats (float16, float32 or "
                         "float64) in [0, 1].")
    height, width = int(shape[0]), int(shape[1])
    if not height or not width:
        raise ValueError(f"image {path!r} is empty ({height}x{width} pixels); every image needs pixels: drop it and its "
                         f"{MARKER} marker from the record.")
    pixels = height * width * 3 * dtype.itemsize
    if size - offset != pixels:
        raise ValueError(f"image {path!r}: its header declares a {height}x{width}x3 {dtype} array ({pixels:,} bytes of "
                         f"pixels) but the file holds {size - offset:,} bytes after its header: it is cut short or "
                         "was not written by numpy.save. Save the image again with numpy.save.")
    return height, width


def read_image(path: str) -> torch.Tensor:
    """``(3, H, W)`` float32 in [0, 1] from a ``.npy`` file of ``(H, W, 3)`` uint8 or floats, its header checked
    first (:func:`image_header`); read with ``numpy.load(allow_pickle=False)``, so never running code from it."""
    import numpy as np

    image_header(path)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"image {path!r} could not be read as a .npy array of numbers ({err}).") from None
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array)
        if bad.any():
            kinds = " and ".join(k for k, found in (("NaN", np.isnan(array).any()), ("inf", np.isinf(array).any()))
                                 if found)
            row, column, channel = (int(i) for i in np.argwhere(bad)[0])
            count = int(bad.sum())
            raise ValueError(f"image {path!r} holds {kinds} ({count:,} value{'s' if count > 1 else ''}, the first at row "
                             f"{row}, column {column}, channel {channel}); every pixel must be a finite number in [0, 1]. "
                             "Fix or drop the image.")
        low, high = float(array.min()), float(array.max())
        if not (0.0 <= low and high <= 1.0):
            raise ValueError(f"image {path!r} holds floats from {low:g} to {high:g}; floats must lie in [0, 1] (divide "
                             "0-255 values by 255, or save them as uint8).")
    image = torch.from_numpy(array.astype("float32") / (255.0 if array.dtype == np.uint8 else 1.0))
    return image.permute(2, 0, 1)


def _encode(tokenizer, text: str, first: bool) -> list[int]:
    """A record's text piece: the tokenizer's special tokens (a BOS) at the record's start only, not after
    each image."""
    if first:
        return tokenizer.encode(text)
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # the byte tokenizer adds none
        return tokenizer.encode(text)


def normalise(image: torch.Tensor) -> torch.Tensor:
    return (image - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]


def qwen_patches(image: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """``(rows, [1, h, w])``: one ``(3, H, W)`` image as a Qwen-VL processor writes it, the frame repeated
    over the temporal patch, ``C x T x p x p`` values per row, rows in merge-block order."""
    c, height, width = image.shape
    h, w = height // patch, width // patch
    frames = image[None].expand(temporal, c, height, width)
    grid = frames.reshape(temporal, c, h // merge, merge, patch, w // merge, merge, patch)
    rows = grid.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(h * w, c * temporal * patch * patch)
    return rows, [1, h, w]


class ImageJsonl:
    """Records of text and images, tokenized and packed whole into ``seq_len``-token rows."""

    def __init__(self, paths: list[str], seq_len: int, tokenizer, config, *, text_key: str = "text", seed: int = 0):
        from ..vision.families import vision_family
        from ..vision.plain import tokens_per_image

        self.seq_len, self.seed, self.config = seq_len, seed, config
        family = vision_family(config)
        if family.pooled or family.shuffled:
            raise ValueError(f"seqmesh train's image records are cut for Qwen-VL and LLaVA towers, not {family.name}'s; "
                             f"train {family.name} through your loop or the Trainer, with seqmesh.shard_batch(batch, mesh, "
                             "model=model) on its processor's output.")
        self.plain = vision_family(config).plain
        vision = config.vision_config
        self.image_tokens = tokens_per_image(config) if self.plain else None
        media = {config.image_token_id, getattr(config, "vision_start_token_id", None),
                 getattr(config, "vision_end_token_id", None), getattr(config, "video_token_id", None)} - {None}
        records = []
        for path in paths:
            for line, (text, images) in self._records(path, text_key):
                records.append(self._encode(f"{path}:{line}", text, images, tokenizer, vision, media))
        if not records:
            raise ValueError(f"no records found in {paths}.")
        held = set(held_out_documents(len(records)))
        self.train = [r for i, r in enumerate(records) if i not in held]
        self.eval = [r for i, r in enumerate(records) if i in held] or self.train

    @staticmethod
    def _records(path: str, text_key: str):
        folder = os.path.dirname(os.path.abspath(path))
        for n, record in jsonl_records(path):
            if not isinstance(record.get(text_key), str):
                raise ValueError(f"{path}:{n} needs a string {text_key!r} field and an \"images\" list.")
            images = record.get("images", [])
            if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
                raise ValueError(f"{path}:{n}: \"images\" must be a list of .npy paths, got {images!r}.")
            if record[text_key].count(MARKER) != len(images):
                raise ValueError(f"{path}:{n} has {record[text_key].count(MARKER)} {MARKER} markers but {len(images)} "
                                 "images; write one marker where each image goes.")
            yield n, (record[text_key], [os.path.join(folder, i) for i in images])

    def _encode(self, where: str, text: str, images: list[str], tokenizer, vision, media: set[int]) -> dict:
        ids, pixels, grids = [], [], []
        parts = text.split(MARKER)
        for i, part in enumerate(parts):
            tokens = _encode(tokenizer, part, first=i == 0)
            if media & set(tokens):
                raise ValueError(f"{where}: the text encodes to the model's image token ids {sorted(media & set(tokens))}; "
                                 "use a tokenizer whose text tokens stay clear of them.")
            ids += tokens
            if i == len(parts) - 1:
                break
            height, width = image_header(images[i])  # sized from the header: nothing read yet
            placeholders = self._placeholders(images[i], height, width)
            if len(ids) + len(placeholders) > self.seq_len:
                raise ValueError(f"{where} is at least {len(ids) + len(placeholders)} tokens with its images ({images[i]} "
                                 f"is {height}x{width} pixels, {len(placeholders)} tokens), longer than --seq-len "
                                 f"{self.seq_len}; a record is never cut (its images stay whole): raise --seq-len, or "
                                 "shrink the image or the record.")
            image = normalise(read_image(images[i]))
            if self.plain:
                pixels.append(image[None])
            else:
                rows, grid = qwen_patches(image, vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
                pixels.append(rows)
                grids.append(grid)
            ids += placeholders
        if len(ids) > self.seq_len:
            raise ValueError(f"{where} is {len(ids)} tokens with its images, longer than --seq-len {self.seq_len}; a "
                             "record is never cut (its images stay whole): raise --seq-len or shorten the record.")
        return {"ids": ids, "pixels": pixels, "grids": grids}

    def _placeholders(self, path: str, height: int, width: int) -> list[int]:
        """The tokens an image of ``height x width`` pixels takes in the text, after checking its size against the
        tower's: LLaVA's one image size, or Qwen-VL's multiples of ``patch x merge``."""
        cfg, vision = self.config, self.config.vision_config
        if self.plain:
            size = vision.image_size
            if (height, width) != (size, size):
                raise ValueError(f"{path} is {height}x{width} pixels; this LLaVA tower takes {size}x{size} images: resize "
                                 "it first.")
            return [cfg.image_token_id] * self.image_tokens
        side = vision.patch_size * vision.spatial_merge_size
        if height % side or width % side:
            fit = lambda n: max(side, round(n / side) * side)  # noqa: E731
            raise ValueError(f"{path} is {height}x{width} pixels; this model needs multiples of {side} on each side "
                             f"(patch {vision.patch_size} x merge {vision.spatial_merge_size}): resize it to "
                             f"{fit(height)}x{fit(width)}.")
        units = (height // side) * (width // side)
        return [cfg.vision_start_token_id] + [cfg.image_token_id] * units + [cfg.vision_end_token_id]

    def _epoch_rows(self, records: list[dict], epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        rows, row, used = [], [], 0
        for i in torch.randperm(len(records), generator=g).tolist():
            n = len(records[i]["ids"])
            if used + n > self.seq_len:
                rows.append(row)
                row, used = [], 0
            row.append(i)
            used += n
        return rows + [row]

    def _row(self, records: list[dict], index: int):
        epoch = 0
        rows = self._epoch_rows(records, epoch)
        while index >= len(rows):
            index -= len(rows)
            epoch += 1
            rows = self._epoch_rows(records, epoch)
        picked = [records[i] for i in rows[index]]
        ids = [t for r in picked for t in r["ids"]]
        positions = [p for r in picked for p in range(len(r["ids"]))]
        pad = self.seq_len - len(ids)
        image = self.config.image_token_id
        labels = [IGNORE_INDEX if t == image else t for t in ids] + [IGNORE_INDEX] * pad
        return (ids + [0] * pad, labels, positions + list(range(pad)), [p for r in picked for p in r["pixels"]],
                [g for r in picked for g in r["grids"]])

    def _batch(self, records: list[dict], first: int, batch_size: int) -> dict[str, torch.Tensor]:
        rows = [self._row(records, first + i) for i in range(batch_size)]
        out = {"input_ids": torch.tensor([r[0] for r in rows]), "labels": torch.tensor([r[1] for r in rows]),
               "position_ids": torch.tensor([r[2] for r in rows])}
        pixels = [p for r in rows for p in r[3]]
        if pixels:
            out["pixel_values"] = torch.cat(pixels)
            if not self.plain:  # Qwen-VL: the grids, and each token's modality, which its M-RoPE reads
                out["image_grid_thw"] = torch.tensor([g for r in rows for g in r[4]])
                out["mm_token_type_ids"] = (out["input_ids"] == self.config.image_token_id).long()
        return out

    def batch(self, step: int, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        return self._batch(self.train, (step * dp_size + dp_rank) * batch_size, batch_size)

    def eval_batch(self, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """Rows of the held-out records only."""
        return self._batch(self.eval, dp_rank * batch_size, batch_size)
