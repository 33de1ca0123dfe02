"""seqmesh train / verify: curves that resume exactly, checkpoints that survive interruption, errors
before any work."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from seqmesh.training.checkpoint import latest_checkpoint
from seqmesh.training.config import TrainConfig
from seqmesh.rules.degrees import resolve_degrees
from train_job_cases import entry_error, run_train, run_verify, run_verify_with_a_bug


def _records(folder, kind: str) -> list[tuple[int, float]]:
    """(step, value) of every ``kind`` record, in file order."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [(r["step"], r["loss" if kind == "train" else "accuracy"]) for r in map(json.loads, f) if r["kind"] == kind]


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", seq_len=96, ulysses=2, ring=2, dp=1, steps=6, lr=1e-2, warmup=2, log_every=1,
                eval_every=3, out=str(out), symbols=16)
    base.update(kw)
    return TrainConfig(**base)


def test_resume_continues_the_same_loss_curve(pools, tmp_path):
    straight = _cfg(tmp_path / "straight", save_every=3)
    pools.run(4, run_train, straight)
    split = tmp_path / "split"
    # a run of 5 steps (another lr schedule) logs steps 1-5, then dies before its checkpoint at 5 is named:
    # latest still names step 3, and the metrics hold steps 4 and 5 that the resumed run redoes
    pools.run(4, run_train, _cfg(split, steps=5, save_every=3))
    stale = _records(split, "train")
    shutil.rmtree(split / "checkpoints" / "step_0000005")
    (split / "checkpoints" / "latest").write_text("step_0000003")
    # an interrupted save must not be picked up: leave a half-written later checkpoint behind
    os.makedirs(split / "checkpoints" / "step_0000004.partial")
    summary = pools.run(4, run_train, _cfg(split, resume=True))[0]
    want, got = _records(tmp_path / "straight", "train"), _records(split, "train")
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6], got  # no repeated or backwards steps
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6), (want, got)
    assert stale[4][1] != pytest.approx(want[4][1], abs=1e-6)  # so a stale step 5 left behind would show
    evals, want_evals = _records(split, "eval"), _records(tmp_path / "straight", "eval")
    assert [s for s, _ in evals] == [s for s, _ in want_evals] == [3, 6], evals  # the dead run's eval at 5 is gone
    assert [a for _, a in evals] == pytest.approx([a for _, a in want_evals], abs=1e-9)
    assert latest_checkpoint(str(split / "checkpoints")).endswith("step_0000006")
    assert summary["loss_curve"] and os.path.getsize(summary["loss_curve"]) > 1000


def _config_records(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "config"]


def _back_to_step_3(source, target) -> None:
    """A copy of the finished run in ``source`` whose newest checkpoint is step 3 and that has no export."""
    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step_0000006")
    shutil.rmtree(target / "model")
    (target / "checkpoints" / "latest").write_text("step_0000003")


def _weights(folder) -> dict:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).named_parameters())


