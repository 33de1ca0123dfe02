"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), LLaVA and Gemma 3 (tiny, float64) through seqmesh with the vision tower sharded: logits, loss and
every parameter's gradient (tower included) equal the single-process transformers model on the whole
batch, within the rounding the reference itself carries, on every mesh shape."""

from __future__ import annotations

import pytest

from vision_cases import fsdp_data_parallel_parity, vision_parity_all

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "llava", "qwen3_vl_moe", "qwen3_5", "qwen2_vl", "qwen3_5_moe"]
# (batch kind, layout): images and a video across shard boundaries (zigzag); two packed documents with
# their own images (per_document); one image at the very end, so most ranks hold no image token
# (contiguous); no image at all (no rank runs the tower: its weights get no gradient, as on one device)
KINDS = [("mixed", "zigzag"), ("documents", "per_document"), ("tail", "contiguous"), ("text_only", "auto"),
         ("two_rows", "zigzag")]
MESHES = [(1, 2), (2, 1), (2, 2), (1, 4)]  # which reach every line Ulysses 4 reached here (docs/testing.md)
# As in test_hf_families: a multiple of how far float32 rounding moves the reference (the same model and
# weights run in float32 against float64, measured in the same run). Measured (torch 2.13, transformers 5.24,
# CPU): the reference's rounding is 2e-7..3e-7 on logits and 7e-7..2e-6 (relative) on gradients; seqmesh's
# error is 0 on logits and under 2e-15 on gradients (float64 summation order), 1e-9 of the bound. Qwen3.5 and
# Qwen3.5-MoE are the exception (vision_cases.GATED_DELTA_FAMILIES): transformers' Gated DeltaNet rounds in
# float32, which moves its dt_bias / A_log gradients by up to 7.5e-5 relative; seqmesh's float64 one differs from it
# by that much (1.0x; logits 0.36x).
ROUNDING_MULTIPLE = 4


# Gemma 3 (images seen both ways by their own tokens, a sliding-window layer and a full one): its images all
# have one size and its rows must place them alike (one mask for the batch), so no two_rows; "untyped" leaves out
# token_type_ids, where transformers' mask is plainly causal. On 2x2 its three richest batches.
GEMMA_KINDS = [k for k in KINDS if k[0] != "two_rows"] + [("untyped", "zigzag")]


def _cases(ulysses: int, ring: int) -> list[tuple]:
    if ulysses * ring == 2:
        # The richest batch (mixed) for every family on both axes; each other (family, batch) pair on one of
        # them, alternating like a chequerboard, so each axis still sees every family and every batch kind
        side = ulysses - 1  # 0: ring 2, 1: Ulysses 2
        kinds = {f: [k for j, k in enumerate(GEMMA_KINDS if f == "gemma3" else KINDS)
                     if j == 0 or (i + j + side) % 2 == 0] for i, f in enumerate(FAMILIES + ["internvl", "gemma3"])}
        return [(f, ulysses, ring, kind, layout) for f, chosen in kinds.items() for kind, layout in chosen]
    # 4-rank worlds: the two richest batches, for the three towers (windows; learned positions and DeepStack;
    # CLIP's class token). The others add no code path there: Qwen2-VL's tower is Qwen2.5-VL's full blocks,
    # Qwen3.5(-MoE)'s is Qwen3-VL's without DeepStack, and their decoders' 4-rank paths are tests/linear_attention's;
    # Gemma 3 (its pooled tower and image blocks) on 2x2 only
    # InternVL (its class-token window and pixel shuffle) on 2x2 only, its three richest batches
    gemma = [("gemma3", 2, 2, kind, layout) for kind, layout in GEMMA_KINDS[:3]] if (ulysses, ring) == (2, 2) else []
    internvl = [("internvl", 2, 2, kind, layout) for kind, layout in KINDS[:3]] if (ulysses, ring) == (2, 2) else []
    return [(f, ulysses, ring, kind, layout) for f in FAMILIES[:3] for kind, layout in KINDS[:2]] + gemma + internvl


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_vision_language_models_exact(pools, ulysses, ring):
    """Every family and batch kind within ROUNDING_MULTIPLE times the reference's own rounding; the
    tower's parameters get gradients whenever the batch has images, and embeddings do cross ranks."""
    crossed, worst = 0, {}
    for results in pools.run(ulysses * ring, vision_parity_all, _cases(ulysses, ring)):
        for r in results:
            assert not _outside_rounding(r), r
            assert (r["tower_grads"] > 0) == (r["case"][3] != "text_only"), r
            crossed += r["sent"]
            family = r["case"][0]
            ratios = tuple(r[k] / r["rounding"][k] for k in ("logits", "loss", "grad"))
            worst[family] = tuple(max(a, b) for a, b in zip(worst.get(family, (0.0,) * 3), ratios))
    assert crossed > 0  # some image embedding was computed on one rank and used on another
    print(f"u{ulysses}xr{ring} worst error / reference rounding (logits, loss, grad): {worst}")


