"""The vision tower on this rank's share of the patches, and the model whose forward is the loss of a
vision-language batch.

Each rank embeds its patches, runs every tower block with the block's attention over the whole
sequence group (``seqmesh.attention`` through the attention function ``seqmesh.hf.parallelize``
registered: per frame in full blocks, per window in Qwen2.5-VL's windowed ones), merges its units and
sends each merged unit (with Qwen3-VL's DeepStack features beside it) to the rank holding its
placeholder token: one uneven all-to-all over the sequence group. The decoder then runs as for text.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

from ..mesh import SPMesh
from ..model.lm import SequenceParallelLM
from ..model.router_aux import router_aux
from ..sequence.batch import SequenceInfo
from .batch import VisionShard
from .families import VisionFamily, vision_family
from .plain import run_plain_tower
from .pooled import run_pooled_tower
from .route import route_rows
from .shuffled import run_shuffled_tower
from .route import FixedSizeShard


def _rotary(tower: nn.Module, hidden: torch.Tensor, coordinates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of each patch's (row, column) as the tower's own forward computes them: transformers
    from 5.2x returns them from ``rotary_pos_emb(x, position_ids)``; earlier releases (the floor, 5.15)
    return the angles from ``rotary_pos_emb(position_ids)``, which the forward doubles and turns to cos, sin."""
    if len(inspect.signature(tower.rotary_pos_emb.forward).parameters) >= 2:
        return tower.rotary_pos_emb(hidden, coordinates)
    angles = tower.rotary_pos_emb(coordinates)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def run_tower(family: VisionFamily, tower: nn.Module, shard: VisionShard,
              mesh: SPMesh | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(rows (V, D), deepstack [(V, D)...])``: the embeddings of this rank's ``V`` placeholder tokens,
    in their row-major order, computed by whichever rank holds each one's patches."""
    dtype = tower.patch_embed.proj.weight.dtype
    hidden = tower.patch_embed(shard.pixels.to(dtype))  # (n, C) per patch: the patch embedding is per patch
    if family.learned_positions:
        index, weight = shard.taps
        hidden = hidden + (tower.pos_embed(index) * weight[:, :, None].to(hidden.dtype)).sum(1)
    rotary = _rotary(tower, hidden, shard.coordinates)
    # no split of the shard (seqmesh's attention reads the frames or windows from ``seqmesh=``). On the host: the
    # blocks' attention splits the shard by its differences' ``tolist()``, a device-to-host sync per block for a
    # device tensor, and a value a fake one (seqmesh rehearse) does not have
    import numpy  # transformers' own dependency, as is every tower

    whole = numpy.array([0, hidden.shape[0]], dtype=numpy.int64)
    full_blocks = set(getattr(tower, "fullatt_block_indexes", None) or ())
    deep_blocks = list(getattr(tower, "deepstack_visual_indexes", None) or ()) if family.deepstack else []
    deep = []
    for i, block in enumerate(tower.blocks):
        info = shard.windows if family.windows and i not in full_blocks else shard.frames
        hidden = block(hidden, cu_seqlens=whole, position_embeddings=rotary, seqmesh=info)
        if i in deep_blocks:
            deep.append(tower.deepstack_merger_list[deep_blocks.index(i)](hidden))
    payload = torch.cat([tower.merger(hidden), *deep], dim=-1)  # (units, D * (1 + deep))
    rows = route_rows(payload, shard, mesh).chunk(1 + len(deep), dim=-1)
    return rows[0], list(rows[1:])


class VisionLanguageLM(SequenceParallelLM):
    """A ``SequenceParallelLM`` for the vision-language families of ``seqmesh.vision.families``:
    ``forward(**seqmesh.shard_batch(batch, mesh, model=...))`` runs the sharded tower, routes its
    embeddings to their placeholder tokens and returns the loss of the whole batch, as for a text model."""

    def __init__(self, lm: nn.Module, mesh: SPMesh | None, *, chunk: int = 4096):
        super().__init__(lm, mesh, chunk=chunk)
        self.family = vision_family(lm.config)

    def hidden_states(self, input_ids, position_ids, seqmesh: SequenceInfo | None = None,
                      seqmesh_vision: VisionShard | FixedSizeShard | None = None) -> torch.Tensor:
        return self.decode(input_ids, position_ids, seqmesh, seqmesh_vision).last_hidden_state  # (B, L, D)

    def decode(self, input_ids, position_ids, seqmesh: SequenceInfo | None = None,
               seqmesh_vision: VisionShard | FixedSizeShard | None = None, *, router_logits: bool = False):
        """The language model's output on the tokens with the tower's rows in their placeholders: as
        ``SequenceParallelLM.decode``."""
        if seqmesh_vision is None:
            raise ValueError(f"{type(self.lm).__name__} is a vision-language model: call it with "
                             "seqmesh.shard_batch(batch, mesh, model=model), which shards its images too.")
        family = self.family
        table = family.inner(self.lm).get_input_embeddings()
        image_id = getattr(self.lm.config, "image_token_id", None)
        if family.pooled and image_id is not None and image_id >= table.num_embeddings:
            input_ids = input_ids.masked_fill(input_ids == image_id, 0)  # Gemma 3 looks an id past its table up as 0
        embeds = table(input_ids)  # (B, L, D)
        extra = {"seqmesh": seqmesh} if seqmesh is not None else {}
        media = self._any_media(seqmesh_vision)
        if media and family.fixed_size:
            run = run_plain_tower if family.plain else run_pooled_tower if family.pooled else run_shuffled_tower
            rows = run(self.lm, seqmesh_vision, self.mesh)
            embeds = embeds.masked_scatter(seqmesh_vision.visual_mask[..., None], rows.to(embeds.dtype))
        elif media:
            rows, deep = run_tower(family, family.tower(self.lm), seqmesh_vision, self.mesh)
            mask = seqmesh_vision.visual_mask
            embeds = embeds.masked_scatter(mask[..., None], rows.to(embeds.dtype))
            if family.deepstack:
                extra.update(visual_pos_masks=mask, deepstack_visual_embeds=[d.to(embeds.dtype) for d in deep])
        if router_logits:
            extra["output_router_logits"] = True
        return family.language_model(self.lm)(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, **extra)

    def _any_media(self, shard: VisionShard | FixedSizeShard) -> bool:
        """Whether any rank's batch holds an image or a video. Then every rank runs the tower (on padding
        if it has none), so the collectives of the tower and of FSDP2 match. Otherwise no rank runs it, and
        its weights get no gradient, as on one device: an optimizer leaves them alone rather than moving
        them on a zero gradient. One all-reduce of a flag when data-parallel replicas read different batches."""
        if self.mesh is None or self.mesh.dp_size == 1:
            return shard.has_media
        flag = torch.tensor([float(shard.has_media)], device=self.mesh.collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.batch_group)
        return bool(flag.item())

    def forward(self, input_ids, position_ids, shift_labels, seqmesh: SequenceInfo | None = None,
                seqmesh_vision: VisionShard | FixedSizeShard | None = None) -> torch.Tensor:
        aux = router_aux(self.lm)
        out = self.decode(input_ids, position_ids, seqmesh, seqmesh_vision, router_logits=aux is not None)
        return self.loss_of(out, shift_labels, seqmesh, aux)

    @torch.no_grad()
    def score(self, input_ids, position_ids, shift_labels, seqmesh: SequenceInfo | None = None,
              seqmesh_vision: VisionShard | FixedSizeShard | None = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, position_ids, seqmesh, seqmesh_vision)
        return self.score_from_hidden(hidden, shift_labels, seqmesh)
