"""Gated DeltaNet cases run on every rank of a spawned group (see conftest.Pools)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

import seqmesh
from dist_cases import get_mesh
from seqmesh.comm.stats import comm_stats
from seqmesh.hf import parallelize, unparallelize
from seqmesh.linear_attention.gated_delta import segment_bounds
from seqmesh.linear_attention.sequence_parallel import GateParams, LinearHeads, gated_delta_heads, sequence_parallel_gated_delta
from seqmesh.linear_attention.state_passing import state_passing_gated_delta


# transformers config class and the extra arguments of each family with Gated DeltaNet layers
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                 num_experts=4, num_experts_per_tok=2)),
    "qwen3_next": ("Qwen3NextConfig", dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                                           num_experts_per_tok=2)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(pad_token_id=None, eos_token_id=None, bos_token_id=None,
                                             linear_allow_neg_eigval=True)),
}


def tiny_qwen3_5(key_heads: int = 2, value_heads: int = 4, *, seed: int = 0, dtype=torch.float32, family: str = "qwen3_5"):
    """A random 4-layer Qwen3.5 (3 Gated DeltaNet layers, full attention 4th), or another family's, with long
    memory: A in (0.01, 0.2) keeps exp(g) near 1, so a recurrence cut at a shard boundary is visibly wrong
    (transformers' init, A in (0.01, 16), forgets within a few tokens)."""
    import transformers
    from transformers import AutoModelForCausalLM

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=97, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, linear_conv_kernel_dim=4, attention_dropout=0.0, **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None:
                gdn.A_log.copy_(torch.empty(value_heads).uniform_(0.01, 0.2, generator=g).log())
                gdn.dt_bias.copy_(torch.randn(value_heads, generator=g) * 0.5)
                norm = gdn.norm if hasattr(gdn, "norm") else gdn.o_norm
                norm.weight.copy_(1 + 0.1 * torch.randn(gdn.head_v_dim, generator=g))
    return model


@dataclass(frozen=True)
class ModelCase:
    seq_len: int
    layout: str = "zigzag"
    documents: tuple[int, ...] | None = None
    key_heads: int = 2
    value_heads: int = 4
    batch: int = 2
    family: str = "qwen3_5"
    design: str = "auto"  # parallelize's linear_attention

    @property
    def name(self) -> str:
        return (f"{self.family}-S{self.seq_len}-{self.layout}-hk{self.key_heads}hv{self.value_heads}-"
                f"{'docs' if self.documents else 'nodocs'}-{self.design}")


def _inputs(case: ModelCase, vocab: int):
    g = torch.Generator().manual_seed(case.seq_len)
    ids = torch.randint(0, vocab, (case.batch, case.seq_len), generator=g)
    dlogits = torch.randn(case.batch, case.seq_len, vocab, generator=g)
    return ids, dlogits


def reference_logits_and_grads(model, case: ModelCase, ids: torch.Tensor, dlogits: torch.Tensor):
    """The unmodified model on one process: the whole sequence, or each packed document alone."""
    model.zero_grad()
    bounds = case.documents or (0, case.seq_len)
    logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(bounds[:-1], bounds[1:])], 1)
    (logits * dlogits.to(logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _positions(case: ModelCase) -> torch.Tensor | None:
    if case.documents is None:
        return None
    d = case.documents
    return torch.cat([torch.arange(b - a) for a, b in zip(d[:-1], d[1:])])[None].expand(case.batch, -1)


def model_cases(ulysses: int, ring: int, cases: list[ModelCase]) -> list[dict]:
    """Logits and every parameter gradient of the parallelized model against the one-process model;
    relative errors (max |diff| / max |reference|) per case."""
    mesh = get_mesh(ulysses, ring)
    results = []
    for case in cases:
        reference = tiny_qwen3_5(case.key_heads, case.value_heads, family=case.family)
        ids, dlogits = _inputs(case, reference.config.vocab_size)
        want_logits, want_grads = reference_logits_and_grads(reference, case, ids, dlogits)
        model = parallelize(copy.deepcopy(reference), mesh, linear_attention=case.design)
        model.zero_grad()
        batch = {"input_ids": ids}
        if case.documents is not None:
            batch["position_ids"] = _positions(case)
        local = seqmesh.shard_batch(batch, mesh, layout=case.layout)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], seqmesh=local["seqmesh"],
                       use_cache=False).logits
        (logits * seqmesh.shard_sequence(dlogits, mesh, layout=case.layout)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.sp_group)
        got = seqmesh.gather_sequence(logits.detach(), mesh, layout=case.layout, length=case.seq_len)
        scale = want_logits.abs().max()
        errors = {"logits": float((got - want_logits).abs().max() / scale)}
        for name, p in model.named_parameters():
            want = want_grads[name]
            errors[name] = float((p.grad - want).abs().max() / want.abs().max().clamp(min=1e-30))
        unparallelize(model)
        results.append({"case": case.name, "errors": errors, "params": len(want_grads)})
    return results


