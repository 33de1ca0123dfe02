"""The planner's fixed-size towers (LLaVA's CLIP, Gemma 3's SigLIP, InternVL's InternViT) read from a config.json,
against transformers' parameter counts and hand arithmetic on the tiny configs of tests/vision_cases.py: 8 x 8 px
images of 2 x 2 px patches, 16 patches each; Gemma 3 pools and InternVL shuffles 2 x 2 windows (4 tokens an image),
LLaVA routes every patch (16 tokens) and reads its 3-layer CLIP after layer 2."""

from __future__ import annotations

import pytest

from seqmesh.rules.degrees import Degrees
from seqmesh.model.presets import model_shape
from seqmesh.planner.vision import Media, Tower
from seqmesh.planner.workload import Workload
from seqmesh.tools.cli import main

VARIANTS = {  # a variant's config changes beside the tiny case's: (attribute path, value)
    "siglip-head": ("gemma3", [("vision_config.vision_use_head", True)]),
    "internvit-options": ("internvl", [("vision_config.attention_bias", True), ("vision_config.use_qk_norm", True),
                                       ("vision_config.use_mean_pooling", True)]),
    "clip-two-layers-full": ("llava", [("vision_feature_layer", [-3, -1]),
                                       ("vision_feature_select_strategy", "full")]),
}


def _config_dir(tmp_path, family: str, changes=()):
    from vision_cases import vision_config

    config = vision_config(family)
    for path, value in changes:
        *owners, name = path.split(".")
        target = config
        for owner in owners:
            target = getattr(target, owner)
        setattr(target, name, value)
    config.save_pretrained(tmp_path)
    return config, str(tmp_path)


