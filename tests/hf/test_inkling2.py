"""Inkling 2 and Inkling2-Loop (tiny, float64 with transformers' float32 parts: a sliding layer of window 6, a full
layer with dynamic convolutions on its keys and values and a relative bias 8 keys back, queries log-scaled by their
index in the document, block states after every layer; -loop: a middle layer in two passes) through
seqmesh.hf.inkling2: logits, loss and every parameter's gradient equal the unmodified transformers model on one
process (packed documents one call each), within a multiple of the reference's own rounding, on Ulysses, ring and
both; a dynamic or a static convolution without its halo, a bias one key off, another token's sink and the log scale
counted from the row's start are seen."""

from __future__ import annotations

import pytest

from family_cases import during_calls, outside_rounding, parity_cases, parity_line

pytest.importorskip("transformers.models.inkling2")  # transformers 5.24's
ROUNDING_MULTIPLE = 4


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (2, 2)], ids=["u2xr1", "u1xr2", "u2xr2"])
def test_inkling2_exact(pools, ulysses, ring):
    cases = [("inkling2", ulysses, ring, layout, docs) for layout, docs in
             (("zigzag", False), ("zigzag", True), ("contiguous", True))]
    cases += [("inkling2-loop", ulysses, ring, "zigzag", ulysses == 1)]
    for r in pools.run(ulysses * ring, parity_cases, cases)[0]:
        print(parity_line(r))
        assert not outside_rounding(r, ROUNDING_MULTIPLE), r


def _during_attention(lm, name: str, value, owner: str = "inkling2") -> None:
    """``seqmesh.hf.<owner>.<name>`` replaced by ``value(original)`` during each call of the model's attention
    (Inkling 2's attends its blocks through Inkling's ``_attend``)."""
    import importlib

    from seqmesh.hf import inkling2

    module = importlib.import_module(f"seqmesh.hf.{owner}")
    during_calls(lm, inkling2.is_attention, module, name, value(getattr(module, name)))


def _dynamic_conv_without_halo(lm) -> None:
    """The dynamic convolutions' earlier tokens from this rank's rows only (zeros where another rank's would be)."""
    import torch

    from seqmesh.hf import inkling2
    from seqmesh.linear_attention import halo

    def own_rows_only(x, place, kernel):
        rows = halo.extend(x, place).shape[1]
        own = torch.zeros(rows, dtype=x.dtype)
        own[place.mine.own] = 1.0

        def windows(extended, bounds):
            offset = torch.arange(rows)
            lags = [extended] + [torch.nn.functional.pad((extended * own[None, :, None])[:, :-lag], (0, 0, lag, 0))
                                 * (offset >= lag).to(x.dtype)[None, :, None] for lag in range(1, kernel)]
            return torch.stack(lags, dim=-1).flatten(-2)

        return halo.with_halo(x, place, windows).unflatten(-1, (x.shape[-1], kernel))

    during_calls(lm, inkling2.is_dynamic_convolution, inkling2, "lagged", own_rows_only)


def _static_conv_without_halo(lm) -> None:
    """The static short convolutions read this rank's rows only."""
    from family_cases import conv_without_halo
    from seqmesh.hf import inkling2

    def own_rows_only(module, x, place, scale):
        conv, wide = conv_without_halo(module, x, place)
        return ((conv + wide) / scale).to(x.dtype)

    during_calls(lm, inkling2.is_short_convolution, inkling2, "short_convolution", own_rows_only)


def _bias_one_key_off(lm) -> None:
    """Each query's bias read one distance further (its profile shifted by one key)."""
    import torch

    def shifted(attend):
        return lambda module, query, rel, *rest: attend(module, query, torch.roll(rel, 1, dims=-1), *rest)

    _during_attention(lm, "_attend", shifted, owner="inkling")


def _sink_of_the_next_query(lm) -> None:
    """Each query's sink logits taken from the next query of its block."""
    import torch

    def shifted(attend):
        return lambda *args: attend(*args[:-1], torch.roll(args[-1], -1, dims=1))  # sinks (B, l, Hq), last

    _during_attention(lm, "_attend", shifted, owner="inkling")


def _scale_from_the_row_start(lm) -> None:
    """The full layer's log scale (of its queries and relative states) from each query's index in the row, not in its
    document; the documents' masks untouched."""
    _during_attention(lm, "log_scale_index", lambda index: lambda starts, within: (starts + within)[None, :])


