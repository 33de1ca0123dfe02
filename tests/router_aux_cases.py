"""MoE models whose config asks for the router load-balancing loss (``output_router_logits=True``,
``router_aux_loss_coef=0.5``), through seqmesh on every rank, against the unmodified transformers model on the
whole batch on one process: loss and every parameter's gradient (the routers' included).

The reference is transformers' own: the model's forward with ``output_router_logits=True`` and its family's
``load_balancing_loss_func`` on the router logits of every token of the batch (packed documents: one model call
per document, their router logits together, as the one packed call would give them), masked by the batch's
``attention_mask``, plus the mean cross-entropy of every valid target. For a whole, unpacked batch it is checked
against the model's own ``loss`` (labels given).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from family_cases import SMALL, WINDOW, _worst_grad, build, computed_once, gradients_of, reference_rounding
from seqmesh.hf import parallelize, unparallelize
from seqmesh.model.fsdp import sync_gradients
from seqmesh.model.lm import SequenceParallelLM

COEF = 0.5  # moves the loss by ~1 and the routers' gradients by far more than rounding
SEQ = 45
SHORT_ROW = 38  # the second row's real tokens (right padding after)


def moe_config(family: str):
    """A tiny MoE config of ``family`` (4 experts, 2 per token, every layer MoE) asking for the aux loss."""
    import transformers as tf

    aux = dict(output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=2)
    if family == "qwen3_moe":  # softmax router without bias
        return tf.Qwen3MoeConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2,
                                 head_dim=8, num_experts=4, **aux)
    if family == "gpt-oss":  # router with a bias, top-k of the logits, sinks and a window
        return tf.GptOssConfig(**SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"], num_local_experts=4, **aux)
    if family == "mixtral":  # softmax router taken in float32
        return tf.MixtralConfig(**SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                **aux)
    raise ValueError(f"unknown family {family!r}")


def aux_batch(kind: str, vocab: int) -> dict:
    """``rows``: two rows, the second right-padded (``attention_mask``); ``documents``: one row of five packed
    documents (``position_ids`` restarting)."""
    g = torch.Generator().manual_seed(5)
    if kind == "rows":
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, SHORT_ROW:] = 0
        return {"input_ids": torch.randint(0, vocab, (2, SEQ), generator=g), "attention_mask": mask}
    cuts = [0, 1, 9, 10, 30, SEQ]
    return {"input_ids": torch.randint(0, vocab, (1, SEQ), generator=g),
            "position_ids": torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]}


def _targets(batch: dict) -> torch.Tensor:
    """``(B, S - 1)`` next-token targets: -100 across a document boundary and past a row's real tokens."""
    targets = batch["input_ids"][:, 1:].clone()
    if "position_ids" in batch:
        targets[batch["position_ids"][:, 1:] == 0] = -100
    if "attention_mask" in batch:
        targets[batch["attention_mask"][:, 1:] == 0] = -100
    return targets


def aux_reference(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and loss (cross-entropy + coef x transformers' load-balancing loss) of the whole batch."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    cuts = [0, ids.shape[1]]
    if "position_ids" in batch:
        cuts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    outs = [model(input_ids=ids[:, a:b], attention_mask=None if mask is None else mask[:, a:b], use_cache=False,
                  output_router_logits=True) for a, b in zip(cuts[:-1], cuts[1:])]
    logits = torch.cat([o.logits for o in outs], dim=1)
    layers = tuple(torch.cat(per_layer, dim=0) for per_layer in zip(*(o.router_logits for o in outs)))
    balance = sys.modules[type(model).__module__].load_balancing_loss_func(
        layers, model.num_experts, model.num_experts_per_tok, mask)
    targets = _targets(batch)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                         reduction="sum") / (targets != -100).sum()
    return logits, ce + model.router_aux_loss_coef * balance


# (family, kind) -> _aux_reference's tuple, in each rank process (a pool outlives its tests)
REFERENCES: dict[tuple, tuple] = {}


def _aux_reference(family: str, kind: str) -> tuple:
    """``(loss, gradients, rounding, own)`` of :func:`aux_reference` on one process (``gradients``:
    ``family_cases.gradients_of``); ``own``: for ``rows``, transformers' own loss of the model given labels."""
    config = moe_config(family)
    reference = build(config)
    batch = aux_batch(kind, config.vocab_size)
    ref_logits, ref_loss = aux_reference(reference, batch)
    ref_loss.backward()
    own = None
    if kind == "rows":  # the reference is transformers' loss: the model's own, labels given
        with torch.no_grad():
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            own = reference(**batch, labels=labels, use_cache=False).loss.item()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference, loss_fn=aux_reference)
    return ref_loss.detach(), gradients_of(reference), rounding, own


def aux_parity_all(cases: list[tuple], **kwargs) -> list[dict]:
    """:func:`aux_parity` of each ``(family, ulysses, ring, kind, ...)``, the references they need computed once
    over the group (``family_cases.computed_once``)."""
    computed_once([(c[0], c[3]) for c in cases], _aux_reference, REFERENCES)
    return [{"case": c, **aux_parity(*c, **kwargs)} for c in cases]


