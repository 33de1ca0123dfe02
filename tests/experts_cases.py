"""Expert parallelism against one process: a tiny MoE model trained a few steps through ``parallelize_model`` with
``ep`` (FSDP2, float64), and the unmodified transformers model trained the same steps on the whole batch in one
process. Losses per step and, after the first backward, every parameter's gradient (the experts' gathered whole).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from family_cases import SMALL, ULPS, WINDOW, KeepFloat64, build, computed_once

SEQ = 45
ROWS = 2
STEPS = 3
LR = 0.05


def ep_config(family: str, experts: int = 8):
    """A tiny ``family`` with ``experts`` routed experts, 2 per token."""
    import transformers as tf

    if family == "qwen3_moe":  # softmax top-k, every layer MoE
        return tf.Qwen3MoeConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2,
                                 head_dim=8, num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True)
    if family == "deepseek_v3":  # sigmoid scores with a bias, top groups then top-k, a shared expert, MLA, a dense layer
        return tf.DeepseekV3Config(**{**SMALL, "num_hidden_layers": 3}, intermediate_size=64, moe_intermediate_size=16,
                                   num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                   qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=experts, num_experts_per_tok=2,
                                   n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1)
    if family == "gpt_oss":  # router bias, softmax over the top-k, expert biases, clamped interleaved gate
        return tf.GptOssConfig(**SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"], num_local_experts=experts,
                               num_experts_per_tok=2)
    raise ValueError(f"unknown family {family!r}")


def _model(family: str):
    """The float64 model of one of :func:`ep_config`'s families, or of any other family from the census's tiny
    configs (4 experts, 2 per token)."""
    if family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        model = build(ep_config(family))
    else:
        from census_configs import build as census_build
        from census_configs import census_config

        model = census_build(census_config(family)).train()
        # one dtype, for FSDP2: HY-V4's float32 sinks and head in float64; a model whose float32 weights are modules
        # whose forwards cast their inputs to float32 (Inkling 2's router), which float64 weights would fail, all in
        # float32 (the reference's noise is then measured in float32 too)
        from seqmesh.model.fsdp import float32_modules

        if len({p.dtype for p in model.parameters()}) > 1:
            own = {id(p) for m in float32_modules(model) for p in m.parameters()}
            casting = all(p.dtype == torch.float64 or id(p) in own for p in model.parameters())
            model = model.float() if casting else model.double()
    with torch.no_grad():  # DeepSeek's routing bias starts at zero: give it values, so the test sees it used
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(-0.5, 0.5, buf.numel(), dtype=buf.dtype))
    return model


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(7)
    return {"input_ids": torch.randint(0, vocab, (ROWS, SEQ), generator=g)}


def rows_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the mean next-token cross-entropy of every row of the batch, one process."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return logits, loss


def only_first_experts(model, keep: int) -> None:
    """Route every token-expert pair to experts ``< keep`` only (its index modulo ``keep``; weights as routed), on
    the reference and the parallel model alike: the experts past ``keep`` see no token, and with ``keep`` experts
    per rank the other ranks of an expert group receive nothing."""
    from seqmesh.experts.layers import experts_modules

    def hook(module, args, kwargs):
        hidden, index, weights = args
        return (hidden, index % keep, weights), kwargs

    for module in experts_modules(model):
        module.register_forward_pre_hook(hook, with_kwargs=True)


def reference_noise(reference, batch: dict, loss: float, want: dict) -> dict:
    """How far the one-process reference moves when only its summation order changes (the batch's rows in reverse
    order: the same mean loss and gradients, summed the other way round): the loss's spread, and per parameter dtype
    the largest relative gradient spread (at least that dtype's unit roundoff). A float32 weight (DeepSeek's router)
    has float32's noise; the float64 ones float64's. The loss's spread is at least ``ULPS`` units in its last place,
    plus how far the model's own float32 steps (an upcast norm, a float32 router) move it from the same code run all
    in float64: reordering rows leaves those steps' rounding as it was, and sharding the sequence does not (one run at
    transformers 5.15 read 80 times the reordered spread on DeepSeek-V3's float32 router, within that figure)."""
    with torch.no_grad(), KeepFloat64():  # a float64 copy: a float32 weight of the model's (a router's) too
        inside = abs(rows_loss(copy.deepcopy(reference).double(), batch)[1].item() - loss)
    reference.zero_grad()
    flipped = {k: v.flip(0) for k, v in batch.items()}
    again = rows_loss(reference, flipped)[1]
    again.backward()
    grad: dict[str, float] = {}
    for name, p in reference.named_parameters():
        if name not in want:  # a weight the loss does not reach
            continue
        key = str(p.dtype)
        err = float((p.grad - want[name]).abs().max() / want[name].abs().max().clamp(min=1e-12))
        grad[key] = max(grad.get(key, float(torch.finfo(p.dtype).eps)), err)
    for name, p in reference.named_parameters():  # back to the first order's gradients for the optimizer
        if name in want:
            p.grad.copy_(want[name])
    return {"loss": max(abs(again.item() - loss), ULPS * math.ulp(loss)) + inside, "grad": grad}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# (family, keep) -> _ep_reference's tuple, in each rank process (a pool outlives its tests)