def test_one_process_trains_without_fsdp_and_its_checkpoints_resume_export_and_move_to_two_ranks(pools, tmp_path):
    """``seqmesh train`` on one process (no --fsdp) keeps whole weights; its step-3 checkpoint resumes
    on one process to the same curve and export, exports through ``seqmesh export``, and resumes on two
    ranks under FSDP2 (torch.distributed.checkpoint reshards the whole tensors) to the same curve."""
    from seqmesh.tools.cli import main

    one = dict(ulysses=1, ring=1, dp=1, save_every=3)
    straight = tmp_path / "straight"
    pools.run(1, run_train, _cfg(straight, **one))
    assert [r["fsdp"] for r in _config_records(straight)] == [False]
    want, exported = _records(straight, "train"), _weights(straight / "model")

    resumed = tmp_path / "resumed"
    _back_to_step_3(straight, resumed)
    pools.run(1, run_train, _cfg(resumed, resume=True, **one))
    assert [r["step"] for r in _config_records(resumed)] == [0, 3]
    assert _records(resumed, "train") == want  # the same process, the same ops: exactly
    again = _weights(resumed / "model")
    assert all(torch.equal(again[n], p) for n, p in exported.items())

    cli = tmp_path / "cli"
    assert main(["export", str(straight / "checkpoints" / "step_0000006"), str(cli)]) == 0
    from_checkpoint = _weights(cli)
    assert all(torch.equal(from_checkpoint[n], p) for n, p in exported.items())

    moved = tmp_path / "moved"
    _back_to_step_3(straight, moved)
    pools.run(2, run_train, _cfg(moved, resume=True, ulysses=2, ring=1, dp=1, save_every=3))
    assert [(r["step"], r["fsdp"]) for r in _config_records(moved)] == [(0, False), (3, True)]  # from step 3
    got = _records(moved, "train")
    print(f"\none process, then two ranks from its step 3: largest loss difference "
          f"{max(abs(a - b) for (_, a), (_, b) in zip(got, want)):.1e}")
    assert [s for s, _ in got] == [s for s, _ in want]
    # steps 4-6 on two sequence shards: float32 rounding of another summation order (measured 2.4e-7)
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-5, rel=0), (want, got)
    moved_weights = _weights(moved / "model")
    assert max(float((moved_weights[n] - p).abs().max()) for n, p in exported.items()) < 1e-5


def test_one_process_bf16_autocast_trains_like_fsdp_bf16(pools, tmp_path):
    """--bf16 on one process without FSDP is autocast: the default of ``seqmesh train --bf16`` on one GPU, where an
    H100 run first met transformers' rotary leaving q and k in fp32 beside a bf16 v. Its loss curve stays as close
    to the fp32 run's as FSDP2's bf16 (parameters in bf16) does: 3x that run's largest distance, measured here."""
    one = dict(ulysses=1, ring=1, dp=1, eval_every=0)
    curves = {}
    for name, kw in {"fp32": {}, "autocast": dict(bf16=True, fsdp=False), "fsdp_bf16": dict(bf16=True, fsdp=True)}.items():
        pools.run(1, run_train, _cfg(tmp_path / name, **one, **kw))
        curves[name] = [v for _, v in _records(tmp_path / name, "train")]
    assert [r["fsdp"] for r in _config_records(tmp_path / "autocast")] == [False]
    noise = max(abs(a - b) for a, b in zip(curves["fsdp_bf16"], curves["fp32"]))
    gap = max(abs(a - b) for a, b in zip(curves["autocast"], curves["fp32"]))
    print(f"\nbf16 against fp32, largest loss distance: autocast {gap:.1e}, FSDP2 bf16 {noise:.1e}")
    assert 0 < gap <= 3 * noise, curves


def test_tensor_parallel_trains_resumes_on_another_tp_and_loads_its_export(pools, tmp_path):
    """``seqmesh train --tp 2 --ulysses 2`` on 4 ranks: the curve of the same run without TP (Ulysses 2 x ring 2,
    the same batches); its step-3 checkpoint resumes without TP (torch.distributed.checkpoint reshards the
    FSDP-over-TP shards) to the same curve; its export is a transformers folder with the same weights, which a
    TP run then reads shard by shard and verifies against one process."""
    tp = dict(ulysses=2, ring=1, dp=1, tp=2, save_every=3)
    straight = tmp_path / "tp"
    pools.run(4, run_train, _cfg(straight, **tp))
    plain = tmp_path / "plain"
    pools.run(4, run_train, _cfg(plain, save_every=3))
    want, got = _records(plain, "train"), _records(straight, "train")
    resumed = tmp_path / "resumed"
    _back_to_step_3(straight, resumed)
    pools.run(4, run_train, _cfg(resumed, resume=True, save_every=3))  # U2 x R2, no TP, from the TP checkpoint
    again = _records(resumed, "train")
    print(f"\nTP 2 x U2 against U2 x R2: largest loss difference {max(abs(a - b) for (_, a), (_, b) in zip(got, want)):.1e}; "
          f"resumed without TP: {max(abs(a - b) for (_, a), (_, b) in zip(again, got)):.1e}")
    # another split of the same float32 sums (measured: 2.4e-7 between layouts, test above; here below 1e-6)
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-5, rel=0), (want, got)
    assert [s for s, _ in again] == [s for s, _ in got]
    assert [v for _, v in again] == pytest.approx([v for _, v in got], abs=1e-5, rel=0), (got, again)
    ours, theirs = _weights(straight / "model"), _weights(plain / "model")
    assert max(float((ours[n] - p).abs().max()) for n, p in theirs.items()) < 1e-5
    report = pools.run(4, run_verify, _cfg(tmp_path / "verify", model=str(straight / "model"), **tp), None)[0]
    assert report["ok"], (report["worst"], report["allowed"])


