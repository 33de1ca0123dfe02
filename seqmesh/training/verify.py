"""``seqmesh verify``: one step of a configuration with sequence parallelism and without, compared.

Every rank also runs the unmodified model (transformers' own SDPA attention) on the whole batch of
every data-parallel rank, with the same loss definition written independently here, and compares
the loss and every parameter's gradient with the sequence-parallel step. Use it when a loss looks
off: a wrong degree, layout or data pipeline shows up as a difference far above rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..sequence.batch import IGNORE_INDEX
from ..model.lm import build_model
from .config import TrainConfig
from ..comm.ranks import full_value
from .step import to_device
from .train import build, read_inputs, uses_fsdp
from ..vision.batch import VISION_KEYS


def _media_documents(config, batch: dict, bounds: list[int]) -> list[dict]:
    """A one-row vision-language batch cut at ``bounds`` into documents, each with the images (and grids) whose
    placeholder tokens it holds: the model's own inputs for that document alone."""
    from ..vision.families import vision_family
    from ..vision.plain import tokens_per_image

    ids = batch["input_ids"]
    plain = vision_family(config).plain
    grid = batch.get("image_grid_thw")
    merge = None if plain else config.vision_config.spatial_merge_size
    tokens = [tokens_per_image(config)] * len(batch["pixel_values"]) if plain else \
        [int(g.prod()) // merge ** 2 for g in grid] if grid is not None else []
    rows = [0] if plain else [int(g.prod()) for g in grid] if grid is not None else []
    parts, image, row = [], 0, 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        need, n = int((ids[:, a:b] == config.image_token_id).sum()), 0
        while need > 0:
            need -= tokens[image + n]
            n += 1
        part = {"input_ids": ids[:, a:b]}
        if not plain:  # Qwen-VL's M-RoPE needs each token's modality (text 0, image 1, video 2)
            video = getattr(config, "video_token_id", None)
            part["mm_token_type_ids"] = (ids[:, a:b] == config.image_token_id).long() + 2 * (ids[:, a:b] == video).long()
        if n and plain:
            part["pixel_values"] = batch["pixel_values"][image : image + n]
        elif n:
            count = sum(rows[image : image + n])
            part.update(pixel_values=batch["pixel_values"][row : row + count], image_grid_thw=grid[image : image + n])
            row += count
        image += n
        parts.append(part)
    return parts


def _reference_sums(model, batches: list[dict], device: torch.device, parity: int | None = None) -> tuple[torch.Tensor, int]:
    """Summed next-token loss and target count over ``batches``, one device, whole sequences, written without
    seqmesh's data pipeline: target t is label t+1, except where the next token starts a new packed document
    (its position restarts at 0). Each document runs through the model alone (transformers' recurrent layers,
    unlike its attention, do not separate packed documents). ``parity``: only targets at even (0) or odd
    (1) positions (the two halves of the loss)."""
    total = torch.zeros((), device=device)
    count = 0
    for batch in batches:
        ids = batch["input_ids"].to(device)
        positions = batch.get("position_ids")
        targets = batch.get("labels", batch["input_ids"])[:, 1:].clone()
        if positions is not None:
            targets[positions[:, 1:] == 0] = IGNORE_INDEX
        if parity is not None:
            targets[:, torch.arange(targets.shape[1]) % 2 != parity] = IGNORE_INDEX
        starts = [0] if positions is None else sorted({0, *(positions[0] == 0).nonzero().flatten().tolist()})
        if positions is not None and not torch.equal(positions, positions[:1].expand_as(positions)):
            starts = [0]  # rows with different documents: whole rows (the copy task and text data never make them)
        bounds = starts + [ids.shape[1]]
        if any(batch.get(k) is not None for k in VISION_KEYS):  # each document with its own images
            logits = torch.cat([model(**{k: v.to(device) for k, v in part.items()}, use_cache=False).logits
                                for part in _media_documents(model.config, batch, bounds)], dim=1)[:, :-1]
        else:
            logits = torch.cat([
                model(input_ids=ids[:, a:b], position_ids=None if positions is None else positions[:, a:b].to(device),
                      use_cache=False).logits
                for a, b in zip(bounds[:-1], bounds[1:])], dim=1)[:, :-1]
        targets = targets.to(device)
        total = total + F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="sum")
        count += int((targets != IGNORE_INDEX).sum())
    return total, count


def _reference_loss(model, batches: list[dict], device: torch.device) -> tuple[torch.Tensor, int]:
    """Mean next-token loss over all valid targets of ``batches`` (see :func:`_reference_sums`), and
    their count."""
    total, count = _reference_sums(model, batches, device)
    return total / max(count, 1), count


def _as_transformers_builds(model: torch.nn.Module, wide: torch.nn.Module) -> torch.nn.Module:
    """``wide`` (``model`` cast to float64) with the parameters that transformers creates in another dtype even in a
    float64 model back in that dtype (Inkling 2's router and Inkling2-Loop's gates, created in float32, whose
    forwards cast their inputs to float32): read from ``model``'s class built in float64 on the meta device."""
    with torch.device("meta"):
        twin = type(model)._from_config(model.config, dtype=torch.float64)
    fixed = {name: p.dtype for name, p in twin.named_parameters() if p.dtype != torch.float64}
    for name, p in wide.named_parameters():
        if name in fixed:
            p.data = p.data.to(fixed[name])
    return wide


