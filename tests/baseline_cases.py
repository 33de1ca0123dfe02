"""The buffer audit on spawned ranks: every tensor a training step creates that is (S, S)-sized or has a
vocabulary-sized dimension, recorded by a dispatch mode, as plain data to assert on."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargeBuffers(TorchDispatchMode):
    """Records ``(op, shape)`` of every operator output with at least ``square`` elements (an (S, S)
    buffer's size) or with a dimension of ``vocab`` entries, with how many times each was made."""

    def __init__(self, square: int, vocab: int):
        super().__init__()
        self.square, self.vocab = square, vocab
        self.squares: Counter = Counter()
        self.vocab_sized: Counter = Counter()
        self.largest_other: tuple[tuple[int, ...], int] = ((), 0)  # the largest output below ``square``

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            shape = tuple(t.shape)
            if t.numel() >= self.square:
                self.squares[str(func), shape] += 1
            elif t.numel() > self.largest_other[1]:
                self.largest_other = (shape, t.numel())
            if self.vocab in shape:
                self.vocab_sized[str(func), shape] += 1
        return out


ODD_VOCAB = 320  # no sequence piece, head count or width of these runs has this size


def odd_vocab_config(preset: str, folder: str) -> str:
    """A config.json of ``preset`` with a vocabulary of :data:`ODD_VOCAB` tokens, so that a dimension of
    that size can only be the vocabulary's."""
    from dataclasses import replace

    from seqmesh.model.lm import hf_config
    from seqmesh.model.presets import model_shape

    hf_config(replace(model_shape(preset), vocab=ODD_VOCAB)).save_pretrained(folder)
    return os.path.join(folder, "config.json")


def audit_seqmesh_step(seq_len: int, ulysses: int, ring: int, loss_chunk: int, options: dict,
                       documents: tuple[int, ...] | None = None) -> dict:
    """Two AdamW steps of the ``seqmesh train`` build (FSDP2, chunked loss) under :class:`LargeBuffers`,
    with the square of the local length as the (S, S) threshold. ``documents``: lengths of packed
    documents (positions restart at each), which ``shard_batch`` lays out per document."""
    import torch.distributed as dist

    from seqmesh.training.config import TrainConfig
    from seqmesh.sequence.batch import shard_batch
    from seqmesh.training.step import make_optimizer
    from seqmesh.training.train import build
    from seqmesh.training.run_data import make_dataset

    folder = tempfile.mkdtemp()
    options = {**options, "model": odd_vocab_config(options.get("model", "llama-tiny"), folder)}
    cfg = TrainConfig(seq_len=seq_len, ulysses=ulysses, ring=ring, dp=1, loss_chunk=loss_chunk,
                      symbols=8, **options)
    data = make_dataset(cfg)
    mesh, module, _ = build(cfg)
    module.train()
    optimizer = make_optimizer(module, lr=1e-4)
    local_len = seq_len // mesh.sp_size
    vocab, hidden = module.lm.config.vocab_size, module.lm.config.hidden_size
    recorder = LargeBuffers(local_len * local_len, vocab)
    with recorder:
        for step in range(2):  # the second step has the optimizer state in place
            batch = data.batch(step, 0, 1, 1)
            if documents is not None:  # (1, S) positions from 0 in each document
                batch["position_ids"] = torch.cat([torch.arange(n) for n in documents]).unsqueeze(0)
            local = shard_batch(batch, mesh)
            layout = local["seqmesh"].layout
            module(**local).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    shutil.rmtree(folder)
    return {"rank": dist.get_rank(), "local_len": local_len, "layout": layout, "vocab": vocab, "hidden": hidden,
            "squares": dict(recorder.squares), "largest_other": recorder.largest_other, "vocab_sized": dict(recorder.vocab_sized)}


class OpNames(TorchDispatchMode):
    """The names of the operators a step runs."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def attention_ops_of_both_sides(seq_len: int) -> dict[str, set[str]]:
    """On one process: the attention and softmax operators of one training step of each side of
    ``seqmesh bench baseline``."""
    from seqmesh.bench.baseline import BaselineBench, run_method

    found = {}
    for method in ("transformers", "seqmesh"):
        recorder = OpNames()
        with recorder:
            run_method(BaselineBench(world=1), method, seq_len, track=False)
        # eager attention shows as a softmax; bmm is left out: torch 2.9 runs transformers' rotary-frequency
        # product (inv_freq @ positions) as a bmm where later releases take mm
        found[method] = {n for n in recorder.names if "attention" in n or "softmax" in n}
    return found