def test_evaluation_does_not_wait_for_logging(pools, tmp_path):
    """Evaluations at their own steps, whatever the logging interval (a ring of 2: the schedule is the job's, not the
    mesh's)."""
    summary = pools.run(2, run_train, _cfg(tmp_path, ulysses=1, steps=5, log_every=4, eval_every=2))[0]
    assert [s for s, _ in _records(tmp_path, "train")] == [4, 5]
    assert [s for s, _ in _records(tmp_path, "eval")] == [2, 4, 5]
    assert summary["accuracy"] == _records(tmp_path, "eval")[-1][1]


def test_local_text_trains_on_a_tiny_preset(pools, tmp_path):
    """The default byte tokenizer (256 tokens) on llama-tiny; documents longer than a row are split."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {d}, naïve café ÿ: " + "the quick brown fox jumps over the lazy dog. " * (d % 4 + 1)
                                    for d in range(12)), encoding="utf-8")
    summary = pools.run(4, run_train, _cfg(tmp_path / "run", data=[str(corpus)], steps=3, eval_every=0))[0]
    losses = [v for _, v in _records(tmp_path / "run", "train")]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
    assert 0 <= summary["accuracy"] <= 1


def test_verify_passes_and_fails_loudly(pools, tmp_path):
    cfg = _cfg(tmp_path, seq_len=77, ulysses=2, ring=1, dp=2)
    good = pools.run(4, run_verify, cfg, None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5 and good["worst"][0][1] < 1e-4, good
    bug = pools.run(4, run_verify_with_a_bug, cfg)[0]
    assert not bug["ok"] and bug["worst"][0][1] > 0.1, bug  # an off-by-one in the labels is caught


@pytest.mark.parametrize("change,message", [
    (dict(ulysses=4, ring=1, dp=1, model="qwen3-tiny", seq_len=3, data=["{tmp}/a.txt"]),  # text: no copy-task minimum
     "seq_len=3 is smaller than the sequence degree 4"),
    (dict(seq_len=6), "the copy task needs at least 8 tokens, got seq_len=6"),
    (dict(ulysses=3, ring="auto", dp=1), "ulysses=3 x ring=1 = 3 but the sequence group has 4 ranks"),
    (dict(data=["/nonexistent/corpus.jsonl"]), "data file '/nonexistent/corpus.jsonl' does not exist"),
    (dict(tokenizer="/nonexistent/tok"), "tokenizer directory '/nonexistent/tok' does not exist"),
    (dict(model="gpt-9"), "unknown model 'gpt-9': not a preset"),
    (dict(symbols=600), "the copy task uses 603 tokens (600 symbols + 3 reserved) but the model's vocabulary has 256"),
    (dict(data=["{tmp}/a.txt"], tokenizer="{tmp}"), "no tokenizer could be loaded from"),  # a folder, no tokenizer
    (dict(model="{tmp}/bad.json"), "bad.json, line 1, column 2, is not valid JSON"),
    (dict(model="{tmp}/odd.json", ulysses=1, ring=1, dp=1, tp=4),
     "tp=4 does not fit the model's MLP intermediate size (intermediate_size) = 130"),
    # tp at or above the heads: "max() arg is an empty sequence", "has 0 query heads ... use one of: ." and "has 1
    # query heads" of a 2-head model, before
    (dict(model="{tmp}/two_heads.json", ulysses="auto", ring="auto", dp=1, tp=4),
     "tp=4 is more than the model's 2 query heads (num_attention_heads): each tensor-parallel rank holds whole heads, "
     "at least one. Degrees that fit the model: 1, 2."),
    (dict(model="{tmp}/two_heads.json", ulysses=2, ring=1, dp=1, tp=2),
     "tp=2 x ulysses=2 needs at least one query head per rank, but the model has 2 query heads: each tensor-parallel "
     "rank keeps 1 and Ulysses deals them over 2 ranks. Lower ulysses to 1 or less"),
    (dict(model="{tmp}/two_heads.json", ulysses="auto", ring=1, dp=1, tp=2),  # ulysses = 2: the ring takes 1 rank
     "tp=2 x ulysses=2 needs at least one query head per rank"),
    (dict(model="{tmp}/no_layers.json"), "no_layers.json: num_hidden_layers = 0: the number of decoder layers must be "
                                         "at least 1"),  # it trained, and exited 0
])
@pytest.mark.parametrize("entry", ["train", "verify"])
def test_bad_configuration_fails_before_any_work(pools, tmp_path, change, message, entry):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "bad.json").write_text("{oops")
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
    for name, changes in (("odd", {"intermediate_size": 130}), ("two_heads", {"num_attention_heads": 2}),
                          ("no_layers", {"num_hidden_layers": 0})):
        (tmp_path / f"{name}.json").write_text(json.dumps({**llama, **changes}))
    at_tmp = lambda v: [at_tmp(x) for x in v] if isinstance(v, list) else v.format(tmp=tmp_path) if isinstance(v, str) else v  # noqa: E731
    errors = pools.run(4, entry_error, entry, _cfg(tmp_path, **{k: at_tmp(v) for k, v in change.items()}))
    assert all(message in e for e in errors), errors


def test_degrees_auto_and_errors():
    auto = TrainConfig(ulysses="auto", ring="auto", dp="auto").degrees()
    assert resolve_degrees(16, **auto, q_heads=32, ranks_per_node=8) == (8, 2, 1)  # Ulysses fills a node, the ring crosses nodes
    assert resolve_degrees(16, **auto, q_heads=4, ranks_per_node=8) == (4, 4, 1)  # no more Ulysses ranks than query heads
    assert resolve_degrees(8, **TrainConfig(ulysses=2, ring=2).degrees(), q_heads=4) == (2, 2, 2)  # dp takes the rest
    assert resolve_degrees(8, ulysses=2, ring=2) == (2, 2, 2)  # as the Trainer asks: no heads known yet
    with pytest.raises(ValueError, match="too few for ulysses=8; with 8 sequence ranks use one of: ulysses=1 ring=8, ulysses=2 ring=4, ulysses=4 ring=2"):
        resolve_degrees(8, **TrainConfig(ulysses=8, ring=1).degrees(), q_heads=4, ranks_per_node=8)
    with pytest.raises(ValueError, match="ulysses=2 x ring=2 does not divide the 6 ranks per replica"):
        resolve_degrees(6, ulysses=2, ring=2)
    # tensor parallelism takes its ranks first: the others share world / tp, and Ulysses deals heads / tp
    assert resolve_degrees(16, **{**auto, "tp": 2}, q_heads=32, ranks_per_node=8) == (4, 2, 1)
    with pytest.raises(ValueError, match="tp=3 x dp_replicate=1 does not divide the 8 ranks"):
        resolve_degrees(8, **{**auto, "tp": 3})
    # tp at or above the heads: one refusal naming tp, the heads and the degrees that fit (before: "max() arg is an
    # empty sequence", "the model has 0 query heads ... use one of: .", "the model has 1 query heads" of 2)
    above = r"tp=8 is more than the model's 4 query heads \(num_attention_heads\).* Degrees that fit the model: 1, 2, 4\."
    for given in (auto, {**auto, "ulysses": 1, "ring": 1}):
        with pytest.raises(ValueError, match=above):
            resolve_degrees(8, **{**given, "tp": 8}, q_heads=4)
    for given in ({**auto, "ulysses": 2, "ring": 1}, {**auto, "ring": 1}):
        with pytest.raises(ValueError, match=r"tp=2 x ulysses=2 needs at least one query head per rank, but the model "
                                             r"has 2 query heads: each tensor-parallel rank keeps 1 .* use a tp that "
                                             r"leaves 2 heads a rank: 1\."):
            resolve_degrees(4, **{**given, "tp": 2}, q_heads=2)
    with pytest.raises(ValueError, match="packed text data takes one sequence"):
        TrainConfig(data=["x.txt"], batch=2)


def test_an_output_folder_that_cannot_be_written_fails_before_any_work(pools, tmp_path):
    (tmp_path / "a-file").write_text("x")  # a file where a folder is needed (root ignores permission bits)
    errors = pools.run(4, entry_error, "train", _cfg(tmp_path / "a-file" / "run"))
    assert all("cannot be written" in e and "--out" in e for e in errors), errors


def test_a_vision_language_model_trains_on_the_image_task_and_verifies(pools, tmp_path):
    """qwen2.5-vl-tiny on the built-in image task on a ring of 2 (tower and sequence sharded, images straddling
    shards): it learns to name the symbol each image shows (chance is 1/16), which it can only do through the routed
    image embeddings; and ``seqmesh verify`` finds its step on ring 2 x ulysses 2 equal to the whole model's. (The
    80 steps ran on U2 x R2 too, twice the time on 2 cores: the 2-D mesh's exactness is what verify checks.)"""
    cfg = _cfg(tmp_path / "run", model="qwen2.5-vl-tiny", seq_len=128, ulysses=1, steps=80, lr=3e-3, warmup=10,
               log_every=10, eval_every=80)
    summary = pools.run(2, run_train, cfg)[0]
    assert summary["accuracy"] >= 0.5, summary
    check = pools.run(4, run_verify, _cfg(tmp_path / "verify", model="qwen2.5-vl-tiny", seq_len=128), None)[0]
    assert check["ok"] and check["loss_diff"] < 1e-5, check