def reference_noise(cases: list[ModelCase]) -> list[dict]:
    """The one-process reference against itself: the same loss back-propagated in two halves of the
    batch rows and summed, vs in one pass (same math, other rounding). Relative errors per case."""
    results = []
    for case in cases:
        model = tiny_qwen3_5(case.key_heads, case.value_heads, family=case.family)
        ids, dlogits = _inputs(case, model.config.vocab_size)
        logits, grads = reference_logits_and_grads(model, case, ids, dlogits)
        half = case.batch // 2
        parts = [reference_logits_and_grads(model, case, ids[r], dlogits[r]) for r in (slice(0, half), slice(half, None))]
        errors = {"logits": float((torch.cat([parts[0][0], parts[1][0]]) - logits).abs().max() / logits.abs().max())}
        for name, g in grads.items():
            errors[name] = float((parts[0][1][name] + parts[1][1][name] - g).abs().max() / g.abs().max().clamp(min=1e-30))
        results.append({"case": case.name, "errors": errors})
    return results


@dataclass(frozen=True)
class LayerCase:
    seq_len: int
    key_heads: int
    value_heads: int
    layout: str = "zigzag"
    documents: tuple[int, ...] | None = None
    key_dim: int = 5
    value_dim: int = 3
    kernel: int = 4
    batch: int = 2
    design: str = "all_to_all"  # or "state_passing"

    @property
    def name(self) -> str:
        return (f"S{self.seq_len}-hk{self.key_heads}hv{self.value_heads}-{self.layout}-"
                f"{'docs' if self.documents else 'nodocs'}-k{self.kernel}-{self.design}")


def layer_inputs(case: LayerCase, heads: LinearHeads):
    """float64 inputs of one layer case: the packed channels, the gate parameters, an output gradient."""
    g = torch.Generator().manual_seed(7)
    dt = torch.float64
    packed = torch.randn(case.batch, case.seq_len, heads.channels, generator=g, dtype=dt)
    params = GateParams(
        torch.randn(heads.conv_dim, case.kernel, generator=g, dtype=dt) * 0.5,
        torch.randn(heads.conv_dim, generator=g, dtype=dt) * 0.1,
        torch.empty(case.value_heads, dtype=dt).uniform_(0.01, 0.3, generator=g).log(),
        torch.randn(case.value_heads, generator=g, dtype=dt),
    )
    dout = torch.randn(case.batch, case.seq_len, case.value_heads, case.value_dim, generator=g, dtype=dt)
    return packed, params, dout


