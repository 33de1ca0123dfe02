"""One run per output folder: an exclusive lock on ``OUT/.seqmesh.lock``, held for the run's life.

Two jobs started on the same ``--out`` would each find it empty (or each resume the same checkpoint),
then interleave their curves in ``metrics.jsonl`` and write over each other's checkpoints. Rank 0
takes an exclusive ``fcntl.flock`` on the lock file before anything in the folder is read or cleared
(``--overwrite`` included) and keeps it until the run ends; its verdict is broadcast, so every rank of
a refused job raises the same ValueError.

The lock belongs to the open file: the run releases it when it ends, and the kernel releases it when
the process dies in any way (an exception, SIGTERM, SIGKILL, a crash), so a dead run never leaves a
stale lock behind. It is advisory (it stops seqmesh runs, not other programs writing there) and needs
a filesystem where flock works between the machines that share it (local disks do; NFS and parallel
filesystems only where their flock support is enabled). The file names the holder (pid, host, start
time) for the refusal message; it is left in place, empty, when the run ends.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from typing import IO

from ..comm.ranks import agree, is_rank0

LOCK_NAME = ".seqmesh.lock"


def _describe_holder(out: str, text: str) -> str:
    """The refusal for ``out``, from what its holder wrote into the lock file (possibly nothing yet)."""
    try:
        holder = json.loads(text)
        who = f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"
    except (ValueError, TypeError, KeyError):
        who = "another process (it has not written its pid yet)"
    return (f"{out} is already used by a seqmesh run: {who}. Two runs in one --out would interleave their metrics "
            "and overwrite each other's checkpoints; wait for it to finish or choose another --out.")


class OutputLock:
    """The exclusive lock on ``out``'s lock file, for this process (see the module docstring)."""

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, LOCK_NAME)
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> str | None:
        """Take the lock without waiting: None when taken, else the refusal naming the holder."""
        if self._file is not None:
            return None
        try:
            file = open(self.path, "a+", encoding="utf-8")
        except OSError as err:
            return f"the lock file {self.path} cannot be opened ({err.strerror or err}); choose another --out."
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            text = file.read()
            file.close()
            return _describe_holder(self.out, text)
        except OSError as err:  # e.g. ENOLCK or EOPNOTSUPP: a filesystem without working flock
            file.close()
            return (f"{self.path} cannot be locked ({err.strerror or err}): the filesystem of --out does not support "
                    "flock, which keeps two runs out of one folder. Choose an --out on a local disk or a filesystem "
                    "with flock enabled.")
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n")
        file.flush()
        self._file = file
        return None

    def release(self) -> None:
        """Empty the file and let the lock go (a no-op when not held)."""
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.truncate(0)  # before unlocking: the next holder's own record must not be cut
        except OSError:
            pass
        file.close()  # closing the file releases the flock

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output(out: str) -> OutputLock:
    """Rank 0 takes ``out``'s lock; when another run holds it, every rank raises the same ValueError.
    Collective when a process group is up. Release the returned lock when the run ends."""
    lock = OutputLock(out)
    refusal = agree(lock.acquire() if is_rank0() else None)
    if refusal is not None:
        lock.release()
        raise ValueError(refusal)
    return lock
