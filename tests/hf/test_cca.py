"""ZAYA (Compressed Convolutional Attention: q and k convolved over earlier tokens, half of each value from the
previous token; a sliding layer, then a full one; tiny, float64) through seqmesh.hf: logits and every parameter's
gradient equal the unmodified transformers model on one process (packed documents one call each), within a multiple
of the reference's own rounding; and a projection run without the rows other ranks hold is caught."""

from __future__ import annotations

import pytest

from family_cases import outside_rounding, parity_cases, parity_line

ROUNDING_MULTIPLE = 4
MESHES = [(2, 1), (1, 2)]


def _outside_rounding(r: dict) -> list[str]:
    return outside_rounding(r, ROUNDING_MULTIPLE)


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_zaya_exact(pools, ulysses, ring):
    """Zigzag plain and with packed documents, on one mesh, in one pools.run call."""
    cases = [("zaya", ulysses, ring, "zigzag", docs) for docs in (False, True)]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        print(parity_line(r))
        assert not _outside_rounding(r), r


def test_zaya_exact_on_the_2d_mesh(pools):
    r = pools.run(4, parity_cases, [("zaya", 2, 2, "zigzag", True)])[0][0]
    print(parity_line(r))
    assert not _outside_rounding(r), r


def _without_halo(lm) -> None:
    """The mutation: each rank convolves q | k and delays v over its own rows only (zeros, or the projected zeros,
    where another rank's rows belong)."""
    from seqmesh.hf import cca

    def own_rows(x, place, causal):
        return causal(x, place.mine.segment_bounds)

    for module in lm.modules():
        if cca.is_cca(module):
            def local(*args, _forward=module.forward, **kwargs):
                kept, cca.halo.with_halo = cca.halo.with_halo, own_rows
                try:
                    return _forward(*args, **kwargs)
                finally:
                    cca.halo.with_halo = kept

            module.forward = local


def test_a_projection_without_its_halo_is_caught(pools):
    r = pools.run(2, parity_cases, [("zaya", 1, 2, "zigzag", True)], alter=_without_halo)[0][0]
    print(f"without the halo: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


@pytest.mark.parametrize("family,find,words", [("zaya", "cca.cca_layers", "grouped conv"),
                                               ("recurrent_gemma", "rg_lru.rg_lru_layers", "block-diagonal gates")])
def test_tensor_parallelism_is_refused_by_name(family, find, words):
    """ZAYA's CCA projection and RecurrentGemma's RG-LRU block under tp=2: a ValueError naming the first layer, what
    seqmesh does not split and the fix, before anything changes; at tp=1 the layers are found."""
    import types

    import torch
    import transformers as tf

    from family_cases import family_config
    from seqmesh.hf import cca, rg_lru

    module, name = find.split(".")
    layers_of = getattr({"cca": cca, "rg_lru": rg_lru}[module], name)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(family_config(family))
    assert layers_of(model, types.SimpleNamespace(tp=1))
    with pytest.raises(ValueError, match=rf"model\.layers\.0\..*{words}.*tp=1"):
        layers_of(model, types.SimpleNamespace(tp=2))
