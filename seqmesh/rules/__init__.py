"""The rules the runtime and the planner share, each written once: what a run is and how its settings must agree
(:mod:`.settings`, the one record the job, ``parallelize_model`` and the planner take, and :mod:`.flags`, the
command-line flags generated from it), how many ranks each parallelism gets and what it refuses (:mod:`.degrees`),
how Ulysses deals heads (:mod:`.heads`), how long a padded sequence becomes (:mod:`.padding`), how big generation's KV cache is on a rank (:mod:`.kv_cache`), how much of a
pipelined collective stays exposed (:mod:`.overlap`) and the sizes a decoder's config may hold
(:mod:`.model_sizes`). Torch-free (``seqmesh plan`` imports them without torch); nothing here imports the runtime
or the planner."""
