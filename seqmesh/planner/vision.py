"""The vision tower of a vision-language workload (``--images``, ``--video-frames``) on the busiest rank: its
sequence, what it keeps for backward, sends and computes, folded into the step's memory, traffic and time.
The model and its assumptions: docs/planner.md, "Vision towers".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate
from typing import TYPE_CHECKING

from ..rules.degrees import Degrees
from ..model.shapes import VisionShape
from .activations import outside_layers_bytes
from .hardware import HardwareSpec
from .media import Media  # noqa: F401 (where the tower's tests import it from)
from .memory import MOMENTS, MemoryBreakdown, memory_at, parameter_memory
from .network import axis_all_to_all_seconds, fsdp_seconds, ring_hop_seconds
from .attention_layer import ATTENTION_BACKWARD
from .timing import StepTime
from .traffic import RankTraffic, fsdp_traffic, vision_route_traffic, vision_tower_traffic

if TYPE_CHECKING:
    from .workload import Workload

DURING_DECODER = ("loss forward", "loss backward", "layer backward", "first layer backward")
TOWER_KEYS = ("vision_all_to_all", "vision_ring_p2p", "vision_route")


@lru_cache(maxsize=256)
def block_traffic(v: VisionShape, bounds: tuple[int, ...], group: Degrees, dtype: str) -> RankTraffic:
    """The busiest rank's traffic in one tower block whose documents end at ``bounds``."""
    ranks = vision_tower_traffic(1, v.heads, v.hidden // v.heads, frames=bounds, merge=v.merge, ulysses=group.ulysses,
                                 ring=group.ring, dtype=dtype)
    return max(ranks, key=lambda t: sum(c.bytes_sent for c in t.collectives))


