"""Vision-language models through seqmesh on every rank, against the unmodified transformers model on the
whole batch on one process: logits, loss and every parameter's gradient (the vision tower's included).

Tiny random-weight models of every family seqmesh routes, from transformers' config classes, float64. The
batches hold several images of different sizes and a video, whose placeholder tokens cross shard
boundaries; one variant packs two documents, each with its own images (the reference runs each
document on its own); one has a row with no image at all on some ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from family_cases import computed_once, gradients_of
from seqmesh.compose import ParallelPlan, parallelize_model
from seqmesh.model.fsdp import sync_gradients

IMAGE, VIDEO, START, END = 290, 291, 292, 293  # token ids of the tiny models
TEXT_VOCAB = 280  # text tokens are drawn below the special ones


LLAVA_SIDE = 4  # LLaVA's tiny CLIP: 8x8-pixel images of 2x2-pixel patches, 16 patches, 16 placeholder tokens
# Gemma 3's tiny SigLIP: the same 16 patches pooled 2x2 into 4 placeholder tokens; its decoder alternates a layer
# with a sliding window of GEMMA_WINDOW tokens and a full one, so windows matter on these ~40-token batches
GEMMA_TOKENS, GEMMA_WINDOW = 4, 8
# InternVL's tiny InternViT: 8x8-pixel tiles of the same 16 patches, a class token, the 2x2 windows pixel-shuffled into
# 4 placeholder tokens (GEMMA_TOKENS); an image may span several tiles (its tokens one run between start and end)
FIXED_SIZE = ("llava", "llava_full", "gemma3", "internvl")  # families whose images all have one size (no grid): (N, 3, 8, 8)


def _tokens_per_image(family: str) -> int:
    return GEMMA_TOKENS if family in ("gemma3", "internvl") else LLAVA_SIDE ** 2


def vision_config(family: str):
    """A tiny config of ``family``: 2 decoder layers, a 3-block tower with 2x2-patch merging (LLaVA: a
    3-layer CLIP read after its second layer, no merging)."""
    from transformers import AutoConfig

    if family == "gemma3":
        text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=4096,
                    attention_dropout=0.0, sliding_window=GEMMA_WINDOW, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention"])
        vision = dict(model_type="siglip_vision_model", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, image_size=2 * LLAVA_SIDE, patch_size=2, vision_use_head=False)
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA_TOKENS,
                                    image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END)
    if family == "internvl":  # a Qwen2 decoder; the tower read after its last layer and final LayerNorm
        text = dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, max_position_embeddings=4096, attention_dropout=0.0)
        vision = dict(model_type="internvl_vision", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=48, image_size=2 * LLAVA_SIDE, patch_size=2, use_mean_pooling=False)
        return AutoConfig.for_model("internvl", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                    image_seq_length=GEMMA_TOKENS, downsample_ratio=0.5, vision_feature_layer=-1,
                                    vision_feature_select_strategy="default")
    if family in ("llava", "llava_full"):  # llava_full: the "full" strategy, the class token's row an image token too
        text = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, max_position_embeddings=4096, attention_dropout=0.0)
        vision = dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=48, image_size=2 * LLAVA_SIDE, patch_size=2)
        full = family == "llava_full"
        return AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                    image_seq_length=LLAVA_SIDE ** 2 + full,
                                    vision_feature_select_strategy="full" if full else "default")

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=300, max_position_embeddings=4096, attention_dropout=0.0, rope_parameters=rope)
    vision = dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=48, out_hidden_size=64, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_5_vl":  # windows of 2x2 units (8 pixels), block 1 full attention
        vision.update(window_size=8, fullatt_block_indexes=[1], tokens_per_second=2)
    elif family == "qwen2_vl":  # every block per frame; the tower's width is embed_dim, hidden_size the merger's output
        vision = dict(depth=3, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    elif family in ("qwen3_5", "qwen3_5_moe"):  # a Gated DeltaNet layer, then attention with half the head dim rotated
        text.update(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
        if family == "qwen3_5_moe":  # both layers' MLPs: 4 routed experts (2 per token) beside a shared one
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        rope.update(partial_rotary_factor=0.5, mrope_section=[2, 1, 1], mrope_interleaved=True)
        vision.update(num_position_embeddings=16)
    else:  # Qwen3-VL(-MoE): a 4x4 learned position table, DeepStack features from blocks 0 and 2
        text.update(head_dim=16)
        if family == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        rope["mrope_interleaved"] = True
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
    return AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=IMAGE,
                                video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def build(config, seed: int = 0, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                    experts_implementation="eager")  # grouped_mm has no float64
    if config.model_type == "gemma3":  # its projection starts at zero, which would hide the image features
        with torch.no_grad():
            weight = model.model.multi_modal_projector.mm_input_projection_weight
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 0.2)
    if config.model_type == "internvl":  # its class token and position table start at zero, which would hide their
        embeddings = model.model.vision_tower.embeddings  # place: a patch at the wrong position must show
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for weight in (embeddings.cls_token, embeddings.position_embeddings):
                weight.copy_(torch.randn(weight.shape, generator=g, dtype=dtype))
    return model


def _media_tokens(family: str, grid: list[int], token: int, text) -> list[int]:
    """The placeholder tokens of one image or video as its processor writes them (Qwen3-VL: a video's
    frames one by one, each after its timestamp's text)."""
    t, h, w = grid
    if family in ("llava", "llava_full"):  # a fixed size: LLAVA_SIDE x LLAVA_SIDE patches (and the class token's row)
        return [token] * (LLAVA_SIDE ** 2 + (family == "llava_full"))
    if family == "gemma3":  # a fixed size, pooled to GEMMA_TOKENS tokens between start and end tokens
        return [START] + [token] * GEMMA_TOKENS + [END]
    if family == "internvl":  # t tiles of a fixed size, each shuffled to GEMMA_TOKENS tokens, between start and end
        return [START] + [token] * (GEMMA_TOKENS * t) + [END]
    per_frame = h * w // 4
    if token == VIDEO and family not in ("qwen2_vl", "qwen2_5_vl"):  # Qwen3-VL and Qwen3.5: timestamps between frames
        return [tok for _ in range(t) for tok in text(2) + [START] + [token] * per_frame + [END]]
    return [START] + [token] * (t * per_frame) + [END]


def vision_batch(family: str, kind: str = "mixed", seed: int = 3) -> dict:
    """A whole batch. ``kind``: ``mixed`` (two images of different shapes and a video, text between),
    ``documents`` (two packed documents, each with an image; ``position_ids`` restart), ``text_only``
    (a row with no image: no rank runs the tower), ``two_rows`` (two rows, each with its images), ``tail``
    (one image near the end,
    so most ranks hold no image token)."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, TEXT_VOCAB, (n,), generator=g).tolist()  # noqa: E731
    images, videos, docs = [], [], []
    ids: list[int] = []

    def image(grid):
        images.extend([grid] * (grid[0] if family == "internvl" else 1))  # InternVL: one pixel_values row per tile
        return _media_tokens(family, grid, IMAGE, text)

    def video(grid):
        videos.append(grid)
        return _media_tokens(family, grid, VIDEO, text)

    if kind == "mixed" and family in ("llava", "llava_full"):  # images only
        ids = text(5) + image([1, 4, 6]) + text(7) + image([1, 4, 4]) + text(4) + image([1, 6, 4]) + text(6)
    elif kind in ("mixed", "untyped") and family == "gemma3":  # images only; two back to back make one 8-token block
        ids = text(5) + image([1, 4, 4]) + text(7) + image([1, 4, 4])[:-1] + image([1, 4, 4])[1:] + text(9)
        ids += image([1, 4, 4]) + text(6)
    elif kind == "mixed" and family == "internvl":  # a two-tile image, then two one-tile ones
        ids = text(5) + image([2, 4, 4]) + text(7) + image([1, 4, 4]) + text(4) + image([1, 4, 4]) + text(6)
    elif kind == "mixed":
        ids = text(5) + image([1, 4, 6]) + text(7) + video([2, 4, 4]) + text(4) + image([1, 6, 4]) + text(6)
    elif kind == "documents":
        first = text(3) + image([1, 4, 4]) + text(5)
        second = text(4) + image([1, 6, 4]) + text(3) + image([1, 2, 2]) + text(2)
        ids, docs = first + second, [len(first), len(second)]
    elif kind == "tail":
        ids = text(30) + image([1, 4, 4]) + text(2)
    elif kind == "text_only":
        ids = text(29)
    rows = [ids]
    if kind == "two_rows":  # two rows of the same length, each with its own images (row-major in the pixels)
        first = text(5) + image([1, 4, 6]) + text(7)
        second = text(2) + image([1, 2, 2]) + text(3) + image([1, 4, 4])
        longest = max(len(first), len(second))
        rows = [first + text(longest - len(first)), second + text(longest - len(second))]
    input_ids = torch.tensor(rows)
    batch = {"input_ids": input_ids, "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long()}
    if family == "internvl":  # its processor writes none
        batch.pop("mm_token_type_ids")
    if family == "gemma3":  # its processor's name for them; "untyped": without them (transformers' mask is causal)
        types = batch.pop("mm_token_type_ids")
        if kind != "untyped":
            batch["token_type_ids"] = types
    if family in FIXED_SIZE and images:
        side = 2 * LLAVA_SIDE
        batch["pixel_values"] = torch.randn(len(images), 3, side, side, generator=g, dtype=torch.float64)
        images = []
    for key, grid_key, grids in (("pixel_values", "image_grid_thw", images),
                                 ("pixel_values_videos", "video_grid_thw", videos)):
        if grids:
            grid = torch.tensor(grids)
            batch[grid_key] = grid
            batch[key] = torch.randn(int(grid.prod(dim=1).sum()), 24, generator=g, dtype=torch.float64)
    if docs:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in docs])[None]
    if family == "qwen2_5_vl" and videos:  # the video's frame pairs 0.5 s apart (its temporal M-RoPE ids spaced so)
        batch["second_per_grid_ts"] = torch.tensor([0.5])
    return batch


def _split_documents(batch: dict) -> list[dict]:
    """Each packed document of a one-row batch as a batch of its own, with its own images."""
    ids = batch["input_ids"]
    if "position_ids" not in batch:
        return [batch]
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    llava = "image_grid_thw" not in batch and "pixel_values" in batch  # fixed-size images, one row each
    grid = batch.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
    per_image = int((ids == IMAGE).sum()) // len(batch["pixel_values"]) if llava else 0  # tokens per fixed-size image
    sizes = [4 * per_image] * len(batch["pixel_values"]) if llava else grid.prod(dim=1).tolist()
    out, image, patch = [], 0, 0
    for a, b in zip(starts, starts[1:]):
        part = ids[:, a:b]
        need, n = int((part == IMAGE).sum()), 0
        while need > 0:
            need -= sizes[image + n] // 4
            n += 1
        doc = {"input_ids": part, **{key: batch[key][:, a:b] for key in ("mm_token_type_ids", "token_type_ids")
                                     if key in batch}}
        if n and llava:
            doc["pixel_values"] = batch["pixel_values"][image : image + n]
            image += n
        elif n:
            doc["image_grid_thw"] = grid[image : image + n]
            count = sum(sizes[image : image + n])
            doc["pixel_values"] = batch["pixel_values"][patch : patch + count]
            image, patch = image + n, patch + count
        out.append(doc)
    return out


def reference_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``(1, S, V)`` and the mean next-token loss of the whole batch on one process, no loss on a
    placeholder token or across a document boundary; packed documents run one model call each."""
    logits = torch.cat([model(**doc, use_cache=False).logits for doc in _split_documents(batch)], dim=1)
    ids = batch["input_ids"]
    labels = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)
    targets = labels[:, 1:].clone()
    if "position_ids" in batch:
        targets[batch["position_ids"][:, 1:] == 0] = -100
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="sum") / (targets != -100).sum()
    return logits, loss


