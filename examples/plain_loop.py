"""Your own PyTorch loop with seqmesh: USP (Ulysses x ring) and FSDP2 around a transformers model.

    python examples/plain_loop.py                       # tiny Llama, 4 CPU processes (gloo)
    torchrun --nproc-per-node 8 examples/plain_loop.py  # a GPU node: one process per GPU (NCCL)

Step 1's loss is also computed by the unmodified model on the whole sequence, on one process: they agree.
"""

import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import seqmesh
from seqmesh.compose import parallelize_model


def run(steps: int = 10, seq_len: int = 1024) -> list[float]:
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    torch.manual_seed(0)  # the same weights on every rank
    model = AutoModelForCausalLM.from_config(config).to(device)
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():  # the reference: one process, the whole sequence, transformers' own loss
        reference = float(model(input_ids=ids, labels=ids).loss)

    mesh = seqmesh.init_mesh(ulysses=2, ring=dist.get_world_size() // 2, device_type=device.type)
    module = parallelize_model(model, mesh)  # sequence-parallel attention, the exact loss, FSDP2 over ranks
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)  # as seqmesh train: in place, no copy
    losses = []
    for _ in range(steps):
        local = seqmesh.shard_batch({"input_ids": ids}, mesh)  # shift labels, pad, slice this rank's part
        loss = module(**local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    if dist.get_rank() == 0:
        print(f"step 1 loss {losses[0]:.6f} (one process, whole sequence: {reference:.6f}); "
              f"step {steps} loss {losses[-1]:.6f}")
    return [reference] + losses


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        run()
        dist.destroy_process_group()
    else:
        from seqmesh.comm.launch import spawn

        spawn(run, 4, threads=1)
