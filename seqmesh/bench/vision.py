"""``seqmesh bench vision``: the vision tower sharded by patches against the tower replicated on every rank.

One batch of images (or a video) through a vision-language model's tower, forward and backward, on
spawned CPU ranks. Sharded: seqmesh's tower (each rank ~1/P of the patches, attention over the sequence
group, merged units routed to their tokens). Replicated: the unmodified transformers tower on every
patch on every rank (what verl and Megatron do). Per mesh the table gives each way's peak tensor bytes
on the rank that holds most (``MemoryTracker``: parameters, gradients, activations) and, for the
sharded tower, the bytes a rank sends, counted, beside the formula of ``seqmesh.planner.traffic``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

import torch

from .common import check_meshes, factorisations, parse_mesh


@dataclass
class VisionBench:
    """A batch of ``images`` images of ``height x width`` patches each (``frames`` > 1: videos of that many
    frame pairs), and the meshes to run it on."""

    model: str = "qwen2.5-vl-tiny"
    images: int = 4
    height: int = 32
    width: int = 32
    frames: int = 1
    world: int = 2
    meshes: list[tuple[int, int]] = field(default_factory=list)  # (ulysses, ring); empty: all factorisations

    def factorisations(self) -> list[tuple[int, int]]:
        return factorisations(self.world, self.meshes)

    def batch(self, config) -> dict:
        """Text, then each image's placeholders between its start and end tokens; random pixels."""
        vision = config.vision_config
        merge = vision.spatial_merge_size
        grid = torch.tensor([[self.frames, self.height, self.width]] * self.images)
        units = self.frames * self.height * self.width // (merge * merge)
        text = [0] * 8  # eight text tokens before each image (token 0: any id below the media tokens)
        ids = []
        for _ in range(self.images):
            ids += text + [config.vision_start_token_id] + [config.image_token_id] * units + [config.vision_end_token_id]
        g = torch.Generator().manual_seed(0)
        features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        pixels = torch.randn(int(grid.prod(dim=1).sum()), features, generator=g)
        input_ids = torch.tensor([ids])
        return {"input_ids": input_ids, "pixel_values": pixels, "image_grid_thw": grid,
                "mm_token_type_ids": (input_ids == config.image_token_id).long()}