@pytest.mark.parametrize("mutation,case", [
    (_dynamic_conv_without_halo, ("inkling2", 1, 2, "zigzag", False)),
    (_static_conv_without_halo, ("inkling2", 2, 1, "zigzag", False)),
    (_bias_one_key_off, ("inkling2", 1, 2, "zigzag", False)),
    (_sink_of_the_next_query, ("inkling2", 2, 1, "zigzag", False)),
    (_scale_from_the_row_start, ("inkling2", 2, 1, "contiguous", True)),
], ids=["dynamic-conv-halo", "conv-halo", "bias", "sink", "scale"])
def test_an_inkling2_mutation_is_seen(pools, mutation, case):
    r = pools.run(2, parity_cases, [case], alter=mutation)[0][0]
    print(f"{mutation.__name__}: logits off by {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e})")
    assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_an_inkling2_config_json_verifies_and_trains(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train --model config.json`` on a ring of 2 (its soft-capped head read by the
    chunked loss): a finite, falling loss; the planner sizes it, and Inkling2-Loop."""
    import math

    from family_cases import family_config
    from seqmesh.model.presets import model_shape
    from train_job_cases import verify_then_train

    family_config("inkling2").save_pretrained(tmp_path / "plan")
    assert not model_shape(str(tmp_path / "plan")).unplanned
    family_config("inkling2-loop").save_pretrained(tmp_path / "loop")
    assert not model_shape(str(tmp_path / "loop")).unplanned

    good, losses = verify_then_train(pools, tmp_path, family_config("inkling2"))
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_inkling2_trains_in_bf16_under_fsdp(pools, tmp_path):
    """In bf16 under FSDP2 (as seqmesh train runs one GPU and more) the modules Inkling 2 keeps in float32 are
    gathered in float32: its router multiplies a float32 input by its weight, and a bf16 weight failed there."""
    import math

    from family_cases import family_config
    from seqmesh.model.fsdp import float32_modules
    from train_job_cases import train_from_config

    config = family_config("inkling2")
    import transformers

    kept = {type(m).__name__ for m in float32_modules(transformers.AutoModelForCausalLM.from_config(config))}
    assert {"Inkling2TopKRouter", "Inkling2ShortConvolution", "Inkling2BlockAttentionResidual"} <= kept, kept
    losses = train_from_config(pools, tmp_path, config, steps=3, bf16=True)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses


@pytest.mark.parametrize("family", ["inkling2", "inkling2-loop"])
def test_the_distances_seqmesh_runs_with_are_one_element_and_only_its_own(family):
    """While a model seqmesh runs goes forward, its text model hands its layers a broadcast view of one element as
    the (L, L) distances its attention would read (seqmesh's reads the row's positions; built, two were 16 GiB at
    32K tokens on a rank, kept by every checkpointed layer); the function is the family's own again after the
    forward, after a forward that raised too, and a model transformers runs alone meanwhile gets the real
    distances."""
    import sys

    import torch
    import transformers

    from family_cases import family_config
    from seqmesh.hf import inkling2

    config = family_config(family)
    torch.manual_seed(0)
    ours, theirs = (transformers.AutoModelForCausalLM.from_config(config) for _ in range(2))
    namespace = sys.modules[type(ours.model).__module__]
    original = namespace.get_relative_distance
    hooks = inkling2.unread_distances(ours.model, [ours.model.layers[0].self_attn])
    seen = []
    for model in (ours, theirs):
        model.model.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["relative_distance"]), with_kwargs=True)
    ids = torch.arange(10)[None] % config.vocab_size
    ours(input_ids=ids, use_cache=False)
    assert namespace.get_relative_distance is original
    theirs(input_ids=ids, use_cache=False)
    assert seen[0].shape == (10, 10) and seen[0].stride() == (0, 0), (seen[0].shape, seen[0].stride())
    assert torch.equal(seen[1], torch.arange(10)[:, None] - torch.arange(10)[None]), seen[1]
    with pytest.raises(Exception):
        ours(input_ids=ids, inputs_embeds=torch.zeros(1, 10, config.hidden_size), use_cache=False)
    assert namespace.get_relative_distance is original
    for hook in hooks:
        hook.remove()
    assert inkling2.unread_distances(ours.model, []) == []
