"""The main job: train a transformers causal LM with Ulysses x ring sequence parallelism and FSDP2.

``train(TrainConfig(...))`` runs on every rank of an initialised process group (``seqmesh train``
under torchrun, or ``seqmesh demo``'s spawned CPU ranks). Every configuration error is raised before
any model is built.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..comm.ranks import agree, all_gather_object
from ..compose import parallelize_model
from ..rules.degrees import check_tensor_parallel_sizes, resolve_degrees
from ..experts.rules import check_expert_parallel
from ..hf.compressed_attention import is_compressed
from ..hf.indexed_attention import is_indexed
from ..hf.mixers import has_mixers
from ..kernels.sparse_latent import PROBE as SPARSE_PROBE
from ..linear_attention.decay_scan import SCAN_PROBE
from ..linear_attention.carry import CARRY_PROBE
from ..linear_attention.kernels import probe_kernels
from ..memory import MemoryTracker
from ..mesh import SPMesh, init_mesh
from ..model.lm import ModelSource, SequenceParallelLM, build_model, materialize
from ..model.pretrained import check_pretrained, check_values, checkpoint_files, load_pretrained
from ..model.writer import export_pretrained
from .checkpoint import check_output_dir, load_checkpoint, prune_checkpoints, save_checkpoint
from .config import TrainConfig
from ..inputs import shard_batch
from .run_data import make_dataset, read_run_model
from .step import evaluate, forward_backward, make_optimizer, step_autocast, step_offload, to_device
from .metrics import MetricsLog, Progress, peak_memory_bytes, plot_loss_curve
from .outlock import lock_output
from .resume import choose_start, config_changes, refuse_changes, run_record
from .heartbeat import job_heartbeat
from .watch import StallWatch, nonfinite_message


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _same_error_on_every_rank(fn, *args):
    """``fn(*args)``, with a ValueError or OSError (an unreadable file) raised on any rank raised on every
    rank as a ValueError with the first such rank's message: a check that fails on one rank alone would
    leave the others waiting in the next collective."""
    try:
        result, problem = fn(*args), None
    except (ValueError, OSError) as err:
        result, problem = None, str(err)
    problems = [p for p in all_gather_object(problem) if p is not None]
    if problems:
        raise ValueError(problems[0])
    return result


def _device() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def uses_fsdp(cfg: TrainConfig) -> bool:
    """Whether this run shards with FSDP2 (``TrainConfig.fsdp``, resolved for this world)."""
    return cfg.uses_fsdp(dist.get_world_size())


def build(cfg: TrainConfig, source: ModelSource | None = None,
          files: dict[str, str] | None = None) -> tuple[SPMesh, SequenceParallelLM, torch.device]:
    """Check the degrees and devices, then build the mesh and the parallelized model, sharded with FSDP2
    when :func:`uses_fsdp` (the data is checked by ``make_dataset``, which callers run first). ``source``: the model
    as the job read it (read here when not given); ``files``: a checkpoint folder's, as :func:`read_inputs` read them."""
    source = source if source is not None else read_run_model(cfg)
    mesh, device = build_mesh(cfg, source=source)
    return mesh, build_module(cfg, mesh, device, source, files), device


def read_inputs(cfg: TrainConfig) -> tuple[ModelSource, object, dict[str, str] | None]:
    """What the job reads before any model, each once, with every rank given the same first error in one round:
    the model (:func:`~.run_data.read_run_model`), the data (``make_dataset``) and a checkpoint folder's index and
    headers."""
    def read():
        source = read_run_model(cfg)
        data = make_dataset(cfg, source=source)
        files = checkpoint_files(cfg.model, uses_fsdp(cfg)) if source.pretrained else None
        return source, data, files

    return _same_error_on_every_rank(read)


