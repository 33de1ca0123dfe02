"""Mamba2 hybrids (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1) and the pure Mamba2 model through seqmesh.hf: the halo conv and the
state pass across ranks give the logits, the loss and every parameter's gradient of the unmodified model on one
process (each packed document alone), within the reference's own rounding (test_hf_families's bound)."""

from __future__ import annotations

import dataclasses

import pytest

from family_cases import family_parity, share_references
from test_hf_families import ROUNDING_MULTIPLE, _outside_rounding

FAMILIES = ["nemotron-h", "granite-4-hybrid", "bamba", "falcon-h1", "mamba2"]  # mamba2: no attention at all
MESHES = [(2, 1), (1, 2), (2, 2)]


def _run(cases: list[tuple]) -> list[dict]:
    share_references([c[:-1] for c in cases])
    return [{"case": c, **family_parity(*c[:-1], design=c[-1])} for c in cases]


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_mamba2_families_exact(pools, ulysses, ring):
    """Zigzag without documents, and with documents shorter than the conv's halo (1 token at the row's start) and
    documents crossing rank boundaries: state passing for every family on ring 2 (Granite-4 hybrid and Bamba run
    Nemotron-H's mixer code in another decoder, so the other meshes take Nemotron-H, Falcon-H1 and Mamba2); the
    all-to-all over heads for every family on U2 x R2, and contiguous with documents."""
    families = FAMILIES if (ulysses, ring) == (1, 2) else ["nemotron-h", "falcon-h1", "mamba2"]
    cases = [(f, ulysses, ring, "zigzag", docs, "state_passing") for f in families for docs in (False, True)]
    if (ulysses, ring) == (2, 2):
        cases += [(f, ulysses, ring, "zigzag", docs, "all_to_all") for f in FAMILIES for docs in (False, True)]
        cases += [("nemotron-h", ulysses, ring, "contiguous", True, "all_to_all")]
    worst = {}
    for results in pools.run(ulysses * ring, _run, cases, timeout=900):
        for r in results:
            assert not _outside_rounding(r), r
            ratios = tuple(r[k] / r["rounding"][k] for k in ("logits", "loss", "grad"))
            key = (r["case"][0], r["case"][-1])
            worst[key] = tuple(max(a, b) for a, b in zip(worst.get(key, (0.0,) * 3), ratios))
    print(f"u{ulysses}xr{ring} worst error / reference rounding (logits, loss, grad): {worst}  (bound {ROUNDING_MULTIPLE})")


def _mutant(what: str):
    """A change to the parallelized model only: ``state``: each rank's runs start from zero (no state passed);
    ``halo``: every conv halo one token short (the placement built for a conv of width K - 1); ``reset``: the
    all-to-all design's conv and state not restarted at document starts."""
    from unittest import mock

    import seqmesh.linear_attention.mamba2 as mamba2
    from seqmesh.linear_attention.decay_scan import chunk_decay_scan
    from seqmesh.linear_attention.gated_delta import segment_bounds
    from seqmesh.linear_attention.halo import halo_causal_conv, placement

    def alter(model):
        if what == "reset":
            mock.patch.object(mamba2, "segment_bounds", lambda total, cu_seqlens, seq_len: segment_bounds(
                total, None, seq_len)).start()
        elif what == "state":
            mock.patch.object(mamba2, "pass_decay_states", lambda q, k, v, g, place, keep=None: chunk_decay_scan(
                q, k, v, g, place.mine.segment_bounds)[0]).start()
        else:
            short = lambda mesh, n, kernel, **kw: placement(mesh, n, kernel=kernel - 1, **kw)  # noqa: E731
            mock.patch.object(mamba2, "placement", short).start()
            mock.patch.object(mamba2, "halo_causal_conv", lambda x, w, b, place, act: halo_causal_conv(
                x, w, b, dataclasses.replace(place, kernel=w.shape[-1]), act)).start()

    return alter


def _run_mutants(cases: list[tuple]) -> list[dict]:
    from unittest import mock

    out = []
    share_references([case for _, case in cases])
    for what, case in cases:
        try:
            design = "all_to_all" if what == "reset" else "state_passing"
            out.append({"case": (what, *case), **family_parity(*case, alter=_mutant(what), design=design)})
        finally:
            mock.patch.stopall()
    return out


def test_mutants_are_seen(pools):
    """The bound sees a state not passed between ranks and a conv halo one token short (Nemotron-H, ring 2, zigzag:
    every rank's runs continue another rank's), and a conv and state not restarted at a document's start."""
    cases = [(what, ("nemotron-h", 1, 2, "zigzag", False)) for what in ("state", "halo")]
    cases += [("reset", ("nemotron-h", 1, 2, "zigzag", True))]
    for r in pools.run(2, _run_mutants, cases, timeout=900)[0]:
        ratios = {k: r[k] / r["rounding"][k] for k in ("logits", "grad")}
        assert max(ratios.values()) > 100 * ROUNDING_MULTIPLE, r  # not a near miss
        print(f"{r['case'][0]} mutant: error / reference rounding {ratios} (logits {r['logits']:.1e}, "
              f"relative grad {r['grad']:.1e})")


