"""``seqmesh train`` under torchrun with one rank stopped (SIGSTOP) mid-run: when the other ranks and the job
end, and what they said. The job runs as a subprocess of the test, so a hang is bounded by ``limit``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class StoppedJob:
    """Seconds after the stop at which: the last other rank exited (``others_ended``), torchrun exited
    (``ended``: the stopped rank is killed once the others have ended, as torchrun itself does 30 s after the SIGTERM
    a stopped process cannot act on), a line naming the stopped rank was printed (``named``); None where it did not
    happen within the limit. ``returncode``: torchrun's (None: killed at the limit); ``output``: every line."""

    returncode: int | None
    others_ended: float | None
    ended: float | None
    named: float | None
    output: list[str] = field(repr=False)


def children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (not gone, not a zombie waiting for torchrun to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _train_records(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(json.loads(line)["kind"] == "train" for line in f)
    except (OSError, ValueError):
        return 0


def stop_a_rank(out: str, args: list[str], *, nproc: int, rank: int, limit: float, steps_before: int = 2,
                start_limit: float = 240.0) -> StoppedJob:
    """Run ``seqmesh train --out out ARGS`` on ``nproc`` CPU ranks, SIGSTOP ``rank`` once ``steps_before``
    steps are logged, and watch for ``limit`` seconds; once the other ranks have ended, SIGKILL the stopped one (what
    torchrun sends it after its own 30 s grace, which is torchrun's to keep, not seqmesh's); at the limit, kill
    whatever is left."""
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "seqmesh", "train",
         "--model", "llama-tiny", "--seq-len", "64", "--steps", "100000", "--log-every", "1", "--eval-every", "0",
         "--out", out, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in job.stdout), daemon=True)
    reader.start()
    ranks: dict[int, int] = {}
    try:
        deadline = time.monotonic() + start_limit
        while time.monotonic() < deadline and job.poll() is None and _train_records(out) < steps_before:
            time.sleep(0.5)
        ranks = {rank_of(pid): pid for pid in children(job.pid)}
        if _train_records(out) < steps_before or rank not in ranks:
            raise AssertionError("the job did not start:\n" + "".join(line for _, line in lines)[-3000:])
        os.kill(ranks[rank], signal.SIGSTOP)
        stopped = time.monotonic()
        others = [pid for r, pid in ranks.items() if r != rank]
        others_ended = ended = None
        while time.monotonic() < stopped + limit and ended is None:
            now = time.monotonic() - stopped
            if others_ended is None and not any(_running(pid) for pid in others):
                others_ended = now
                with contextlib.suppress(ProcessLookupError):  # gone already: nothing to end
                    os.kill(ranks[rank], signal.SIGKILL)
            if job.poll() is not None:
                ended = now
            time.sleep(0.1)
    finally:
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
        job.wait()
        reader.join(timeout=10)
    if others_ended is None and ended is not None:
        others_ended = ended
    # the heartbeat's verdict ("rank 1 (pid ...) has sent no heartbeat for 9 s; it was in step 3: forward") or
    # the report of a collective that timed out ("rank 1 silent for 10 s, in step 3: forward (pid ...)")
    pattern = re.compile(rf"\brank {rank}\b[^;]*(no heartbeat|silent).*?step \d+: \w")
    named = next((t - stopped for t, line in lines if pattern.search(line)), None)
    return StoppedJob(job.returncode if ended is not None else None, others_ended, ended, named,
                      [line for _, line in lines])
