"""Training data: a built-in long-range copy task, and local text or JSONL files packed into sequences.

Both produce whole batches (``input_ids``, ``labels``, optionally ``position_ids`` for packed
documents) for one data-parallel rank at one step, deterministically from ``(seed, step, rank)``,
so a resumed run sees exactly the batches the interrupted one would have. ``eval_batch`` is held out:
the copy task draws it from a seed no training step reaches, local text from documents set aside.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from dataclasses import dataclass

import torch

from ..sequence.batch import IGNORE_INDEX
from ..model.pretrained import load_tokenizer_folder

FIRST_SYMBOL = 3  # tokens 0-2 are reserved (padding and markers)
HELD_OUT_STEP = 10**9  # the copy task is seeded by step: training never reaches this one
HELD_OUT_EVERY = 20  # local text: every 20th document is held out for evaluation


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
            raise ValueError(f"the copy task needs at least 8 tokens, got seq_len={self.seq_len}; raise --seq-len.")
        if self.symbols < 1:
            raise ValueError(f"the copy task needs at least 1 symbol, got symbols={self.symbols}.")
        if not 1 <= self.block < self.seq_len - 1:  # the first block and the token after it are not scored
            raise ValueError(f"the copy period must be in [1, {self.seq_len - 2}] (a token after the first block "
                             f"must be left to score at seq_len={self.seq_len}), got {self.block}; omit it for "
                             "seq_len // 4.")

    @property
    def block(self) -> int:
        return self.seq_len // 4 if self.period is None else self.period

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

    def eval_batch(self, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """A batch from a seed no training step draws."""
        return self.batch(HELD_OUT_STEP, dp_rank, batch_size, dp_size)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, for runs without a tokenizer: any vocabulary of 256 or more covers
    them, the tiny presets' included. Nothing is reserved: packed text carries no markers, and the
    padding token 0 that ``seqmesh.shard_batch`` appends is never scored nor seen by real tokens."""

    vocab_size = 256

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def tokenizer_vocab(tokenizer) -> int:
    """Token ids the tokenizer can produce: ``len(tokenizer)`` counts added tokens, ``vocab_size`` does not."""
    return int(len(tokenizer)) if hasattr(tokenizer, "__len__") else int(tokenizer.vocab_size)


def load_tokenizer(path: str | None):
    """A local transformers tokenizer directory (never downloaded), or bytes when ``path`` is None."""
    return ByteTokenizer() if path is None else load_tokenizer_folder(path)


def check_data_paths(paths: list[str]) -> None:
    """Raise naming the first data file that does not exist."""
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"data file {path!r} does not exist.")


