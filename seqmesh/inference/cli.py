"""``seqmesh generate``: new tokens after a prompt, on the sequence mesh, under ``torchrun``.

    torchrun --nproc-per-node N -m seqmesh generate --model M --prompt-ids FILE --max-new-tokens K
        [--ulysses U --ring R --tp T] [--dtype fp32|fp64|bf16] [--temperature T --top-p P --seed S] [--shard-weights]
        [--prefill-chunk N [--schedule auto|pass_kv|pass_q]] [--json]

``FILE`` holds a JSON list of token ids, or a list of lists of one length (a batch). The prompt's prefill is
sharded over the ``ulysses x ring`` ranks as in training and the KV cache stays sharded (:mod:`seqmesh.inference`).
With ``--json`` the last line of rank 0's output is one JSON object whose ``"tokens"`` are the new ids (a list, or a
list of lists for a batch). Errors end the job with ``seqmesh: error:`` and the reason, before any model is built
where they can be.
"""

from __future__ import annotations

import argparse
import json
import os

from ..rules.kv_cache import SCHEDULES

DTYPES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16"}


def add_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="new tokens after a prompt, the prefill and the KV cache sharded over the "
                       "sequence mesh (launch with torchrun)", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a preset, a config.json (random weights) or a checkpoint folder")
    p.add_argument("--prompt-ids", required=True, metavar="FILE",
                   help="a JSON list of token ids, or a list of lists of one length")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="K")
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="split the heads and MLP over this many ranks besides (tensor "
                   "parallelism, innermost; each rank caches its heads)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"],
                   help="how the prompt is split over the ranks (default %(default)s)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the draws' seed, the same on every rank")
    p.add_argument("--weights-seed", type=int, default=0, help="a config.json's random weights (default %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="run --max-new-tokens steps whatever is drawn (default: "
                   "stop a row at the model's end-of-sequence id, from its generation config, as transformers does)")
    p.add_argument("--shard-weights", action="store_true", help="shard the weights over the ranks (FSDP2: each layer "
                   "gathered for its forward), for a model larger than one GPU; each decode step gathers them again")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N", help="prefill at most N prompt tokens a "
                   "call, each chunk onto the cache the ones before it left (activations bounded by a chunk's; not "
                   "for sparse-attention models)")
    p.add_argument("--schedule", default="auto", choices=SCHEDULES, help="with --prefill-chunk: how a chunk after "
                   "the first attends the kept cache: the ring passing the shares, or the chunk's queries passed to "
                   "them (default: the one that moves fewer bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=cmd_generate)
    return p


def read_prompt(path: str) -> tuple[list[list[int]], bool]:
    """The prompt rows of ``path`` and whether it was a batch (a list of lists)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompt-ids {path}: no such file; write the prompt's token ids there as a JSON "
                                "list.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--prompt-ids {path} is not JSON ({err}); write a list of token ids, e.g. [1, 15, 27].") from None
    batched = isinstance(data, list) and bool(data) and all(isinstance(row, list) for row in data)
    rows = data if batched else [data]
    good = isinstance(data, list) and bool(data) and all(
        isinstance(row, list) and row and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row)
        for row in rows)
    if not good:
        raise ValueError(f"--prompt-ids {path} must hold a non-empty JSON list of non-negative token ids, or a list "
                         "of such lists.")
    lengths = sorted({len(row) for row in rows})
    if len(lengths) > 1:
        raise ValueError(f"--prompt-ids {path}: the prompts have {len(lengths)} lengths ({lengths[0]} to {lengths[-1]}); "
                         "a batch needs prompts of one length (generate the others in another call).")
    return rows, batched


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from ..hf import parallelize
    from ..mesh import init_mesh
    from ..model.lm import build_model, read_model
    from ..comm.launch import init_distributed
    from .generate import Sampling, generate, shard_weights, split_heads

    rows, batched = read_prompt(args.prompt_ids)  # every input checked before any process group or model
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: generate at least 1 token.")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk}: give a positive number of tokens.")
    if args.schedule != "auto" and args.prefill_chunk is None:
        raise ValueError(f"--schedule {args.schedule}: it chooses how a chunk attends the cache the earlier chunks "
                         "left; add --prefill-chunk N.")
    if args.ulysses < 1 or args.ring < 1 or args.tp < 1:
        raise ValueError(f"--ulysses {args.ulysses} --ring {args.ring} --tp {args.tp}: each degree is at least 1.")
    source = read_model(args.model)
    vocab = source.config.get_text_config().vocab_size
    largest = max(max(row) for row in rows)
    if largest >= vocab:
        raise ValueError(f"--prompt-ids {args.prompt_ids} holds token id {largest}, but {args.model}'s vocabulary has "
                         f"{vocab} tokens; give ids below {vocab}.")
    init_distributed()
    world = dist.get_world_size()
    ranks = args.ulysses * args.ring * args.tp
    if ranks != world:
        dist.destroy_process_group()
        raise ValueError(f"--ulysses {args.ulysses} x --ring {args.ring} x --tp {args.tp} = {ranks} ranks, but "
                         f"{world} were launched: run torchrun --nproc-per-node {ranks}.")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_mesh(args.ulysses, args.ring, tp=args.tp)
    model = build_model(source, seed=args.weights_seed, dtype=getattr(torch, DTYPES[args.dtype]), device=device)
    model.eval()
    parallelize(model, mesh)
    if args.tp > 1:
        split_heads(model, mesh)
    if args.shard_weights:
        shard_weights(model, mesh)
    prompt = torch.tensor(rows, dtype=torch.long)
    config = getattr(model, "generation_config", None)
    eos = None if args.ignore_eos or config is None else config.eos_token_id
    done = generate(model, mesh, prompt, args.max_new_tokens, layout=args.layout, sampling=sampling, eos_token_id=eos,
                    pad_token_id=None if config is None else config.pad_token_id, schedule=args.schedule,
                    prefill_chunk=args.prefill_chunk)
    tokens = done.tokens.tolist()
    shares = [torch.zeros(1, dtype=torch.long, device=mesh.collective_device()) for _ in range(world)]
    dist.all_gather(shares, torch.tensor([done.cache.nbytes()], device=mesh.collective_device()))
    if dist.get_rank() == 0:
        summary = {"tokens": tokens if batched else tokens[0], "prompt_tokens": prompt.numel(), "mesh": repr(mesh),
                   "prefill_seconds": done.prefill_seconds, "decode_seconds": done.decode_seconds,
                   "prefill_tokens_per_second": prompt.numel() / max(done.prefill_seconds, 1e-9),
                   "cache_bytes_per_rank": [int(b) for b in shares], "schedules": list(done.schedules)}
        if args.json:
            print(json.dumps(summary), flush=True)
        else:
            for row in tokens:
                print(" ".join(str(t) for t in row))
            print(f"{prompt.numel():,} prompt tokens prefilled in {done.prefill_seconds:.2f} s "
                  f"({summary['prefill_tokens_per_second']:,.0f} tokens/s) on {mesh!r}; {args.max_new_tokens} new "
                  f"tokens in {done.decode_seconds:.2f} s; KV cache per rank {summary['cache_bytes_per_rank']} bytes")
    dist.destroy_process_group()
    return 0
