"""seqmesh verify and seqmesh train from a config.json in GPT-2's names (n_embd, n_layer, n_head; GPT-BigCode's
multi-query heads), whose attention dropout is ``attn_pdrop`` (0.1 by default): before, train and verify refused the
file ("no hidden_size entry"), and with its names read the run stopped at the first attention's dropout; verify then
compared steps whose residual dropout drew different masks (it now drops nothing on either side). Its table of
positions bounds the sequence (tests/planner/test_planner_own_attention.py holds the refusal past it)."""

from __future__ import annotations

import math

import pytest

from train_job_cases import verify_then_train


@pytest.mark.parametrize("config_class", ["GPT2Config", "GPTBigCodeConfig"])
def test_a_gpt2_style_config_json_verifies_and_trains(pools, tmp_path, config_class):
    """On a ring of 2: ``seqmesh verify`` passes, and ``seqmesh train`` gives a finite, falling loss."""
    import transformers as tf

    config = getattr(tf, config_class)(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=1024,
                                       bos_token_id=0, eos_token_id=0)
    assert config.attn_pdrop > 0  # the family's default, which seqmesh sets to 0 as it reads the file
    good, losses = verify_then_train(pools, tmp_path, config)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
