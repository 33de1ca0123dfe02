"""transformers Trainer cases: seqmesh's Trainer on spawned ranks, plain Trainer in one process.

Both train a tiny Llama (built from LlamaConfig with a fixed seed) on the same local rows, whose
first tokens (a varying number) are not scored, so micro-batches hold different numbers of targets
and gradient accumulation must weight them as one device does.
"""

from __future__ import annotations

import contextlib
import os

import torch

VOCAB, SEQ = 256, 32


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0, family: str = "llama"):
    """A tiny Llama; ``family="qwen3_moe"``: a tiny Qwen3-MoE (4 experts, top 2) whose loss adds its routers'
    load-balancing term (``output_router_logits``, a coefficient large enough to move the curves)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=4 * SEQ, attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**shape, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, head_dim=16, output_router_logits=True, router_aux_loss_coef=0.5)
        return AutoModelForCausalLM.from_config(config, experts_implementation="eager").to(dtype)  # float64 experts
    return LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=128)).to(dtype)


def rows(count: int, seed: int) -> list[dict[str, list[int]]]:
    """``input_ids`` and ``labels`` rows; labels are -100 over a prompt of 0..SEQ/2 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, SEQ // 2, (1,), generator=g))] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


TRAIN_ROWS, EVAL_ROWS = rows(48, seed=1), rows(8, seed=2)


def rows_without_targets_in_step(step: int, rows_per_step: int) -> list[dict[str, list[int]]]:
    """TRAIN_ROWS with every label of optimizer step ``step`` (0-based) set to -100: read in order
    (``train_sampling_strategy="sequential"``), that step's batch has no target at all."""
    unscored = range(step * rows_per_step, (step + 1) * rows_per_step)
    return [{**r, "labels": [-100] * SEQ} if i in unscored else r for i, r in enumerate(TRAIN_ROWS)]


def training_args(output_dir: str, batch: int, accumulation: int, **extra):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        gradient_accumulation_steps=accumulation, max_steps=10, learning_rate=2e-3, warmup_steps=2,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
        disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
    )
    return TrainingArguments(**{**settings, **extra})


def curves(trainer) -> dict[str, list[float]]:
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs]}


def single_process(output_dir: str, batch: int, accumulation: int, dtype: torch.dtype = torch.float32,
                   train_rows: list | None = None, family: str = "llama", **extra) -> dict:
    """Plain transformers Trainer in this process (no process group) on the whole batch; ``extra``
    overrides training arguments."""
    from transformers import Trainer

    trainer = Trainer(model=tiny_model(dtype, family=family), args=training_args(output_dir, batch, accumulation, **extra),
                      train_dataset=train_rows or TRAIN_ROWS, eval_dataset=EVAL_ROWS)
    trainer.train()
    result = curves(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["weights"] = {k: v.detach().to(torch.float64).clone() for k, v in trainer.model.state_dict().items()}
    return result


# the variables torchrun sets for a rank; with them set, transformers' TrainingArguments (accelerate) starts a process
# group itself
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def torchrun_environment():
    """The variables torchrun sets, around a job on a spawned rank (its process group already exists),
    and a fresh accelerate state after it (accelerate keeps its view of the processes in singletons)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    names = (*TORCHRUN_VARIABLES, "OMP_NUM_THREADS")
    saved = {n: os.environ.get(n) for n in names}
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def checkpointing_args() -> dict:
    """TrainingArguments turning on transformers' activation checkpointing (its name before 5.24:
    gradient_checkpointing; the old name warns after)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": True}