def _measure_rank(bench: VisionBench, ulysses: int, ring: int) -> dict:
    """On every rank: the sharded tower's peak and traffic, then the replicated tower's peak."""
    from ..comm.stats import comm_stats
    from ..compose import ParallelPlan, parallelize_model
    from ..inputs import shard_batch
    from ..memory import MemoryTracker
    from ..mesh import init_mesh
    from ..model.lm import build_model
    from ..planner.traffic import vision_route_traffic, vision_tower_traffic
    from ..vision.tower import run_tower

    mesh = init_mesh(ulysses, ring)
    model = build_model(bench.model)
    batch = bench.batch(model.config)
    sp = parallelize_model(model, mesh, ParallelPlan(fsdp=False))
    shard = shard_batch(batch, mesh, model=sp)["seqmesh_vision"]
    tower = sp.family.tower(model)
    with MemoryTracker(tower) as tracker, comm_stats() as stats:
        rows, routed = run_tower(sp.family, tower, shard, mesh)
        torch.cat([rows, *routed], dim=-1).square().sum().backward()
    sharded = tracker.report().peak_bytes

    replica = build_model(bench.model).model.visual  # the unmodified tower, every patch on this rank
    with MemoryTracker(replica) as tracker:
        out = replica(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
        deep = list(getattr(out, "deepstack_features", None) or [])
        torch.cat([out.pooler_output, *deep], dim=-1).square().sum().backward()
    replicated = tracker.report().peak_bytes

    vision = model.config.vision_config
    patches = int(batch["image_grid_thw"].prod(dim=1).sum())
    formula = vision_tower_traffic(vision.depth, vision.num_heads, vision.hidden_size // vision.num_heads,
                                   frames=shard.frames.cu_seqlens, merge=vision.spatial_merge_size, ulysses=ulysses, ring=ring,
                                   dtype="float32", windows=shard.windows.cu_seqlens if shard.windows else None,
                                   full_blocks=len(getattr(vision, "fullatt_block_indexes", None) or ()))[mesh.sp_rank]
    me = mesh.sp_rank
    width = rows.shape[-1] * (1 + len(routed))
    route = vision_route_traffic(sum(shard.send_rows) - shard.send_rows[me], sum(shard.recv_rows) - shard.recv_rows[me],
                                 width, "float32")
    counted = {f"{kind}_{phase}": stats.sent(kind, phase)
               for kind in ("all_to_all", "p2p") for phase in ("forward", "backward")}
    predicted = {f"{kind}_{phase}": formula.sent(kind, phase) + (route[phase] if kind == "all_to_all" else 0)
                 for kind in ("all_to_all", "p2p") for phase in ("forward", "backward")}
    return {"sharded_bytes": sharded, "replicated_bytes": replicated, "counted": counted, "formula": predicted,
            "patches": patches, "local_patches": int(shard.pixels.shape[0])}


def bench_vision(bench: VisionBench) -> list[dict]:
    """One row per mesh: the busiest rank's peaks, and the most any rank sends, counted and by formula."""
    from ..comm.launch import WorkerPool

    rows = []
    with WorkerPool(bench.world, threads=max(1, (os.cpu_count() or 1) // bench.world)) as pool:
        for ulysses, ring in bench.factorisations():
            ranks = pool.run(_measure_rank, bench, ulysses, ring, timeout=3600)
            keys = ranks[0]["counted"].keys()
            rows.append({
                "mesh": f"{ulysses}x{ring}", "patches": ranks[0]["patches"],
                "sharded_bytes": max(r["sharded_bytes"] for r in ranks),
                "replicated_bytes": max(r["replicated_bytes"] for r in ranks),
                "counted": {k: max(r["counted"][k] for r in ranks) for k in keys},
                "formula": {k: max(r["formula"][k] for r in ranks) for k in keys},
                "exact": all(r["counted"] == r["formula"] for r in ranks),
            })
    return rows


def format_vision_rows(bench: VisionBench, rows: list[dict]) -> str:
    mib = 2**20
    lines = [f"vision tower fwd+bwd: {bench.model}, {bench.images} image(s) of {bench.frames}x{bench.height}x{bench.width} "
             f"patches, {bench.world} CPU ranks (gloo); busiest rank",
             f"{'mesh UxR':>9}{'sharded MiB':>13}{'replicated MiB':>16}{'ratio':>7}{'a2a fwd/bwd MiB':>18}"
             f"{'p2p fwd/bwd MiB':>18}{'= formula':>11}"]
    for r in rows:
        c = r["counted"]
        lines.append(f"{r['mesh']:>9}{r['sharded_bytes'] / mib:>13.2f}{r['replicated_bytes'] / mib:>16.2f}"
                     f"{r['sharded_bytes'] / r['replicated_bytes']:>7.3f}"
                     f"{c['all_to_all_forward'] / mib:>9.3f}/{c['all_to_all_backward'] / mib:<8.3f}"
                     f"{c['p2p_forward'] / mib:>9.3f}/{c['p2p_backward'] / mib:<8.3f}{'yes' if r['exact'] else 'NO':>11}")
    return "\n".join(lines)


def add_subcommand(bench_sub) -> None:
    """``seqmesh bench vision``."""

    def run(args: argparse.Namespace) -> int:
        from ..model.presets import model_shape

        bench = VisionBench(model=args.model, images=args.images, height=args.height, width=args.width,
                            frames=args.frames, world=args.world, meshes=args.mesh or [])
        check_meshes(bench.factorisations(), args.world)
        vision = model_shape(args.model).vision  # a LLaVA config.json is refused here, by name
        if vision is None:
            raise SystemExit(f"{args.model} has no vision tower; give a vision-language preset or config.json.")
        if args.height % vision.merge or args.width % vision.merge:
            raise SystemExit(f"--height {args.height} and --width {args.width} must be multiples of the merge size "
                             f"{vision.merge}.")
        rows = bench_vision(bench)
        print(json.dumps(rows, indent=1) if args.json else format_vision_rows(bench, rows))
        return 0

    p = bench_sub.add_parser("vision", help="the vision tower sharded by patches against replicated, per rank")
    p.add_argument("--model", default="qwen2.5-vl-tiny", help="a vision-language preset or config.json")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--height", type=int, default=32, help="patches per image column (a multiple of the merge size)")
    p.add_argument("--width", type=int, default=32, help="patches per image row (a multiple of the merge size)")
    p.add_argument("--frames", type=int, default=1,
                   help="temporal patches per image (t of its grid): more than 1 gives each image several frames")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (gloo, CPU)")
    p.add_argument("--mesh", type=parse_mesh, action="append", help="ULYSSESxRING to run (repeatable); default: all")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run)
