"""``seqmesh rehearse``: ``seqmesh train``'s flags plus ``--gpus N``, ``--device`` and ``--json``.

The flags are checked here (the degrees against ``--gpus``) before anything expensive; the step then runs in a
fresh Python process (:mod:`seqmesh.rehearsal.child`), so the fake process group and fake mode never touch the
caller. The child prints one JSON object as its last line; this command prints it (``--json``) or a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable

from ..model.presets import model_shape
from ..planner.media import Media
from ..training.config import TrainConfig


def add_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``rehearse`` to ``seqmesh``'s subcommands."""
    from ..planner.media import add_media_flags
    from ..rules.flags import add_dataclass_flags

    p = sub.add_parser("rehearse", help="one rank's full-size training step on fake tensors: its peak tensor "
                       "bytes beside seqmesh plan's", description=__doc__.splitlines()[0])
    add_dataclass_flags(p, TrainConfig)
    add_media_flags(p, video=False)  # seqmesh plan's: rows of these images, then text, in place of the image task
    p.add_argument("--gpus", type=int, required=True, help="ranks of the rehearsed world")
    p.add_argument("--rank", type=int, default=0, help="the rank whose step is run (default %(default)s): ranks "
                   "differ where their shares do (images, documents, the ring's last rank); run each one you doubt")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="fake cuda:0 tensors and CUDA's kernels (on a CPU build of torch: needs a C++ compiler), or "
                        "the CPU kernels (default %(default)s)")
    p.add_argument("--top", type=int, default=6, metavar="N",
                   help="describe the N largest storages at the peak that are neither weights, gradients nor "
                        "optimizer state: bytes, shape, dtype, saved or transient, and the operator and phase that "
                        "made it (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (the last line)")
    p.set_defaults(func=cmd_rehearse)
    return p


def check_world(cfg: TrainConfig, gpus: int) -> None:
    """Raise a ValueError naming the value and the fix when ``cfg``'s degrees cannot tile ``gpus`` ranks."""
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: the rehearsed world needs at least 1 rank.")
    given = {name: value for name, value in (("ulysses", cfg.ulysses), ("ring", cfg.ring), ("dp", cfg.dp),
                                             ("dp-replicate", cfg.dp_replicate), ("tp", cfg.tp))
             if isinstance(value, int) and value > 1}
    product = 1
    for value in given.values():
        product *= value
    if gpus % product:
        named = " x ".join(f"--{k} {v}" for k, v in given.items())
        total = f" = {product}" if len(given) > 1 else ""
        raise ValueError(f"--gpus {gpus} is not divisible by {named}{total}: give --gpus a multiple of {product}, "
                         f"or degrees whose product divides {gpus}.")
    if all(isinstance(v, int) for v in (cfg.ulysses, cfg.ring, cfg.dp)) and product != gpus:
        raise ValueError(f"--gpus {gpus} but the degrees given multiply to {product}: make them multiply to {gpus} "
                         "or leave one of --ulysses/--ring/--dp auto.")
    from ..rules.degrees import resolve_degrees

    shape = model_shape(cfg.model)
    resolve_degrees(gpus, **cfg.degrees(), q_heads=shape.fewest_heads, seq_len=cfg.seq_len)  # its errors name the fix