def aux_parity(family: str, ulysses: int, ring: int, kind: str, dp: int = 1, drop_aux: bool = False,
               plan: dict | None = None) -> dict:
    """Loss error and largest relative gradient error against :func:`aux_reference`, with the reference's own
    rounding (``family_cases.reference_rounding``). ``dp``: data-parallel replicas, each given its share of the
    rows, against one process on all of them. ``drop_aux``: seqmesh's model told coefficient 0 (the behaviour
    before seqmesh added the term), for the test that the comparison sees the term. ``plan``: ParallelPlan options,
    the model then composed by ``parallelize_model`` (activation checkpointing recomputes the routers in backward)."""
    mesh = get_mesh(ulysses, ring, dp_shard=dp)
    config = moe_config(family)
    batch = aux_batch(kind, config.vocab_size)
    if (family, kind) not in REFERENCES:
        REFERENCES[family, kind] = _aux_reference(family, kind)
    ref_loss, ref_grads, rounding, own = REFERENCES[family, kind]

    lm = build(config)
    if plan is not None:
        from seqmesh.compose import ParallelPlan, parallelize_model

        sp = parallelize_model(lm, mesh, ParallelPlan(fsdp=False, loss_chunk=16, **plan))
    else:
        sp = SequenceParallelLM(parallelize(lm, mesh), mesh, chunk=16)
    if drop_aux:
        lm.router_aux_loss_coef = 0.0
    rows = batch["input_ids"].shape[0] // dp
    local = {k: v[mesh.dp_rank * rows : (mesh.dp_rank + 1) * rows] for k, v in batch.items()}
    loss = sp(**seqmesh.shard_batch(local, mesh))
    loss.backward()
    sync_gradients(sp, mesh)
    grad, worst = _worst_grad(lm, ref_grads)
    unparallelize(lm)
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": grad, "worst": worst, "rounding": rounding,
            "value": loss.item(), "own": None if own is None else abs(own - ref_loss.item())}


def vision_aux_reference(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`aux_reference` for a vision-language batch (``vision_cases``): one call per packed document, no
    target on a placeholder token, the language model's routers over every token."""
    from vision_cases import IMAGE, VIDEO, _split_documents

    outs = [model(**doc, use_cache=False, output_router_logits=True) for doc in _split_documents(batch)]
    logits = torch.cat([o.logits for o in outs], dim=1)
    layers = tuple(torch.cat(per_layer, dim=0) for per_layer in zip(*(o.router_logits for o in outs)))
    text = model.config.text_config
    balance = sys.modules[type(model).__module__].load_balancing_loss_func(layers, text.num_experts,
                                                                           text.num_experts_per_tok, None)
    ids = batch["input_ids"]
    targets = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)[:, 1:].clone()
    if "position_ids" in batch:
        targets[batch["position_ids"][:, 1:] == 0] = -100
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                         reduction="sum") / (targets != -100).sum()
    return logits, ce + text.router_aux_loss_coef * balance


def vision_aux_parity(ulysses: int, ring: int, kind: str, layout: str, drop_aux: bool = False) -> dict:
    """Qwen3-VL-MoE with the aux loss: loss and relative gradient errors against :func:`vision_aux_reference`,
    with the reference's float32-vs-float64 spread (as ``vision_cases.vision_parity``)."""
    from seqmesh.compose import ParallelPlan, parallelize_model
    from vision_cases import _spread, vision_batch, vision_config
    from vision_cases import build as build_vision

    mesh = get_mesh(ulysses, ring)
    config = vision_config("qwen3_vl_moe")
    config.text_config.output_router_logits = True
    config.text_config.router_aux_loss_coef = COEF
    batch = vision_batch("qwen3_vl_moe", kind)
    reference = build_vision(config)
    ref_logits, ref_loss = vision_aux_reference(reference, batch)
    ref_loss.backward()
    low = build_vision(config).to(torch.float32)
    low_logits, low_loss = vision_aux_reference(low, {k: v.float() if v.is_floating_point() else v for k, v in batch.items()})
    low_loss.backward()
    rounding = _spread(low_logits, low_loss, low, ref_logits, ref_loss, reference)

    model = build_vision(config)
    if drop_aux:
        model.config.text_config.router_aux_loss_coef = 0.0
    sp = parallelize_model(model, mesh, ParallelPlan(fsdp=False, loss_chunk=16))
    loss = sp(**seqmesh.shard_batch(batch, mesh, model=sp, layout=layout))
    loss.backward()
    sync_gradients(sp, mesh)
    spread = _spread(ref_logits, loss, model, ref_logits, ref_loss, reference)
    unparallelize(model)
    return {"loss": spread["loss"], "grad": spread["grad"], "rounding": rounding, "value": loss.item()}


def vision_aux_all(cases: list[tuple]) -> list[dict]:
    return [vision_aux_parity(*c) for c in cases]