REFERENCES: dict[tuple, tuple] = {}


def _ep_reference(family: str, keep: int | None) -> tuple:
    """``(batch, gradients, rounding, losses)`` of one process: the first step's gradients by name, the reference's
    own noise (``reference_noise``) and the loss of each of ``STEPS`` SGD steps."""
    reference = _model(family)
    batch = _batch(reference.config.vocab_size)
    if keep:
        only_first_experts(reference, keep)
    ref_logits, ref_loss = rows_loss(reference, batch)
    ref_loss.backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters()}
    rounding = reference_noise(reference, batch, ref_loss.item(), want)
    ref_losses = [ref_loss.item()]
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for _ in range(STEPS - 1):
        opt.step()
        opt.zero_grad()
        loss = rows_loss(reference, batch)[1]
        loss.backward()
        ref_losses.append(loss.item())
    return batch, want, rounding, ref_losses


def ep_parity(family: str, ulysses: int, ring: int, dp: int, ep: int, keep: int | None = None,
              wrong_rank: bool = False, checkpointing: bool = False, replicate: int = 1) -> dict:
    """Per-step loss errors and the first step's largest relative gradient error against one process, with the
    reference's own rounding. ``keep``: :func:`only_first_experts`. ``wrong_rank``: a mutation that sends each pair
    to the same expert slot of the next rank of its group (the test that the comparison sees a misrouted token).
    ``replicate``: HSDP replicas besides the ``dp`` shards (the experts are then sharded over every replica)."""
    mesh = get_mesh(ulysses, ring, dp_shard=dp, dp_replicate=replicate)
    if (family, keep) not in REFERENCES:
        REFERENCES[family, keep] = _ep_reference(family, keep)
    batch, want, rounding, ref_losses = REFERENCES[family, keep]
    losses, grads = _train_parallel(family, mesh, batch, ep, keep, wrong_rank, checkpointing)
    grad, worst = _worst(grads, want, rounding)
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)) / rounding["loss"], "grad": grad,
            "worst": worst, "rounding": rounding, "losses": losses}


