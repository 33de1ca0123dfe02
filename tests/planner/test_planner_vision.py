"""The planner's vision tower (``seqmesh plan --images``) against hand arithmetic on qwen2.5-vl-tiny: patches,
placeholder tokens, bytes sent, bytes kept, FLOPs, and the refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from seqmesh.rules.degrees import Degrees
from seqmesh.model.presets import MODELS
from seqmesh.planner.hardware import PRESETS, make_cluster
from seqmesh.planner.plan import evaluate, layouts
from seqmesh.planner.traffic import vision_tower_traffic
from seqmesh.planner.vision import Media, Tower
from seqmesh.planner.workload import Workload
from seqmesh.tools.cli import main

# qwen2.5-vl-tiny's tower: depth 3 (block 1 full, blocks 0 and 2 in windows of 8 px), hidden 32, 4 heads of 8,
# intermediate 48, out_hidden 64, 2-px patches, merge 2, temporal 2. An 8 x 12 px image is 4 x 6 = 24 patches,
# 2 x 3 merge units = 6 tokens; its windows (2 x 2 units) are a 2 x 2 block (16 patches) and a 2 x 1 one (8).
TINY_VL = MODELS["qwen2.5-vl-tiny"]
THREE_IMAGES = Media(images=3, height=8, width=12)  # 72 patches, 18 units


def _work(**kw) -> Workload:
    return Workload(TINY_VL, seq_len=64, media=THREE_IMAGES, **kw)


def test_patches_tokens_and_documents():
    tower = Tower(_work(), Degrees(2, 2, 1))
    assert THREE_IMAGES.tokens(TINY_VL.vision) == 3 * 6
    assert tower.patches == 3 * 24
    # 18 units over P = 4 ranks: ceil(18 / 4) = 5 units = 20 patches each, the sequence padded to 80
    assert tower.rank_patches == 20
    frames, windows = (0, 24, 48, 72), (0, 16, 24, 40, 48, 64, 72)
    assert tower.documents() == [(frames, 1), (windows, 2)]
    video = Tower(Workload(TINY_VL, seq_len=64, media=Media(video_frames=6, height=8, width=12)), Degrees(1, 1, 4))
    assert video.patches == 6 // 2 * 24 and video.rank_patches == 72  # 3 temporal patches of 24
    with pytest.raises(ValueError, match="give an image or a video"):
        Media(images=0)


def test_traffic_by_hand():
    # U2 x R2, bf16: each rank holds L = 20 patches; a row (one head of its patches) is 20 x 8 x 2 = 320 bytes.
    # Ulysses deals 4 heads as 2 + 2: forward sends q, k, v of the other rank's 2 heads, (12 - 6) rows, and the
    # output of its 2 heads, 2 rows; backward the adjoints, the same 8 rows: 2,560 bytes per block each way.
    a2a = 8 * 320
    # Ring blocks are U x L = 40 patches: [0, 40) and [40, 80). Frame [24, 48) straddles them, so a full block
    # makes one hop (relayed: its partial comes home, 2 partials); the windows end at 40 and make none. A K/V
    # block is 2 x 40 patches x 2 kv heads x 8 = 1,280 values: 2,560 bytes forward; backward the block again and
    # 2 float32 partials, 2,560 + 10,240.
    kv = 2 * 40 * 2 * 8
    sent = Tower(_work(), Degrees(2, 2, 1)).traffic()
    assert sent["forward"] == {"vision_all_to_all": 3 * a2a, "vision_ring_p2p": kv * 2, "vision_route": 5 * 64 * 2}
    assert sent["backward"] == {"vision_all_to_all": 3 * a2a, "vision_ring_p2p": kv * 2 + 2 * kv * 4,
                                "vision_route": 5 * 64 * 2}  # the route: 5 units of 64 values back, in bf16
    assert sent["recompute"] == {"vision_all_to_all": 3 * a2a, "vision_ring_p2p": kv * 2, "vision_route": 0}
    # the same as the formula the bench checks against counted bytes, over the whole tower at once
    whole = vision_tower_traffic(3, 4, 8, frames=(0, 24, 48, 72), merge=2, ulysses=2, ring=2, dtype="bfloat16",
                                 windows=(0, 16, 24, 40, 48, 64, 72), full_blocks=1)
    assert max(t.sent("p2p", "backward") for t in whole) == sent["backward"]["vision_ring_p2p"]
    assert max(t.sent("all_to_all", "forward") for t in whole) == sent["forward"]["vision_all_to_all"]


def test_fsdp_by_hand():
    # a block: qkv and proj with biases 4 x 32^2 + 4 x 32, the gated MLP 3 x 32 x 48 + 2 x 48 + 32, two norms 64
    block = 4 * 32 * 32 + 4 * 32 + 3 * 32 * 48 + 2 * 48 + 32 + 2 * 32
    assert block == 9024 == TINY_VL.vision.block_params
    # the rest: patch embedding 24 x 32, the merger's norm 32 and linears 128 x 128 + 128 + 128 x 64 + 64
    rest = 24 * 32 + 32 + 128 * 128 + 128 + 128 * 64 + 64
    # over 4 ranks each sends 3 shards: bf16 gathers (a block twice), float32 reduce-scatters
    assert Tower(_work(), Degrees(2, 2, 1)).fsdp() == {
        "fsdp_all_gather": 2 * 3 * 3 * (block // 4) * 2 + 3 * (rest // 4) * 2,
        "fsdp_reduce_scatter": 3 * 3 * (block // 4) * 4 + 3 * (rest // 4) * 4}


def test_memory_by_hand():
    # per patch, bf16, U2 x R2 (Ulysses: 2 ranks' patches, 2 heads of 8 each, = 4 heads' worth):
    norm = 4 * 32 + 4 + 2 * 32  # eager RMSNorm: float32 input, float32 scale, the normalized tensor
    attention = 4 * (4 * 8 * 2 + 4) + 2 * 32  # q, k, v, output and the float32 LSE; the projection's own input
    block = 2 * (norm + 2 * 32) + attention + 4 * 48 * 2  # two norms and their outputs; gate, up, SiLU, product
    merger = norm + 3 * 2 * 32  # its norm, the norm's output, fc1's output, GELU's
    outside = 24 * (4 + 2) + 2 * 8 * 4  # pixels in float32 and bf16; rotary cos and sin in float32
    kept = outside + merger + 3 * 2 * 32  # checkpointing: each block's input
    working = 2 * 2 * 32 + 32 * (3 * 2 + 4 + 2 * (16 + 3 * 2))  # gradients of the block's output and input; the
    # ring's attention backward (dq, dk, dv, float32 dQ, 4 float32 partials, 3 K/V blocks) outweighs the MLP's
    assert working > 2 * 2 * 32 + 3 * 48 * 2
    assert Tower(_work(), Degrees(2, 2, 1)).memory() == (20 * kept, 20 * (kept - merger + block + working))
    no_ckpt = Tower(_work(checkpointing=False), Degrees(2, 2, 1)).memory()[0]
    assert no_ckpt == 20 * (outside + merger + 3 * block)


def test_seconds_by_hand_on_one_gpu():
    # one GPU: no collectives, no FSDP traffic; all FLOPs at one rate
    hw = replace(PRESETS["h100-nvlink"], attention_efficiency=0.5, matmul_efficiency=0.5)
    rate = hw.flops_for("bf16") * 0.5
    mm = 2 * 72 * (4 * 32 * 32 + 3 * 32 * 48)  # one block forward on the 72 patches
    full, windowed = 4 * 8 * 4 * 3 * 24 ** 2, 4 * 8 * 4 * 3 * (16 ** 2 + 8 ** 2)  # 4 D H per visible pair
    blocks = 3 * 4 * mm + 4.5 * (full + 2 * windowed)  # forward twice (checkpointing), backward 2x and 2.5x
    outside = 3 * 2 * 72 * (24 * 32 + (128 * 128 + 128 * 64) / 4)  # patch embedding, merger; forward + backward
    seconds = Tower(_work(), Degrees(1, 1, 1)).seconds(hw)
    assert seconds["compute"] == pytest.approx((blocks + outside) / rate, rel=1e-12)
    assert seconds["total"] == pytest.approx(seconds["compute"], rel=1e-12) and seconds["serial"] == 0


def test_the_plan_adds_the_tower():
    cluster = make_cluster(PRESETS["h100-nvlink"], 4, None, None)
    text = evaluate(Workload(TINY_VL, seq_len=64), Degrees(2, 2, 1), cluster)
    vision = evaluate(_work(), Degrees(2, 2, 1), cluster)
    tower = Tower(_work(), Degrees(2, 2, 1))
    added = {k: vision.comm_per_step[k] - text.comm_per_step.get(k, 0) for k in vision.comm_per_step}
    assert added["vision_all_to_all"] == 3 * 3 * 2560 and added["vision_route"] == 2 * 640
    assert added["fsdp_all_gather"] == tower.fsdp()["fsdp_all_gather"]
    assert added["total"] == sum(v for k, v in added.items() if k != "total")
    s = tower.seconds(cluster.hardware)
    assert vision.time.total == pytest.approx(text.time.total + s["total"])
    assert vision.memory.total > text.memory.total


def test_plan_prints_the_tower(capsys):
    assert main(["plan", "--model", "qwen2.5-vl-tiny", "--seq-len", "64", "--gpus", "4", "--images", "3",
                 "--image-size", "8x12"]) == 0
    out = capsys.readouterr().out
    assert "3 image(s) of 8x12 px per sequence, 24 patches (6 tokens) per image" in out
    assert "72 patches and 18 placeholder tokens per sequence group" in out and "vision tower time:" in out
    assert main(["plan", "--model", "qwen3-vl-tiny", "--gpus", "2", "--video-frames", "4", "--image-size", "8x8",
                 "--max-seq-len"]) == 0


@pytest.mark.parametrize("argv, needle", [
    (["--model", "qwen2.5-vl-tiny", "--seq-len", "17", "--images", "3", "--image-size", "8x12"],
     "3 images x 6 tokens = 18 placeholder tokens do not fit in --seq-len 17; use --seq-len 18"),
    (["--model", "qwen2.5-vl-tiny", "--seq-len", "64", "--images", "1", "--image-size", "9x12"],
     "multiples of patch x merge = 4 pixels; use 8x12"),
    (["--model", "qwen2.5-vl-tiny", "--seq-len", "64", "--video-frames", "3", "--image-size", "8x8"],
     "--video-frames 3 is not a multiple of the 2 frames of a temporal patch; use 2 or 4"),
    (["--model", "llama-tiny", "--seq-len", "64", "--images", "1"], "llama-tiny has no vision tower"),
    (["--model", "qwen2.5-vl-tiny", "--seq-len", "64", "--images", "1", "--image-size", "8"], "HEIGHTxWIDTH"),
])
def test_refusals(capsys, argv, needle):
    assert main(["plan", "--gpus", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqmesh plan: error:") and needle in err


def test_ulysses_beyond_the_tower_heads_is_set_aside():
    # Qwen2.5-VL-7B: 28 decoder heads, 16 tower heads; 24 GPUs give U24, which only the tower cannot take
    cluster = make_cluster(PRESETS["h100-nvlink"], 24, None, None)
    work = Workload(MODELS["qwen2.5-vl-7b"], seq_len=131072, media=Media(images=64))
    assert (Degrees(24, 1, 1), "ulysses 24 exceeds the vision tower's 16 heads") in layouts(work, cluster)[1]
    assert Degrees(24, 1, 1) in layouts(replace(work, media=None), cluster)[0]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl"])
def test_a_config_json_sizes_the_tower_transformers_builds(tmp_path, family):
    """``seqmesh plan`` / ``seqmesh train`` read a Qwen-VL config.json: the tower's parameters equal those of the
    model transformers builds from it (Qwen2-VL names its tower's width embed_dim and its merger's output
    hidden_size); Qwen3.5-MoE's decoder, which has no dense MLP, is read as its experts."""
    import torch
    from transformers import AutoModelForImageTextToText
    from vision_cases import vision_config

    from seqmesh.model.presets import model_shape

    config = vision_config(family)
    config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    tower = sum(p.numel() for p in model.model.visual.parameters())
    assert shape.vision.params == tower, (shape.vision, tower)
    assert shape.vision.gated == (family == "qwen2_5_vl")
    if family == "qwen3_5_moe":
        assert (shape.experts, shape.experts_per_token, shape.intermediate) == (4, 2, 32), shape


def test_keep_attention_is_refused_where_a_tower_runs():
    """A tower's blocks would keep their attention outputs too, which the planner does not count: refused by name for
    images, planned for text."""
    assert Workload(TINY_VL, seq_len=64, keep_attention=True).keep_attention
    with pytest.raises(ValueError, match="--keep-attention is not planned for a vision tower's blocks; plan without"):
        Workload(TINY_VL, seq_len=64, keep_attention=True, media=THREE_IMAGES)
