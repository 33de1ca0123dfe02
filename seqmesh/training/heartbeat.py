"""A heartbeat between the ranks of a job, through the job's store: a rank that stops answering ends the
job within ``--timeout``, named, with the phase it was in.

Each rank's thread writes its beat (a count, its phase, pid and host) under ``seqmesh/heartbeat/RUN/RANK``
every ``interval`` seconds and as soon as the main thread enters another phase. Rank 0 watches every
rank; every other rank watches rank 0. A watched rank whose count has not moved for ``timeout - 2 x
interval`` seconds, by the watcher's own clock, has stopped (the watcher sees a beat up to an interval
late and looks once an interval, so it tells within ``timeout`` of the stop): a process stopped
(SIGSTOP, a frozen host or container) or one whose Python threads cannot run. The watcher prints which rank, its phase and pid, then ends its own
process (``os._exit(LOST_RANK_EXIT)``): a thread cannot interrupt a main thread blocked inside a
collective, and the launcher (torchrun) ends the other ranks once one has exited.

It depends on no collective, so it holds whatever the ranks wait in: gloo or NCCL, DTensor's collectives
under tensor parallelism, the all-to-alls, the ring's sends, a vision tower's. A rank that is alive but
never joins a collective (a GPU wedged under a live process, a rank on another code path) keeps beating:
the collective timeout every group of the mesh has ends that job (:mod:`seqmesh.comm.timeouts`), and
:meth:`Heartbeat.report` says where each rank was.

The beats go over a client connection of their own: a TCPStore client serialises its operations, so a
main thread blocked in the store (creating a process group) would otherwise hold the heartbeat too.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

import torch.distributed as dist

LOST_RANK_EXIT = 3  # the exit code of a rank that ended the job because a peer stopped answering


def own_connection(store: dist.Store, timeout: float) -> dist.Store:
    """A client of ``store`` of its own when it is a TCPStore (under any PrefixStores), else ``store``."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        return dist.TCPStore(inner.host, inner.port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    return store


