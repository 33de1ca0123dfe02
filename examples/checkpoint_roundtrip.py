"""A transformers checkpoint in, trained with Ulysses x ring sequence parallelism and FSDP2, a
transformers checkpoint out.

    python examples/checkpoint_roundtrip.py                 # tiny Llama, 4 CPU processes, about a minute

The same with your own checkpoint folder on a GPU node (each rank reads only its shards' rows):

    torchrun --nproc-per-node 8 -m seqmesh train --model ./my-checkpoint --ulysses 4 --ring 2 --out runs/x
    python -m seqmesh export runs/x/checkpoints/step_0000200 ./trained-at-200   # any saved step
"""

import argparse
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from seqmesh.comm.launch import spawn
from seqmesh.training.config import TrainConfig
from seqmesh.training.datasets import LongRangeCopy
from seqmesh.training.train import train


def held_out_loss(model, task: LongRangeCopy) -> float:
    """transformers' own loss on a copy-task sequence no training step saw."""
    batch = task.eval_batch(0)
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/roundtrip")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    start = os.path.join(args.out, "start")  # stands in for a downloaded checkpoint folder
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(start)

    cfg = TrainConfig(model=start, seq_len=args.seq_len, ulysses=2, ring=2, dp=1, steps=args.steps, lr=1e-2,
                      warmup=5, symbols=8, eval_every=0, log_every=10, out=os.path.join(args.out, "run"),
                      overwrite=True)  # writes run/model at the end (TrainConfig.export)
    summary = spawn(train, 4, cfg, threads=1)[0]

    task = LongRangeCopy(cfg.seq_len, symbols=cfg.symbols, seed=cfg.seed)
    before = held_out_loss(AutoModelForCausalLM.from_pretrained(start), task)
    after = held_out_loss(AutoModelForCausalLM.from_pretrained(os.path.join(cfg.out, "model")), task)
    print(f"seqmesh's final training loss {summary['loss']:.4f}; held-out loss with transformers: "
          f"{before:.4f} before, {after:.4f} after (from {cfg.out}/model)")


if __name__ == "__main__":
    main()
