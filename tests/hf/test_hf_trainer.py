"""seqmesh's Trainer on 4 gloo ranks against plain transformers Trainer in one process.

The reference is the single-process run in float64. The tolerance comes from rounding: the same run
in float32 tells how far float32 rounding alone moves the loss curve and the weights after 10 AdamW
steps; seqmesh (float32, other summation orders) must stay within a small multiple of that. That
measurement can read 0 (the logged loss is a float32 number: both runs may round to the same one),
so it is floored at the rounding float32 cannot avoid, see :func:`_bound`.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytest.importorskip("accelerate")

from trainer_cases import (  # noqa: E402
    EVAL_ROWS, resume as resume_fn, rows_without_targets_in_step, sequence_parallel, sft, single_process,
    vision_trainer,
)

ROUNDING_MULTIPLE = 8.0
EPS32 = torch.finfo(torch.float32).eps
STEPS = 10
WORLD = 4


def _bound(rounding: float, magnitude: float, terms: int) -> float:
    """How far seqmesh may be from the float64 run: ``ROUNDING_MULTIPLE`` times the measured float32
    rounding ``rounding`` (float32 vs float64 in one process, one summation order: other orders round
    differently, hence the multiple), and never less than ``EPS32 * magnitude * terms``.

    The floor: seqmesh adds ``terms`` partial sums (one per rank and micro-batch, for the loss and for
    every gradient entry; a weight adds one rounded update per optimizer step) in another order than
    one device; reordering a float32 sum of ``terms`` terms of total size ``magnitude`` moves it by up
    to ``terms`` roundings of ``EPS32 * magnitude``. It is a worst case, so it takes no multiple. For
    the loss it is ~11 float32 units of the value (5e-6), while a target left out of the count moves
    the loss by ``magnitude / targets`` (~3e-2 here).
    """
    return max(ROUNDING_MULTIPLE * rounding, EPS32 * magnitude * terms)


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def _weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_matches_reference(ours: dict, weights: dict, ref32: dict, ref64: dict, accumulation: int,
                              eval_batches: int) -> None:
    """Loss and gradient-norm curves, final weights and evaluation loss within :func:`_bound` of the
    float64 single-process run (``WORLD`` ranks; ``eval_batches`` batches of the evaluation rows)."""
    for key in ("loss", "grad_norm"):
        rounding = _max_diff(ref32[key], ref64[key])
        bound = _bound(rounding, max(abs(x) for x in ref64[key]), WORLD * accumulation)
        diff = _max_diff(ours[key], ref64[key])
        assert diff <= bound, (key, diff, bound, rounding, ours[key], ref64[key])
    rounding = _weight_diff(ref32["weights"], ref64["weights"])
    bound = _bound(rounding, max(float(w.abs().max()) for w in ref64["weights"].values()), STEPS)
    diff = _weight_diff(weights, ref64["weights"])
    assert diff <= bound, ("weights", diff, bound, rounding)
    rounding = abs(ref32["eval_loss"] - ref64["eval_loss"])
    bound = _bound(rounding, abs(ref64["eval_loss"]), WORLD * eval_batches)
    diff = abs(ours["eval_loss"] - ref64["eval_loss"])
    assert diff <= bound, ("eval_loss", diff, bound, rounding)


def _saved_weights(folder: str) -> dict:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    return {k: v.to(torch.float64) for k, v in saved.state_dict().items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs (float32 and float64), keyed by (batch, accumulation)."""
    cache: dict = {}

    def get(batch: int, accumulation: int, family: str = "llama") -> tuple[dict, dict]:
        if (batch, accumulation, family) not in cache:
            out = str(tmp_path_factory.mktemp("single"))
            cache[batch, accumulation, family] = tuple(single_process(out, batch, accumulation, dtype, family=family)
                                                       for dtype in (torch.float32, torch.float64))
        return cache[batch, accumulation, family]

    return get


# (ulysses, ring, tp, per-rank batch, accumulation, seqmesh_plan's fields or None): the single-process batch is dp x
# the per-rank batch, so every case shares one reference (4 rows x 2 micro-batches a step). Both run under the
# TrainingArguments' activation checkpointing; the second through a plan keeping the attention outputs, with the tiled
# MLP and the lean RMSNorm. Data parallelism 2 x Ulysses 2 runs without checkpointing in
# test_trainer_step_without_targets_matches_single_process and the experts' test (a case of it here reached no line of
# seqmesh they do not: docs/testing.md)
KEPT_PLAN = {"checkpointing": True, "keep_attention": True, "tiled_mlp": True, "efficient_norm": True}
CASES = [
    pytest.param(2, 1, 2, 4, 2, None, id="u2tp2-checkpointed"),
    pytest.param(2, 2, 1, 4, 2, KEPT_PLAN, id="u2r2-checkpointed-kept-tiled"),
]


