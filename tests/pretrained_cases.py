"""Rank functions for tests/test_pretrained.py: transformers checkpoint folders in and out."""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqmesh.training.config import TrainConfig


def loaded_weights(folder: str, ulysses: int, ring: int, dp_replicate: int = 1) -> dict:
    """build() of a checkpoint folder with FSDP: the full weights and buffers it ends up with (rank 0)."""
    from seqmesh.training.train import build

    _, module, _ = build(TrainConfig(model=folder, seq_len=64, ulysses=ulysses, ring=ring, dp=1,
                                     dp_replicate=dp_replicate))
    lm = module.lm
    weights = {n: p.full_tensor().detach().clone() for n, p in lm.named_parameters()}
    inv_freq = lm.model.rotary_emb.inv_freq.clone()
    tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    return {"weights": weights, "inv_freq": inv_freq, "tied": tied,
            "dtypes": sorted({str(p.dtype) for p in lm.parameters()})} if dist.get_rank() == 0 else {}


def build_error(folder: str) -> str:
    """The error build() raises for a checkpoint folder that does not match its config."""
    from seqmesh.training.train import build

    try:
        build(TrainConfig(model=folder, seq_len=64, ulysses=2, ring=2, dp=1))
    except ValueError as err:
        return str(err)
    return "no error"


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process. Not ``ru_maxrss``: a spawned
    process starts with its parent's, which outlives the exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def _peak_above_now(load) -> tuple[object, int]:
    """``load()``'s result and the peak resident size it reached above the resident size before it:
    freed memory goes back to the system first (malloc_trim) and the peak is reset (clear_refs 5)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    result = load()
    return result, max(0, _status_bytes("VmHWM") - before)


def loading_memory(folder: str) -> dict:
    """Host memory this rank (a fresh process) takes to load ``folder``: shard by shard (meta model,
    FSDP over every rank), then, on rank 0 only, whole with transformers' ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    from seqmesh.mesh import init_mesh
    from seqmesh.model.fsdp import apply_fsdp
    from seqmesh.model.lm import SequenceParallelLM, build_model
    from seqmesh.model.pretrained import load_pretrained

    mesh = init_mesh(1, 1, dp_shard=dist.get_world_size(), device_type="cpu")
    module = apply_fsdp(SequenceParallelLM(build_model(folder, device="meta"), mesh), mesh)
    read, sharded = _peak_above_now(lambda: load_pretrained(module, folder, "cpu"))
    held = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
    dist.barrier()
    del module
    whole = None
    if dist.get_rank() == 0:  # the weights may be left mapped from the files: read them all, as training would
        _, whole = _peak_above_now(lambda: [float(p.sum()) for p in AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).parameters()])
    return {"sharded": sharded, "whole": whole, "read": read, "held": held}


def trained_weights(cfg: TrainConfig) -> dict:
    """Train as ``seqmesh train`` does (``train()`` is ``TrainingRun(cfg).run()``); rank 0 returns the
    summary and the trained model's full weights."""
    from seqmesh.training.train import TrainingRun

    run = TrainingRun(cfg)
    summary = run.run()
    weights = {n: p.full_tensor().detach().clone() for n, p in run.module.lm.named_parameters()}
    return {"summary": summary, "weights": weights} if dist.get_rank() == 0 else {}


def export_loaded(folder: str, out: str, max_shard_bytes: int, dtype: torch.dtype | None, fsdp: bool) -> str:
    """Load ``folder`` over U2xR2 (sharded, or whole on every rank), then export it with ``export_pretrained``."""
    from seqmesh.model.writer import export_pretrained
    from seqmesh.training.train import build

    _, module, _ = build(TrainConfig(model=folder, seq_len=64, ulysses=2, ring=2, dp=1, fsdp=fsdp))
    return export_pretrained(module, out, max_shard_bytes=max_shard_bytes, dtype=dtype)


def train_command(argv: list[str], before_model: bool) -> dict:
    """``seqmesh train ARGV`` on this rank as under torchrun (``RANK`` set, the process group up): its exit
    code, what it printed to stderr, and the message of the user error it reported (None if none).
    ``before_model``: building a model before the error is raised is a failure. The job's teardown of the
    process group is skipped, so the pool's ranks stay joined for the next case."""
    import contextlib
    import io
    import os

    import seqmesh.training.train as job
    from seqmesh.tools import cli

    reported = []
    report, destroy, build_model = cli._report_user_error, dist.destroy_process_group, job.build_model

    def recording(err: BaseException) -> int:
        reported.append(str(err))
        return report(err)

    def too_early(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint's files were checked")

    cli._report_user_error, dist.destroy_process_group = recording, lambda *args, **kwargs: None
    if before_model:
        job.build_model = too_early
    rank, stderr = os.environ.get("RANK"), io.StringIO()
    os.environ["RANK"] = str(dist.get_rank())
    try:
        with contextlib.redirect_stderr(stderr):
            code = cli.main(["train", *argv])
    finally:
        cli._report_user_error, dist.destroy_process_group, job.build_model = report, destroy, build_model
        if rank is None:
            os.environ.pop("RANK")
        else:
            os.environ["RANK"] = rank
    return {"code": code, "stderr": stderr.getvalue(), "error": reported[0] if reported else None}