def _reference_noise(model, batches: list[dict], device: torch.device, grads: dict[str, torch.Tensor],
                     count: int) -> dict[str, float]:
    """The reference's own rounding, relative per parameter: the larger of (a) its gradients back-propagated as
    two halves of the loss and summed, against ``grads`` from one pass, and (b) ``grads`` against the same
    model and batches in float64. Some gradients cancel heavily (Gated DeltaNet's A_log and dt_bias: ~1e-3 in
    float32), and another split of attention's sums moves a small gradient by more than (a) sees (a trained
    tiny Llama's k_proj: 1.1e-4 against (a)'s 1e-5), so no fixed tolerance fits every model. ``count``: the
    valid targets of ``batches``."""
    import copy

    model.zero_grad()
    for parity in (0, 1):
        (_reference_sums(model, batches, device, parity)[0] / max(count, 1)).backward()
    noise = {name: float((p.grad - grads[name]).abs().max() / grads[name].abs().max().clamp(min=1e-12))
             for name, p in model.named_parameters() if name in grads}
    model.zero_grad()
    # a layer may keep a tensor of its last forward (RecurrentGemma's RG-LRU its final state), which deepcopy refuses
    held = {id(v): v.detach().clone() for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and not v.is_leaf}

    def widened(fixed: bool) -> torch.nn.Module:
        wide = copy.deepcopy(model, held).to(torch.float64)
        wide = _as_transformers_builds(model, wide) if fixed else wide
        if hasattr(wide, "set_experts_implementation"):  # grouped_mm (MoE experts' default) has no float64 kernel
            wide.set_experts_implementation("eager")
        return wide

    wide = widened(fixed=False)
    saved = torch.get_default_dtype()  # what the model makes inside, float64 too (XGLM clamps its float64 scores with
    torch.set_default_dtype(torch.float64)  # a default-dtype tensor, which float64's minimum would overflow)
    try:
        try:
            (_reference_sums(wide, batches, device)[0] / max(count, 1)).backward()
        except RuntimeError:  # a forward that needs a weight in the dtype transformers creates it in (Inkling 2)
            wide = widened(fixed=True)
            (_reference_sums(wide, batches, device)[0] / max(count, 1)).backward()
    finally:
        torch.set_default_dtype(saved)
    for name, p in wide.named_parameters():
        if name in grads:
            exact = p.grad
            rounding = float((grads[name].double() - exact).abs().max() / exact.abs().max().clamp(min=1e-12))
            noise[name] = max(noise[name], rounding)
    del wide
    return noise


NOISE_FACTOR = 10  # a parameter's gradient may differ by this many times the reference's own rounding


def _without_dropout(*models: torch.nn.Module) -> None:
    """Every dropout module of ``models`` (GPT-2's residual and embedding dropout, ``resid_pdrop`` and ``embd_pdrop``,
    0.1 by default) set to drop nothing: verify compares the step's arithmetic, and one process and the shards draw
    their masks from different random streams. Training keeps the config's dropout."""
    for model in models:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.dropout._DropoutNd):
                m.p = 0.0


def verify(cfg: TrainConfig, *, rtol: float | None = None) -> dict:
    """Returns ``{"loss_diff", "worst": [(name, relative difference)], "tolerance", "allowed", "ok"}``.

    A gradient passes within ``tolerance`` or ``NOISE_FACTOR`` times the reference's own rounding of it
    (``allowed``: the bound of each of the worst five), whichever is larger."""
    from ..inputs import shard_batch

    source, data, files = read_inputs(cfg)  # model, data and vocabulary errors come before any model is built
    mesh, module, device = build(cfg, source, files)
    fsdp = uses_fsdp(cfg)
    reference = build_model(source, seed=cfg.seed, device=device)
    with torch.no_grad():  # the same weights, however the sharded model was initialised
        ref_params = dict(reference.named_parameters())
        for name, p in module.named_parameters():
            ref_params[name.removeprefix("lm.")].copy_(full_value(p))
    _without_dropout(reference, module)
    batches = [data.batch(0, d, cfg.batch, mesh.dp_size) for d in range(mesh.dp_size)]
    ref_loss, count = _reference_loss(reference, batches, device)
    ref_loss.backward()
    # parameters the loss never reaches (a tower layer past the one LLaVA reads) have no gradient on either side
    ref_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters() if p.grad is not None}
    noise = _reference_noise(reference, batches, device, ref_grads, count)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and not fsdp):
        loss = module(**to_device(shard_batch(batches[mesh.dp_rank], mesh, model=module, layout=cfg.layout), device))
    loss.backward()
    if not fsdp:
        from ..model.fsdp import sync_gradients

        sync_gradients(module, mesh)
    diffs = []
    for name, p in module.named_parameters():
        if name.removeprefix("lm.") not in ref_grads:
            continue
        grad = full_value(p.grad)
        want = ref_grads[name.removeprefix("lm.")]
        diffs.append((name.removeprefix("lm."), float((grad.float() - want).abs().max() / want.abs().max().clamp(min=1e-12))))
    tolerance = rtol if rtol is not None else (5e-2 if cfg.bf16 else 1e-4)
    loss_diff = abs(float(loss) - float(ref_loss))
    allowed = {name: max(tolerance, NOISE_FACTOR * noise[name]) for name, _ in diffs}
    worst = sorted(diffs, key=lambda x: -x[1] / allowed[x[0]])[:5]
    ok = loss_diff <= tolerance * max(1.0, abs(float(ref_loss))) and all(d <= allowed[n] for n, d in diffs)
    dist.barrier()
    return {"loss": float(loss), "reference_loss": float(ref_loss), "loss_diff": loss_diff, "worst": worst,
            "tolerance": tolerance, "allowed": {n: allowed[n] for n, _ in worst}, "ok": ok, "mesh": repr(mesh)}
