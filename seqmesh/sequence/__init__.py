"""Sequences on the sequence group: where each rank's tokens lie and how they get there.

``runs`` (a ring rank's block as runs of positions; the ``per_document`` placement, torch-free) ->
``layout`` (``SequenceLayout``: the placement as an invertible permutation; ``auto_layout``) ->
``sharding`` (``shard_sequence`` / ``gather_sequence``, differentiable) -> ``batch`` (``shard_batch``:
a whole batch to this rank's inputs). The padding rule the planner shares is ``seqmesh.rules.padding``.

Nothing is imported here; the public names are ``seqmesh.SequenceLayout``, ``seqmesh.shard_batch``, ...
"""
