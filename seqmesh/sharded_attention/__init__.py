"""Exact attention over a sharded sequence; the public entry is ``seqmesh.attention`` (``api.py``).

- ``checks``: inputs checked on every rank, the group agreeing before any work;
- ``heads``: how Ulysses deals query and kv heads to ranks; ``ulysses``: the all-to-all wrapping;
- ``schedule``: which key block each ring rank meets at each step, and which steps a window skips;
- ``blocks``: what one (query block, key block) pair computes (causal, documents, window), as kernel calls;
- ``ring``: the ring loop, its backward, and the single-block case;
- ``merge``: the fp32 LSE merge, and attention sinks folded into it once.
"""