def _train_parallel(family: str, mesh, batch: dict, ep: int, keep: int | None = None, wrong_rank: bool = False,
                    checkpointing: bool = False, steps: int = STEPS) -> tuple[list[float], dict]:
    """``steps`` steps of SGD through ``parallelize_model`` (FSDP2, ``ep``): every step's loss, and the first step's
    gradients gathered whole."""
    from seqmesh.compose import ParallelPlan, parallelize_model

    lm = _model(family)
    if keep:
        only_first_experts(lm, keep)
    sp = parallelize_model(lm, mesh, ParallelPlan(fsdp=True, ep=ep, loss_chunk=16, checkpointing=checkpointing))
    if wrong_rank:
        _send_to_next_rank(lm, ep)
    rows = ROWS // mesh.dp_size
    local = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for k, v in batch.items()}
    opt = torch.optim.SGD(sp.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        loss = sp(**seqmesh.shard_batch(local, mesh))
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {name: _full(p.grad) for name, p in lm.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads


def _worst(grads: dict, want: dict, rounding: dict) -> tuple[float, str]:
    """The largest relative gradient error, in units of its dtype's noise, and whose it is."""
    worst, name_of = 0.0, ""
    for name, ref in want.items():
        if name not in grads:
            return float("inf"), name
        err = float((grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        err /= rounding["grad"][str(ref.dtype)]
        if err > worst:
            worst, name_of = err, name
    return worst, name_of


def ep_against_replicas(family: str, ulysses: int, ring: int, dp: int, ep: int) -> dict:
    """The same ranks with and without expert parallelism: per-step loss difference and the first step's largest
    relative gradient difference, in units of the one-process reference's noise. For families whose exactness
    without EP the census and family tests establish against one process (with bounds from their float32 steps)."""
    mesh = get_mesh(ulysses, ring, dp_shard=dp)
    reference = _model(family)
    batch = _batch(reference.config.vocab_size)
    ref_loss = rows_loss(reference, batch)[1]
    ref_loss.backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    rounding = reference_noise(reference, batch, ref_loss.item(), want)
    # two steps: the second's loss is computed with the weights the first step's update left on the expert mesh, the
    # path a third step would only repeat (the few families tested against one process take STEPS)
    plain_losses, plain = _train_parallel(family, mesh, batch, 1, steps=2)
    losses, grads = _train_parallel(family, mesh, batch, ep, steps=2)
    grad, worst = _worst(grads, plain, rounding)
    return {"loss": max(abs(a - b) for a, b in zip(losses, plain_losses)) / rounding["loss"], "grad": grad,
            "worst": worst, "losses": losses}


def _experts(lm):
    from seqmesh.experts.layers import experts_modules

    return experts_modules(lm)


def _send_to_next_rank(lm, ep: int) -> None:
    """The mutation: each pair's expert index moved to the same slot on the next rank of the group, for the
    dispatch only (the weights stay): every token is computed by another rank's expert."""
    for module in _experts(lm):
        inner = module.forward
        n = module.num_experts // ep

        def shifted(hidden, index, weights, inner=inner, n=n, total=module.num_experts):
            return inner(hidden, (index + n) % total, weights)

        module.forward = shifted


def ep_all(cases: list[tuple], **kwargs) -> list[dict]:
    """:func:`ep_parity` of each ``(family, ulysses, ring, dp, ep[, keep])``, the references they need computed once
    over the group (``family_cases.computed_once``)."""
    computed_once([(c[0], c[5] if len(c) > 5 else None) for c in cases], _ep_reference, REFERENCES)
    return [{"case": c, **ep_parity(*c, **kwargs)} for c in cases]


def replicas_all(cases: list[tuple]) -> list[dict]:
    """:func:`ep_against_replicas` per case; a family seqmesh refuses at this transformers (every rank alike, before
    any collective) gives its message instead."""
    results = []
    for c in cases:
        try:
            results.append({"case": c, **ep_against_replicas(*c)})
        except ValueError as err:
            results.append({"case": c, "refused": str(err)})
    return results


def ep_bytes(family: str, ring: int, dp: int, ep: int) -> dict:
    """One step on a mesh with no Ulysses axis (so every all-to-all is the experts'): the all-to-all bytes this rank
    counted, and ``seqmesh.experts.traffic.exchange_bytes`` of the routes it took, summed over the MoE layers."""
    import seqmesh.experts.dispatch as dispatch
    from seqmesh.comm.stats import comm_stats
    from seqmesh.compose import ParallelPlan, parallelize_model
    from seqmesh.experts.traffic import exchange_bytes

    mesh = get_mesh(1, ring, dp_shard=dp)
    lm = _model(family)
    sp = parallelize_model(lm, mesh, ParallelPlan(fsdp=True, ep=ep, loss_chunk=16))
    routes = []
    plan_route = dispatch.plan_route

    def recorded(*args, **kwargs):
        routes.append(plan_route(*args, **kwargs))
        return routes[-1]

    rows = ROWS // dp
    local = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for k, v in _batch(lm.config.vocab_size).items()}
    dispatch.plan_route = recorded
    try:
        with comm_stats() as stats:
            sp(**seqmesh.shard_batch(local, mesh)).backward()
    finally:
        dispatch.plan_route = plan_route
    experts = _experts(lm)[0].num_experts
    from seqmesh.experts.mesh import expert_mesh

    rank = expert_mesh(mesh, ep).ep_rank
    formula = [exchange_bytes(r.send, r.receive, rank, lm.config.hidden_size, 8, experts // ep) for r in routes]
    return {"counted": {phase: stats.sent("all_to_all", phase) for phase in ("forward", "backward")},
            "formula": {"forward": sum(f.forward for f in formula), "backward": sum(f.backward for f in formula)},
            "layers": len(routes), "pairs": [sum(r.send) for r in routes]}


def _norm_of(grads) -> torch.Tensor:
    """The 2-norm of every element of ``grads`` together, in float64 (the reference's, one process)."""
    return torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]))


def ep_gradient_norm(family: str, ulysses: int, ring: int, dp: int, ep: int) -> dict:
    """``seqmesh.model.fsdp.gradient_norm`` of the first step's gradients with ``ep`` against the one-process
    model's gradient norm (relative error, and the reference's own spread when its rows are summed in the other
    order), then clipped to a quarter of it: the largest relative error of the gathered gradients against the
    reference's scaled by torch's clip coefficient. ``meshes``: how many device meshes the gradients live on."""
    from seqmesh.compose import ParallelPlan, parallelize_model
    from seqmesh.model.fsdp import gradients_by_mesh, gradient_norm

    mesh = get_mesh(ulysses, ring, dp_shard=dp)
    reference = _model(family)
    batch = _batch(reference.config.vocab_size)
    rows_loss(reference, batch)[1].backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ref_norm = _norm_of(want.values())
    reference.zero_grad()
    rows_loss(reference, {k: v.flip(0) for k, v in batch.items()})[1].backward()
    spread = float((_norm_of(p.grad for p in reference.parameters()) - ref_norm).abs() / ref_norm)

    lm = _model(family)
    sp = parallelize_model(lm, mesh, ParallelPlan(fsdp=True, ep=ep, loss_chunk=16))
    rows = ROWS // dp
    local = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for k, v in batch.items()}
    sp(**seqmesh.shard_batch(local, mesh)).backward()
    meshes = len(gradients_by_mesh([p for p in sp.parameters() if p.grad is not None]))
    norm = gradient_norm(sp.parameters())
    limit = float(ref_norm) / 4
    again = gradient_norm(sp.parameters(), limit)  # the norm before clipping, then every group clipped by it
    coef = limit / (float(ref_norm) + 1e-6)  # torch's clip_grads_with_norm_ coefficient
    clipped = 0.0
    for name, p in lm.named_parameters():
        expect = want[name] * coef
        clipped = max(clipped, float((_full(p.grad) - expect).abs().max() / expect.abs().max().clamp(min=1e-12)))
    return {"norm": abs(float(norm) - float(ref_norm)) / float(ref_norm), "again": float(again) == float(norm),
            "spread": spread, "clipped": clipped, "meshes": meshes, "value": float(norm)}
