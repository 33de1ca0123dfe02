"""Training parity, run on every rank: seqmesh (SP, optional FSDP2) vs one process on the whole batch.

The reference is the unmodified transformers model (its own SDPA attention, which masks packed
documents from position_ids) on the whole batch, with a loss written out here: the mean
cross-entropy of every next-token target except the last token of each document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from seqmesh.model.fsdp import apply_fsdp, enable_checkpointing, sync_gradients
from seqmesh.hf import parallelize
from seqmesh.model.lm import SequenceParallelLM, build_model


@dataclass(frozen=True)
class TrainCase:
    model: str
    ulysses: int
    ring: int
    dp_shard: int = 1
    fsdp: bool = False
    documents: bool = False
    seq_len: int = 45  # not a multiple of 2P for the meshes used
    steps: int = 3
    layout: str = "zigzag"
    checkpointing: bool = False
    bf16: bool = False
    dp_replicate: int = 1

    @property
    def name(self) -> str:
        extras = "".join(f"-{flag}" for flag in ("checkpointing", "bf16") if getattr(self, flag))
        return (f"{self.model}-u{self.ulysses}r{self.ring}dp{self.dp_shard}rep{self.dp_replicate}"
                f"-{'fsdp' if self.fsdp else 'nofsdp'}-{'docs' if self.documents else 'nodocs'}-S{self.seq_len}"
                f"-{self.layout}{extras}")

    @property
    def world(self) -> int:
        return self.ulysses * self.ring * self.dp_shard * self.dp_replicate

    @property
    def data_parallel(self) -> int:
        return self.dp_shard * self.dp_replicate


def _sample(case: TrainCase, index: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(0, vocab, (1, case.seq_len), generator=g)
    if not case.documents:
        return {"input_ids": ids}
    cuts = [0, 1, 9 + index, 10 + index, 30, case.seq_len]  # includes documents of length 1
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]
    return {"input_ids": ids, "position_ids": positions}


def _reference_loss(model, batches: list[dict]) -> torch.Tensor:
    total, count = 0.0, 0
    for batch in batches:
        ids = batch["input_ids"]
        logits = model(input_ids=ids, position_ids=batch.get("position_ids"), use_cache=False).logits[0]
        targets = ids[0, 1:].clone()
        if "position_ids" in batch:  # a document's last token predicts nothing
            pos = batch["position_ids"][0]
            targets[pos[1:] == 0] = -100
        total = total + F.cross_entropy(logits[:-1].float(), targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def training_parity(case: TrainCase) -> dict:
    mesh = get_mesh(case.ulysses, case.ring, case.dp_shard, case.dp_replicate)
    reference = build_model(case.model, seed=0)
    sp = SequenceParallelLM(parallelize(build_model(case.model, seed=0), mesh), mesh, chunk=16)
    if case.checkpointing:
        enable_checkpointing(sp.lm)
    if case.fsdp:
        apply_fsdp(sp, mesh, bf16=case.bf16)
    vocab = reference.config.vocab_size
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    sp_opt = torch.optim.AdamW(sp.parameters(), lr=1e-3, fused=True)  # seqmesh train's kernel (make_optimizer)

    result = {"case": case.name, "loss": [], "grad": [], "weight": 0.0}
    for step in range(case.steps):
        samples = [_sample(case, step * case.data_parallel + d, vocab) for d in range(case.data_parallel)]
        ref_loss = _reference_loss(reference, samples)
        ref_loss.backward()

        local = seqmesh.shard_batch(samples[mesh.dp_rank], mesh, layout=case.layout)
        loss = sp(**local)
        loss.backward()
        if not case.fsdp:
            sync_gradients(sp, mesh)

        ref_grads = dict(reference.named_parameters())
        worst = 0.0
        for name, p in sp.named_parameters():
            want = ref_grads[name.removeprefix("lm.")].grad
            worst = max(worst, float((_full(p.grad) - want).abs().max() / want.abs().max().clamp(min=1e-12)))
        result["loss"].append(abs(loss.item() - ref_loss.item()))
        result["grad"].append(worst)
        ref_opt.step()
        sp_opt.step()
        ref_opt.zero_grad()
        sp_opt.zero_grad()
    ref_weights = dict(reference.named_parameters())
    for name, p in sp.named_parameters():
        want = ref_weights[name.removeprefix("lm.")].detach()
        result["weight"] = max(result["weight"], float((_full(p.detach()) - want).abs().max()))
    return result