def build_mesh(cfg: TrainConfig, device: torch.device | None = None, *,
               source: ModelSource) -> tuple[SPMesh, torch.device]:
    """The checks of :func:`build` and its mesh on ``device`` (default: this rank's): every configuration error is
    raised here, before any model. Apart from :func:`build_module` so that ``seqmesh rehearse`` builds the mesh from
    real tensors and the model from fake ones (on its fake device)."""
    shape = source.shape  # a preset, a config.json, or a checkpoint folder's config
    # Ulysses deals the decoder's heads and, in a vision-language model, the tower's: the fewer bound it
    q_heads = min(shape.fewest_heads, shape.vision.heads) if shape.vision is not None else shape.fewest_heads
    world = dist.get_world_size()
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    sizes = dict(heads=shape.heads, kv_heads=shape.kv_heads, intermediate=shape.intermediate, vocab=shape.vocab)
    if cfg.tp > 1:  # the sizes tensor parallelism splits, before any mesh or model (the layers are checked once built)
        if shape.vision is not None:
            raise ValueError(f"{cfg.model} is a vision-language model; seqmesh's tensor parallelism covers text "
                             "decoders only so far. Train it with --tp 1 (Ulysses and ring shard its tower and decoder).")
        # every size first, so tp at or above the heads is named with the degrees that fit all of them
        check_tensor_parallel_sizes(cfg.tp, cfg.ulysses if isinstance(cfg.ulysses, int) else 1, **sizes)
    ulysses, ring, dp = resolve_degrees(world, **cfg.degrees(), q_heads=q_heads, ranks_per_node=ranks_per_node,
                                        seq_len=cfg.seq_len)  # tp is given (cfg.tp), never auto
    check_tensor_parallel_sizes(cfg.tp, ulysses, **sizes)
    fsdp = uses_fsdp(cfg)
    # the rule parallelize_model applies, from the model's shape: refused before any mesh, alike on every rank
    check_expert_parallel(cfg.ep, experts=shape.experts, token_ranks=world // cfg.tp, tp=cfg.tp, fsdp=fsdp,
                          compile=cfg.compile, model=cfg.model)
    device = device or _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # once attention sharpens, exp() underflows into denormals that slow CPU kernels several-fold
        torch.set_flush_denormal(True)
    mesh = init_mesh(ulysses, ring, dp_shard=dp, dp_replicate=cfg.dp_replicate, tp=cfg.tp, device_type=device.type,
                     timeout=cfg.timeout)
    return mesh, device


def build_module(cfg: TrainConfig, mesh: SPMesh, device: torch.device, source: ModelSource,
                 files: dict[str, str] | None = None, fake: bool = False) -> SequenceParallelLM:
    """The parallelized model of :func:`build` on ``mesh``, its weights on ``device`` (or the host, offloaded).
    ``fake``: built under a ``FakeTensorMode`` (a rehearsal), whose tensors hold no values, so none are drawn, and
    no optional CUDA kernel is probed (its fake tensors take the torch rules, and a probe there could only fail and
    warn of a fix the GPU does not need); on a real device each kernel is run once first."""
    fsdp = uses_fsdp(cfg)
    # With FSDP the model is built on the meta device and only its shards are ever allocated, random or
    # read from a checkpoint folder (Llama-3-70B could not otherwise start); without FSDP a folder is loaded whole.
    on_meta, pretrained = fsdp, source.pretrained
    if pretrained and files is None:  # the files' index and headers, read on every rank: cheap, before any model
        files = _same_error_on_every_rank(checkpoint_files, cfg.model, on_meta)  # without FSDP: .bin files too
    lm = build_model(source, seed=cfg.seed, device="meta" if on_meta else device, values=not fake)
    if pretrained and not on_meta:  # loaded whole by from_pretrained: its values checked in memory
        check_values(lm, cfg.model, files)
    # names and shapes, before any work
    sources = _same_error_on_every_rank(check_pretrained, lm, cfg.model, files) if on_meta and pretrained else None
    module = parallelize_model(lm, mesh, cfg.parallel_plan(fsdp))
    home = "cpu" if cfg.fsdp_cpu_offload else device  # offloaded shards live on the host
    if on_meta and pretrained:
        load_pretrained(module, cfg.model, home, sources)
    elif on_meta:
        materialize(module, home, cfg.seed, values=not fake)
    if cfg.fsdp_cpu_offload:  # offloaded shards live on the host, buffers (RoPE tables) on the device
        for sub in module.modules():
            for name, buffer in sub.named_buffers(recurse=False):
                setattr(sub, name, buffer.to(device))
    if not fake and device.type == "cuda" and has_mixers(module):  # a recurrent kernel failing on this GPU warns now
        probe_kernels(device)
        CARRY_PROBE.probe_all(device)
        SCAN_PROBE.probe_all(device)
    if not fake and device.type == "cuda" and any(is_indexed(m) or is_compressed(m) for m in module.modules()):
        SPARSE_PROBE.probe_all(device)
    return module


