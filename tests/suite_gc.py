"""The suite's garbage-collection thresholds, set when this module is imported: by ``conftest`` in pytest's
processes, and by the fork server the ranks start from (``conftest.PRELOAD``), whose forked ranks inherit them.

Python collects its youngest generation every 700 net allocations of container objects. The suite's steps are
tiny models, so its time goes to the interpreter (half of the machine's cycles in a full run, by ``perf record
-a``), and the collector took about 3.5% of them; the ranks hold cached references, models and process groups
that every older collection walks again. Collecting the youngest generation every 20,000 allocations instead
(the older ones keep Python's ratios) took 5-10% off the CPU time of the planner's measured peaks, the memory
tests and expert parallelism, which allocate most (two interleaved runs of those files each way, docs/testing.md),
and those peaks, measured on real tensors, stay within the planner's 5%; the whole suite and the floor subset pass
with them (docs/testing.md's ledger, 2026-12-03). The rehearsals' zygote (``rehearsal_server``) keeps Python's:
its children live for one short step and freeze what they import, and their CPU time did not move with it.
"""

from __future__ import annotations

import gc

THRESHOLDS = (20_000, 10, 10)

gc.set_threshold(*THRESHOLDS)
