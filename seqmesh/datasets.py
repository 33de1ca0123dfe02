"""Training data: a built-in long-range copy task, and local text or JSONL files packed into sequences.

Both produce whole batches (``input_ids``, ``labels``, optionally ``position_ids`` for packed
documents) for one data-parallel rank at one step, deterministically from ``(seed, step, rank)``,
so a resumed run sees exactly the batches the interrupted one would have.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from .loss import IGNORE_INDEX

FIRST_SYMBOL = 3  # tokens 0-2 are reserved (padding and markers)


@dataclass(frozen=True)
class LongRangeCopy:
    """Recall across shards: the sequence is one random block of ``period`` symbols, repeated.

    Every token after the first block is scored, and the only way to predict it is to find the same
    place in an earlier block, a whole period or more back. With the default period (a quarter of the
    sequence, the shard length on four ranks) the sources of every scored token live in other chunks
    of the zigzag and contiguous layouts, on other ranks: a model whose attention stopped at its own
    shard would stay at chance, ``1 / symbols``.
    """

    seq_len: int
    symbols: int = 32
    period: int | None = None  # default: seq_len // 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 8:
            raise ValueError(f"the copy task needs at least 8 tokens, got {self.seq_len}.")
        if not 1 <= self.block < self.seq_len:
            raise ValueError(f"the copy period must be in [1, {self.seq_len - 1}], got {self.block}.")

    @property
    def block(self) -> int:
        return self.period or self.seq_len // 4

    @property
    def vocab(self) -> int:
        return FIRST_SYMBOL + self.symbols

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        block = torch.randint(FIRST_SYMBOL, self.vocab, (self.block,), generator=g)
        ids = block.repeat(-(-self.seq_len // self.block))[: self.seq_len]
        labels = ids.clone()
        labels[: self.block + 1] = IGNORE_INDEX  # the first block, and the first token of the second
        return ids, labels

    def batch(self, step: int, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * dp_size + dp_rank)
        rows = [self.sample(g) for _ in range(batch_size)]
        return {"input_ids": torch.stack([r[0] for r in rows]), "labels": torch.stack([r[1] for r in rows])}


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258 (0-2 are reserved), for runs without a tokenizer."""

    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]


def load_tokenizer(path: str | None):
    """A local transformers tokenizer directory (never downloaded), or bytes when ``path`` is None."""
    if path is None:
        return ByteTokenizer()
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist; give a local tokenizer folder or omit it for bytes.")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _read_documents(paths: list[str], text_key: str) -> list[str]:
    docs = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"data file {path!r} does not exist.")
        with open(path, encoding="utf-8") as f:
            if path.endswith((".jsonl", ".json")):
                for n, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if text_key not in record:
                            raise ValueError(f"{path}:{n} has no {text_key!r} field; name the text field with --text-key.")
                        docs.append(record[text_key])
            else:
                docs.extend(part for part in f.read().split("\n\n") if part.strip())
    if not docs:
        raise ValueError(f"no documents found in {paths}.")
    return docs


class PackedText:
    """Documents from local ``.txt`` (blank-line separated) or ``.jsonl`` files, tokenized, shuffled
    per epoch and packed end to end into ``seq_len``-token rows; ``position_ids`` restart at each
    document so attention never crosses one."""

    def __init__(self, paths: list[str], seq_len: int, tokenizer=None, *, text_key: str = "text", seed: int = 0):
        self.seq_len = seq_len
        self.seed = seed
        tokenizer = tokenizer or ByteTokenizer()
        self.vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
        self.docs = [torch.tensor(tokenizer.encode(d), dtype=torch.long) for d in _read_documents(paths, text_key)]
        self.docs = [d for d in self.docs if d.numel()]
        self.tokens = sum(d.numel() for d in self.docs)

    def _row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids, positions, filled = [], [], 0
        while filled < self.seq_len:
            doc = self.docs[int(torch.randint(len(self.docs), (1,), generator=g))]
            piece = doc[: self.seq_len - filled]
            ids.append(piece)
            positions.append(torch.arange(piece.numel()))
            filled += piece.numel()
        return torch.cat(ids), torch.cat(positions)

    def batch(self, step: int, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        rows = [self._row((step * dp_size + dp_rank) * batch_size + i) for i in range(batch_size)]
        ids = torch.stack([r[0] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.stack([r[1] for r in rows])}