# A gradient that is zero in exact arithmetic (an attention key's bias: softmax does not see a shift shared
# by every key) is pure rounding in both runs, and its error relative to itself says nothing; such
# gradients, below this fraction of the model's largest, are left out of the relative comparison.
ZERO_GRADIENT = 1e-9


def _worst_grad(model, want: dict) -> tuple[float, str]:
    worst, name_of = 0.0, ""
    largest = max(float(p.grad.abs().max()) for p in want.values() if p.grad is not None)
    for name, p in model.named_parameters():
        ref = want[name].grad
        if ref is None:  # the loss never reaches it (a LLaVA tower layer past the one read): nor may seqmesh's
            if p.grad is not None and float(p.grad.abs().max()) > 0:
                return float("inf"), name
            continue
        if float(ref.abs().max()) <= ZERO_GRADIENT * largest:
            continue
        got = p.grad.double() if p.grad is not None else torch.zeros_like(ref)
        err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        if err > worst:
            worst, name_of = err, name
    return worst, name_of


# Transformers' Gated DeltaNet computes in float32 whatever the model's dtype, so a float64 Qwen3.5 is float64
# everywhere but there, and its float32-vs-float64 spread cannot show that layer's own rounding (its float32
# parts round alike in both runs), which seqmesh's float64 Gated DeltaNet does not share. The reference's noise
# therefore also counts how far that layer's float32 rounding alone moves it: the same float64 reference with
# transformers' token-by-token rule in place of its chunked one (:func:`_gated_delta_spread`).
GATED_DELTA_FAMILIES = ("qwen3_5", "qwen3_5_moe")


