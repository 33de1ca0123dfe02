"""The ``seqmesh`` command, its benchmarks, the single-process ring emulator they use, and spawned
gloo process groups (tests, demo, benchmarks)."""
