"""RecurrentGemma (two RG-LRU blocks, then local attention; tiny, float64) through seqmesh.hf: logits and every
parameter's gradient equal the unmodified transformers model on one process (packed documents one call each),
within a multiple of the reference's own rounding (family_cases.reference_rounding: transformers runs the
recurrence in float32 whatever the model's dtype); and a state not carried across ranks, or not reset at a
document start, is caught."""

from __future__ import annotations

import pytest

from family_cases import outside_rounding, parity_cases, parity_line

ROUNDING_MULTIPLE = 4
MESHES = [(2, 1), (1, 2)]


def _outside_rounding(r: dict) -> list[str]:
    return outside_rounding(r, ROUNDING_MULTIPLE)


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_recurrent_gemma_exact(pools, ulysses, ring):
    """Zigzag plain and with packed documents, on one mesh, in one pools.run call."""
    cases = [("recurrent_gemma", ulysses, ring, "zigzag", docs) for docs in (False, True)]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        print(parity_line(r))
        assert not _outside_rounding(r), r


def test_recurrent_gemma_exact_on_the_2d_mesh(pools):
    """Ulysses 2 x ring 2, packed documents: a state passed across both axes' ranks."""
    r = pools.run(4, parity_cases, [("recurrent_gemma", 2, 2, "zigzag", True)])[0][0]
    print(parity_line(r))
    assert not _outside_rounding(r), r


def _state_not_carried(lm) -> None:
    """The mutation: every rank runs its RG-LRU runs from zero (the state of earlier ranks dropped)."""
    from seqmesh.hf import rg_lru
    from seqmesh.linear_attention.selective_scan import diagonal_scan

    def from_zero(log_a, inp, place, keep=None):
        return diagonal_scan(log_a, inp, place.mine.segment_bounds)[0]

    for module in lm.modules():
        if rg_lru.is_rg_lru_block(module):
            def dropping(*args, _forward=module.forward, **kwargs):
                kept, rg_lru.state_passing_diagonal_scan = rg_lru.state_passing_diagonal_scan, from_zero
                try:
                    return _forward(*args, **kwargs)
                finally:
                    rg_lru.state_passing_diagonal_scan = kept

            module.forward = dropping


def _no_reset_at_documents(lm) -> None:
    """The mutation: every RG-LRU block scans as if the row were one document (its state carried across starts)."""
    import dataclasses

    from seqmesh.hf import mixer_kind, rg_lru

    for module in lm.modules():
        if rg_lru.is_rg_lru_block(module):
            def one_document(*args, _forward=module.forward, _module=module, **kwargs):
                entry = kwargs.pop("seqmesh", None) or _module.__dict__.get(mixer_kind.ENTRY_ATTR)
                return _forward(*args, seqmesh=dataclasses.replace(entry, cu_seqlens=None), **kwargs)

            module.forward = one_document


@pytest.mark.parametrize("mutation", [_state_not_carried, _no_reset_at_documents], ids=["not-carried", "not-reset"])
def test_a_recurrent_gemma_mutation_is_caught(pools, mutation):
    r = pools.run(2, parity_cases, [("recurrent_gemma", 1, 2, "zigzag", True)], alter=mutation)[0][0]
    print(f"{mutation.__name__}: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_a_recurrent_gemma_config_json_verifies_and_trains(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a tiny RecurrentGemma over a ring of 2: the
    single-process model's gradients (its float64 copy taken though transformers' RG-LRU keeps its last state, a
    non-leaf tensor, on the module), then a finite, falling loss with the blocks recomputed in backward."""
    import math

    import transformers as tf

    from train_job_cases import verify_then_train

    config = tf.RecurrentGemmaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, vocab_size=64,
                                     intermediate_size=64, lru_width=32, attention_window_size=16,
                                     num_key_value_heads=1)
    good, losses = verify_then_train(pools, tmp_path, config, checkpointing=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
