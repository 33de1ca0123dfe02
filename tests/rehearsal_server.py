"""Rehearsals forked from a process that imported torch once, for the tests that run many of them.

``seqmesh.tools.rehearse.run_rehearsal`` starts each rehearsal in a fresh interpreter, which spends about 7 s
importing torch, transformers and seqmesh before its step (a toy step takes 2-4 s). :class:`RehearsalServer` is a
``launch`` for it: one *zygote* per environment (the fake CUDA library is preloaded into a process by its
environment, before torch loads) imports them once, then forks one child per rehearsal. A child is the same
interpreter state a fresh process reaches after those imports, with the same environment, and runs the same
``seqmesh.rehearsal.child`` main; what it prints goes to files the caller reads back, and its exit status is the
process's. The CLI's own start-up (``seqmesh rehearse`` in a subprocess) is still tested as users run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

CHILD_MODULE = "seqmesh.rehearsal.child"

# The zygote: imports, then for each request line forks a child that runs the rehearsal with its output in the
# request's files and writes its exit status last (a file renamed into place, so a reader never sees half of it).
ZYGOTE = r"""
import gc, json, os, signal, sys, traceback
import torch, transformers, transformers.modeling_utils
import seqmesh, seqmesh.hf, seqmesh.training.train, seqmesh.rehearsal.runtime, seqmesh.rehearsal.child
import transformers.models.llama.modeling_llama

gc.freeze()  # the imports are never garbage: a child's full collections walk only what its rehearsal makes

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)
        continue
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = [seqmesh.rehearsal.child.__file__, *request["args"]]
        code = seqmesh.rehearsal.child.main(request["args"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(request["status"] + ".part", "w") as f:
            f.write(str(code))
        os.rename(request["status"] + ".part", request["status"])
        os._exit(code)
"""


class RehearsalServer:
    """``run_rehearsal(..., launch=server)``: rehearsals forked from a zygote per environment. Thread-safe (the
    rehearsal tests run two or three side by side); :meth:`close` ends the zygotes."""

    def __init__(self) -> None:
        self._zygotes: dict[frozenset, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._folder = tempfile.TemporaryDirectory(prefix="seqmesh-rehearsals-")
        self._count = 0

    def _zygote(self, env: dict[str, str]) -> subprocess.Popen:
        # by the environment the rehearsal needs, not the test that asks: pytest names the running test in
        # PYTEST_CURRENT_TEST, and keyed with it every rehearsal started a zygote of its own (about 8 CPU-seconds of
        # imports each), and kept it to the session's end (34 of them held 14 GB an hour into a full suite)
        key = frozenset((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")
        zygote = self._zygotes.get(key)
        if zygote is None or zygote.poll() is not None:
            zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            ready = zygote.stdout.readline()
            if not ready:
                raise RuntimeError(f"the rehearsal zygote ended at start-up (exit {zygote.wait()})")
            self._zygotes[key] = zygote
        return zygote

    def __call__(self, argv: list[str], env: dict[str, str], timeout: float | None) -> subprocess.CompletedProcess:
        if argv[:2] != ["-m", CHILD_MODULE]:
            raise ValueError(f"the rehearsal server runs {CHILD_MODULE} only, not {argv[:2]}")
        with self._lock:
            self._count += 1
            stem = os.path.join(self._folder.name, str(self._count))
            files = {"stdout": stem + ".out", "stderr": stem + ".err", "status": stem + ".status"}
            zygote = self._zygote(env)
            zygote.stdin.write(json.dumps({"args": argv[2:], **files}) + "\n")
            zygote.stdin.flush()
            pid = json.loads(zygote.stdout.readline())["pid"]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not os.path.exists(files["status"]):
            if not _alive(pid):  # killed before it could write its status
                if not os.path.exists(files["status"]):
                    return self._finished(argv, files, -9)
                break
            if deadline is not None and time.monotonic() > deadline:
                _kill(pid)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
            time.sleep(0.05)
        with open(files["status"]) as f:
            code = int(f.read())
        while _alive(pid):  # its last flushes and exit
            time.sleep(0.01)
        return self._finished(argv, files, code)

    @staticmethod
    def _finished(argv: list[str], files: dict, code: int) -> subprocess.CompletedProcess:
        with open(files["stdout"]) as out, open(files["stderr"]) as err:
            return subprocess.CompletedProcess([sys.executable, *argv], code, out.read(), err.read())

    def close(self) -> None:
        for zygote in self._zygotes.values():  # it holds nothing to save: killed, not asked to exit
            zygote.kill()
            zygote.wait()
            zygote.stdin.close()
            zygote.stdout.close()
        self._zygotes.clear()
        self._folder.cleanup()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
