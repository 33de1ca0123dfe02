"""One record of what a run is (``seqmesh.rules.settings.RunSettings``): the job's config, the plan
``parallelize_model`` takes and the planner's workload are it, so each setting is one field, refused the same way by
all three, and a flag of every command that takes it."""

from __future__ import annotations

import dataclasses
import types

import pytest

from seqmesh.compose import ParallelPlan, parallelize_model
from seqmesh.model.presets import MODELS
from seqmesh.planner.hardware import PRESETS, make_cluster
from seqmesh.planner.plan import plan
from seqmesh.planner.workload import Workload
from seqmesh.rules.settings import NOT_PLANNED, RunSettings, setting_names
from seqmesh.tools.cli import build_parser
from seqmesh.training.config import TrainConfig

RECORDS = {
    "TrainConfig": TrainConfig,
    "ParallelPlan": ParallelPlan,
    "Workload": lambda **kw: Workload(MODELS["llama3-8b"], 4096, **kw),
}

BROKEN = [  # (settings that cannot work together, what every record says)
    ({"offload_checkpoints": True, "checkpointing": False}, "add checkpointing (--checkpointing)"),
    ({"keep_attention": True, "checkpointing": False}, "keep_attention (--keep-attention) keeps the attention outputs"),
    ({"keep_attention": True, "checkpointing": True, "compile": True}, "keep_attention=True with compile=True"),
    ({"loss_chunk": 0}, "loss_chunk must be at least 1 token"),
    ({"mlp_tiles": 0}, "mlp_tiles must be at least 1"),
    ({"compile": True, "async_ulysses": True}, "compile=True with async_ulysses=True"),
    ({"ring": 0}, "ring must be a positive integer or 'auto', got 0"),
    ({"ep": -2}, "ep must be a positive integer or 'auto', got -2"),
    ({"linear_attention": "diagonal"}, "linear_attention='diagonal' (--linear-attention): choose one of"),
]


@pytest.mark.parametrize("settings, message", BROKEN, ids=[next(iter(s)) for s, _ in BROKEN])
@pytest.mark.parametrize("record", RECORDS)
def test_every_record_refuses_a_broken_setting_alike(record, settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RECORDS[record](**settings)


def test_cpu_offload_without_fsdp_is_refused_where_fsdp_can_be_off():
    for record in (TrainConfig, ParallelPlan):
        with pytest.raises(ValueError, match="fsdp_cpu_offload offloads FSDP2's shards"):
            record(fsdp=False, fsdp_cpu_offload=True)
    with pytest.raises(ValueError, match="the planner models FSDP2 runs"):
        RECORDS["Workload"](fsdp=False)


def test_a_run_needs_a_number_where_the_planner_takes_auto():
    assert RECORDS["Workload"](ep="auto").ep == "auto"
    for record in (TrainConfig, ParallelPlan):
        with pytest.raises(ValueError, match=r"a run needs a number: run `seqmesh plan --ep auto`"):
            record(ep="auto")


def test_the_records_are_the_one_record():
    """Each record has every setting and gives it back as the record alone."""
    names = setting_names()
    for record in (TrainConfig, ParallelPlan, Workload):
        assert set(names) <= {f.name for f in dataclasses.fields(record)}, record
    cfg = TrainConfig(checkpointing=True, tiled_mlp=True, mlp_tiles=3, ulysses=2, backend="math")
    assert cfg.settings() == RunSettings(checkpointing=True, tiled_mlp=True, mlp_tiles=3, ulysses=2, backend="math")
    assert cfg.parallel_plan(fsdp=True).settings() == dataclasses.replace(cfg.settings(), fsdp=True)


def _flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {option for action in sub._actions for option in action.option_strings}


def test_every_setting_is_a_flag_of_every_command_that_takes_it():
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for command in ("train", "rehearse"):
        assert {flag(n) for n in setting_names()} <= _flags(command), command
    planned = {flag(n) for n in setting_names(planned=True) if n != "bf16"}  # plan's spelling: --dtype
    assert planned <= _flags("plan") and "--dtype" in _flags("plan")
    assert not {flag(n) for n in NOT_PLANNED} & _flags("plan"), "no flag for what the planner does not model"


def test_a_degree_given_to_the_planner_plans_only_its_layouts():
    cluster = make_cluster(PRESETS["h100-nvlink"], 8, None, None)
    every = plan(Workload(MODELS["llama3-8b"], 65536), cluster)
    only = plan(Workload(MODELS["llama3-8b"], 65536, tp=2, ring=1), cluster)
    expected = [c for c in every.candidates if c.layout.tp == 2 and c.layout.ring == 1]
    assert expected and [c.layout for c in only.candidates] == [c.layout for c in expected]
    assert [c.as_dict() for c in only.candidates] == [c.as_dict() for c in expected]


def test_parallelize_model_refuses_degrees_that_are_not_the_meshs():
    from seqmesh.model.lm import build_model

    mesh = types.SimpleNamespace(ulysses=2, ring=1, dp_shard=1, dp_replicate=1, tp=1)
    with pytest.raises(ValueError, match=r"ring=2 \(the mesh has 1\).*leave them out of the plan"):
        parallelize_model(build_model("llama-tiny"), mesh, ParallelPlan(ulysses=2, ring=2))