@dataclass(frozen=True)
class Tower:
    """The tower of one sequence group (its ``batch`` sequences' media) on its busiest rank (tp is 1: the planner
    refuses tensor parallelism for vision-language models, as seqmesh does)."""

    work: Workload
    layout: Degrees

    @property
    def vision(self) -> VisionShape:
        return self.work.model.vision

    @property
    def group(self) -> Degrees:
        return self.layout

    @property
    def patches(self) -> int:
        """Patches of the group's batch (images, then videos)."""
        return self.work.batch * self.work.media.frames(self.vision) * self.work.media.frame_patches(self.vision)

    @property
    def image_places(self) -> int:
        """Places of one frame in the tower's sequence: its patches, and a class token's window of ``merge**2``
        places (its padding first; LLaVA's is the class token alone), seqmesh.vision.windows."""
        v = self.vision
        return self.work.media.frame_patches(v) + v.class_token * v.merge ** 2

    @property
    def rank_patches(self) -> int:
        """Places per rank: ``P`` equal shares of whole merge units (padded to ``merge**2 x P x ceil(units / P)``);
        Qwen-VL's are all patches."""
        unit = self.vision.merge ** 2
        places = self.work.batch * self.work.media.frames(self.vision) * self.image_places
        return unit * -(-places // unit // self.group.sp)

    def routed_rows(self) -> int:
        """Rows the busiest rank sends to placeholder tokens: the windows of its share that yield one (a class
        window yields none, but LLaVA's under "full"); 0 on one rank."""
        v, g = self.vision, self.group
        if g.sp == 1:
            return 0
        unit = v.merge ** 2
        share, per_image = self.rank_patches // unit, self.image_places // unit
        windows = self.work.batch * self.work.media.frames(v) * per_image
        idle = v.class_token and not v.routes_class  # each image's first window yields no token
        counts = []
        for r in range(g.sp):
            lo, hi = min(r * share, windows), min((r + 1) * share, windows)
            counts.append(hi - lo - (idle * (-(-hi // per_image) - -(-lo // per_image))))
        return max(counts)

    def documents(self) -> list[tuple[tuple[int, ...], int]]:
        """``(document boundaries, blocks)``: the frames, for full blocks; Qwen2.5-VL's windows of ``window``
        pixels (edge windows smaller), for its windowed blocks."""
        v, media, unit = self.vision, self.work.media, self.vision.merge ** 2
        if v.fixed_size:  # one document per image; InternVL's class window's padding a document before it
            pad = unit - 1 if v.class_token else 0
            starts = [i * self.image_places for i in range(self.work.batch * media.frames(v))]
            ends = {*starts, *(s + pad for s in starts), len(starts) * self.image_places}
            return [(tuple(sorted(ends)), v.run_blocks)]
        rows, cols = media.height // v.patch // v.merge, media.width // v.patch // v.merge  # units per side
        frames = self.work.batch * media.frames(v)
        full = tuple(accumulate([0] + [rows * cols * unit] * frames))
        if not v.window:
            return [(full, v.depth)]
        k = v.window // v.patch // v.merge
        sizes = [min(k, rows - i) * min(k, cols - j) * unit for i in range(0, rows, k) for j in range(0, cols, k)]
        windows = tuple(accumulate([0] + sizes * frames))
        return [(b, n) for b, n in ((full, len(v.full_blocks)), (windows, v.depth - len(v.full_blocks))) if n]

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes sent per step by phase (``recompute``: the blocks' forward replayed) and collective, ``TOWER_KEYS``."""
        v, dtype, g = self.vision, self.work.torch_dtype, self.group
        out = {phase: dict.fromkeys(TOWER_KEYS, 0) for phase in ("forward", "backward", "recompute")}
        for bounds, n in self.documents():
            sent = block_traffic(v, bounds, g, dtype)
            for phase in ("forward", "backward"):
                out[phase]["vision_all_to_all"] += n * sent.sent("all_to_all", phase)
                out[phase]["vision_ring_p2p"] += n * sent.sent("p2p", phase)
        units = self.routed_rows()
        for phase, sent in vision_route_traffic(units, units, v.out_hidden * (1 + len(v.deepstack)), dtype).items():
            out[phase]["vision_route"] = sent
        if self.work.checkpointing:
            out["recompute"] |= {k: out["forward"][k] for k in TOWER_KEYS[:2]}
        return out

    def _units(self) -> tuple[dict[str, int], dict[str, int]]:
        """FSDP traffic of a block's unit and of the tower's part of the root unit (patch embedding, mergers)."""
        v, w = self.vision, self.work
        return tuple(fsdp_traffic(n, self.group.fsdp_group, w.torch_dtype, w.reduce_dtype)
                     for n in (v.block_params, v.params - v.depth * v.block_params))

    def fsdp(self) -> dict[str, int]:
        """FSDP bytes per step: each block's unit gathered twice, the root's part once; each reduce-scattered once
        (blocks past the layer LLaVA or InternVL reads never run, so are never gathered)."""
        v, (block, rest) = self.vision, self._units()
        return {"fsdp_all_gather": 2 * v.run_blocks * block["all_gather_forward"] + rest["all_gather_forward"],
                "fsdp_reduce_scatter": v.run_blocks * block["reduce_scatter_backward"] + rest["reduce_scatter_backward"]}

    def memory(self) -> tuple[int, int]:
        """``(kept, peak)`` bytes: kept from the tower's forward to its backward, i.e. through the whole decoder, and
        at its peak, in the top block's backward. What each counts per patch: docs/planner.md, "Vision towers"."""
        v, e, g, w = self.vision, self.work.act_bytes, self.group, self.work
        c, d, heads = v.hidden, v.hidden // v.heads, g.ulysses * -(-v.heads // g.ulysses)
        norm = 4 * c + 4 + e * c if v.gated else e * c + 8  # eager RMSNorm (fp32 x, rstd, normed) or LayerNorm
        attention = heads * (4 * d * e + 4) + (e * c if g.ulysses > 1 else 0)  # q, k, v, out, LSE; o_proj input
        block = 2 * (norm + e * c) + attention + (4 if v.gated else 2) * v.intermediate * e  # + norm outputs, MLP
        pixels = v.patch_features * (4 + (e if e != 4 else 0))  # pixels in float32, their compute-dtype copy
        if v.fixed_size:  # learned positions (no cos, sin); the final norm, and the projector's rows per place
            block += 2 * e * c if v.tower == "internvit" else 0  # layer scale: the scaled attention and MLP outputs
            mergers = (norm if v.final_norm else 0) + v.feature_layers * e * c + 3 * e * v.out_hidden // v.merge ** 2
            outside = pixels
        else:
            mergers = (1 + len(v.deepstack)) * (norm + 3 * e * c)  # the norm, its output, fc1's output, GELU's
            outside = pixels + 2 * d * 4  # cos, sin
        kept = outside + mergers + v.run_blocks * (e * c if w.checkpointing else block)
        grads = heads * d * (3 * e + (4 + 2 * (16 + 3 * e) if g.ring > 1 else 0))  # dq, dk, dv; ring buffers
        working = 2 * e * c + max((3 if v.gated else 2) * v.intermediate * e, grads)  # d(out), d(in), the larger
        peak = kept - mergers + (block if w.checkpointing else 0) + working
        return self.rank_patches * kept, self.rank_patches * peak

    def _comm_seconds(self, sent: RankTraffic, phase: str, hw: HardwareSpec) -> float:
        """One block's all-to-alls and ring hops in ``phase``, call by call."""
        g, seconds = self.group, 0.0
        for c in (c for c in sent.collectives if c.phase == phase):
            each = c.bytes_sent // c.calls
            seconds += c.calls * (ring_hop_seconds(each, hw, g) if c.kind == "p2p"
                                  else axis_all_to_all_seconds([each], hw, g, "ulysses"))
        return seconds

    def seconds(self, hw: HardwareSpec) -> dict[str, float]:
        """``total``, ``compute`` and ``serial`` (communication end to end) seconds per step; docs/planner.md,
        "Vision towers", says what is counted and what overlaps."""
        v, w, g, n = self.vision, self.work, self.group, self.rank_patches
        peak, ranks, repeat = hw.flops_for(w.dtype), list(range(g.gpus)), 2 if w.checkpointing else 1
        mm_rate, attn_rate = peak * hw.matmul_efficiency, peak * hw.attention_efficiency
        mm = 2 * n * (4 * v.hidden ** 2 + (3 if v.gated else 2) * v.hidden * v.intermediate) / mm_rate
        block, rest = self._units()
        ag, rs = fsdp_seconds(block, hw, ranks)
        total = compute = serial = 0.0
        for bounds, count in self.documents():
            pairs = sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:])) + (g.sp * n - bounds[-1]) ** 2  # + padding
            attn = 4 * (v.hidden // v.heads) * -(-v.heads // g.ulysses) * pairs / g.ring / attn_rate
            sent = block_traffic(v, bounds, g, w.torch_dtype)
            comm_fwd, comm_bwd = (self._comm_seconds(sent, phase, hw) for phase in ("forward", "backward"))
            fwd = mm + attn + comm_fwd
            bwd = 2 * mm + ATTENTION_BACKWARD * attn + comm_bwd + (fwd if w.checkpointing else 0.0)
            total += count * (max(fwd, ag) + max(bwd, ag + rs))
            compute += count * ((mm + attn) * repeat + 2 * mm + ATTENTION_BACKWARD * attn)
            serial += count * (comm_fwd * repeat + comm_bwd + 2 * ag + rs)
        mergers = v.projector_macs // v.merge ** 2  # per patch
        outside = 3 * 2 * n * (v.patch_features * v.hidden + mergers) / mm_rate  # forward, and backward 2x
        exposed = axis_all_to_all_seconds([phase["vision_route"] for phase in self.traffic().values()], hw, g,
                                          "sequence")
        exposed += sum(fsdp_seconds(rest, hw, ranks))
        return {"total": total + outside + exposed, "compute": compute + outside, "serial": serial + exposed}


def tower_memory(work: Workload, layout: Degrees) -> MemoryBreakdown:
    """The step's peak with the tower: what it keeps added to every moment inside the decoder, and one moment more,
    ``vision backward`` (docs/planner.md, "Vision towers")."""
    kept, peak = Tower(work, layout).memory()
    moments = [memory_at(work, layout, moment) for moment in MOMENTS]
    moments = [replace(b, activations=b.activations + kept) if b.moment in DURING_DECODER else b for b in moments]
    weights, grads, optimizer = parameter_memory(work, layout, "first layer backward")
    moments.append(MemoryBreakdown(weights, grads, optimizer, outside_layers_bytes(work, layout) + peak, 0, 0,
                                   work.reserve_bytes, "vision backward"))
    return max(moments, key=lambda b: b.total)


def with_tower(t: StepTime, per_step: dict[str, int], work: Workload, layout: Degrees,
               hw: HardwareSpec) -> tuple[StepTime, dict[str, int]]:
    """The step's time and bytes with the tower's forward before the decoder's and its backward after it: its
    collectives (``vision_*``) and FSDP units added to the bytes."""
    tower, out = Tower(work, layout), dict(per_step)
    for sent in (*tower.traffic().values(), tower.fsdp()):
        for k, v in sent.items():
            out[k] = out.get(k, 0) + v
    out["total"] = sum(v for k, v in out.items() if k != "total")
    s = tower.seconds(hw)
    total, compute = t.total + s["total"], t.compute + s["compute"]
    return replace(t, total=total, compute=compute, exposed_comm=total - compute,
                   serial_comm=t.serial_comm + s["serial"]), out