def read_text(path: str) -> str:
    """The file as UTF-8, or a ValueError naming the line and byte that are not."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line} is not UTF-8 (byte {err.start} of the file, {raw[err.start:err.start + 1]!r}). "
                         "Convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8), or drop that line.") from None


def jsonl_records(path: str):
    """``(line number, record)`` of every non-blank line of a ``.jsonl`` file, each checked to be a JSON object."""
    for n, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{n} is not valid JSON ({err.args[0] if err.args else err}); each line of a "
                             ".jsonl file must be one JSON object.") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n} is a JSON {type(record).__name__}, not an object of fields.")
        yield n, record


def _read_jsonl(path: str, text_key: str) -> list[str]:
    docs = []
    for n, record in jsonl_records(path):
        if text_key not in record:
            raise ValueError(f"{path}:{n} has no {text_key!r} field; name the text field with --text-key.")
        text = record[text_key]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{n}: the {text_key!r} field is {text!r} ({type(text).__name__}), not a string. "
                             "Fix or drop that record, or name another field with --text-key.")
        docs.append(text)
    return docs


def _read_documents(paths: list[str], text_key: str) -> list[str]:
    check_data_paths(paths)
    docs = []
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            docs.extend(_read_jsonl(path, text_key))
        else:
            docs.extend(part for part in read_text(path).split("\n\n") if part.strip())
    if not docs:
        raise ValueError(f"no documents found in {paths}.")
    return docs


def held_out_documents(count: int) -> list[int]:
    """Indices of the documents kept for evaluation: every 20th, and at least one (the last) when there
    are two or more; a single document is trained on (and evaluation then reads it too)."""
    held = list(range(HELD_OUT_EVERY - 1, count, HELD_OUT_EVERY))
    return held or ([count - 1] if count >= 2 else [])


class _PackedStream:
    """Documents shuffled per epoch and laid end to end; row ``i`` is tokens ``[i*S, (i+1)*S)`` of that
    endless stream, so every token is trained on once per epoch. A document cut by a row boundary goes
    on in the next row as a document of its own (positions from 0 again): attention never crosses a
    row, and a document longer than a row fills whole rows."""

    def __init__(self, docs: list[torch.Tensor], seed: int):
        self.docs, self.seed = docs, seed
        self.tokens = sum(d.numel() for d in docs)
        self._epochs: dict[int, tuple[list[int], list[int]]] = {}

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        """(document order, end offset of each in the epoch) for ``epoch``; the last two are kept."""
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.docs), generator=g).tolist()
            ends = torch.tensor([self.docs[i].numel() for i in order]).cumsum(0).tolist()
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = (order, ends)
        return self._epochs[epoch]

    def row(self, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, offset = divmod(index * seq_len, self.tokens)
        ids, positions, need = [], [], seq_len
        while need:
            order, ends = self._epoch(epoch)
            k = bisect_right(ends, offset)  # the document holding stream offset ``offset``
            doc = self.docs[order[k]]
            begin = offset - (ends[k] - doc.numel())
            piece = doc[begin : begin + need]
            ids.append(piece)
            positions.append(torch.arange(piece.numel()))
            need -= piece.numel()
            offset += piece.numel()
            if offset == self.tokens:
                epoch, offset = epoch + 1, 0
        return torch.cat(ids), torch.cat(positions)


def _check_targets(paths: list[str], seq_len: int, docs: list[torch.Tensor]) -> None:
    """Raise when no row can hold a target: a token is scored only when the next token of its document
    is in the same row, so rows of one token, or documents of one token, train nothing (loss 0)."""
    files = ", ".join(paths)
    if seq_len < 2:
        raise ValueError(f"{files}: no target tokens at --seq-len {seq_len}: a row of one token has no next token to "
                         "predict. Raise --seq-len to 2 or more.")
    if max(d.numel() for d in docs) < 2:
        raise ValueError(f"{files} has no target tokens at --seq-len {seq_len}: each of its {len(docs)} training "
                         "documents is a single token, and a token is scored only when the next token of its own "
                         "document follows it. Give documents of two or more tokens (in .txt files a blank line "
                         "separates documents; in .jsonl files each record is one).")


class PackedText:
    """Documents from local ``.txt`` (blank-line separated) or ``.jsonl`` files, tokenized, shuffled
    per epoch and packed end to end into ``seq_len``-token rows; ``position_ids`` restart at each
    document (and at each row) so attention never crosses one. Every 20th document (at least one) is
    held out for :meth:`eval_batch`."""

    def __init__(self, paths: list[str], seq_len: int, tokenizer=None, *, text_key: str = "text", seed: int = 0):
        self.seq_len = seq_len
        self.seed = seed
        tokenizer = tokenizer or ByteTokenizer()
        self.vocab = tokenizer_vocab(tokenizer)
        docs = [torch.tensor(tokenizer.encode(d), dtype=torch.long) for d in _read_documents(paths, text_key)]
        docs = [d for d in docs if d.numel()]
        if not docs:
            raise ValueError(f"the documents in {paths} are all empty after tokenization.")
        held = set(held_out_documents(len(docs)))
        self.train_docs = [d for i, d in enumerate(docs) if i not in held]
        self.eval_docs = [d for i, d in enumerate(docs) if i in held] or self.train_docs
        _check_targets(paths, seq_len, self.train_docs)
        self._train = _PackedStream(self.train_docs, seed)
        self._eval = _PackedStream(self.eval_docs, seed + 1)
        self.tokens = self._train.tokens  # training tokens per epoch

    @staticmethod
    def _rows(stream: _PackedStream, first: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        rows = [stream.row(first + i, seq_len) for i in range(batch_size)]
        ids = torch.stack([r[0] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.stack([r[1] for r in rows])}

    def batch(self, step: int, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        return self._rows(self._train, (step * dp_size + dp_rank) * batch_size, batch_size, self.seq_len)

    def eval_batch(self, dp_rank: int, batch_size: int = 1, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """Rows of the held-out documents only."""
        return self._rows(self._eval, dp_rank * batch_size, batch_size, self.seq_len)
