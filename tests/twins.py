"""Which cases of a parametrized test reach no line of seqmesh that another case of it does not: the evidence behind
the twins in docs/testing.md. Not part of ``make test``; it needs ``coverage`` (``pip install coverage``).

As a pytest plugin it records, per test, the lines of seqmesh run by the test itself and by every pool rank working
for it (each pool job runs under coverage in its rank and sends its lines back with its result)::

    PYTHONPATH=tests TWINS_OUT=lines.json python -m pytest -p twins tests/hf/test_hf_families.py

As a script it reads that file with the ``--durations=0`` output of a run, and for each parametrized test prints the
cheapest set of cases that reaches every line all of its cases reach, and the cases outside it::

    python tests/twins.py lines.json durations.txt
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import sys

import pytest

SEQMESH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "seqmesh")
OUT = os.environ.get("TWINS_OUT", "twins-lines.json")


def _lines(cov) -> dict[str, list[int]]:
    data = cov.get_data()
    return {path: sorted(data.lines(path) or ()) for path in data.measured_files()}


def traced(fn, args: tuple, kwargs: dict) -> tuple:
    """``fn(*args, **kwargs)`` on this rank under coverage of seqmesh: ``(its result, {file: lines})``."""
    import coverage

    cov = coverage.Coverage(data_file=None, include=[SEQMESH + "/*"], config_file=False)
    cov.start()
    try:
        result = fn(*args, **kwargs)
    finally:
        cov.stop()
    return result, _lines(cov)


class Recorder:
    """The lines each test ran, in pytest's process and in the ranks of every pool job it started."""

    def __init__(self) -> None:
        self.per_test: dict[str, dict[str, set[int]]] = {}
        self.current: str | None = None

    def add(self, lines: dict) -> None:
        mine = self.per_test.setdefault(self.current, {})
        for path, numbers in lines.items():
            mine.setdefault(path, set()).update(numbers)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        import coverage

        self.current = item.nodeid
        cov = coverage.Coverage(data_file=None, include=[SEQMESH + "/*"], config_file=False)
        cov.start()
        try:
            yield
        finally:
            cov.stop()
            self.add(_lines(cov))

    def pytest_sessionfinish(self, session) -> None:
        with open(OUT, "w") as f:
            json.dump({t: {p: sorted(n) for p, n in d.items()} for t, d in self.per_test.items()}, f)


def pytest_configure(config) -> None:
    import conftest

    recorder = Recorder()
    config.pluginmanager.register(recorder, "twins-recorder")
    run = conftest.Pools.run

    def traced_run(self, world_size, fn, *args, timeout=300.0, **kwargs):
        out = run(self, world_size, traced, fn, args, kwargs, timeout=timeout)
        for _, lines in out:
            recorder.add(lines)
        return [result for result, _ in out]

    conftest.Pools.run = traced_run


def cheapest_cover(lines: dict[str, set], seconds: dict[str, float]) -> tuple[float, tuple[str, ...]]:
    """The set of cases whose lines together are every case's, at the least total seconds (every subset tried)."""
    every = set().union(*lines.values())
    best = (float("inf"), tuple(lines))
    for size in range(1, len(lines) + 1):
        for chosen in itertools.combinations(lines, size):
            if set().union(*(lines[c] for c in chosen)) == every:
                best = min(best, (sum(seconds.get(c, 0.0) for c in chosen), chosen))
    return best


def main(lines_file: str, durations_file: str) -> None:
    with open(lines_file) as f:
        lines = {t: {(p.split("/seqmesh/")[-1], n) for p, ns in d.items() for n in ns} for t, d in json.load(f).items()}
    seconds: dict[str, float] = collections.Counter()
    with open(durations_file) as f:
        for row in f:
            found = re.match(r"([0-9.]+)s (?:call|setup|teardown)\s+(\S+)", row)
            if found:
                seconds[found.group(2)] += float(found.group(1))
    tests = collections.defaultdict(list)
    for case in lines:
        tests[case.split("[")[0]].append(case)
    for test, cases in tests.items():
        if len(cases) < 2 or len(cases) > 17:  # every subset of 17 cases is 131,071 sets
            continue
        cost, kept = cheapest_cover({c: lines[c] for c in cases}, seconds)
        print(f"{test}: {sum(seconds[c] for c in cases):.1f} s -> {cost:.1f} s")
        for case in cases:
            others = set().union(*(lines[o] for o in cases if o != case))
            print(f"  {'keep' if case in kept else 'twin'} {seconds[case]:6.1f} s {len(lines[case] - others):4d} lines "
                  f"no other case reaches  {case.split('::')[-1]}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
