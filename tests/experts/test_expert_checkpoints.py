"""Expert parallelism and saved state: a checkpoint written with the experts split over ``ep=4`` resumes at ``ep=2``
and without expert parallelism (AdamW's moments resharded with the weights); the rows the losses of the resumed
runs take equal one uninterrupted process's within a multiple of its noise."""

from __future__ import annotations

from experts_checkpoint_cases import resume_at_other_ep

NOISE_MULTIPLE = 8


def test_checkpoint_resumes_at_another_ep(pools, tmp_path):
    """Qwen3-MoE on U2 x R2, FSDP2, AdamW, float64: 2 steps at ep=4, saved; loaded at ep=2 and at ep=1, 2 more
    steps each. Every step's loss against the uninterrupted one-process run, and the loaded exp_avg (gathered)
    against that run's after 2 steps."""
    for rank in pools.run(4, resume_at_other_ep, "qwen3_moe", str(tmp_path / "ckpt"), 2, 2, 1, 4, [2, 1]):
        for ep, r in rank.items():
            print(f"\nresumed at ep={ep}: loss {r['loss']:.2f} x noise, exp_avg relative error {r['exp_avg']:.1e}")
            assert r["loss"] <= NOISE_MULTIPLE and r["exp_avg"] <= 1e-12, (ep, r)