def exit_job(message: str) -> None:
    """Print ``message`` and end this process with :data:`LOST_RANK_EXIT` (the default ``on_lost``)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOST_RANK_EXIT)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


class Heartbeat:
    """This rank's beat and its watch on its peers, from a thread that runs from :meth:`start` (or entering
    ``with``) to :meth:`stop`.

    Args:
        store: the job's store (``torch.distributed.distributed_c10d._get_default_store()``); shared by
            every rank.
        run: a name every rank of this run gives alike (keys of earlier runs in the same store are ignored).
        rank, world: this rank and the number of ranks.
        timeout: seconds without a beat after which a watched rank is lost (``--timeout``).
        interval: seconds between beats and between looks at the peers; by default a tenth of ``timeout``,
            within [0.2, 5] (at most a quarter of it).
        on_lost: called once, from the heartbeat's thread, with the message naming the lost ranks;
            by default :func:`exit_job`.
    """

    def __init__(self, store: dist.Store, run: str, rank: int, world: int, timeout: float, *,
                 interval: float | None = None, on_lost: Callable[[str], None] = exit_job):
        if not timeout > 0:
            raise ValueError(f"the heartbeat's timeout must be a positive number of seconds, got {timeout!r}.")
        self.interval = min(5.0, max(0.2, timeout / 10), timeout / 4) if interval is None else interval
        self.silence = timeout - 2 * self.interval  # a watched rank silent this long is lost
        if self.silence <= 0:
            raise ValueError(f"the heartbeat's interval ({self.interval:g} s) must be under half its timeout "
                             f"({timeout:g} s); give a shorter interval or leave it to the default.")
        self.store = own_connection(store, 2 * self.interval)
        self.prefix, self.rank, self.world, self.timeout = f"seqmesh/heartbeat/{run}", rank, world, timeout
        self.on_lost = on_lost
        self.phase = "start-up"
        self.count = 0
        self.watched = [r for r in range(world) if r != rank] if rank == 0 else [0]
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    # -- this rank ----------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """The main thread is now in ``phase`` (published at once, by the heartbeat's thread)."""
        self.phase = phase
        self._wake.set()

    def _publish(self, state: str = "running") -> None:
        self.count += 1
        beat = {"count": self.count, "phase": self.phase, "state": state, "pid": os.getpid(),
                "host": socket.gethostname(), "time": time.time()}
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps(beat))

    # -- the peers ----------------------------------------------------------------------------------
    def read(self, rank: int) -> dict | None:
        """``rank``'s last beat, or None when it has not beaten yet."""
        key = f"{self.prefix}/{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def report(self) -> str:
        """Where each rank was at its last beat, ranks alike together; a rank whose last beat is older than
        two intervals (by the hosts' clocks) is called silent, with its pid and host."""
        lines: dict[str, list[int]] = {}
        now = time.time()
        for rank in range(self.world):
            try:
                beat = self.read(rank)
            except (RuntimeError, ValueError):  # the store did not answer
                beat = None
            if beat is None:
                line = "no heartbeat"
            elif beat["state"] == "ended":
                line = f"ended in {beat['phase']}"
            elif now - beat["time"] > 2 * self.interval:
                line = (f"silent for {now - beat['time']:.0f} s, in {beat['phase']} (pid {beat['pid']} on "
                        f"{beat['host']})")
            else:
                line = f"beating, in {beat['phase']}"
            lines.setdefault(line, []).append(rank)
        return "; ".join(f"{_ranks(ranks)} {line}" for line, ranks in lines.items())

    def _lost_message(self, lost: dict[int, tuple[float, dict | None]], problem: str | None) -> str:
        parts = []
        for rank, (silent, beat) in sorted(lost.items()):
            if beat is None:
                parts.append(f"rank {rank} never sent a heartbeat in {silent:.0f} s")
            else:
                parts.append(f"rank {rank} (pid {beat['pid']} on {beat['host']}) has sent no heartbeat for "
                             f"{silent:.0f} s; it was in {beat['phase']}")
        store = f" The job's store did not answer this rank either ({problem})." if problem else ""
        return (f"seqmesh: error: {'; '.join(parts)} (--timeout {self.timeout:g} s).{store} Rank {self.rank} ends the "
                f"job (exit code {LOST_RANK_EXIT}). A process stopped (SIGSTOP, a frozen host or container) or whose "
                "Python threads cannot run stops its heartbeat: look at that rank's process and host, or raise "
                "--timeout if it may pause that long for a reason.")

    def _run(self) -> None:
        last_seen = {r: (-1, time.monotonic(), None) for r in self.watched}  # count, when it changed, the beat
        next_look = time.monotonic()
        while not self._stop.is_set():
            problem = None
            try:
                self._publish()
            except (RuntimeError, ValueError) as err:  # the store may be slow for a while: the clock decides
                problem = str(err).splitlines()[0]
            now = time.monotonic()
            if now >= next_look:
                next_look = now + self.interval
                lost = {}
                for rank in list(last_seen):
                    count, since, beat = last_seen[rank]
                    try:
                        seen = self.read(rank)
                    except (RuntimeError, ValueError) as err:
                        seen, problem = None, str(err).splitlines()[0]
                    if seen is not None and seen["state"] == "ended":
                        del last_seen[rank]  # finished (or failed and said so): no longer watched
                        continue
                    if seen is not None and seen["count"] != count:
                        last_seen[rank] = (seen["count"], now, seen)
                    elif now - since >= self.silence:
                        lost[rank] = (now - since, beat)
                if lost and not self._stop.is_set():
                    self.on_lost(self._lost_message(lost, problem))
                    return
            self._wake.wait(self.interval)
            self._wake.clear()
            self._stop.wait(self.interval / 10)  # at most ten beats an interval, however often phases change

    def start(self) -> Heartbeat:
        """Beat and watch from a thread of this process, until :meth:`stop`."""
        self._publish()  # a first beat before any peer looks
        self._thread = threading.Thread(target=self._run, name="seqmesh-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching; the last beat says this rank ended, so no peer takes it for lost."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self._publish("ended")
        except (RuntimeError, ValueError):  # the store may already be gone at the end of a job
            pass

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def job_heartbeat(timeout: float) -> Heartbeat | None:
    """A started :class:`Heartbeat` for this rank of the default process group, through its store (a
    collective: every rank calls it); None on a single rank, which has no peer to watch."""
    if dist.get_world_size() == 1:
        return None
    from ..comm.ranks import agree

    run = agree(uuid.uuid4().hex[:12])  # keys of earlier runs in the same store (a worker pool's) stay apart
    store = dist.distributed_c10d._get_default_store()
    return Heartbeat(store, run, dist.get_rank(), dist.get_world_size(), timeout).start()
