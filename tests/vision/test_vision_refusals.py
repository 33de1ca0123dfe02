"""What seqmesh refuses about vision-language models, by name and before any work."""

from __future__ import annotations

from vision_cases import refusals


def test_refusals_name_the_problem_and_the_way_out(pools):
    for out in pools.run(2, refusals, 2, 1):
        towers = [f"whole_tower_{f}" for f in ("llava", "qwen2_5_vl", "qwen3_vl")]
        assert sorted(out) == ["gemma3_long_image", "gemma3_rows", "internvl_ratio", "internvl_strategy",
                               "llava_onevision", "no_model", "placeholders", "text_batch", "tower_heads", *towers], out
        # the model's own forward given the whole images: its tower's attention would see the text's sequence
        assert all("runs on each rank's share of the patches" in out[t] for t in towers), out
        assert "holds 4 tokens, more than the sliding window of 3" in out["gemma3_long_image"], out["gemma3_long_image"]
        assert "place their images differently" in out["gemma3_rows"], out["gemma3_rows"]
        supported = out["llava_onevision"].split("seqmesh runs the vision-language models ")[1]  # what a refusal offers
        assert all(f in supported for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_5_moe", "gemma3", "internvl")), out["llava_onevision"]
        assert "vision_feature_select_strategy='full'" in out["internvl_strategy"] and "set it to 'default'" in \
            out["internvl_strategy"], out["internvl_strategy"]
        assert "downsample_ratio=0.3 must be 1/k" in out["internvl_ratio"], out["internvl_ratio"]
        assert "LLaVA-OneVision" in out["llava_onevision"], out["llava_onevision"]
        assert "vision tower has 1 query heads" in out["tower_heads"] and "ulysses=1 x ring=2" in out["tower_heads"]
        assert "model=model" in out["no_model"], out["no_model"]
        assert "0 video placeholder tokens" in out["placeholders"] and "8 embeddings" in out["placeholders"]
        assert "shard_batch(batch, mesh, model=model)" in out["text_batch"], out["text_batch"]


def test_the_jobs_device_move_takes_every_tensor_of_a_vision_shard(pools):
    """``seqmesh train`` builds batches on the CPU and moves them to the GPU: the vision shard's pixels,
    positions, taps and routing indices must go too (the meta device stands in for the GPU here)."""
    from vision_cases import fields_left_behind

    for family in ("qwen2_5_vl", "qwen3_vl", "llava", "internvl"):
        assert pools.run(1, fields_left_behind, family)[0] == [], family


def test_a_qwen_vl_batch_without_mm_token_type_ids_is_refused_naming_the_field():
    """transformers 5.24 computes Qwen-VL's 3-D M-RoPE positions only when mm_token_type_ids is given (its processor
    returns them); seqmesh computed them always, 2.8e-5 from the model's own output in float64. A batch with images
    and without them is refused, naming the field, where the model's M-RoPE reads it."""
    from types import SimpleNamespace

    import pytest

    from seqmesh.model.lm import build_model
    from seqmesh.training.config import TrainConfig
    from seqmesh.training.run_data import make_dataset
    from seqmesh.vision.batch import reads_token_types, shard_multimodal_batch

    model = build_model("qwen2.5-vl-tiny", device="meta")
    if not reads_token_types(model):
        pytest.skip("this transformers release's M-RoPE finds each token's modality in input_ids")
    batch = make_dataset(TrainConfig(model="qwen2.5-vl-tiny", seq_len=64)).batch(0, 0)
    batch.pop("mm_token_type_ids")
    with pytest.raises(ValueError) as err:
        shard_multimodal_batch(batch, SimpleNamespace(sp_size=1), model)
    images = len(batch["image_grid_thw"])
    assert str(err.value).startswith(f"the batch holds {images} images but no mm_token_type_ids: Qwen2.5-VL in "
                                     "transformers "), str(err.value)
    assert "Pass the processor's mm_token_type_ids with the batch (1 on image placeholder tokens" in str(err.value)
