"""What seqmesh refuses about vision-language models, by name and before any work."""

from __future__ import annotations

from vision_cases import refusals


def test_refusals_name_the_problem_and_the_way_out(pools):
    for out in pools.run(2, refusals, 2, 1):
        assert sorted(out) == ["gemma3", "llava_onevision", "no_model", "placeholders", "text_batch", "tower_heads"], out
        assert "bidirectionally" in out["gemma3"] and "qwen2_5_vl" in out["gemma3"], out["gemma3"]
        assert "LLaVA-OneVision" in out["llava_onevision"], out["llava_onevision"]
        assert "vision tower has 1 query heads" in out["tower_heads"] and "ulysses=1 x ring=2" in out["tower_heads"]
        assert "model=model" in out["no_model"], out["no_model"]
        assert "0 video placeholder tokens" in out["placeholders"] and "8 embeddings" in out["placeholders"]
        assert "shard_batch(batch, mesh, model=model)" in out["text_batch"], out["text_batch"]