def _spread(logits, loss, model, ref_logits, ref_loss, reference) -> dict:
    return {"logits": float((logits.detach().double() - ref_logits.detach()).abs().max()),
            "loss": abs(loss.item() - ref_loss.item()), "grad": _worst_grad(model, dict(reference.named_parameters()))[0]}


def _gated_delta_spread(config, batch: dict, ref_logits, ref_loss, reference) -> dict:
    """How far the float64 reference moves when its Gated DeltaNet layers compute the same recurrence token
    by token (``torch_recurrent_gated_delta_rule``) instead of by chunks: that layer's float32 rounding."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")

    def token_by_token(*args, chunk_size=None, **kwargs):
        return modeling.torch_recurrent_gated_delta_rule(*args, **kwargs)

    other = build(config)
    with mock.patch.object(modeling, "torch_chunk_gated_delta_rule", token_by_token):
        logits, loss = reference_loss(other, batch)
        loss.backward()
    return _spread(logits, loss, other, ref_logits, ref_loss, reference)


def _norms_in_input_dtype(family: str):
    """Gemma 3's RMSNorm computes in float32 whatever the model's dtype, so a float64 Gemma 3 rounds to float32
    at every norm and two exact computations whose inputs differ in the 16th digit can differ in the 7th.
    Within this context (both the reference's runs and seqmesh's) the norm computes in its input's dtype: the
    same function, bitwise the same in float32, and float64 in float64, so the comparison sees float64 errors."""
    if family != "gemma3":
        return contextlib.nullcontext()
    from transformers.models.gemma3 import modeling_gemma3

    def forward(self, x):
        return self._norm(x) * (1.0 + self.weight.to(x.dtype))

    return mock.patch.object(modeling_gemma3.Gemma3RMSNorm, "forward", forward)


def _transposed_windows(transpose: bool):
    """A deliberate error for the test that the tolerance sees one: every window's patches column-major instead
    of row-major (a transposed pixel shuffle). Each patch keeps its pixels and its position, so the tower's
    attention is unchanged; only the order in which a token's row concatenates its window's patches is wrong."""
    if not transpose:
        return contextlib.nullcontext()
    from seqmesh.vision import windows

    right = windows.window_places

    def transposed(grid, images):
        patches, tokens = right(grid, images)
        k = grid.kernel
        by_window = patches.reshape(-1, k, k)
        whole = (by_window >= 0).flatten(1).all(dim=1)  # windows of patches (not a class window)
        by_window[whole] = by_window[whole].transpose(1, 2)
        return by_window.reshape(-1), tokens

    return mock.patch.object(windows, "window_places", transposed)


# (family, kind) -> _vision_reference's tuple, in each rank process (a pool outlives its tests)
REFERENCES: dict[tuple, tuple] = {}


def _vision_reference(family: str, kind: str) -> tuple:
    """``(logits, loss, gradients, rounding)`` of the one-process float64 model on ``vision_batch(family, kind)``
    (``gradients``: ``family_cases.gradients_of``), and the same run in float32 against it (its own rounding)."""
    with _norms_in_input_dtype(family):
        config = vision_config(family)
        batch = vision_batch(family, kind)
        reference = build(config)
        ref_logits, ref_loss = reference_loss(reference, batch)
        ref_loss.backward()
        low = build(config).to(torch.float32)  # the same weights, rounded
        low_logits, low_loss = reference_loss(low, {k: v.float() if v.is_floating_point() else v
                                                    for k, v in batch.items()})
        low_loss.backward()
        rounding = _spread(low_logits, low_loss, low, ref_logits, ref_loss, reference)
        if family in GATED_DELTA_FAMILIES:
            algorithm = _gated_delta_spread(config, batch, ref_logits, ref_loss, reference)
            rounding = {key: max(rounding[key], algorithm[key]) for key in rounding}
    return ref_logits.detach(), ref_loss.detach(), gradients_of(reference), rounding


def vision_parity_all(cases: list[tuple], **kwargs) -> list[dict]:
    """:func:`vision_parity` of each case (its positional arguments), the references they need computed once over
    the group (``family_cases.computed_once``)."""
    computed_once([(c[0], c[3] if len(c) > 3 else "mixed") for c in cases], _vision_reference, REFERENCES)
    return [{"case": c, **vision_parity(*c, **kwargs)} for c in cases]


def vision_parity(family: str, ulysses: int, ring: int, kind: str = "mixed", layout: str = "auto",
                  shift_positions_on: int | None = None, drop_image_blocks: bool = False,
                  transpose_windows: bool = False, checkpointing: bool = False) -> dict:
    """:func:`_vision_parity` (see there), Gemma 3's norms in float64 for a float64 model; ``transpose_windows``:
    :func:`_transposed_windows`."""
    with _norms_in_input_dtype(family), _transposed_windows(transpose_windows):
        return _vision_parity(family, ulysses, ring, kind, layout, shift_positions_on, drop_image_blocks, checkpointing)


def _counting_layer_steps(family: str, calls: list):
    """Gemma 3's and InternVL's tower layer step (the function seqmesh runs each layer with), counting its calls."""
    import importlib

    module = importlib.import_module({"gemma3": "seqmesh.vision.pooled", "internvl": "seqmesh.vision.shuffled"}[family])
    step = module.encoder_layer

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    return mock.patch.object(module, "encoder_layer", counted)


def _vision_parity(family: str, ulysses: int, ring: int, kind: str, layout: str, shift_positions_on: int | None,
                   drop_image_blocks: bool, checkpointing: bool = False) -> dict:
    """Largest logit error, loss error and largest relative gradient error over all parameters against
    the one-process model, and the same three for the reference run in float32 against float64 (the
    reference's own rounding). ``shift_positions_on``: a deliberate error for the test that the
    tolerance sees one, that rank's M-RoPE ids one position too far. ``drop_image_blocks``: another, Gemma 3's
    decoder run plainly causal (its image tokens no longer see their image's later tokens)."""
    mesh = get_mesh(ulysses, ring)
    config = vision_config(family)
    batch = vision_batch(family, kind)
    if (family, kind) not in REFERENCES:
        REFERENCES[family, kind] = _vision_reference(family, kind)
    ref_logits, ref_loss, ref_grads, rounding = REFERENCES[family, kind]

    model = build(config)
    sp = parallelize_model(model, mesh, ParallelPlan(fsdp=False, loss_chunk=16, checkpointing=checkpointing))
    local = seqmesh.shard_batch(batch, mesh, model=sp, layout=layout)
    if drop_image_blocks:
        local["seqmesh"] = dataclasses.replace(local["seqmesh"], image_blocks=None)
    if shift_positions_on == torch.distributed.get_rank():
        local["position_ids"] = local["position_ids"] + 1
    step_calls: list = []
    with _counting_layer_steps(family, step_calls) if family in ("gemma3", "internvl") else contextlib.nullcontext():
        loss = sp(**local)
        loss.backward()
    sync_gradients(sp, mesh)
    with torch.no_grad():
        hidden = sp.hidden_states(local["input_ids"], local["position_ids"], local["seqmesh"], local["seqmesh_vision"])
        logits = model.lm_head(hidden)
    whole = seqmesh.gather_sequence(logits.double(), mesh, layout=local["seqmesh"].layout, length=batch["input_ids"].shape[1],
                                    cu_seqlens=local["seqmesh"].cu_seqlens)
    grad, worst = _worst_grad(model, ref_grads)
    tower_grads = sum(1 for n, p in model.named_parameters()
                      if ("visual" in n or "vision_tower" in n) and p.grad is not None and p.grad.abs().sum() > 0)
    return {"logits": float((whole - ref_logits.detach()).abs().max()), "loss": abs(loss.item() - ref_loss.item()),
            "grad": grad, "worst": worst, "tower_grads": tower_grads, "rounding": rounding,
            "tokens": batch["input_ids"].shape[1], "layout": local["seqmesh"].layout,
            "sent": sum(local["seqmesh_vision"].send_rows) - local["seqmesh_vision"].send_rows[mesh.sp_rank],
            "tower_layer_steps": len(step_calls)}


def _tiny_refused(kind: str):
    """A multimodal config seqmesh refuses, built from transformers' config classes."""
    from transformers import AutoConfig

    text = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, vocab_size=300, model_type="qwen2")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8,
                  patch_size=2, model_type="siglip_vision_model")
    return AutoConfig.for_model(kind, text_config=text, vision_config=vision)


