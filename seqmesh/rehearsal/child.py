"""The rehearsal's own process: ``python -m seqmesh.rehearsal.child '{"config": {...}, "gpus": N}'``
(``"device": "cpu"`` for the CPU kernels; ``"fake": false`` for real tensors, the tests' reference; ``"top": N``
the largest storages at the peak to describe; ``"rank": R`` the rank to run (default 0);
``"media": {"images": N, "height": H, "width": W}`` the images each sequence shows a vision-language model).

Prints the :class:`~seqmesh.rehearsal.runtime.Rehearsal` as one JSON line (its last line of stdout); a
configuration error exits 2 with ``seqmesh: error: <message>`` as the last line of stderr.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    from ..planner.media import Media
    from ..training.config import TrainConfig
    from .runtime import rehearse_rank
    from .cuda_library import CannotRehearse

    request = json.loads(argv[0])
    try:
        result = rehearse_rank(TrainConfig(**request["config"]), int(request["gpus"]),
                               device=request.get("device", "cuda"),
                               fake=request.get("fake", True), top=int(request.get("top", 6)),
                               media=Media(**request["media"]) if request.get("media") else None,
                               rank=int(request.get("rank", 0)))
    except (ValueError, CannotRehearse) as err:
        print(f"seqmesh: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(result.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # the result is out: no interpreter teardown, where the autograd engine's thread for the fake CUDA device has
    # aborted the process once ("terminate called without an active exception", in a make test of 2026-11-29)
    os._exit(code)
