"""Jamba (a Mamba v1 layer, then attention with a small MoE; tiny, float64) through seqmesh.hf: logits and every
parameter's gradient equal the unmodified transformers model on one process (packed documents one call each),
within a multiple of the reference's own rounding (family_cases.reference_rounding); and a state not reset at a
document start is caught."""

from __future__ import annotations

import pytest

from family_cases import outside_rounding, parity_cases, parity_line

# the reference rounds x, B and A to float32 inside its float64 scan (``.float()``), so its rounding is float32's
ROUNDING_MULTIPLE = 4
MESHES = [(2, 1), (1, 2)]  # U2 x R2 reached no line they do not (docs/testing.md)


def _outside_rounding(r: dict) -> list[str]:
    return outside_rounding(r, ROUNDING_MULTIPLE)


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_jamba_exact(pools, ulysses, ring):
    """Zigzag plain and with packed documents, on one mesh, in one pools.run call."""
    cases = [("jamba", ulysses, ring, "zigzag", docs) for docs in (False, True)]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        assert not _outside_rounding(r), r
        print(parity_line(r))


def _no_reset_at_documents(lm) -> None:
    """The mutation: every Mamba mixer scans as if the row were one document (its state carried across starts)."""
    import dataclasses

    from seqmesh.hf import mamba, mixer_kind

    for module in lm.modules():
        if mamba.is_mamba1(module):
            forward = module.forward

            def one_document(hidden_states, *args, _forward=forward, _module=module, **kwargs):
                entry = kwargs.pop("seqmesh", None) or _module.__dict__.get(mixer_kind.ENTRY_ATTR)
                return _forward(hidden_states, *args, seqmesh=dataclasses.replace(entry, cu_seqlens=None), **kwargs)

            module.forward = one_document


def test_a_state_not_reset_at_a_document_start_is_caught(pools):
    r = pools.run(2, parity_cases, [("jamba", 2, 1, "zigzag", True)], alter=_no_reset_at_documents)[0][0]
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r
    print(f"not reset at document starts: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")


def test_each_mamba_mixer_exact_on_its_own(pools):
    """Jamba's, Mamba's and Falcon-Mamba's mixers alone (tests/mamba_cases.py) on ulysses=2 x ring=2, zigzag with
    packed documents and contiguous without: outputs and parameter gradients within float64 rounding of the
    mixer's own forward on each whole document."""
    from mamba_cases import all_mixers

    cases = [(f, 2, 2, layout, docs) for f in ("jamba", "mamba", "falcon_mamba")
             for layout, docs in (("zigzag", True), ("contiguous", False))]
    results = pools.run(4, all_mixers, cases)[0]
    for r in results:
        print(f"{r['case']}: output {r['out']:.1e} (of {r['scale']:.1e}), relative grad {r['grad']:.1e} ({r['worst']})")
    for r in results:
        assert r["out"] <= 1e-12 * r["scale"] and r["grad"] <= 1e-10, r


def test_mamba_layers_found_and_their_entry_carried():
    """Jamba's decoder layer calls its Mamba mixer without **kwargs, and Mamba's and Falcon-Mamba's backbones call
    their blocks without them: each mixer is found, and the module that still receives seqmesh's entry (the layer;
    the backbone) carries it (one pre-hook, which leaves it for a checkpointed layer's recompute); unparallelize's
    uninstall deletes the forwards."""
    import types

    import torch
    import transformers as tf

    from family_cases import family_config
    from seqmesh.hf import mamba, mixers

    mesh = types.SimpleNamespace(sp_size=2)
    with torch.device("meta"):
        models = [tf.AutoModelForCausalLM.from_config(family_config(f)) for f in ("jamba", "mamba", "falcon-mamba")]
    for model, carrier in zip(models, ("model.layers.0", "backbone", "backbone")):
        found = mixers.mixer_layers(model, mesh, "auto")
        assert list(found) == [mamba.KIND] and len(found[mamba.KIND]) >= 1, found
        before = {p: len(m._forward_pre_hooks) for p, m in model.named_modules()}
        handles = mixers.carry_entry(model, found)
        hooked = [p for p, m in model.named_modules() if len(m._forward_pre_hooks) > before[p]]
        assert hooked == [carrier] and len(handles) == 1, (hooked, handles)
        for h in handles:
            h.remove()
        mamba.KIND.install(found[mamba.KIND], mesh, "auto")
        assert all("forward" in m.__dict__ for _, m in found[mamba.KIND])
        mixers.uninstall(model)
        assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["mamba", "falcon-mamba"])
def test_pure_mamba_models_exact(pools, family):
    """Mamba and Falcon-Mamba (no attention at all; the backbone drops **kwargs, so it carries the entry) on ring 2
    and U2 x R2, zigzag plain and with packed documents."""
    for ulysses, ring in ((1, 2), (2, 2)):
        cases = [(family, ulysses, ring, "zigzag", docs) for docs in (False, True)]
        for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
            assert not _outside_rounding(r), r
            print(parity_line(r))