def refusals(ulysses: int, ring: int) -> dict:
    """The message of every refusal a user can meet before any work: families seqmesh does not route
    (LLaVA-OneVision), a tower with too few heads for Ulysses, a multimodal batch sharded without its model,
    placeholder tokens that do not match the images, a vision-language model called with a text batch, and
    Gemma 3's two: rows placing their images differently, and an image longer than the sliding window; InternVL's
    settings its pixel shuffle cannot take whole (the class token kept, a downsample ratio that is not 1/k)."""
    from transformers import AutoModelForImageTextToText

    from seqmesh.hf import parallelize

    mesh = get_mesh(ulysses, ring)
    out = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as e:
            out[name] = str(e)

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(_tiny_refused("llava_onevision"))
    catch("llava_onevision", lambda: parallelize(model, mesh))
    for name, setting in (("internvl_strategy", {"vision_feature_select_strategy": "full"}),
                          ("internvl_ratio", {"downsample_ratio": 0.3})):
        internvl = vision_config("internvl")
        for key, value in setting.items():
            setattr(internvl, key, value)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(internvl)
        catch(name, lambda: parallelize(model, mesh))
    gemma = vision_config("gemma3")
    gemma.text_config.sliding_window = GEMMA_TOKENS - 1
    sp = parallelize_model(build(gemma), mesh, ParallelPlan(fsdp=False))
    batch = vision_batch("gemma3")
    catch("gemma3_long_image", lambda: sp(**seqmesh.shard_batch(batch, mesh, model=sp)))
    rows = {k: torch.cat([v, v.roll(1, dims=1)]) if k in ("input_ids", "token_type_ids") else v for k, v in batch.items()}
    rows["pixel_values"] = torch.cat([batch["pixel_values"]] * 2)
    catch("gemma3_rows", lambda: seqmesh.shard_batch(rows, mesh, model=sp))
    config = vision_config("qwen2_5_vl")
    config.vision_config.num_heads = 1
    with torch.device("meta"):
        few_heads = AutoModelForImageTextToText.from_config(config)
    catch("tower_heads", lambda: parallelize(few_heads, mesh))
    sp = parallelize_model(build(vision_config("qwen2_5_vl")), mesh, ParallelPlan(fsdp=False))
    batch = vision_batch("qwen2_5_vl")
    catch("no_model", lambda: seqmesh.shard_batch(batch, mesh))
    short = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["input_ids"] == VIDEO, 7))
    catch("placeholders", lambda: seqmesh.shard_batch(short, mesh, model=sp))
    text = seqmesh.sequence.batch.shard_batch({"input_ids": batch["input_ids"]}, mesh)
    catch("text_batch", lambda: sp(**text))
    media = {k: v for k, v in batch.items() if k not in ("input_ids", "mm_token_type_ids")}
    for family in ("qwen2_5_vl", "qwen3_vl", "llava"):  # the model's own forward given the whole images
        model = parallelize(build(vision_config(family)), mesh)
        pixels = media if family != "llava" else vision_batch("llava")
        pixels = {k: v for k, v in pixels.items() if k not in ("input_ids", "mm_token_type_ids")}
        catch(f"whole_tower_{family}", lambda: model(input_ids=text["input_ids"], position_ids=text["position_ids"],
                                                     seqmesh=text["seqmesh"], **pixels))
    return out


