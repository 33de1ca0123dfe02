"""The suite's rank pools start from the fork server's preload (tests/conftest.py): a rank that no job has asked
to import anything holds the collector thresholds that only ``suite_gc``, first in ``conftest.PRELOAD``, sets."""

from __future__ import annotations

import gc

import suite_gc


def test_a_rank_starts_with_what_the_fork_server_preloaded(pools):
    # gc.get_threshold travels to the ranks by name and imports nothing there: a rank has the suite's thresholds only
    # if the fork server imported suite_gc from tests/, which Python 3.11's did not find before conftest.fork_server
    # put tests/ on its PYTHONPATH (its ranks read Python's (700, 10, 10))
    assert pools.run(2, gc.get_threshold) == [suite_gc.THRESHOLDS] * 2
