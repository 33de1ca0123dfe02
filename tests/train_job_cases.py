"""The main job on spawned ranks: runs, resumes, verifies."""

from __future__ import annotations

from seqmesh.config import TrainConfig
from seqmesh.train import train
from seqmesh.verify import verify


def run_train(cfg: TrainConfig) -> dict:
    return train(cfg)


def run_verify(cfg: TrainConfig, rtol: float | None) -> dict:
    return verify(cfg, rtol=rtol)


def build_error(cfg: TrainConfig) -> str:
    from seqmesh.train import build

    try:
        build(cfg)
    except ValueError as err:
        return str(err)
    return "no error"