def sequence_parallel(output_dir: str, ulysses: int, ring: int, batch: int, accumulation: int,
                      train_rows: list | None = None, tp: int = 1, family: str = "llama", ep: int = 1,
                      keep_attention: bool = False, plan: dict | None = None, **extra) -> dict:
    """seqmesh's Trainer on this rank (``ep``: its ``seqmesh_ep``; ``keep_attention``: its ``seqmesh_keep_attention``;
    ``plan``: the fields of its ``seqmesh_plan`` instead); rank 0 saves the final model to ``output_dir/final``. Counts,
    while training, the batches cut and the attention's forward calls (one process's kernel calls or ring passes)."""
    import seqmesh.trainer
    from seqmesh.compose import ParallelPlan
    from seqmesh.memory.rmsnorm import EfficientNormForward
    from seqmesh.memory.tiled_mlp import TiledForward
    from seqmesh.sharded_attention import ring as ring_module
    from seqmesh.trainer import SequenceParallelTrainer

    calls = {"shard_calls": 0, "attention_calls": 0}
    patched = {(seqmesh.trainer, "shard_batch"): "shard_calls", (ring_module, "local_forward"): "attention_calls",
               (ring_module, "ring_forward"): "attention_calls"}
    originals = {where: getattr(*where) for where in patched}

    def counted(fn, kind):
        def call(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return call

    with torchrun_environment():
        trainer = SequenceParallelTrainer(
            model=tiny_model(family=family), args=training_args(output_dir, batch, accumulation, **extra),
            train_dataset=train_rows or TRAIN_ROWS, eval_dataset=EVAL_ROWS, seqmesh_degrees=(ulysses, ring, tp),
            **({"seqmesh_plan": ParallelPlan(**plan)} if plan is not None else
               {"seqmesh_ep": ep, "seqmesh_keep_attention": keep_attention}),
        )
        for (module, name), kind in patched.items():
            setattr(module, name, counted(originals[(module, name)], kind))
        try:
            trainer.train()
        finally:
            for (module, name), fn in originals.items():
                setattr(module, name, fn)
        result = curves(trainer)
        result.update(calls)  # shard_calls: one per micro-batch when each is cut once
        forwards = [m.__dict__.get("forward") for m in trainer.model.modules()]  # the techniques' instance forwards
        result["tiled_mlps"] = sum(isinstance(f, TiledForward) for f in forwards)
        result["lean_norms"] = sum(isinstance(f, EfficientNormForward) for f in forwards)
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        trainer.save_model(os.path.join(output_dir, "final"))
        return result


def run_example(output_dir: str, *argv: str) -> list[dict]:
    """``examples/trainer.py``'s main on this rank, as torchrun would start it."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "trainer.py")
    spec = importlib.util.spec_from_file_location("example_trainer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torchrun_environment():
        return module.main(["--out", output_dir, *argv])


def resume(output_dir: str, ulysses: int, ring: int) -> dict:
    """10 steps saving a checkpoint at step 5, then a fresh Trainer (other initial weights) resumed
    from it: both curves (the resumed one holds the checkpoint's first 5 entries) and the steps run."""
    from transformers import TrainerCallback

    from seqmesh.trainer import SequenceParallelTrainer

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1

    with torchrun_environment():
        runs = {}
        for name, seed, start in (("straight", 0, None), ("resumed", 1, os.path.join(output_dir, "checkpoint-5"))):
            args = training_args(output_dir, 2, 1, save_strategy="steps", save_steps=5)
            counter = CountSteps()
            trainer = SequenceParallelTrainer(model=tiny_model(seed=seed), args=args, train_dataset=TRAIN_ROWS,
                                              callbacks=[counter], seqmesh_degrees=(ulysses, ring))
            trainer.train(resume_from_checkpoint=start)
            runs[name] = {**curves(trainer), "steps_run": counter.steps}
        return runs


def byte_tokenizer():
    """A local word-level tokenizer over the VOCAB ids (no download): what TRL's SFTTrainer requires."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<pad>": VOCAB - 1}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<pad>")


def sft(output_dir: str, ulysses: int = 0, ring: int = 0) -> dict:
    """TRL's SFTTrainer on token rows: plain in one process (ulysses=0), or with the seqmesh mixin."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from seqmesh.trainer import SequenceParallelTrainerMixin

    rows = Dataset.from_list([{"input_ids": r["input_ids"]} for r in TRAIN_ROWS])

    def config() -> SFTConfig:
        return SFTConfig(output_dir=output_dir, per_device_train_batch_size=4, max_steps=10, learning_rate=2e-3,
                         logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
                         use_cpu=True, bf16=False, gradient_checkpointing=False, max_grad_norm=0.5, max_length=None)

    if not ulysses:
        trainer = SFTTrainer(model=tiny_model(), args=config(), train_dataset=rows, processing_class=byte_tokenizer())
        trainer.train()
        return curves(trainer)

    class SequenceParallelSFTTrainer(SequenceParallelTrainerMixin, SFTTrainer):
        pass

    with torchrun_environment():
        trainer = SequenceParallelSFTTrainer(model=tiny_model(), args=config(), train_dataset=rows,
                                             processing_class=byte_tokenizer(), seqmesh_degrees=(ulysses, ring))
        trainer.train()
        return curves(trainer)


# -- a vision-language model through the Trainer --------------------------------------------------------------

def vision_rows(count: int = 6) -> list[dict]:
    """Qwen2.5-VL batches of one row each (images, a video, packed-free), labels with no loss on placeholders."""
    from vision_cases import IMAGE, VIDEO, vision_batch

    kinds = ("mixed", "tail", "text_only")
    out = []
    for i in range(count):
        batch = vision_batch("qwen2_5_vl", kinds[i % len(kinds)], seed=10 + i)
        batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
        ids = batch["input_ids"]
        out.append({**batch, "labels": ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)})
    return out


def one_row(rows: list[dict]) -> dict:
    """The collator of one-row multimodal batches (their pixel tables have different lengths)."""
    assert len(rows) == 1, "one row per micro-batch"
    return dict(rows[0])


def vision_trainer(output_dir: str, ulysses: int = 0, ring: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """4 optimizer steps of a tiny Qwen2.5-VL: plain Trainer in this process (``ulysses=0``), or seqmesh's
    Trainer on this rank with the tower and the sequence sharded."""
    from transformers import Trainer

    from seqmesh.trainer import SequenceParallelTrainer
    from vision_cases import build, vision_config

    model = build(vision_config("qwen2_5_vl"), dtype=torch.float64).to(dtype)
    args = training_args(output_dir, 1, 1, max_steps=4, remove_unused_columns=False)
    rows = vision_rows()
    if not ulysses:
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=one_row)
        trainer.train()
        return curves(trainer)
    with torchrun_environment():
        trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=rows, data_collator=one_row,
                                          seqmesh_degrees=(ulysses, ring))
        trainer.train()
        return curves(trainer)
