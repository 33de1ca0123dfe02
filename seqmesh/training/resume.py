"""Where a run starts: a fresh output folder, or the newest intact checkpoint of the same run.

Nothing a user has is replaced without a flag:

- a fresh run (no ``--resume``) in an ``out`` that already holds checkpoints or ``metrics.jsonl``
  refuses, unless ``--overwrite`` says to replace them;
- ``--resume`` continues from the newest checkpoint whose files match their checksums, whatever
  ``latest`` names. Newer damaged ones are renamed ``step_N.damaged`` (kept for inspection, never
  written over by the resumed run's saves);
- a resumed run whose configuration differs from the checkpoint's in anything that changes the run
  (learning rate, sequence length, data, seed, ...) refuses, unless ``--allow-config-change``; the
  accepted changes are then recorded in ``metrics.jsonl``;
- a resumed run rewrites ``metrics.jsonl`` without the records after its checkpoint and without a torn
  last line, so the records it appends follow whole lines; a bad line before the last is refused.

All of this runs before the model is built, and every rank reaches the same verdict (the checksum
checks are collective), so each error is raised on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, field


from .checkpoint import newest_intact_checkpoint, steps_in
from .config import TrainConfig
from .metrics import MetricsLog
from ..comm.ranks import agree, barrier, is_rank0

# Fields that change what the run computes. The mesh degrees, kernel, layout, checkpointing, FSDP and
# output cadence do not (seqmesh is exact under any of them), so they may change across a resume; so may
# ``steps``, to train longer (the cosine decay then spreads over the new length from the resumed step on).
RUN_FIELDS = ("model", "seq_len", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "batch",
              "bf16", "data", "tokenizer", "text_key", "symbols", "copy_period", "seed", "dp_replicate")


def data_fingerprint(cfg: TrainConfig) -> dict[str, int]:
    """``{file: size in bytes}`` of the run's data files: an edited or swapped file changes the run."""
    return {path: os.path.getsize(path) for path in cfg.data if os.path.isfile(path)}


def run_record(cfg: TrainConfig, data_parallel: int) -> dict:
    """What each checkpoint stores about its run, to compare a resume against."""
    return {"config": asdict(cfg), "data_files": data_fingerprint(cfg), "data_parallel": data_parallel}


def config_changes(saved: dict, cfg: TrainConfig, data_parallel: int | None = None) -> dict[str, list]:
    """``{name: [saved value, new value]}`` for every difference that changes the run."""
    old = saved.get("config", {})
    new = asdict(cfg)
    changes = {name: [old[name], new[name]] for name in RUN_FIELDS if name in old and old[name] != new[name]}
    if "data_files" in saved and saved["data_files"] != data_fingerprint(cfg):
        changes["data_files"] = [saved["data_files"], data_fingerprint(cfg)]
    if data_parallel is not None and saved.get("data_parallel", data_parallel) != data_parallel:
        changes["data_parallel"] = [saved["data_parallel"], data_parallel]  # the batch of a step changes
    return changes


def describe_changes(changes: dict[str, list]) -> str:
    return ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())


def refuse_changes(path: str, changes: dict[str, list]) -> None:
    raise ValueError(
        f"--resume would continue {path} with a different configuration: {describe_changes(changes)}. That splices "
        "another run onto its curve. Resume with the checkpoint's settings, start a new run in another --out, or pass "
        "--allow-config-change to continue anyway (the change is recorded in metrics.jsonl)."
    )


@dataclass
class StartPoint:
    """Where this run starts: ``checkpoint`` (None for step 0) and what it saved about its run."""

    checkpoint: str | None = None
    saved: dict = field(default_factory=dict)
    changes: dict[str, list] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.saved.get("step", 0))

    def describe(self) -> str | None:
        """The line a resumed run prints: which checkpoint, which step, and the changes it accepted (None: a fresh
        start)."""
        if self.checkpoint is None:
            return None
        accepted = f", with --allow-config-change: {describe_changes(self.changes)}" if self.changes else ""
        return f"resuming from {self.checkpoint} (step {self.step}){accepted}"


def _previous_run(out: str, folder: str) -> list[str]:
    """What an earlier run left in ``out``, as rank 0 sees it, on every rank: each rank looking for itself
    would race rank 0's clearing (a rank that looks after the files are gone would skip the clearing's
    barrier, and the ranks' collectives would no longer pair)."""
    found = [os.path.basename(p) for p in steps_in(folder)] if is_rank0() else []
    for name in ("metrics.jsonl", "model"):  # model/: the exported transformers folder
        if is_rank0() and os.path.exists(os.path.join(out, name)):
            found.append(name)
    return agree(found)


def _clear_previous_run(out: str, folder: str) -> None:
    """Remove an earlier run's checkpoints, exported model, metrics and curve (the user passed --overwrite)."""
    if is_rank0():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(os.path.join(out, "model"), ignore_errors=True)
        for name in ("metrics.jsonl", "loss_curve.png"):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
    barrier()


def check_metrics(out: str) -> None:
    """Raise on every rank if ``out/metrics.jsonl`` has a bad line before its last (rank 0 reads it; a
    resumed run rewrites it without its records after the checkpoint and a torn last line)."""
    problem = None
    if is_rank0():
        try:
            MetricsLog(os.path.join(out, "metrics.jsonl")).read()
        except ValueError as err:
            problem = str(err)
    problem = agree(problem)
    if problem is not None:
        raise ValueError(problem)


def choose_start(cfg: TrainConfig) -> StartPoint:
    """Decide where the run starts (see the module docstring); raises before any model is built."""
    folder = os.path.join(cfg.out, "checkpoints")
    if not cfg.resume:
        found = _previous_run(cfg.out, folder)
        if found and not cfg.overwrite:
            shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            raise ValueError(f"{cfg.out} already holds a run ({shown}). Pass --resume to continue it, --overwrite to "
                             "replace it, or choose another --out.")
        if found:
            _clear_previous_run(cfg.out, folder)
        return StartPoint()
    path, skipped = newest_intact_checkpoint(folder)
    if path is None and skipped:
        listed = "; ".join(f"{p}: {why}" for p, why in skipped)
        raise ValueError(f"--resume found no intact checkpoint in {folder}: {listed}. Restore them from a copy, or start "
                         "over in another --out (or with --overwrite instead of --resume).")
    if path is None:
        found = _previous_run(cfg.out, folder)
        if found and not cfg.overwrite:
            raise ValueError(f"--resume found no checkpoint in {folder}, but {cfg.out} holds {', '.join(found)} from an "
                             "earlier run. Pass --overwrite to start over there, or choose another --out.")
        if found:  # --overwrite: a fresh start, not new records appended to the old run's
            _clear_previous_run(cfg.out, folder)
        return StartPoint()
    for damaged, why in skipped:
        if is_rank0():
            warnings.warn(f"{damaged} is damaged ({why}); resuming from {path} instead and keeping it as "
                          f"{damaged}.damaged.", stacklevel=2)
            if not damaged.endswith(".old"):
                os.replace(damaged, damaged + ".damaged")
    barrier()
    with open(os.path.join(path, "seqmesh.json")) as f:
        saved = json.load(f)
    changes = config_changes(saved, cfg)
    if changes and not cfg.allow_config_change:
        refuse_changes(path, changes)
    check_metrics(cfg.out)  # before the model is built: the resumed run appends to it
    return StartPoint(path, saved, changes)
