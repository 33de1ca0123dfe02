"""The main job: train a transformers causal LM with Ulysses x ring sequence parallelism and FSDP2.

``train(TrainConfig(...))`` runs on every rank of an initialised process group (``seqmesh train``
under torchrun, or ``seqmesh demo``'s spawned CPU ranks). Every configuration error is raised before
any model is built.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import shard_batch
from .datasets import LongRangeCopy, PackedText, check_data_paths, check_tokenizer_path, load_tokenizer, tokenizer_vocab
from .fsdp import apply_fsdp, enable_checkpointing, sync_gradients
from ..hf import parallelize, workable_degrees
from ..mesh import SPMesh, init_mesh
from .metrics import MetricsLog, Progress, peak_memory_bytes, plot_loss_curve
from .model import SequenceParallelLM, build_model, has_weights, materialize
from .presets import model_shape


def resolve_degrees(cfg: TrainConfig, world: int, q_heads: int, ranks_per_node: int) -> tuple[int, int, int]:
    """``(ulysses, ring, dp_shard)`` for ``world`` ranks; raises listing the choices that would work."""
    per_replica, rem = divmod(world, cfg.dp_replicate)
    if rem:
        raise ValueError(f"dp_replicate={cfg.dp_replicate} does not divide the {world} ranks.")
    fixed = {k: int(v) for k, v in (("ulysses", cfg.ulysses), ("ring", cfg.ring), ("dp", cfg.dp)) if v != "auto"}
    dp = fixed.get("dp", 1 if "ulysses" not in fixed or "ring" not in fixed else 0)
    if not dp:  # both sequence degrees fixed: data parallelism takes what is left
        dp, rem = divmod(per_replica, fixed["ulysses"] * fixed["ring"])
        if rem or dp < 1:
            raise ValueError(f"ulysses={fixed['ulysses']} x ring={fixed['ring']} does not divide the {per_replica} "
                             f"ranks per replica; choose degrees whose product divides {per_replica}.")
    sp, rem = divmod(per_replica, dp)
    if rem:
        raise ValueError(f"dp={dp} does not divide the {per_replica} ranks per replica.")
    if "ulysses" in fixed:
        ulysses = fixed["ulysses"]
    elif "ring" in fixed:
        ulysses = sp // fixed["ring"]
    else:  # Ulysses inside a node, as wide as the heads allow; the ring takes the rest
        ulysses = max(u for u in range(1, sp + 1) if sp % u == 0 and u <= q_heads and u <= max(ranks_per_node, 1))
    ring = fixed.get("ring", sp // max(ulysses, 1))
    if ulysses * ring != sp:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {ulysses * ring} but the sequence group has {sp} ranks "
                         f"({world} ranks / dp {dp} / dp_replicate {cfg.dp_replicate}).")
    if ulysses > q_heads:
        options = ", ".join(f"ulysses={u} ring={r}" for u, r in workable_degrees(q_heads, sp))
        raise ValueError(f"the model has {q_heads} query heads, too few for ulysses={ulysses}; with {sp} sequence "
                         f"ranks use one of: {options}.")
    if cfg.seq_len < sp:
        raise ValueError(f"seq_len={cfg.seq_len} is smaller than the sequence degree {sp}; every rank needs a token.")
    return ulysses, ring, dp


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _copy_task(cfg: TrainConfig, vocab: int) -> LongRangeCopy:
    task = LongRangeCopy(cfg.seq_len, symbols=cfg.symbols, period=cfg.copy_period, seed=cfg.seed)
    if task.vocab > vocab:
        raise ValueError(f"the copy task uses {task.vocab} tokens ({cfg.symbols} symbols + 3 reserved) but the model's "
                         f"vocabulary has {vocab}; lower --symbols to {vocab - 3} or use a larger vocabulary.")
    return task


def _tokenizer(cfg: TrainConfig, vocab: int):
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer_vocab(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {tokenizer_vocab(tokenizer)} tokens but the model's vocabulary has {vocab}; "
                         "use a model whose vocab_size covers the tokenizer.")
    return tokenizer


def make_dataset(cfg: TrainConfig, vocab: int | None = None) -> LongRangeCopy | PackedText:
    """The run's data: the copy task, or ``cfg.data`` packed into rows. Raises for missing files or
    tokenizer, or a model vocabulary (``vocab``; by default read from ``cfg.model``'s config, no model
    built) too small for the data. ``train`` and ``verify`` call it before building anything."""
    vocab = model_shape(cfg.model).vocab if vocab is None else vocab
    if not cfg.data:
        check_tokenizer_path(cfg.tokenizer)  # unused by the copy task, but a wrong path is still a mistake
        return _copy_task(cfg, vocab)
    check_data_paths(cfg.data)  # cheaper than loading a tokenizer first
    return PackedText(cfg.data, cfg.seq_len, _tokenizer(cfg, vocab), text_key=cfg.text_key, seed=cfg.seed)


def _device() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build(cfg: TrainConfig) -> tuple[SPMesh, SequenceParallelLM, torch.device]:
    """Check the degrees and devices, then build the mesh and the parallelized, sharded model (the
    data is checked by ``make_dataset``, which callers run first)."""
    q_heads = model_shape(cfg.model).heads  # a preset, a config.json, or a checkpoint folder's config
    world = dist.get_world_size()
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ulysses, ring, dp = resolve_degrees(cfg, world, q_heads, ranks_per_node)
    if cfg.bf16 and not cfg.fsdp and not torch.cuda.is_available():
        raise ValueError("--bf16 without FSDP uses autocast, which needs a CUDA device here; keep FSDP on.")
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # once attention sharpens, exp() underflows into denormals that slow CPU kernels several-fold
        torch.set_flush_denormal(True)
    mesh = init_mesh(ulysses, ring, dp_shard=dp, dp_replicate=cfg.dp_replicate, device_type=device.type)
    # With FSDP a randomly initialised model is built on the meta device and only its shards are ever
    # allocated (Llama-3-70B could not otherwise start); a checkpoint folder is loaded whole, then sharded.
    on_meta = cfg.fsdp and not has_weights(cfg.model)
    lm = build_model(cfg.model, seed=cfg.seed, device="meta" if on_meta else device)
    lm = parallelize(lm, mesh, backend=cfg.backend)
    module = SequenceParallelLM(lm, mesh, chunk=cfg.loss_chunk)
    if cfg.checkpointing:
        enable_checkpointing(lm)
    if cfg.fsdp:
        apply_fsdp(module, mesh, bf16=cfg.bf16)
    if on_meta:
        materialize(module, device, cfg.seed)
    return mesh, module, device


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def evaluate(module: SequenceParallelLM, data, mesh: SPMesh, cfg: TrainConfig, device: torch.device) -> float:
    """Accuracy of argmax predictions on the scored tokens of the data's held-out batch."""
    module.eval()
    batch = data.eval_batch(mesh.dp_rank, cfg.batch, mesh.dp_size)
    local = _to(shard_batch(batch, mesh, layout=cfg.layout), device)
    with torch.no_grad():
        counts = module.score(**local)
    dist.all_reduce(counts, group=mesh.all_group)
    module.train()
    return float(counts[0] / counts[1].clamp(min=1))


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg`` on this rank; returns the final figures (the same on every rank)."""
    data = make_dataset(cfg)  # data and vocabulary errors come before any model is built
    mesh, module, device = build(cfg)
    rank0 = dist.get_rank() == 0
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    folder = os.path.join(cfg.out, "checkpoints")
    start = 0
    if cfg.resume and (path := latest_checkpoint(folder)) is not None:
        start = load_checkpoint(path, module, optimizer)["step"]
    log = MetricsLog(os.path.join(cfg.out, "metrics.jsonl"))
    if rank0 and start == 0 and os.path.exists(log.path):
        os.remove(log.path)  # a fresh run starts a fresh curve; a resumed one continues it
    elif rank0 and start:
        log.keep_until(start)  # steps logged after the checkpoint are redone: drop them, or they would repeat
    if rank0:
        log.write({"kind": "config", "step": start, "config": asdict(cfg), "mesh": repr(mesh)})
    progress = Progress(cfg.steps, start) if rank0 else None
    tokens_per_step = mesh.dp_size * cfg.batch * cfg.seq_len
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and not cfg.fsdp)
    module.train()
    loss_value, accuracy, window_start, window_steps = float("nan"), float("nan"), time.perf_counter(), 0
    for step in range(start, cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        local = _to(shard_batch(data.batch(step, mesh.dp_rank, cfg.batch, mesh.dp_size), mesh, layout=cfg.layout), device)
        with autocast:
            loss = module(**local)
        loss.backward()
        if not cfg.fsdp:
            sync_gradients(module, mesh)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_steps += 1
        done = step + 1
        log_now = done % cfg.log_every == 0 or done == cfg.steps
        eval_now = done == cfg.steps or (cfg.eval_every > 0 and done % cfg.eval_every == 0)
        save_now = cfg.save_every > 0 and done % cfg.save_every == 0 and done != cfg.steps
        if not (log_now or eval_now or save_now):
            continue
        loss_value = float(loss.detach())  # waits for the step to finish: what follows is not training time
        paused = time.perf_counter()
        fields = {}
        if log_now:
            tokens_per_s = tokens_per_step * window_steps / (paused - window_start)
            if rank0:
                memory = peak_memory_bytes(device)
                log.write({"kind": "train", "step": done, "loss": loss_value, "lr": lr_at(cfg, step),
                           "tokens_per_s": tokens_per_s, "peak_memory_bytes": memory})
                fields = {"loss": f"{loss_value:.4f}", "tok/s": f"{tokens_per_s:,.0f}", "mem": f"{memory / 2**30:.2f}GiB"}
        if eval_now:
            accuracy = evaluate(module, data, mesh, cfg, device)
            if rank0:
                log.write({"kind": "eval", "step": done, "accuracy": accuracy})
                fields["acc"] = f"{accuracy:.3f}"
        if rank0 and fields:
            progress.update(done, fields)
        if save_now:
            save_checkpoint(folder, done, module, optimizer, {"config": asdict(cfg)})
        if log_now:  # a new throughput window
            window_start, window_steps = time.perf_counter(), 0
        else:  # evaluation and saving are not training time
            window_start += time.perf_counter() - paused
    if start < cfg.steps:
        save_checkpoint(folder, cfg.steps, module, optimizer, {"config": asdict(cfg)})
    curve = None
    if rank0:
        title = (f"{cfg.model}, {cfg.seq_len:,} tokens, ulysses {mesh.ulysses} x ring {mesh.ring} "
                 f"x dp {mesh.dp_size}")
        chance = 1 / cfg.symbols if not cfg.data else None
        curve = plot_loss_curve(log.read(), os.path.join(cfg.out, "loss_curve.png"), title, chance)
    return {"loss": loss_value, "accuracy": accuracy, "mesh": repr(mesh), "loss_curve": curve, "steps": cfg.steps}
