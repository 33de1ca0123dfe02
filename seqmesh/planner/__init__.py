"""``seqmesh plan``: memory, traffic and step time of every layout of a cluster, and a recommendation.

- :mod:`.hardware`  GPUs and their link hierarchy (presets, custom links, rank placement)
- :mod:`.traffic`   exact per-rank bytes of seqmesh's collectives; FSDP and tensor-parallel references
"""