@pytest.mark.parametrize("case", ["gemma3", "internvl", "llava", *VARIANTS])
def test_a_config_json_sizes_the_tower_transformers_builds(tmp_path, case):
    """The tower's parameters (tower, and projector into the decoder) equal those of the model transformers builds."""
    import torch
    from transformers import AutoModelForImageTextToText

    family, changes = VARIANTS.get(case, (case, []))
    config, path = _config_dir(tmp_path, family, changes)
    shape = model_shape(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    built = sum(p.numel() for m in (model.model.vision_tower, model.model.multi_modal_projector) for p in m.parameters())
    assert shape.vision.fixed_size and shape.vision.params == built, (shape.vision, built)


def _tower(path: str, layout: Degrees, images: int = 3) -> Tower:
    model = model_shape(path)
    size = model.vision.image_size
    return Tower(Workload(model, seq_len=64, media=Media(images=images, height=size, width=size)), layout)


def test_gemma3_pools_windows_by_hand(tmp_path):
    # 3 images of 16 patches, 4 windows of 2 x 2 each: 12 windows over P = 4 ranks, 3 windows = 12 patches each;
    # each rank sends its 3 pooled rows of the decoder's 64 values (bf16), k * k = 4 times fewer than its patches
    tower = _tower(_config_dir(tmp_path, "gemma3")[1], Degrees(2, 2, 1))
    assert tower.work.media.tokens(tower.vision) == 3 * 4
    assert (tower.patches, tower.rank_patches, tower.routed_rows()) == (48, 12, 3)
    assert tower.documents() == [((0, 16, 32, 48), 2)]
    assert tower.traffic()["forward"]["vision_route"] == 3 * 64 * 2


def test_internvl_class_windows_by_hand(tmp_path):
    # an image is its class window (3 padding places, then the class token) and 4 windows: 20 places, 5 windows;
    # 15 windows over P = 4 ranks: 4 windows = 16 places each. Rank 0 holds windows 0-3, the first a class window:
    # 3 shuffled rows; every rank holds one class window but the last, which holds 3 windows.
    path = _config_dir(tmp_path, "internvl")[1]
    tower = _tower(path, Degrees(2, 2, 1))
    assert tower.work.media.tokens(tower.vision) == 3 * 4
    assert (tower.image_places, tower.rank_patches, tower.routed_rows()) == (20, 16, 3)
    assert tower.documents() == [((0, 3, 20, 23, 40, 43, 60), 3)]
    # over P = 2: 8 windows each; rank 0 holds the class windows 0 and 5, rank 1 window 10: 6 rows each
    assert _tower(path, Degrees(2, 1, 1)).routed_rows() == 6


def test_llava_places_and_blocks_by_hand(tmp_path):
    # an image is its class token and 16 patches, 17 places; 51 over P = 4: 13 each. LLaVA reads layer -2, so 2 of
    # the 3 blocks run (and are gathered); each rank holds one class token, whose row stays home: 12 rows sent
    tower = _tower(_config_dir(tmp_path, "llava")[1], Degrees(2, 2, 1))
    v = tower.vision
    assert (v.merge, v.run_blocks, v.depth) == (1, 2, 3)
    assert tower.work.media.tokens(v) == 3 * 16
    assert (tower.rank_patches, tower.routed_rows()) == (13, 12)
    assert tower.documents() == [((0, 17, 34, 51), 2)]
    block = v.block_params
    assert block == 4 * 32 * 32 + 4 * 32 + 2 * 32 * 48 + 48 + 32 + 4 * 32
    rest = v.params - 3 * block
    assert tower.fsdp()["fsdp_all_gather"] == 2 * 2 * 3 * (block // 4) * 2 + 3 * -(-rest // 4) * 2


@pytest.mark.parametrize("family, needle", [
    ("gemma3", "16 patches (4 tokens) per image; 48 patches and 12 placeholder tokens per sequence group, 12 patches"),
    ("internvl", "16 patches (4 tokens) per image; 48 patches and 12 placeholder tokens per sequence group, 16 places"),
    ("llava", "16 patches (16 tokens) per image; 48 patches and 48 placeholder tokens per sequence group, 13 places"),
])
def test_plan_prints_the_tower(tmp_path, capsys, family, needle):
    path = _config_dir(tmp_path, family)[1]
    assert main(["plan", "--model", path, "--seq-len", "64", "--gpus", "4", "--images", "3", "--one-group"]) == 0
    out = capsys.readouterr().out
    assert "3 image(s) of 8x8 px per sequence" in out and needle in out and "vision tower time:" in out


def test_a_fixed_size_tower_refuses_other_sizes_and_video(tmp_path, capsys):
    path = _config_dir(tmp_path, "gemma3")[1]
    assert main(["plan", "--model", path, "--seq-len", "64", "--gpus", "4", "--images", "1", "--image-size",
                 "16x16"]) == 2
    assert "takes images of 8x8 px only" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gemma3", "internvl", "llava"])
def test_seqmesh_train_refuses_a_fixed_size_tower_by_name(tmp_path, family):
    """``seqmesh train`` builds Qwen-VL towers only: a config.json with a fixed-size tower is refused before any
    model is built, naming the way to train it."""
    from seqmesh.training.config import TrainConfig
    from seqmesh.training.run_data import make_dataset

    _, path = _config_dir(tmp_path, family)
    with pytest.raises(ValueError, match="parallelize_model in your own loop"):
        make_dataset(TrainConfig(model=path, seq_len=64, ulysses=1, ring=1, dp=1))


def test_seqmesh_train_refuses_llava_onevision_once_with_the_true_reason(tmp_path):
    """It told the user to train it with parallelize_model, which then refused it: now the family's own refusal."""
    from vision_cases import _tiny_refused

    from seqmesh.training.config import TrainConfig
    from seqmesh.training.run_data import make_dataset

    _tiny_refused("llava_onevision").save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        make_dataset(TrainConfig(model=str(tmp_path), seq_len=64, ulysses=1, ring=1, dp=1))
    assert str(err.value).startswith("seqmesh cannot run this multimodal model exactly: LLaVA-OneVision's tower is not "
                                     "yet routed through seqmesh. seqmesh runs the vision-language models "), str(err.value)
    assert "parallelize_model" not in str(err.value)
