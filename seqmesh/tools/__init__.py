"""The ``seqmesh`` command, the single-process ring emulator the benchmarks (``seqmesh.bench``) use,
and spawned gloo process groups (tests, demo, benchmarks)."""
