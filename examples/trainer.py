r"""A transformers Trainer script with seqmesh sequence parallelism: Ulysses x ring over the ranks.

    torchrun --nproc-per-node 4 examples/trainer.py --ulysses 2 --ring 2
    torchrun --nproc-per-node 8 examples/trainer.py --model ./my-llama --ulysses 4 --seq-len 65536 \
        --checkpointing --keep-attention

Compared with a plain Trainer script only two things change: the class (SequenceParallelTrainer, or
SequenceParallelTrainerMixin put before any Trainer subclass such as TRL's SFTTrainer) and the
degrees. Data parallelism (FSDP2) takes the ranks that remain. Without --model it trains a tiny random
Llama on random tokens, so it runs anywhere (CPU: gloo).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

from seqmesh.trainer import SequenceParallelTrainer


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local transformers checkpoint folder (default: a tiny random Llama)")
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="trainer-out")
    parser.add_argument("--checkpointing", action="store_true", help="the TrainingArguments' activation checkpointing")
    parser.add_argument("--keep-attention", action="store_true",
                        help="with --checkpointing: each layer keeps its attention outputs, and the recompute skips it")
    a = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial weights on every rank
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True)
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    vocab = model.config.vocab_size
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (32, a.seq_len)).tolist()]

    gpu = torch.cuda.is_available()
    # transformers 5.24 renamed gradient_checkpointing (the old name still works, with a warning)
    renamed = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    checkpointing = {"activation_checkpointing" if renamed else "gradient_checkpointing": a.checkpointing}
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=1, max_steps=a.steps, learning_rate=1e-4,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=not gpu, bf16=gpu,
                             **checkpointing)
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=rows,
                                      seqmesh_degrees=(a.ulysses, a.ring), seqmesh_keep_attention=a.keep_attention)
    trainer.train()
    trainer.save_model()  # a folder AutoModelForCausalLM.from_pretrained opens
    return trainer.state.log_history


if __name__ == "__main__":
    main()
