"""Rank functions for tests/test_checkpoint_safety.py: loading checkpoint folders someone else wrote."""

from __future__ import annotations

import contextlib
import io
import os

import torch.distributed as dist


def cli_exit(argv: list[str]) -> dict:
    """``seqmesh <argv>`` on this rank as torchrun would run it: its exit code and what it printed to
    stderr. The process group is the pool's, so the error path may not destroy it."""
    from seqmesh.tools.cli import main

    destroy, saved_rank = dist.destroy_process_group, os.environ.get("RANK")
    dist.destroy_process_group = lambda *args, **kwargs: None
    os.environ["RANK"] = str(dist.get_rank())
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            code = main(argv)
    finally:
        dist.destroy_process_group = destroy
        if saved_rank is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved_rank
    return {"code": code, "stderr": stderr.getvalue()}


def trainer_checkpoint(output_dir: str) -> None:
    """Two steps of seqmesh's Trainer (ulysses 2) saving ``output_dir/checkpoint-2``."""
    from seqmesh.trainer import SequenceParallelTrainer
    from trainer_cases import TRAIN_ROWS, tiny_model, training_args, torchrun_environment

    with torchrun_environment():
        args = training_args(output_dir, 2, 1, max_steps=2, save_strategy="steps", save_steps=2)
        SequenceParallelTrainer(model=tiny_model(), args=args, train_dataset=TRAIN_ROWS,
                                seqmesh_degrees=(2, 1)).train()


def trainer_resume_error(output_dir: str) -> str:
    """``train(resume_from_checkpoint=output_dir/checkpoint-2)`` for 4 steps with a fresh Trainer: the error
    it raises on this rank as ``"Type: message"`` ("" if it resumed and finished)."""
    from seqmesh.trainer import SequenceParallelTrainer
    from trainer_cases import TRAIN_ROWS, tiny_model, training_args, torchrun_environment

    with torchrun_environment():
        args = training_args(output_dir, 2, 1, max_steps=4, save_strategy="no")
        trainer = SequenceParallelTrainer(model=tiny_model(seed=1), args=args, train_dataset=TRAIN_ROWS,
                                          seqmesh_degrees=(2, 1))
        try:
            trainer.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-2"))
        except Exception as err:  # the test asserts which error, and that every rank raised it
            return f"{type(err).__name__}: {err}"
    return ""
