"""Rank functions for tests/test_run_folder.py."""

from __future__ import annotations

import torch.distributed as dist

from train_job_cases import entry_error


def data_unreadable_on_rank1(cfg) -> str:
    """``entry_error("train", cfg)`` where rank 1 alone cannot read the data file (a node whose copy of it
    has other permissions): every rank must raise the same error, none may go on to a collective."""
    import seqmesh.training.train as job

    original = job.make_dataset

    def unreadable_on_rank1(cfg, **kwargs):  # the model the job read once comes as a keyword
        if dist.get_rank() == 1:
            raise PermissionError(13, "Permission denied", cfg.data[0])
        return original(cfg, **kwargs)

    job.make_dataset = unreadable_on_rank1
    try:
        return entry_error("train", cfg)
    finally:
        job.make_dataset = original


def config_reads_in_a_run(cfg) -> int:
    """How often ``seqmesh train`` of ``cfg`` reads its model's ``config.json`` into a shape: the job reads the
    model once and hands it to its data, its mesh and its model."""
    import seqmesh.model.presets as presets
    from seqmesh.training.train import train

    original, reads = presets.shape_from_config, []

    def counted(path):
        reads.append(path)
        return original(path)

    presets.shape_from_config = counted
    try:
        train(cfg)
    finally:
        presets.shape_from_config = original
    return len(reads)
