"""Rank functions for tests/test_run_folder.py."""

from __future__ import annotations

import torch.distributed as dist

from train_job_cases import entry_error


def data_unreadable_on_rank1(cfg) -> str:
    """``entry_error("train", cfg)`` where rank 1 alone cannot read the data file (a node whose copy of it
    has other permissions): every rank must raise the same error, none may go on to a collective."""
    import seqmesh.training.train as job

    original = job.make_dataset

    def unreadable_on_rank1(cfg):
        if dist.get_rank() == 1:
            raise PermissionError(13, "Permission denied", cfg.data[0])
        return original(cfg)

    job.make_dataset = unreadable_on_rank1
    try:
        return entry_error("train", cfg)
    finally:
        job.make_dataset = original
