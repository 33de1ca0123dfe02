"""``seqmesh rehearse``: one rank's real training step at full size, on fake tensors and a fake process group.

:mod:`.runtime` runs the step (in a fresh process, started by :mod:`.command`); :mod:`.values` is the one hook
the library's data-dependent checks ask (is this tensor fake, with no values to read?).
"""
