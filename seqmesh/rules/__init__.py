"""The rules the runtime and the planner share, each written once: how many ranks each parallelism gets and what
it refuses (:mod:`.degrees`), how Ulysses deals heads (:mod:`.heads`), how long a padded sequence becomes
(:mod:`.padding`), how much of a pipelined collective stays exposed (:mod:`.overlap`) and the sizes a decoder's
config may hold (:mod:`.model_sizes`). Torch-free (``seqmesh plan`` imports them without torch); nothing here imports the
runtime or the planner."""