@pytest.mark.parametrize("family", ["mamba", "falcon-mamba"])
def test_a_pure_mamba_config_json_initialises_verifies_and_trains_under_fsdp(pools, tmp_path, family):
    """``seqmesh verify`` and ``seqmesh train --model config.json --fsdp`` on a tiny Mamba and FalconMamba over a ring
    of 2 (the planner reads the same file: seqmesh.model.jamba.mamba_fields). Their mixer's init writes its
    children's weights (dt_proj's bias from softplus^-1 of a dt in [time_step_min, time_step_max], conv1d, out_proj),
    which FSDP has sharded by then: seqmesh.model.materialize finds those writes and makes them on whole copies, so the
    sharded model equals the one-process one (the init crashed on the shards before: "mixed torch.Tensor and
    DTensor"); a finite, falling loss."""
    import math

    from family_cases import family_config
    from train_job_cases import sharded_init_against_one_process, verify_then_train

    config = family_config(family)
    path = tmp_path / "init" / "config.json"
    path.parent.mkdir()
    path.write_text(config.to_json_string())
    for r in pools.run(2, sharded_init_against_one_process, str(path), 2):
        assert not r["differ"], r["differ"]
        assert config.time_step_min * 0.999 <= r["dt_min"] <= r["dt_max"] <= config.time_step_max * 1.001, r
    good, losses = verify_then_train(pools, tmp_path, config, fsdp=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_zamba_exact(pools, ulysses, ring):
    """Zamba (a multi-head Mamba layer, then two hybrid layers sharing one attention block), zigzag plain and with
    packed documents: each head's own x_proj, dt_proj, B and C, scanned by state passing. Zamba2 (Mamba2 layers,
    hybrid layers running two shared blocks in turn, each with its own LoRA adapters; rotary positions) the same."""
    cases = [(family, ulysses, ring, "zigzag", docs) for family in ("zamba", "zamba2") for docs in (False, True)]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        assert not _outside_rounding(r), r
        print(parity_line(r))


def _zamba_state_not_carried(lm) -> None:
    """The mutation: every rank scans Zamba's Mamba layers from zero (the state of earlier ranks dropped)."""
    from seqmesh.hf import mamba
    from seqmesh.linear_attention.selective_scan import diagonal_scan

    def from_zero(log_decay, inp, place, keep=None):
        return diagonal_scan(log_decay, inp, place.mine.segment_bounds)[0]

    for module in lm.modules():
        if mamba.is_mamba1(module):
            def dropping(*args, _forward=module.forward, **kwargs):
                kept, mamba.state_passing_diagonal_scan = mamba.state_passing_diagonal_scan, from_zero
                try:
                    return _forward(*args, **kwargs)
                finally:
                    mamba.state_passing_diagonal_scan = kept

            module.forward = dropping


def test_a_zamba_state_not_carried_is_caught(pools):
    """Seen in the gradients (each parameter's relative to its own largest): the tiny model's Mamba path reaches its
    logits through out_proj's small initial weights, so the logits move by ~1e-8 only (below float32's rounding)
    while the mixers' own gradients move by half their size."""
    r = pools.run(2, parity_cases, [("zamba", 1, 2, "zigzag", True)], alter=_zamba_state_not_carried)[0][0]
    assert r["grad"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["grad"], r
    print(f"not carried: gradients off by {r['grad']:.2e} ({r['worst']}; rounding {r['rounding']['grad']:.2e})")


@pytest.mark.parametrize("family", ["zamba", "zamba2"])
def test_a_zamba_config_json_verifies_and_trains_under_fsdp(pools, tmp_path, family):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a tiny Zamba over a ring of 2, its weights
    sharded by FSDP2: its two hybrid layers hold the same attention block's weights, so they are one FSDP unit
    (seqmesh.model.fsdp.units_of; each alone, FSDP2 refused the shared parameter); a finite, falling loss. Zamba2's
    first and third hybrid layers share a block (one unit), its second runs the other alone."""
    import math

    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config(family), fsdp=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_layers_sharing_weights_are_one_fsdp_unit():
    """units_of: each layer its own unit, but layers holding the same parameter (through the same module or through
    modules whose weights are tied) in one, in the order of their first layer."""
    import torch.nn as nn

    from seqmesh.model.fsdp import units_of

    shared, a, b = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    tied = nn.Linear(2, 2)
    tied.weight = a.weight  # another module, the same weight
    layers = [nn.Sequential(nn.Linear(2, 2)), nn.Sequential(shared, a), nn.Sequential(nn.Linear(2, 2)),
              nn.Sequential(shared), nn.Sequential(tied, b), nn.Sequential(nn.Linear(2, 2))]
    units = units_of(layers)
    assert [[layers.index(m) for m in unit] for unit in units] == [[0], [1, 3, 4], [2], [5]]


def test_a_jamba_config_json_trains_with_its_layers_recomputed(pools, tmp_path):
    """``seqmesh verify``, then ``seqmesh train --checkpointing`` on a tiny Jamba over a ring of 2: its decoder layer
    calls the Mamba mixer without seqmesh's entry, which the layer hands over; the recompute in backward runs the
    layer's forward without its hooks, and found no entry until the entry stayed until the next call."""
    import math

    import transformers as tf

    from train_job_cases import verify_then_train

    config = tf.JambaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=64, intermediate_size=64, attn_layer_period=2, attn_layer_offset=1,
                            num_experts=1, num_experts_per_tok=1, mamba_d_state=4, mamba_dt_rank=4)
    good, losses = verify_then_train(pools, tmp_path, config, checkpointing=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
