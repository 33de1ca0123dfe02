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


def _npy_header_only(path, shape, dtype="|u1", pixels: int | None = None) -> None:
    """A .npy file whose header declares ``shape`` followed by ``pixels`` bytes (None: as many as it declares, left
    as a sparse hole: no disk space, and nothing anyone reads)."""
    from numpy.lib import format as npy

    with open(path, "wb") as f:
        npy.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": shape})
        start = f.tell()
        if pixels is not None:
            f.write(b"\0" * pixels)
        else:
            f.truncate(start + int(np.prod(shape)) * np.dtype(dtype).itemsize)


def _never_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("numpy.load was called: the pixels were read before the header was checked")

    monkeypatch.setattr(np, "load", refuse)


def _one_record(tmp_path, name: str) -> str:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"text": "an <image>", "images": [name]}) + "\n")
    return str(path)


def test_a_header_claiming_more_pixels_than_the_file_holds_is_refused_unread(tmp_path, monkeypatch):
    """A 130-byte .npy whose header claims 100000x100000x3: every rank tried to allocate 27.9 GiB (a raw
    ArrayMemoryError). Its header is checked against the file's size first; numpy.load is never called."""
    _npy_header_only(tmp_path / "huge.npy", (100000, 100000, 3), pixels=2)
    assert (tmp_path / "huge.npy").stat().st_size == 130
    _never_load(monkeypatch)
    with pytest.raises(ValueError) as err:
        ImageJsonl([_one_record(tmp_path, "huge.npy")], 512, ByteTokenizer(), hf_config(MODELS["qwen2.5-vl-7b"]))
    assert (f"huge.npy': its header declares a 100000x100000x3 uint8 array (30,000,000,000 bytes of pixels) but the file "
            "holds 2 bytes after its header: it is cut short") in str(err.value), str(err.value)


def test_an_image_too_large_for_the_sequence_is_refused_from_its_header(tmp_path, monkeypatch):
    """A 4088x4088 image (146 x 146 units of 28 pixels) in a 512-token sequence: refused, but after reading it
    (919 MB peak), before; now from the header, numpy.load never called."""
    _npy_header_only(tmp_path / "big.npy", (4088, 4088, 3))
    _never_load(monkeypatch)
    with pytest.raises(ValueError) as err:
        ImageJsonl([_one_record(tmp_path, "big.npy")], 512, ByteTokenizer(), hf_config(MODELS["qwen2.5-vl-7b"]))
    assert ":1 is at least 21321 tokens with its images" in str(err.value) and "big.npy is 4088x4088 pixels, 21318 tokens" \
        in str(err.value) and "longer than --seq-len 512" in str(err.value), str(err.value)


@pytest.mark.parametrize("shape,dtype,message", [
    ((0, 0, 3), np.uint8, "is empty (0x0 pixels); every image needs pixels"),  # it trained and verified
    ((28, 28, 3), np.int32, "holds int32 values; save uint8 (0-255) or floats (float16, float32 or float64) in [0, 1]"),
])
def test_an_image_refused_from_its_header(tmp_path, monkeypatch, shape, dtype, message):
    np.save(tmp_path / "a.npy", np.zeros(shape, dtype=dtype))
    _never_load(monkeypatch)
    with pytest.raises(ValueError) as err:
        ImageJsonl([_one_record(tmp_path, "a.npy")], 64, ByteTokenizer(), hf_config(MODELS["qwen2.5-vl-7b"]))
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("value,named", [(float("nan"), "holds NaN (1 value, the first at row 2, column 5, channel 1)"),
                                         (float("inf"), "holds inf (1 value, the first at row 2, column 5, channel 1)")])
def test_a_non_finite_pixel_is_named_with_its_file(tmp_path, value, named):
    """A NaN pixel gave "floats from nan to nan"."""
    image = np.full((28, 28, 3), 0.5, dtype=np.float32)
    image[2, 5, 1] = value
    np.save(tmp_path / "a.npy", image)
    with pytest.raises(ValueError) as err:
        read_image(str(tmp_path / "a.npy"))
    assert str(err.value).startswith(f"image {str(tmp_path / 'a.npy')!r} {named}; every pixel must be a finite number"), \
        str(err.value)


def test_qwen_vl_batches_carry_each_tokens_modality(tmp_path):
    """Qwen-VL's M-RoPE reads mm_token_type_ids (transformers 5.24): the records' batches carry them, 1 on the image
    placeholder tokens, as its processor writes them."""
    config = hf_config(MODELS["qwen2.5-vl-7b"])
    data = ImageJsonl([_records(tmp_path, "an <image> here", ["a.npy"])], 64, ByteTokenizer(), config)
    batch = data.batch(0, 0)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == config.image_token_id).long())
    assert int(batch["mm_token_type_ids"].sum()) == 1  # 28x28 pixels: one merged unit