class TrainingRun:
    """One run on this rank: where it starts, its model and optimizer, and what it logs and saves.

    ``run()`` repeats :meth:`step` and, on their schedules, :meth:`log`, :meth:`evaluate` and :meth:`save`.
    Every configuration, output-folder and resume error is raised before the model is built. The run
    holds ``out``'s lock (:mod:`.outlock`) from before it reads anything there until ``run()`` ends, and
    beats a heartbeat (:mod:`.heartbeat`) as long: a rank that stops answering ends the job within
    ``cfg.timeout``, named with the phase it was in (:meth:`phase`)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        check_output_dir(cfg.out)
        self.lock = None
        self.heartbeat = job_heartbeat(cfg.timeout)
        try:
            self.phase("setup: locking the output folder")
            self.lock = lock_output(cfg.out)  # before the old run in out is looked at, let alone cleared
            self._prepare()
        except BaseException:
            self._close()
            raise

    def phase(self, name: str) -> None:
        """This rank is now in ``name`` ("step 5: backward"): what the heartbeat tells if the rank stops."""
        if self.heartbeat is not None:
            self.heartbeat.enter(name)

    def _close(self) -> None:
        if self.lock is not None:
            self.lock.release()
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def _prepare(self) -> None:
        cfg = self.cfg
        self.phase("setup: checking the data")
        source, self.data, files = read_inputs(cfg)  # model, data and vocabulary errors, before any model
        self.start_point = choose_start(cfg)
        self.phase("setup: building the model")
        self.mesh, self.module, self.device = build(cfg, source, files)
        self.fsdp = uses_fsdp(cfg)
        self.rank0 = dist.get_rank() == 0
        self.optimizer = make_optimizer(self.module, cfg.lr, cfg.weight_decay)
        self.folder = os.path.join(cfg.out, "checkpoints")
        self.phase("setup: loading the checkpoint")
        self.start = self._resume()
        self.log_file = MetricsLog(os.path.join(cfg.out, "metrics.jsonl"))
        self.tokens_per_step = self.mesh.dp_size * cfg.batch * cfg.seq_len
        self.autocast = step_autocast(cfg, self.device, self.fsdp)
        self.loss, self.accuracy, self.skipped = float("nan"), float("nan"), 0
        self.offload = step_offload(cfg, self.module, self.device)
        self.memory = None  # the last step's MemoryReport, with --track-memory
        self.window_start, self.window_steps = time.perf_counter(), 0

    def _resume(self) -> int:
        point = self.start_point
        if point.checkpoint is None:
            return 0
        changes = config_changes(point.saved, self.cfg, self.mesh.dp_size)
        if changes and not self.cfg.allow_config_change:
            refuse_changes(point.checkpoint, changes)  # the data-parallel degree is known only now
        point.changes = changes
        load_checkpoint(point.checkpoint, self.module, self.optimizer)
        return point.step

    def _start_log(self) -> None:
        if not self.rank0:
            return
        if self.start:
            self.log_file.keep_until(self.start)  # steps logged after the checkpoint are redone: drop them
        if self.start_point.changes:
            self.log_file.write({"kind": "config_change", "step": self.start, "from": self.start_point.checkpoint,
                                 "changes": self.start_point.changes})
        self.log_file.write({"kind": "config", "step": self.start, "config": asdict(self.cfg), "mesh": repr(self.mesh),
                             "fsdp": self.fsdp,  # config's fsdp may be unset: what this world made of it
                             "resumed_from": self.start_point.checkpoint})
        if self.start_point.checkpoint is not None:
            print(self.start_point.describe(), flush=True)

    def step(self, step: int) -> bool:
        """One optimizer step (0-based ``step``); False if it was skipped for a non-finite loss or gradient."""
        if not self.cfg.track_memory:
            return self._step(step)
        with MemoryTracker(self.module, self.optimizer, device=self.device, offload=self.offload) as tracker:
            done = self._step(step)
        self.memory = tracker.report()
        return done

    def _step(self, step: int) -> bool:
        cfg = self.cfg
        lr = lr_at(cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.phase(f"step {step + 1}: reading the batch")
        batch = self.data.batch(step, self.mesh.dp_rank, cfg.batch, self.mesh.dp_size)
        local = to_device(shard_batch(batch, self.mesh, model=self.module, layout=cfg.layout), self.device)
        compiling = " (compiling)" if cfg.compile and step == self.start else ""
        def phase(name: str) -> None:
            self.phase(f"step {step + 1}: {name}{compiling if name != 'gradients and optimizer' else ''}")

        loss, norm = forward_backward(self.module, local, self.mesh, cfg, self.autocast, self.fsdp, phase)
        self.loss_tensor = loss.detach()
        finite = bool(torch.isfinite(self.loss_tensor) & torch.isfinite(norm))  # the same on every rank
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            if cfg.on_nonfinite == "stop":
                raise FloatingPointError(nonfinite_message(step + 1, float(loss), float(norm), lr))
            self.skipped += 1
            if self.rank0:
                self.log_file.write({"kind": "skipped", "step": step + 1, "loss": str(float(loss)),
                                     "grad_norm": str(float(norm))})
                print(f"step {step + 1}: non-finite loss {float(loss)} or gradient norm {float(norm)}; step skipped "
                      f"({self.skipped} so far).", file=sys.stderr, flush=True)
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def log(self, done: int, paused: float) -> dict[str, str]:
        tokens_per_s = self.tokens_per_step * self.window_steps / (paused - self.window_start)
        if not self.rank0:
            return {}
        memory = peak_memory_bytes(self.device)
        record = {"kind": "train", "step": done, "loss": self.loss, "lr": lr_at(self.cfg, done - 1),
                  "tokens_per_s": tokens_per_s, "peak_memory_bytes": memory}
        if self.memory is not None:  # rank 0's tensors at its peak in the last step, by category
            record["tensor_memory"] = self.memory.as_dict()
        self.log_file.write(record)
        return {"loss": f"{self.loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}", "mem": f"{memory / 2**30:.2f}GiB"}

    def evaluate(self, done: int) -> dict[str, str]:
        self.phase(f"step {done}: evaluation")
        self.accuracy = evaluate(self.module, self.data, self.mesh, self.cfg, self.device)
        if not self.rank0:
            return {}
        self.log_file.write({"kind": "eval", "step": done, "accuracy": self.accuracy})
        return {"acc": f"{self.accuracy:.3f}"}

    def save(self, done: int) -> None:
        self.phase(f"step {done}: saving a checkpoint")
        save_checkpoint(self.folder, done, self.module, self.optimizer, run_record(self.cfg, self.mesh.dp_size))
        if self.cfg.keep_checkpoints is not None:  # once ``latest`` names the new one; rank 0 deletes
            prune_checkpoints(self.folder, self.cfg.keep_checkpoints, protect=self.start_point.checkpoint)

    def run(self) -> dict:
        """Train to ``cfg.steps``, save, export; returns :meth:`summary`. Releases ``out``'s lock and stops the
        heartbeat however it ends; a collective that timed out is reported with where each rank was."""
        try:
            return self._run()
        except RuntimeError as err:
            if self.heartbeat is not None and "timed out" in str(err).lower():
                print(f"seqmesh: error: a collective on rank {dist.get_rank()} gave up waiting after --timeout "
                      f"{self.cfg.timeout:g} s ({str(err).splitlines()[0]}). Where each rank was at its last "
                      f"heartbeat: {self.heartbeat.report()}.", file=sys.stderr, flush=True)
            raise
        finally:
            self._close()

    def _run(self) -> dict:
        cfg = self.cfg
        self._start_log()
        progress = Progress(cfg.steps, self.start) if self.rank0 else None
        watch = (StallWatch(after=120.0, timeout=cfg.timeout, compiling=cfg.compile) if self.rank0
                 else contextlib.nullcontext())
        self.module.train()
        self.window_start = time.perf_counter()
        with watch:
            for step in range(self.start, cfg.steps):
                self.step(step)
                self.window_steps += 1
                done = step + 1
                if self.rank0:
                    watch.beat(done)
                log_now = done % cfg.log_every == 0 or done == cfg.steps
                eval_now = done == cfg.steps or (cfg.eval_every > 0 and done % cfg.eval_every == 0)
                save_now = cfg.save_every > 0 and done % cfg.save_every == 0 and done != cfg.steps
                if not (log_now or eval_now or save_now):
                    continue
                self.loss = float(self.loss_tensor)
                paused = time.perf_counter()  # what follows is not training time
                fields = self.log(done, paused) if log_now else {}
                if eval_now:
                    fields.update(self.evaluate(done))
                if progress is not None and fields:
                    progress.update(done, fields)
                if save_now:
                    self.save(done)
                if log_now:  # a new throughput window
                    self.window_start, self.window_steps = time.perf_counter(), 0
                else:  # evaluation and saving are not training time
                    self.window_start += time.perf_counter() - paused
        if self.start < cfg.steps:
            self.save(cfg.steps)
        if cfg.export:  # the run's own output, replaced as its checkpoints are
            self.phase("exporting the model")
            export_pretrained(self.module, os.path.join(cfg.out, "model"), tokenizer=cfg.tokenizer, overwrite=True)
        return self.summary()

    def summary(self) -> dict:
        self.phase("finishing: the loss curve")
        cfg, mesh = self.cfg, self.mesh
        curve = problem = None
        if self.rank0:  # the verdict is shared: a rank left behind here would wait in a collective for ever
            title = (f"{cfg.model}, {cfg.seq_len:,} tokens, ulysses {mesh.ulysses} x ring {mesh.ring} "
                     + (f"x tp {mesh.tp} " if mesh.tp > 1 else "") + f"x dp {mesh.dp_size}")
            chance = 1 / cfg.symbols if not cfg.data else None
            try:
                curve = plot_loss_curve(self.log_file.read(), os.path.join(cfg.out, "loss_curve.png"), title, chance)
            except ValueError as err:
                problem = str(err)
        curve, problem = agree((curve, problem))
        if problem is not None:
            raise ValueError(problem)
        return {"loss": self.loss, "accuracy": self.accuracy, "mesh": repr(mesh), "loss_curve": curve,
                "steps": cfg.steps, "skipped": self.skipped}


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg`` on this rank; returns the final figures (the same on every rank)."""
    return TrainingRun(cfg).run()
