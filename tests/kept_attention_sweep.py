"""keep_attention against plain checkpointing on every tiny config of ``family_cases.family_config``, on Ulysses 2 and
on a ring of 2 (docs/memory.md has the last result; the suite runs six of them, tests/memory/test_memory.py):

    PYTHONPATH=.:tests python tests/kept_attention_sweep.py      # about 3 minutes on 2 cores

One line a case: exact (loss and every gradient bit for bit) with the attention's forward calls of each run, or the
error (a refusal by name is one)."""

from __future__ import annotations

import inspect
import json
import re


def family_names() -> list[str]:
    """Every family name ``family_config`` answers, read from its source, in order."""
    import family_cases

    source = inspect.getsource(family_cases.family_config)
    names = re.findall(r'family == "([^"]+)"', source)
    for group in re.findall(r"family in \(([^)]*)\)", source):
        names += re.findall(r'"([^"]+)"', group)
    return list(dict.fromkeys(names))


def one_case(family: str, ulysses: int, ring: int) -> dict:
    from memory_cases import kept_attention_families

    try:
        return kept_attention_families([(family, ulysses, ring)])[0]
    except Exception as err:  # a refusal by name, or what the sweep is for
        return {"case": (family, ulysses, ring), "error": f"{type(err).__name__}: {err}"[:300]}


def main() -> None:
    from seqmesh.comm.launch import WorkerPool

    pool = None
    for family in family_names():
        for ulysses, ring in ((2, 1), (1, 2)):
            if pool is None or not pool.alive or pool.threads_held() > 100:
                if pool is not None:
                    pool.close()
                pool = WorkerPool(2, threads=1, collective_timeout=60.0)
            try:
                row = pool.run(one_case, family, ulysses, ring, timeout=300)[0]
            except RuntimeError as err:  # a rank crashed or hung: the pool is closed
                row = {"case": (family, ulysses, ring), "error": str(err)[:300]}
            print(json.dumps(row), flush=True)
    if pool is not None:
        pool.close()


if __name__ == "__main__":
    main()