def _child_env() -> dict[str, str]:
    """This process's environment, with this seqmesh first on the child's path (a checkout run without install)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


# How the rehearsal's process is started: (argv after the interpreter, its environment, timeout in seconds or None)
# to the finished process (stdout and stderr as text); raises subprocess.TimeoutExpired past the timeout
Launch = Callable[[list[str], dict[str, str], "float | None"], subprocess.CompletedProcess]


def launch_process(argv: list[str], env: dict[str, str], timeout: float | None) -> subprocess.CompletedProcess:
    """A fresh interpreter running ``argv`` (the default :data:`Launch`)."""
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)


def run_rehearsal(cfg: TrainConfig, gpus: int, timeout: float | None = None, *, device: str = "cuda",
                  fake: bool = True, top: int = 6, media: Media | None = None, rank: int = 0,
                  launch: Launch = launch_process) -> dict:
    """Check ``cfg`` against ``gpus``, rehearse it on fake ``device`` tensors in a fresh process and return its result
    (:class:`Rehearsal`'s ``as_dict``; ``fake=False``: the same step on real CPU tensors, a toy size's reference).
    ``top``: the largest storages at the peak to describe; ``media``: the images each sequence shows a vision-language
    model (``--images``), for the step and the planner alike; ``rank``: the rank whose step runs; ``launch``: how the
    process starts (a test suite running many rehearsals forks them from one that imported torch). Raises ValueError
    for a bad configuration or a machine that cannot rehearse (naming what is missing), RuntimeError naming the
    child's last words if it fails."""
    from dataclasses import asdict

    from ..rehearsal.cuda_library import CannotRehearse, preload_environment

    check_world(cfg, gpus)
    if not 0 <= rank < gpus:
        raise ValueError(f"--rank {rank}: the rehearsed world's ranks are 0 to {gpus - 1} (--gpus {gpus}).")
    if media is not None:  # before any process: the planner's checks of the images against the model
        media.check(model_shape(cfg.model), cfg.seq_len)
    env = _child_env()
    if device == "cuda":
        try:
            env = preload_environment(env)
        except CannotRehearse as err:
            raise ValueError(str(err)) from None
    payload = json.dumps({"config": asdict(cfg), "gpus": gpus, "device": device, "fake": fake, "top": top,
                          "rank": rank, "media": asdict(media) if media is not None else None})
    done = launch(["-m", "seqmesh.rehearsal.child", payload], env, timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr.strip().splitlines() or ["(no output)"])[-15:])
        if done.returncode == 2:  # the child's ValueError: a configuration problem in words
            raise ValueError(tail.splitlines()[-1].removeprefix("seqmesh: error: "))
        raise RuntimeError(f"the rehearsal process failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def format_result(result: dict, cfg: TrainConfig, gpus: int) -> str:
    """A short table: measured and planned peak, ratio, where the peak fell, the kernels, the time."""
    def gib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"

    ratio = f"{result['ratio']:.3f}" if result["ratio"] is not None else "-"
    rank = result.get("rank", 0)
    rows = [(f"measured peak (rank {rank})", gib(result["measured_peak_bytes"])),
            ("planned peak (no reserve)", gib(result["planned_peak_bytes"])),
            ("planned / measured", ratio),
            ("peak fell in", f"{result['peak_phase']} ({result['peak_op']})"),
            ("planner's moment", result["planned_moment"]),
            ("attention kernels", ", ".join(result["kernels"]) or "-"),
            ("device", f"fake {result['device']}"), ("mesh", result["mesh"]),
            ("wall", f"{result['wall_seconds']:.1f} s")]
    rows += [(f"  measured {k}", gib(v)) for k, v in result["measured_by_category"].items()]
    title = f"seqmesh rehearse: {cfg.model}, {cfg.seq_len:,} tokens, {gpus} ranks (rank {rank} measured)"
    lines = [title] + [f"  {name:<28}{value}" for name, value in rows]
    if result.get("largest_at_peak"):
        lines.append("  largest at the peak (not weights, gradients or optimizer state), and what made them:")
        lines += [f"    {gib(s['bytes']):>11}  {s['kind']:<9} {s['dtype']:<8} {tuple(s['shape'])} from {s['op']} in "
                  f"{s['phase']}" for s in result["largest_at_peak"]]
    return "\n".join(lines)


def cmd_rehearse(args: argparse.Namespace) -> int:
    from ..planner.media import media_from_flags
    from ..rules.flags import dataclass_from_flags

    try:
        cfg = dataclass_from_flags(TrainConfig, args)
        if args.top < 0:
            raise ValueError(f"--top {args.top}: give a number of storages, 0 or more.")
        media = media_from_flags(model_shape(cfg.model), args.images, args.image_size)
        result = run_rehearsal(cfg, args.gpus, device=args.device, top=args.top, media=media, rank=args.rank)
    except ValueError as err:
        print(f"seqmesh rehearse: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_result(result, cfg, args.gpus))
    return 0