def test_a_nemotron_h_config_json_verifies_and_trains_on_four_ranks(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` on a tiny Nemotron-H config.json (Mamba2, MoE, attention and MLP
    layers) over 2 x 2 Ulysses x ring with FSDP2, packed documents: the loss of the single-process model, then
    training."""
    import json
    import math

    from family_cases import family_config
    from seqmesh.training.config import TrainConfig
    from train_job_cases import run_train, run_verify

    path = tmp_path / "nemotron_h" / "config.json"
    path.parent.mkdir()
    path.write_text(family_config("nemotron-h").to_json_string())
    base = dict(model=str(path), seq_len=77, ulysses=2, ring=2, dp=1, lr=1e-2, warmup=1, log_every=1, eval_every=0,
                symbols=16)
    good = pools.run(4, run_verify, TrainConfig(**base, steps=1, out=str(tmp_path / "verify")), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    pools.run(4, run_train, TrainConfig(**base, steps=6, out=str(tmp_path / "train")))
    with open(tmp_path / "train" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("ulysses,ring,layout", [(1, 2, "zigzag"), (2, 1, "zigzag"), (1, 2, "contiguous")])
def test_each_design_sends_the_bytes_it_is_chosen_by(pools, ulysses, ring, layout):
    """One layer by each design: the busiest rank sends what ssd_design_bytes (the rule of linear_attention='auto')
    says; state passing two all-gathers (halo, states), the all-to-all two all-to-alls."""
    from mamba2_cases import HEADS, KERNEL, design_traffic
    from seqmesh.linear_attention.choice import LinearDesign
    from seqmesh.linear_attention.mamba2 import ssd_design_bytes

    seq_len = 48
    per_rank = pools.run(ulysses * ring, design_traffic, ulysses, ring, seq_len, layout)
    want = ssd_design_bytes(HEADS, KERNEL, seq_len=seq_len, batch=1, ulysses=ulysses, ring=ring, layout=layout,
                            dtype_bytes=8, state_bytes=8)
    assert max(r["state_passing"]["all_gather"] for r in per_rank) == want[LinearDesign.STATE_PASSING], per_rank
    assert max(r["all_to_all"]["all_to_all"] for r in per_rank) == want[LinearDesign.ALL_TO_ALL], per_rank
    assert all(r["state_passing"]["calls"] == 2 and r["all_to_all"]["calls"] == 2 for r in per_rank), per_rank


def test_auto_takes_state_passing_at_long_context():
    """Nemotron-H-9B-like Mamba2 layers (128 heads of 64, 8 groups of state 128, conv 4) over 8 ranks in bf16: the
    all-to-all at 4K tokens, state passing from 128K (its bytes do not grow with the sequence); state passing when
    the ranks outnumber the heads; an explicit all-to-all is refused there by the layer finder."""
    from seqmesh.linear_attention.choice import LinearDesign
    from seqmesh.linear_attention.mamba2 import SSDHeads, choose_ssd_design, ssd_design_bytes

    heads = SSDHeads(128, 64, 8, 128)
    shape = dict(batch=1, ulysses=1, ring=8, layout="zigzag", dtype_bytes=2)
    assert choose_ssd_design(heads, 4, seq_len=4096, **shape) is LinearDesign.ALL_TO_ALL
    assert choose_ssd_design(heads, 4, seq_len=131072, **shape) is LinearDesign.STATE_PASSING
    assert choose_ssd_design(heads, 4, "all_to_all", seq_len=131072, **shape) is LinearDesign.ALL_TO_ALL
    few = SSDHeads(4, 64, 1, 128)
    assert choose_ssd_design(few, 4, seq_len=4096, **shape) is LinearDesign.STATE_PASSING
    sent = ssd_design_bytes(heads, 4, seq_len=131072, **shape)
    print(f"128K on 8 ranks, per layer and rank: state passing {sent[LinearDesign.STATE_PASSING] / 1e6:.1f} MB, "
          f"all-to-all {sent[LinearDesign.ALL_TO_ALL] / 1e6:.1f} MB")


def test_tensor_parallelism_is_refused_by_name():
    """tp=2 on a Mamba2 model: refused before any work, naming the layer and tp=1 (the mixers are sequence-parallel
    only)."""
    import types

    import transformers as tf

    from family_cases import family_config
    from seqmesh.tensor_parallel.plan import check_tensor_parallel

    mesh = types.SimpleNamespace(tp=2, ulysses=1, ring=2, sp_size=2)
    with pytest.raises(ValueError, match=r"backbone.layers.0.mixer \(Mamba2Mixer\) is a Mamba2 layer.*tp=1"):
        check_tensor_parallel(tf.AutoModelForCausalLM.from_config(family_config("mamba2")), mesh)