def test_llava_full_strategy_routes_the_class_tokens(pools):
    """LLaVA with vision_feature_select_strategy="full": each image's class-token row is its first placeholder
    token's embedding, routed like the patches' (the window tower's routed class window)."""
    cases = [("llava_full", 1, 2, kind, layout) for kind, layout in KINDS[:3]] + [("llava_full", 2, 1, "mixed", "zigzag")]
    for results in pools.run(2, vision_parity_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            assert r["tower_grads"] > 0, r


def test_checkpointing_recomputes_the_towers_seqmesh_runs(pools):
    """Gemma 3's and InternVL's tower layers, which seqmesh runs from their modules, are recomputed in backward
    under activation checkpointing as their own forward would be (each layer's step runs twice: forward and
    recompute), and the model stays exact."""
    cases = [("gemma3", 1, 2, "mixed", "zigzag"), ("internvl", 2, 1, "documents", "per_document")]
    for results in pools.run(2, vision_parity_all, cases, checkpointing=True):
        for r in results:
            assert not _outside_rounding(r), r
            layers = 2 if r["case"][0] == "gemma3" else 3  # the tiny towers' layers (vision_cases.vision_config)
            assert r["tower_layer_steps"] == 2 * layers, r


def test_tolerance_sees_a_shifted_position(pools):
    """One rank's M-RoPE ids one position off must fail the tolerance by a wide margin."""
    for results in pools.run(2, vision_parity_all, [("qwen2_5_vl", 1, 2, "mixed", "zigzag")], shift_positions_on=1):
        for r in results:
            assert "logits" in _outside_rounding(r), r
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_tolerance_sees_the_image_mask_dropped(pools):
    """Gemma 3's decoder run plainly causal (image tokens blind to their image's later tokens) must fail the
    tolerance by a wide margin: the test sees the mask."""
    for results in pools.run(2, vision_parity_all, [("gemma3", 1, 2, "mixed", "zigzag")], drop_image_blocks=True):
        for r in results:
            assert "logits" in _outside_rounding(r), r
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_tolerance_sees_a_transposed_pixel_shuffle(pools):
    """InternVL's windows concatenated column-major (each patch keeping its pixels and position, so only the
    pixel shuffle's order is wrong) must fail the tolerance by a wide margin: the test sees the patch order."""
    for results in pools.run(2, vision_parity_all, [("internvl", 1, 2, "mixed", "zigzag")], transpose_windows=True):
        for r in results:
            assert "logits" in _outside_rounding(r), r
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_fsdp_over_replicas_with_and_without_images(pools):
    """FSDP2 over 2 data-parallel x 2 ring ranks, one replica's batch with images and the other's text only:
    no hang, and the pooled loss and every gradient equal one process on both batches."""
    # Gemma 3 and InternVL: seqmesh runs their tower layers from the layers' modules, each layer an FSDP unit
    # gathered around that call (windows.LAYER_METHOD)
    for family in ("qwen3_vl", "internvl", "gemma3"):
        for r in pools.run(4, fsdp_data_parallel_parity, family):
            assert r["loss"] <= ROUNDING_MULTIPLE * r["rounding"]["loss"], (family, r)
            assert r["grad"] <= ROUNDING_MULTIPLE * r["rounding"]["grad"], (family, r)
