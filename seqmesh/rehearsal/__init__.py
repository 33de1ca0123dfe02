"""``seqmesh rehearse``: one rank's real training step at full size, on fake tensors and a fake process group.

:mod:`seqmesh.tools.rehearse` (the command) checks the flags and starts a fresh process (:mod:`.child`) that
runs :mod:`.runtime`'s step; :mod:`.workarounds` holds everything fake CUDA needs on a CPU build of torch (or a
CUDA build without a GPU), and :mod:`.cuda_library` builds and loads its C++ part. The
library's data-dependent checks ask :func:`seqmesh.tensor_values.has_values` (is this tensor fake?).
"""
