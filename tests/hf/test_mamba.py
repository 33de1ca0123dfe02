"""Jamba (a Mamba v1 layer, then attention with a small MoE; tiny, float64) through seqmesh.hf: logits and every
parameter's gradient equal the unmodified transformers model on one process (packed documents one call each),
within a multiple of the reference's own rounding (family_cases.reference_rounding); and a state not reset at a
document start is caught."""

from __future__ import annotations

import pytest

from family_cases import family_parity, share_references

# the reference rounds x, B and A to float32 inside its float64 scan (``.float()``), so its rounding is float32's
ROUNDING_MULTIPLE = 4
MESHES = [(2, 1), (1, 2)]  # U2 x R2 reached no line they do not (docs/testing.md)


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    share_references(cases, kwargs.get("seq_len", 45))
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_jamba_exact(pools, ulysses, ring):
    """Zigzag plain and with packed documents, on one mesh, in one pools.run call."""
    cases = [("jamba", ulysses, ring, "zigzag", docs) for docs in (False, True)]
    for r in pools.run(ulysses * ring, _run_all, cases)[0]:
        assert not _outside_rounding(r), r
        print(f"u{ulysses}xr{ring} {r['case']}: logits {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e}), "
              f"grad {r['grad']:.2e} (rounding {r['rounding']['grad']:.2e})")


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
    r = pools.run(2, _run_all, [("jamba", 2, 1, "zigzag", True)], alter=_no_reset_at_documents)[0][0]
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
    the backbone) carries it (one pre-hook and one hook); unparallelize's uninstall deletes the forwards."""
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
        assert hooked == [carrier] and len(handles) == 2, (hooked, handles)
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
        for r in pools.run(ulysses * ring, _run_all, cases)[0]:
            assert not _outside_rounding(r), r
            print(f"u{ulysses}xr{ring} {r['case']}: logits {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e}), "
                  f"grad {r['grad']:.2e} (rounding {r['rounding']['grad']:.2e})")
