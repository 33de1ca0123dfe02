"""The longest sequence a family with a fixed table of positions can number: one rule, read by ``seqmesh plan`` (the
workload), ``seqmesh train`` and ``verify`` (before anything is built). Torch-free.

GPT-2, GPT-BigCode (StarCoder), the original GPT, OPT, XLM and TrOCR's decoder (by default) look each position up in a
learned table; CTRL in a table of sinusoids made once. A position past the table's last row is an index out of range
inside the embedding: on a GPU, a device-side assert in the middle of the first step. Their config.json names the
rows (``n_positions``, OPT's and TrOCR's ``max_position_embeddings``); the rule reads them as :func:`position_rows`
gives them.
"""

from __future__ import annotations

# model_type -> the config.json entry naming its table's rows, and their config class's default where the file says
# nothing (the learned tables' parameters: seqmesh.model.shapes.ModelShape.position_params)
TABLES = {"gpt2": ("n_positions", 1024), "gpt_bigcode": ("n_positions", 1024), "openai-gpt": ("n_positions", 512),
          "ctrl": ("n_positions", 256), "opt": ("max_position_embeddings", 2048),
          "trocr": ("max_position_embeddings", 512), "xlm": ("max_position_embeddings", 512)}


def position_rows(cfg: dict) -> int:
    """The positions a config.json's family can number (0: no table, no limit)."""
    entry = TABLES.get(cfg.get("model_type"))
    if entry is None or cfg.get("use_learned_position_embeddings") is False:  # TrOCR's sinusoids grow as needed
        return 0
    name, default = entry
    rows = cfg.get(name, default)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else default


def position_problem(seq_len: int, rows: int, family: str) -> str | None:
    """Why a sequence of ``seq_len`` tokens cannot be numbered by ``family``'s (a model_type's) table of ``rows``
    positions, or None."""
    if not rows or seq_len <= rows:
        return None
    entry = TABLES.get(family, ("n_positions",))[0]
    return (f"a sequence of {seq_len} tokens is longer than its table of {rows} positions ({entry}={rows}): the "
            f"positions past it have no row; use --seq-len at most {rows} (a generation: its prompt and new tokens "
            f"together), or give the model a longer table (raise {entry} and train the new rows)")