def fsdp_data_parallel_parity(family: str, ep: int = 1) -> dict:
    """4 ranks: FSDP2 over 2 data-parallel x 2 ring ranks, the first replica's batch with images and a video,
    the second's text only (its ranks run the tower on padding; nothing may hang). The loss and every
    gradient against one process on both batches: the mean over every target of both, as seqmesh pools it.
    ``ep``: the language model's experts split over expert groups of that many ranks."""
    mesh = get_mesh(1, 2, dp_shard=2)
    config = vision_config(family)
    batches = [vision_batch(family, "mixed"), vision_batch(family, "text_only")]
    reference = build(config)
    sums, counts = [], []
    for batch in batches:
        logits, _ = reference_loss(reference, batch)
        ids = batch["input_ids"]
        targets = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)[0, 1:]
        sums.append(F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum"))
        counts.append((targets != -100).sum())
    ref_loss = sum(sums) / sum(counts)
    ref_loss.backward()
    low = build(config).to(torch.float32)
    low_sums = []
    for batch in batches:
        logits, _ = reference_loss(low, {k: v.float() if v.is_floating_point() else v for k, v in batch.items()})
        ids = batch["input_ids"]
        targets = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)[0, 1:]
        low_sums.append(F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum"))
    low_loss = sum(low_sums) / sum(counts)
    low_loss.backward()
    rounding = _spread(low_loss, low_loss, low, ref_loss, ref_loss, reference)

    model = build(config)
    sp = parallelize_model(model, mesh, ParallelPlan(fsdp=True, loss_chunk=16, ep=ep))
    loss = sp(**seqmesh.shard_batch(batches[mesh.dp_rank], mesh, model=sp))
    loss.backward()
    worst = 0.0
    want = dict(reference.named_parameters())
    for name, p in sp.lm.named_parameters():
        ref = want[name].grad
        grad = p.grad.full_tensor() if p.grad is not None else torch.zeros_like(ref)
        worst = max(worst, float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)) if ref is not None else 0.0)
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": worst, "rounding": rounding}


def fields_left_behind(family: str) -> list[str]:
    """The tensor fields of a sharded multimodal batch that ``seqmesh train``'s ``to_device`` leaves off the
    target device (the meta device here: every tensor must move)."""
    from seqmesh.training.step import to_device

    mesh = get_mesh(1, 1)
    model = parallelize_model(build(vision_config(family)), mesh, ParallelPlan(fsdp=False))
    local = to_device(seqmesh.shard_batch(vision_batch(family), mesh, model=model), torch.device("meta"))
    shard = local["seqmesh_vision"]
    left = [k for k, v in local.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    for f in dataclasses.fields(shard):
        value = getattr(shard, f.name)
        values = value if isinstance(value, tuple) else (value,)
        left += [f.name for v in values if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    return left