def layer_cases(ulysses: int, ring: int, cases: list[LayerCase]) -> list[dict]:
    """``sequence_parallel_gated_delta`` in float64 against the same math on the whole sequence on one
    process (``gated_delta_heads`` on all heads, itself checked against transformers' own rules by
    ``test_whole_sequence_heads_match_transformers``): max abs error of the output and of the input's
    and every parameter's gradient, and the bytes the all-to-alls moved."""
    mesh = get_mesh(ulysses, ring)
    results = []
    min_chunk = 1  # cut even these short documents (so per_document differs from zigzag)
    for case in cases:
        p = mesh.sp_size
        ranks = p if case.design == "all_to_all" else 1  # state passing keeps every head on every rank
        heads = LinearHeads(case.key_heads, case.value_heads, case.key_dim, case.value_dim, ranks)
        packed, params, dout = layer_inputs(case, heads)
        leaves = [packed, params.conv_weight, params.conv_bias, params.A_log, params.dt_bias]
        for t in leaves:
            t.requires_grad_(True)
        whole = LinearHeads(case.key_heads, case.value_heads, case.key_dim, case.value_dim, 1)
        want = gated_delta_heads(packed, params, whole, 0, segment_bounds(case.seq_len, case.documents))
        want_grads = torch.autograd.grad((want * dout).sum(), leaves)
        shard = lambda t: seqmesh.shard_sequence(t, mesh, layout=case.layout, cu_seqlens=case.documents,  # noqa: E731
                                                 min_chunk=min_chunk)
        design = sequence_parallel_gated_delta if case.design == "all_to_all" else state_passing_gated_delta
        local, dlocal = shard(packed), shard(dout)  # shard_sequence's backward all-gathers (phase "backward")
        with comm_stats() as stats:
            out = design(local, params, heads, mesh, layout=case.layout, seq_len=case.seq_len, cu_seqlens=case.documents,
                         min_chunk=min_chunk)
            grads = torch.autograd.grad((out * dlocal).sum(), leaves)
        a2a = {ph: stats.sent("all_to_all", ph) for ph in ("forward", "backward")}
        gathered = {"forward": stats.sent("all_gather", "forward"), "backward": stats.sent("reduce_scatter", "backward")}
        got = seqmesh.gather_sequence(out.detach(), mesh, layout=case.layout, length=case.seq_len,
                                      cu_seqlens=case.documents, min_chunk=min_chunk)
        errors = {"out": float((got - want.detach()).abs().max())}
        for name, g_sp, g_ref in zip(("packed", "conv_weight", "conv_bias", "A_log", "dt_bias"), grads, want_grads):
            if name != "packed":  # parameters: each rank holds a part of the gradient, the sum is the whole
                g_sp = g_sp.clone()
                dist.all_reduce(g_sp, group=mesh.sp_group)
            errors[name] = float((g_sp - g_ref).abs().max())
        results.append({"case": case.name, "errors": errors, "A_log_scale": float(want_grads[3].abs().max()),
                        "a2a_bytes": a2a, "a2a_calls": stats.count("all_to_all"), "gather_bytes": gathered,
                        "gather_calls": (stats.count("all_gather", "forward"), stats.count("reduce_scatter"))})
    return results


def refusals(ulysses: int, ring: int) -> dict:
    """What parallelize says to models it must not run, and whether unparallelize restores the layers."""
    import torch.nn as nn

    mesh = get_mesh(ulysses, ring)
    out = {}

    class ToyMambaMixer(nn.Module):  # a recurrent layer seqmesh does not know
        def __init__(self):
            super().__init__()
            self.A_log = nn.Parameter(torch.zeros(2))

    model = tiny_qwen3_5()
    model.model.layers[0].mixer = ToyMambaMixer()
    try:
        parallelize(model, mesh)
        out["unknown"] = "no error"
    except ValueError as err:
        out["unknown"] = str(err)
    out["unknown_untouched"] = getattr(model, "_seqmesh_attention", None) is None and not any(
        "forward" in vars(m) for m in model.modules())
    try:
        parallelize(tiny_qwen3_5(key_heads=1, value_heads=1), mesh, linear_attention="all_to_all")
        out["too_few_heads"] = "no error"
    except ValueError as err:
        out["too_few_heads"] = str(err)
    model = tiny_qwen3_5()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    before = model(input_ids=ids, use_cache=False).logits
    parallelize(model, mesh)
    out["installed"] = sum("forward" in vars(m) for m in model.modules())
    try:
        model(input_ids=ids, use_cache=False)
        out["no_info"] = "no error"
    except ValueError as err:
        out["no_info"] = str(err)
    unparallelize(model)
    out["restored"] = sum("forward" in vars(m) for m in model.modules()) == 0 and torch.equal(
        before, model(input_ids=ids, use_cache=False).logits)
    return out


def token_loop_decay(q, k, v, g, starts, initial, reset=True):
    """``S_t = exp(g_t) S_(t-1) + k_t v_t^T``, ``o_t = S_t^T q_t``, per batch row and head; the state restarts from
    ``initial[:, j]`` at ``starts[j]`` (``reset=False``: only at the first) -> (out (B, S, H, Dv), final states)."""
    b, s, h, dk = q.shape
    outs, finals, state = [], [], None
    for t in range(s):
        if t in starts and (reset or t == 0):
            if state is not None:
                finals.append(state)
            state = initial[:, starts.index(t)]
        state = g[:, t].exp()[..., None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    finals.append(state)
    return torch.stack(outs, 1), torch.stack(finals, 1)
