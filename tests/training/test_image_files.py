"""Image records for ``seqmesh train``: pixels cut exactly as transformers' Qwen-VL processor cuts them, and
every mistake in a record named before any model is built."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from seqmesh.model.lm import hf_config
from seqmesh.model.presets import MODELS
from seqmesh.training.datasets import ByteTokenizer
from seqmesh.training.image_files import ImageJsonl, normalise, qwen_patches, read_image


def test_patches_equal_transformers_qwen_processor(tmp_path):
    """A 56x84 uint8 image: seqmesh's rows and grid equal Qwen2VLImageProcessor's (no resizing) exactly."""
    pytest.importorskip("PIL")
    from transformers import Qwen2VLImageProcessor

    image = (np.random.RandomState(0).rand(56, 84, 3) * 255).astype(np.uint8)
    np.save(tmp_path / "a.npy", image)
    want = Qwen2VLImageProcessor(do_resize=False)(images=[image], return_tensors="pt")
    rows, grid = qwen_patches(normalise(read_image(str(tmp_path / "a.npy"))), 14, 2, 2)
    assert grid == want["image_grid_thw"][0].tolist()
    assert torch.equal(rows, want["pixel_values"])


def _records(tmp_path, text: str, images: list[str], shape=(28, 28, 3), dtype=np.uint8) -> str:
    for name in images:
        np.save(tmp_path / name, np.zeros(shape, dtype=dtype))
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"text": text, "images": images}) + "\n")
    return str(path)


@pytest.mark.parametrize("text,images,shape,message", [
    ("one <image> two <image>", ["a.npy"], (28, 28, 3), "has 2 <image> markers but 1 images"),
    ("an <image>", ["a.npy"], (30, 28, 3), "is 30x28 pixels; this model needs multiples of 28 on each side"),
    ("an <image>", ["a.npy"], (28, 28), "has shape (28, 28); seqmesh reads (height, width, 3)"),
    ("an <image>" + " word" * 40, ["a.npy"], (28, 28, 3), "longer than --seq-len 64"),
])
def test_bad_records_are_named(tmp_path, text, images, shape, message):
    config = hf_config(MODELS["qwen2.5-vl-7b"])
    with pytest.raises(ValueError, match=None) as err:
        ImageJsonl([_records(tmp_path, text, images, shape)], 64, ByteTokenizer(), config)
    assert message in str(err.value), str(err.value)


def test_an_image_file_holding_code_is_refused(tmp_path):
    """``numpy.load(allow_pickle=False)``: an object array (which would unpickle, and could run code) is refused."""
    np.save(tmp_path / "evil.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="could not be read as a .npy array of numbers"):
        read_image(str(tmp_path / "evil.npy"))