def _image_records(folder, sizes=((28, 28), (28, 56), (56, 28)), records: int = 6) -> str:
    """A JSONL file of text with ``<image>`` markers and its .npy images (uint8 RGB) in ``folder``."""
    import numpy as np

    rng = np.random.RandomState(0)
    lines = []
    for r in range(records):
        names = []
        for k in range(1 + r % 2):
            h, w = sizes[(r + k) % len(sizes)]
            name = f"img{r}_{k}.npy"
            np.save(folder / name, (rng.rand(h, w, 3) * 255).astype(np.uint8))
            names.append(name)
        text = f"record {r}: look <image> here" + (" and <image> there" if len(names) > 1 else "") + " done."
        lines.append(json.dumps({"text": text, "images": names}))
    path = folder / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_vision_language_model_trains_and_verifies_on_image_records(pools, tmp_path):
    """Your own records: text with <image> markers and .npy images (Qwen2.5-VL's 14-pixel patches, images of
    28 to 56 pixels). ``seqmesh verify`` finds the packed, sharded step (two records a row, positions restarting
    per record) equal to the whole model run on each record, and a few training steps run."""
    from seqmesh.model.presets import MODELS
    from seqmesh.model.shapes import VisionShape

    data = _image_records(tmp_path)
    small = dict(MODELS["qwen2.5-vl-tiny"].__dict__)
    small["vision"] = VisionShape(depth=2, hidden=32, heads=4, intermediate=48, out_hidden=64, patch=14, window=56,
                                  full_blocks=(1,))
    config = tmp_path / "config.json"
    from seqmesh.model.lm import hf_config
    from seqmesh.model.shapes import ModelShape

    hf_config(ModelShape(**small)).to_json_file(str(config))
    cfg = _cfg(tmp_path / "run", model=str(config), seq_len=160, ulysses=2, ring=2, data=[data], steps=3, eval_every=0)
    check = pools.run(4, run_verify, cfg, None)[0]
    assert check["ok"] and check["loss_diff"] < 1e-5, check
    summary = pools.run(4, run_train, cfg)[0]
    assert math.isfinite(summary["loss"]), summary