@pytest.mark.parametrize("ulysses, ring, tp, batch, accumulation, plan", CASES)
def test_trainer_matches_single_process(pools, references, tmp_path, ulysses, ring, tp, batch, accumulation, plan):
    """seqmesh's Trainer under the TrainingArguments' checkpointing logs the curves, and ends with the weights and
    evaluation loss, of plain Trainer on one process; the attention's forward runs twice a layer and micro-batch
    (forward, then the recompute), once where the layers keep its outputs (the Trainer enables checkpointing again
    when it starts: seqmesh's context must survive that)."""
    from trainer_cases import checkpointing_args, tiny_model

    keep = bool(plan and plan["keep_attention"])
    dp = WORLD // (ulysses * ring * tp)
    ref32, ref64 = references(dp * batch, accumulation)
    results = pools.run(WORLD, sequence_parallel, str(tmp_path), ulysses, ring, batch, accumulation, tp=tp, plan=plan,
                        **checkpointing_args(), timeout=600)
    for r in results[1:]:  # every rank logs the same values
        assert r == results[0]
    ours = results[0]
    weights = _saved_weights(os.path.join(tmp_path, "final"))
    _assert_matches_reference(ours, weights, ref32, ref64, accumulation, -(-len(EVAL_ROWS) // (dp * batch)))
    micro_batches = len(ours["loss"]) * accumulation
    assert ours["shard_calls"] == micro_batches, ours  # each micro-batch cut once, not twice
    layers = tiny_model().config.num_hidden_layers
    assert ours["attention_calls"] == (1 if keep else 2) * layers * micro_batches, ours
    assert (ours["tiled_mlps"], ours["lean_norms"] > 0) == ((layers, True) if plan else (0, False)), ours
    print(f"parity {ulysses=} {ring=} {tp=} {dp=} vs float64 single process: loss {_max_diff(ours['loss'], ref64['loss']):.2e}, "
          f"grad_norm {_max_diff(ours['grad_norm'], ref64['grad_norm']):.2e}, weights "
          f"{_weight_diff(weights, ref64['weights']):.2e}; float32 rounding (float32 vs float64 single process): "
          f"loss {_max_diff(ref32['loss'], ref64['loss']):.2e}, grad_norm "
          f"{_max_diff(ref32['grad_norm'], ref64['grad_norm']):.2e}, "
          f"weights {_weight_diff(ref32['weights'], ref64['weights']):.2e}")


def test_trainer_with_experts_split_matches_single_process(pools, references, tmp_path):
    """A Qwen3-MoE whose loss adds its routers' load-balancing term (coefficient 0.5), 2 data-parallel x Ulysses 2,
    2 micro-batches a step, with ``seqmesh_ep=2`` (its 4 experts split over pairs of ranks, FSDP2 over the ranks that
    hold the same ones; clipped by the norm over both meshes): the curves, final weights and evaluation loss of
    transformers' Trainer on one process, which divides the cross-entropy by the step's targets and adds each
    micro-batch's router term as it is. (The same model without ``seqmesh_ep`` reached no line of seqmesh this
    does not: docs/testing.md.)"""
    ulysses, ring, batch, accumulation = 2, 1, 2, 2
    dp = WORLD // (ulysses * ring)
    ref32, ref64 = references(dp * batch, accumulation, "qwen3_moe")
    results = pools.run(WORLD, sequence_parallel, str(tmp_path), ulysses, ring, batch, accumulation, family="qwen3_moe",
                        ep=2, timeout=600)
    for r in results[1:]:
        assert r == results[0]
    weights = _saved_weights(os.path.join(tmp_path, "final"))
    _assert_matches_reference(results[0], weights, ref32, ref64, accumulation, -(-len(EVAL_ROWS) // (dp * batch)))


def test_trainer_step_without_targets_matches_single_process(pools, tmp_path):
    """Optimizer steps whose labels are all -100 (rows read in order: the third step of each of the
    two epochs): plain Trainer logs loss 0 and gradient norm 0 there and trains on. seqmesh's Trainer
    (dp 2 x ulysses 2, 2 micro-batches a step) must log exactly 0 too (not NaN, which Trainer's
    logging_nan_inf_filter would hide behind the running mean), not stop dividing by zero targets,
    and log the single-process curve and end with its weights within the parity bound."""
    step, batch, accumulation = 2, 2, 2
    rows_per_step = 2 * batch * accumulation
    rows = rows_without_targets_in_step(step, rows_per_step)
    unscored = {step, step + len(rows) // rows_per_step}
    ref32, ref64 = (single_process(str(tmp_path / str(dtype)), 2 * batch, accumulation, dtype, rows,
                                   train_sampling_strategy="sequential") for dtype in (torch.float32, torch.float64))
    results = pools.run(WORLD, sequence_parallel, str(tmp_path / "sp"), 2, 1, batch, accumulation, rows,
                        train_sampling_strategy="sequential", timeout=600)
    for r in results[1:]:
        assert r == results[0]
    ours = results[0]
    for run in (ref64, ours):
        assert [i for i, x in enumerate(run["loss"]) if x == 0.0] == sorted(unscored), run["loss"]
        assert [i for i, x in enumerate(run["grad_norm"]) if x == 0.0] == sorted(unscored), run["grad_norm"]
    weights = _saved_weights(os.path.join(tmp_path, "sp", "final"))
    assert all(bool(w.isfinite().all()) for w in weights.values())
    _assert_matches_reference(ours, weights, ref32, ref64, accumulation, len(EVAL_ROWS) // (2 * batch))


def test_trainer_resumes_the_same_curve(pools, tmp_path):
    """A checkpoint at step 5 (weights as a transformers folder, optimizer shards, scheduler, RNG, data
    position), resumed by a fresh Trainer: steps 6-10 log what the uninterrupted run logged."""
    runs = pools.run(4, resume_fn, str(tmp_path), 2, 1, timeout=600)[0]
    straight, resumed = runs["straight"], runs["resumed"]
    assert straight["steps_run"] == 10 and resumed["steps_run"] == 5, runs
    for key in ("loss", "grad_norm"):
        assert len(straight[key]) == len(resumed[key]) == STEPS, runs
        assert max(abs(a - b) for a, b in zip(straight[key][5:], resumed[key][5:])) < 1e-6, (key, runs)


def test_sft_trainer_subclass_matches_single_process(pools, tmp_path):
    """The mixin before TRL's SFTTrainer (its dataset preparation and collator): U2 x R2 logs the
    curve of plain SFTTrainer in one process (float32 rounding measured above: ~5e-7 on the loss)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    reference = sft(str(tmp_path / "single"))
    ours = pools.run(4, sft, str(tmp_path / "sp"), 2, 2, timeout=600)[0]
    for key, bound in (("loss", 5e-6), ("grad_norm", 5e-6)):
        assert _max_diff(ours[key], reference[key]) <= bound, (key, ours[key], reference[key])


def test_trainer_refuses_missing_degrees_and_missing_process_group(tmp_path):
    from seqmesh.trainer import SequenceParallelTrainer
    from trainer_cases import TRAIN_ROWS, tiny_model, training_args

    args = training_args(str(tmp_path), 2, 1)
    with pytest.raises(ValueError, match="seqmesh_degrees"):
        SequenceParallelTrainer(model=tiny_model(), args=args, train_dataset=TRAIN_ROWS)
    with pytest.raises(ValueError, match="torchrun"):  # this pytest process has no process group
        SequenceParallelTrainer(model=tiny_model(), args=args, train_dataset=TRAIN_ROWS, seqmesh_degrees=(2, 1))


def test_trainer_refuses_keeping_attention_it_cannot_keep(tmp_path):
    """seqmesh_keep_attention without the TrainingArguments' checkpointing, or with checkpoint kwargs torch cannot give
    seqmesh's context to (reentrant, debug, a context of the user's own), and checkpointing a model transformers
    cannot checkpoint: each refused by name, naming the TrainingArguments' field, before the process group is needed
    (this pytest process has none)."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    from seqmesh.trainer import SequenceParallelTrainer
    from trainer_cases import TRAIN_ROWS, checkpointing_args, tiny_model, training_args

    (name, _), = checkpointing_args().items()
    on = {name: True}
    cases = [({}, f"set {name}=True"),
             ({**on, f"{name}_kwargs": {"use_reentrant": True}}, "use_reentrant=True"),
             ({**on, f"{name}_kwargs": {"use_reentrant": False, "debug": True}}, "debug=True"),
             ({**on, f"{name}_kwargs": {"use_reentrant": False, "context_fn": contextlib.nullcontext}},
              f"already give a context_fn .* {name}_kwargs")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            SequenceParallelTrainer(model=tiny_model(), args=training_args(str(tmp_path), 2, 1, **extra),
                                    train_dataset=TRAIN_ROWS, seqmesh_degrees=(2, 1), seqmesh_keep_attention=True)
    gpt = OpenAIGPTLMHeadModel(OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match=f"OpenAIGPTLMHeadModel cannot be checkpointed .* set {name}=False"):
        SequenceParallelTrainer(model=gpt, args=training_args(str(tmp_path), 2, 1, **on), train_dataset=TRAIN_ROWS,
                                seqmesh_degrees=(2, 1))


def test_trainer_refuses_a_plan_it_does_not_run_or_that_contradicts_its_arguments(tmp_path):
    """seqmesh_plan: beside the shorthands it replaces, with a setting the Trainer does not run, or asking for bf16 or
    checkpointing the TrainingArguments do not: refused by name before any work; every field of ParallelPlan is one
    the Trainer takes, one the mesh or the TrainingArguments set, or one it refuses."""
    from dataclasses import fields

    from seqmesh.compose import ParallelPlan
    from seqmesh.trainer import NOT_IN_TRAINER, TRAINER_PLAN_MESH, TRAINER_PLAN_SETTINGS, SequenceParallelTrainer
    from trainer_cases import TRAIN_ROWS, checkpointing_args, tiny_model, training_args

    placed = set(TRAINER_PLAN_SETTINGS) | set(NOT_IN_TRAINER) | set(TRAINER_PLAN_MESH) | {"bf16", "checkpointing"}
    assert {f.name for f in fields(ParallelPlan)} == placed
    (name, _), = checkpointing_args().items()
    cases = [({}, dict(seqmesh_plan=ParallelPlan(), seqmesh_chunk=512), "put loss_chunk inside the plan"),
             ({name: True}, dict(seqmesh_plan=ParallelPlan(checkpointing=True, offload_checkpoints=True)),
              "offload_checkpoints=True: the Trainer's step is its own"),
             ({}, dict(seqmesh_plan=ParallelPlan(compile=True)), "compile=True"),
             ({}, dict(seqmesh_plan=ParallelPlan(fsdp=False)), "fsdp=False"),
             ({}, dict(seqmesh_plan=ParallelPlan(checkpointing=True)), f"set {name}=True there"),
             ({}, dict(seqmesh_plan=ParallelPlan(bf16=True)), "set bf16=True there"),
             ({}, dict(seqmesh_plan=ParallelPlan(checkpointing=True, keep_attention=True)), f"set {name}=True in")]
    for extra, given, message in cases:
        with pytest.raises(ValueError, match=message):
            SequenceParallelTrainer(model=tiny_model(), args=training_args(str(tmp_path), 2, 1, **extra),
                                    train_dataset=TRAIN_ROWS, seqmesh_degrees=(2, 1), **given)


def test_trainer_refuses_keeping_beside_trl_selective_checkpointing(tmp_path):
    """TRL's selective checkpointing keeps the attention through its own context_fn (and takes its flag out of the
    kwargs as SFTTrainer starts): with seqmesh_keep_attention, refused by name at construction, not when training
    begins."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from seqmesh.trainer import SequenceParallelTrainerMixin
    from trainer_cases import TRAIN_ROWS, byte_tokenizer, tiny_model

    class SequenceParallelSFTTrainer(SequenceParallelTrainerMixin, SFTTrainer):
        pass

    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                     bf16=False, max_length=None, gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": False, "selective": True})
    with pytest.raises(ValueError, match="TRL's selective checkpointing"):
        SequenceParallelSFTTrainer(model=tiny_model(), args=args, processing_class=byte_tokenizer(),
                                   train_dataset=Dataset.from_list([{"input_ids": r["input_ids"]} for r in TRAIN_ROWS]),
                                   seqmesh_degrees=(2, 1), seqmesh_keep_attention=True)


def test_trainer_refuses_an_accelerator_that_scales_the_loss_again(monkeypatch, tmp_path):
    """transformers 5.3-5.5.3 left accelerate's gradient_accumulation_steps at the TrainingArguments'
    value, so accelerator.backward divided seqmesh's weighted loss again; emulated here, it is refused."""
    from transformers import Trainer

    from seqmesh.trainer import SequenceParallelTrainer
    from trainer_cases import TRAIN_ROWS, tiny_model, training_args

    create = Trainer.create_accelerator_and_postprocess

    def accumulating_accelerator(self):
        create(self)
        self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps

    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", accumulating_accelerator)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        SequenceParallelTrainer(model=tiny_model(), args=training_args(str(tmp_path), 2, 2), train_dataset=TRAIN_ROWS,
                                seqmesh_degrees=(2, 1))


def test_trainer_trains_a_vision_language_model(pools, tmp_path):
    """A tiny Qwen2.5-VL through seqmesh's Trainer on ring 2 (tower and sequence sharded): the loss and
    gradient-norm curves of 4 steps equal plain Trainer's on one process, within float32's rounding
    (the float32 single-process run against the float64 one, 4x)."""
    ref32 = vision_trainer(str(tmp_path / "r32"), dtype=torch.float32)
    ref64 = vision_trainer(str(tmp_path / "r64"), dtype=torch.float64)
    ours = pools.run(2, vision_trainer, str(tmp_path / "sp"), 1, 2)[0]
    for key in ("loss", "grad_norm"):
        assert len(ours[key]) == len(ref64[key]) == 4, (ours, ref64)
        diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
        rounding = diff(ref32[key], ref64[key])
        bound = _bound(rounding, max(abs(x) for x in ref64[key]), 2)
        assert diff(ours[key], ref64[key]) <= bound, (key, ours[key], ref64[key], bound)
