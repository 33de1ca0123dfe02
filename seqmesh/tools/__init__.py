"""The ``seqmesh`` command line (cli.py) and its train / verify flags generated from TrainConfig
(flags.py). Benchmarks are ``seqmesh.bench``; spawned process groups ``seqmesh.comm.launch``."""
