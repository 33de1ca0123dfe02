"""What rank 0 shows and keeps of a run: a progress line, a JSONL of metrics, a loss-curve PNG."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated on ``device``, or this process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Progress:
    """A bar on a terminal, plain lines otherwise (logs, CI); both end with the same figures."""

    def __init__(self, total: int, start: int = 0, stream=sys.stdout, width: int = 24):
        self.total, self.start, self.stream, self.width = total, start, stream, width
        self.tty = stream.isatty()
        self.began = time.monotonic()

    def update(self, step: int, fields: dict[str, str], *, force_line: bool = False) -> None:
        text = "  ".join(f"{k} {v}" for k, v in fields.items())
        if self.tty:
            done = int(self.width * step / max(self.total, 1))
            bar = "#" * done + "." * (self.width - done)
            self.stream.write(f"\r[{bar}] {step}/{self.total}  {text}\033[K")
            if force_line or step == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"step {step}/{self.total}  {text}\n")
        self.stream.flush()


class MetricsLog:
    """Appends one JSON object per record to ``path`` (kept across resumes)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def keep_until(self, step: int) -> int:
        """Drop the records after ``step`` (a resumed run redoes those steps), and a torn last line, so the
        records the resumed run appends follow whole lines; returns how many records went. The file is
        replaced atomically, so an interruption leaves the old one or the new one."""
        records, whole = self._parse()
        kept = [r for r in records if r.get("step", 0) <= step]
        if len(kept) < len(records) or not whole:
            partial = self.path + ".tmp"
            with open(partial, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(partial, self.path)
        return len(records) - len(kept)

    def read(self) -> list[dict]:
        """Every record. A torn last line (power loss, full disk) is dropped with a warning; a bad line
        anywhere else is a ValueError naming the file and line."""
        return self._parse()[0]

    def _parse(self) -> tuple[list[dict], bool]:
        """(the records, whether the file is whole lines only: no torn last line, a newline at the end)."""
        if not os.path.isfile(self.path):
            return [], True
        with open(self.path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.split("\n")
        records = []
        numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
        for i, (number, line) in enumerate(numbered):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
                records.append(record)
            except ValueError as err:
                if i == len(numbered) - 1:
                    warnings.warn(f"{self.path}: line {number} is cut short ({err}); dropping it, as a run stopped "
                                  "mid-write leaves it.", stacklevel=3)
                    return records, False
                raise ValueError(f"{self.path}, line {number}, is not a JSON record ({err}). Fix or delete that "
                                 "line; seqmesh writes one JSON object per line.") from err
        return records, text == "" or text.endswith("\n")


def plot_loss_curve(records: list[dict], path: str, title: str, chance: float | None = None) -> str | None:
    """Loss (and accuracy, when recorded) against step, as a PNG. Returns the path, or None when
    matplotlib is not installed (``pip install seqmesh[train]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [(r["step"], r["accuracy"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), color="tab:blue", label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    if evals:
        acc = ax.twinx()
        acc.plot(*zip(*evals), "o-", color="tab:orange", label="accuracy (held-out)")
        acc.set_ylabel("accuracy")
        acc.set_ylim(0, 1)
        if chance is not None:
            acc.axhline(chance, color="tab:orange", linestyle=":", linewidth=1, label=f"chance ({chance:.3f})")
        acc.legend(loc="center right")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
