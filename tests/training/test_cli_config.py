"""``seqmesh train``'s flags are generated from ``TrainConfig``: every field a flag, every flag a field,
the same defaults, help from each field's docstring, and flags that parse back to the config."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from seqmesh.kernels import BACKENDS
from seqmesh.sequence.layout import LayoutKind
from seqmesh.tools.cli import build_parser, main
from seqmesh.rules.flags import dataclass_from_flags, field_docs
from seqmesh.training.config import TrainConfig

FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def _flags(command: str) -> dict[str, argparse.Action]:
    """``{dest: action}`` of every option of ``seqmesh COMMAND`` but --help."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: a for a in sub._actions if a.option_strings and a.dest != "help"}


def _argv(cfg: TrainConfig) -> list[str]:
    """The ``seqmesh train`` flags that describe ``cfg``."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        flag, value = "--" + f.name.replace("_", "-"), getattr(cfg, f.name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *value]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


@pytest.mark.parametrize("command, own", [("train", set()), ("verify", {"rtol"})])
def test_every_field_has_a_flag_and_every_flag_a_field(command, own):
    flags = _flags(command)
    assert set(flags) == FIELDS | own, "a flag of seqmesh train must be a TrainConfig field (add the field, not the flag)"
    for name in FIELDS:
        assert f"--{name.replace('_', '-')}" in flags[name].option_strings


def test_defaults_and_help_come_from_the_config():
    flags = _flags("train")
    assert {name: flags[name].default for name in FIELDS} == dataclasses.asdict(TrainConfig())
    docs = field_docs(TrainConfig)
    assert set(docs) == FIELDS, f"fields without a docstring (their flag's help): {sorted(FIELDS - set(docs))}"
    for name in FIELDS:
        assert flags[name].help.startswith(docs[name].replace("%", "%%"))
    assert "--symbols" in flags["symbols"].option_strings  # the flag train.py's vocabulary error names


def test_data_help_names_image_records():
    """``seqmesh train --help`` was silent on image records: --data says what a vision-language model reads."""
    text = " ".join(_flags("train")["data"].help.split())
    assert '{"text": "a cat <image> on a mat", "images": ["cat.npy"]}' in text and "uint8 or [0, 1] float .npy" in text


def test_flags_round_trip_to_the_config():
    default = TrainConfig()
    changed = dict(model="qwen3-tiny", seq_len=4099, ulysses=2, ring=4, dp=3, dp_replicate=2, steps=7, lr=3e-4,
                   warmup=0, min_lr_ratio=0.25, weight_decay=0.01, grad_clip=0.0, bf16=True, checkpointing=True,
                   fsdp=False, data=["a.jsonl", "b.txt"], tokenizer="tok", text_key="body", symbols=9, copy_period=100,
                   layout="contiguous", backend="math", loss_chunk=512, out="o", log_every=2, eval_every=0,
                   save_every=5, resume=True, seed=3)
    assert [n for n, v in changed.items() if v == getattr(default, n)] == []  # so an ignored flag would show
    for cfg in (default, dataclasses.replace(default, **{k: v for k, v in changed.items() if k != "data"} | {"batch": 2}),
                dataclasses.replace(default, **changed)):
        args = build_parser().parse_args(["train", *_argv(cfg)])
        assert dataclass_from_flags(TrainConfig, args) == cfg


def test_the_flags_of_before_still_parse():
    args = build_parser().parse_args(["train", "--no-fsdp", "--bf16", "--checkpointing", "--resume", "--ulysses", "auto",
                                      "--ring", "2", "--data", "x.txt", "y.jsonl", "--copy-period", "16"])
    cfg = dataclass_from_flags(TrainConfig, args)
    assert (cfg.fsdp, cfg.bf16, cfg.checkpointing, cfg.resume) == (False, True, True, True)
    assert (cfg.ulysses, cfg.ring, cfg.data, cfg.copy_period) == ("auto", 2, ["x.txt", "y.jsonl"], 16)


def test_fsdp_unset_shards_on_several_processes_and_not_on_one():
    """--fsdp / --no-fsdp decide; unset, FSDP2 on more than one process, and on one only where an option
    needs it (its CPU offload; bf16 without CUDA, which runs through FSDP2's mixed precision)."""
    parse = lambda *argv: dataclass_from_flags(TrainConfig, build_parser().parse_args(["train", *argv]))  # noqa: E731
    assert (parse().fsdp, parse("--fsdp").fsdp, parse("--no-fsdp").fsdp) == (None, True, False)
    unset = TrainConfig()
    assert [unset.uses_fsdp(world) for world in (1, 2, 8)] == [False, True, True]
    assert TrainConfig(fsdp=True).uses_fsdp(1) and not TrainConfig(fsdp=False).uses_fsdp(8)
    assert TrainConfig(fsdp_cpu_offload=True).uses_fsdp(1)
    # bf16 on one process: FSDP2's mixed precision (a bf16 residual stream, as the planner models), unless --no-fsdp
    assert TrainConfig(bf16=True).uses_fsdp(1) and not TrainConfig(bf16=True, fsdp=False).uses_fsdp(1)


@pytest.mark.parametrize("argv, message", [
    (["--ulysses", "two"], "expected an integer or auto, got 'two'"),
    (["--layout", "diagonal"], "invalid choice: 'diagonal'"),
    (["--ring", "0"], "ring must be a positive integer or 'auto', got 0"),
    (["--steps", "0"], "steps must be at least 1, got 0"),
])
def test_bad_flags_exit_with_a_message_before_any_work(argv, message, capsys):
    try:  # argparse exits; a value the config refuses is printed once by main(), which returns the code
        code = main(["train", *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


def test_choices_are_the_libraries():
    hints = typing.get_type_hints(TrainConfig)
    assert typing.get_args(hints["backend"]) == BACKENDS  # the kernels' own list, in auto order
    assert set(typing.get_args(hints["layout"])) == {kind.value for kind in LayoutKind} | {"auto"}
    from seqmesh.linear_attention.choice import LinearDesign

    assert set(typing.get_args(hints["linear_attention"])) == {d.value for d in LinearDesign}
