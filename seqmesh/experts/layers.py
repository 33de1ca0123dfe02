"""Expert parallelism on a transformers model's MoE layers: each experts module keeps ``E / ep`` of its experts and
runs through :func:`seqmesh.experts.dispatch.dispatch_combine`.

transformers (5.x) keeps a layer's routed experts in one module whose weights are ``(E, ...)`` tensors and whose
forward is ``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` (its ``use_experts_implementation``
classes). seqmesh splits each ``(E, ...)`` weight over the expert group as a DTensor ``Shard(0)`` (so checkpoints
hold the whole tensor and resume at any ``ep``), and runs the rows a rank receives through the module's own
forward, given a view of the module that holds only the local experts: each family's expert math (biases, gpt-oss's
clamped gate, transposed weights, a kernel chosen by ``config._experts_implementation``) is the model's, unchanged.
The rows go in unweighted (weight 1) and the router's weights are applied on the token's own rank, which is exact
because each of these families multiplies an expert's output by its weight last.

Llama 4 is the exception: its MoE block (``Llama4TextMoe``) scales every token by its router score *before* the
experts, hands the experts all ``E x T`` rows (a zero score, outside the top k, gives a zero row and, through its
SiLU-gated MLP, a zero output) and sums the ``E`` outputs. Under expert parallelism seqmesh replaces that block's
forward: each of a token's ``k`` picked rows is scaled on the token's rank, dispatched alone (weight 1), run through
its expert (the family's batched matrices, one expert at a time: :func:`run_llama4_experts`) and summed back over
the ``k`` picks; the router and the shared expert are the block's own. The same sum, without the zero rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dispatch import dispatch_combine
from .mesh import ExpertMesh
from .rules import check_expert_parallel

# model_type of the language models (a vision-language model's text config) whose experts modules seqmesh splits.
# Each is measured: its experts module cut into slices against its own forward (tests/experts/test_expert_families.py);
# all but qwen3_vl_moe_text trained with and without EP on the same ranks (test_expert_parallel.py), and Qwen3-MoE,
# DeepSeek-V3 and gpt-oss against one process. A family is added here once both tests cover it.
EXPERT_PARALLEL_FAMILIES = (
    "qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_vl_moe_text", "olmoe", "flex_olmo",
    "deepseek_v3", "deepseek_v2", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "dots1",
    "gpt_oss", "mixtral", "phimoe", "minimax", "minimax_m2", "jamba", "granitemoe", "granitemoeshared",
    "granitemoehybrid", "hunyuan_v1_moe", "exaone_moe", "cohere2_moe", "mimo_v2_flash", "laguna", "afmoe",
    "solar_open", "nemotron_h", "lfm2_moe", "ernie4_5_moe", "llama4_text", "zaya",
    # the sparse-attention MoE families (HY-V4, A.X-K1/K2, dots.llm3), Kimi Linear, and the others whose experts
    # module takes (hidden, top_k_index, top_k_weights) as the ones above
    "hy_v3", "hy_v4", "axk1", "axk2", "dots3_note_text", "kimi_linear", "bailing_hybrid", "granitemoe_swa",
    "kolibri1", "lara_mini", "mellum", "minimax_m3_vl_text", "sarvam_mla", "sarvam_moe", "aria_text",
    # DeepSeek-V4: its hash-routed layers too (the router reads the token ids; the experts are the same module)
    "deepseek_v4",
    # Beam (its soft-capped head read since 2026-11-30), Inkling's and Qwen4-Exp's experts, the same module again
    "beam", "inkling_text", "qwen4_exp_text",
    # Inkling 2's, which weight and sum their outputs in float32 inside the module (SUMMED_IN_FLOAT32 below)
    "inkling2_text", "inkling2_loop_text")
# of those, the families whose experts weight each output and sum them into a float32 buffer inside the module
# (Inkling 2's): split, each expert's unweighted output is computed without that sum (:func:`run_summing_experts`)
# and the token's rank weights the outputs and sums them in float32, expert by expert, as the module does
SUMMED_IN_FLOAT32 = ("inkling2_text", "inkling2_loop_text")
# of those, the families whose MoE block scales each token before its experts (its forward replaced, not the experts')
SCALED_BEFORE_EXPERTS = ("llama4_text",)

# MoE families whose experts module is not the (hidden, top_k_index, top_k_weights) one above, or that a split would
# round otherwise: what they compute instead
NOT_SPLIT = {
    "jetmoe": "JetMoE's experts take tokens already sorted by expert with per-expert counts, and its attention is a "
              "mixture of experts too",
    "dbrx": "DBRX keeps its experts' weights as one (experts x width, hidden) matrix each, not one row per expert",
    # measured: the split's output 2.9e-9 from the module's in float64, where another token order moves it by 8e-18
    "longcat_flash": "LongCat-Flash's experts module holds zero-compute (identity) experts beside its routed ones, "
                     "which the router picks among them, and names no num_experts; a split would keep the identity "
                     "experts on the token's rank (not built)",
    "doge": "Doge's cross-domain experts are rows of two embeddings (num_experts x hidden each, 16,384 by default), "
            "each a rank-one MLP a token reaches by its row index, not stacked matrices; FSDP2 shards the embeddings",
}


def family_refusal(family: str, ep: int, name: str = "") -> str | None:
    """Why ``ep`` cannot split the experts of ``family`` (a model_type: the language model's, or a vision-language
    file's whose language model is ``family + "_text"``), by name and with what its experts compute instead where
    seqmesh knows it; None where it can. The runtime's rule (:func:`check_family`), which the planner reads."""
    text = family if family in EXPERT_PARALLEL_FAMILIES or family in NOT_SPLIT else f"{family}_text"
    if ep <= 1 or text in EXPERT_PARALLEL_FAMILIES:
        return None
    why = f" ({NOT_SPLIT[text]})" if text in NOT_SPLIT else ""
    return (f"ep={ep}: seqmesh splits the experts of {', '.join(EXPERT_PARALLEL_FAMILIES)}; {family}"
            f"{f' ({name})' if name else ''} is not among them{why}. Use ep=1 (every rank holds every expert, FSDP2 "
            "shards them).")


def check_family(model: nn.Module, ep: int) -> None:
    """Refuse ``ep > 1`` for a family whose experts seqmesh has not measured, by name (and with what its experts
    compute instead, where seqmesh knows it)."""
    refusal = family_refusal(model.config.get_text_config().model_type, ep, type(model).__name__)
    if refusal is not None:
        raise ValueError(refusal)


def is_experts(module: nn.Module) -> bool:
    """A transformers routed-experts module: ``num_experts`` experts stacked on dim 0 of its weights."""
    experts = getattr(module, "num_experts", None)
    weights = [p for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    return isinstance(experts, int) and experts > 1 and bool(weights) and all(p.shape[0] == experts for p in weights)


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_experts(m)]


def routed_experts(model: nn.Module) -> int | None:
    """The routed experts per MoE layer of ``model`` (None: it has no experts module)."""
    found = {m.num_experts for m in experts_modules(model)}
    if len(found) > 1:
        raise ValueError(f"{type(model).__name__}'s MoE layers have different expert counts {sorted(found)}; seqmesh's "
                         "expert parallelism needs one count. Use ep=1.")
    return found.pop() if found else None


class _LocalExperts:
    """The experts module as its own forward should see it on this rank: the local experts' weights (plain
    tensors, views of this rank's slice) and their count; everything else read from the module."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], experts: int) -> None:
        self.__dict__.update(weights, _module=module, num_experts=experts)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def run_local_experts(module: nn.Module, weights: dict[str, torch.Tensor], rows: torch.Tensor,
                      local_expert: torch.Tensor) -> torch.Tensor:
    """The unweighted output of the experts whose weights are ``weights`` (``{name: (n, ...)}``, a slice of
    ``module``'s) for ``rows`` (N, H), row ``i`` through local expert ``local_expert[i]`` (N,): ``module``'s own
    forward, given a view of it that holds these experts only."""
    count = next(iter(weights.values())).shape[0]
    view = _LocalExperts(module, weights, count)
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    out = type(module).forward(view, rows, local_expert[:, None], ones)  # the class's (transformers picks the kernel)
    if rows.shape[0] == 0:  # nothing came here, and the model's forward returns a constant: keep the rows in the
        # graph (the dispatch's backward is collective: every rank must run it) and every weight (FSDP2 reduces
        # each weight's gradient, zeros here)
        anchors = [rows.sum()] + [w.reshape(-1)[:1].sum() for w in weights.values()]
        out = out + sum(anchors) * 0
    return out


def run_summing_experts(module: nn.Module, weights: dict[str, torch.Tensor], rows: torch.Tensor,
                        local_expert: torch.Tensor) -> torch.Tensor:
    """Inkling 2's experts (``gate_up_proj`` (n, 2I, H), ``down_proj`` (n, H, I), the module's soft-capped
    ``_apply_gate``) on ``rows`` (N, H), row ``i`` through local expert ``local_expert[i]``, without the module's
    float32 sum, which would round each output before its weight -> (N, H) unweighted, in the rows' dtype."""
    gate_up, down = weights["gate_up_proj"], weights["down_proj"]
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    for e in range(gate_up.shape[0]):
        mine = (local_expert == e).nonzero().flatten()
        out = out.index_put((mine,), F.linear(module._apply_gate(F.linear(rows[mine], gate_up[e])), down[e]))
    if rows.shape[0] == 0:  # keep every weight in the graph (FSDP2 reduces each weight's gradient, zeros here)
        out = out + (gate_up.reshape(-1)[:1].sum() + down.reshape(-1)[:1].sum()) * 0
    return out


def _expert_parallel_forward(module: nn.Module, emesh: ExpertMesh, summing: bool = False):
    """``module``'s forward over ``emesh``'s expert group; ``summing``: a :data:`SUMMED_IN_FLOAT32` family's."""
    experts, ep, group = module.num_experts, emesh.ep, emesh.ep_group
    run = run_summing_experts if summing else run_local_experts

    def run_local(rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        weights = {n: p.to_local() for n, p in module.named_parameters(recurse=False)}  # (E / ep, ...) each
        return run(module, weights, rows, local_expert)

    def ep_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return dispatch_combine(hidden_states, top_k_index, top_k_weights, experts, ep, group, run_local,
                                summed_in=torch.float32 if summing else None)

    return ep_forward


def run_llama4_experts(module: nn.Module, weights: dict[str, torch.Tensor], rows: torch.Tensor,
                       local_expert: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts (``Llama4TextExperts``: ``gate_up_proj`` (n, H, 2I), ``down_proj`` (n, I, H), its activation)
    on ``rows`` (N, H), row ``i`` through local expert ``local_expert[i]``: the module's products, one expert's rows
    at a time (its own forward takes the same number of rows for every expert) -> (N, H), unweighted."""
    gate_up, down = weights["gate_up_proj"], weights["down_proj"]
    out = rows.new_zeros(rows.shape[0], down.shape[-1])
    for e in range(gate_up.shape[0]):
        mine = (local_expert == e).nonzero().flatten()
        gate, up = (rows[mine] @ gate_up[e]).chunk(2, dim=-1)
        out = out.index_put((mine,), (up * module.act_fn(gate)) @ down[e])
    if rows.shape[0] == 0:  # keep every weight in the graph (FSDP2 reduces each weight's gradient, zeros here)
        out = out + (gate_up.reshape(-1)[:1].sum() + down.reshape(-1)[:1].sum()) * 0
    return out


def llama4_moe_forward(block: nn.Module, experts: int, ep: int, group, run_local) -> Callable:
    """``Llama4TextMoe.forward`` with its experts over ``ep`` ranks: the router's top-k picks of each token, the token
    scaled by each pick's score on its own rank, dispatched (weight 1) to ``run_local(rows, local_expert)`` and summed
    back over its picks, plus the shared expert. ``hidden_states`` (B, L, H) -> ((T, H), router logits (T, E))."""
    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, block.hidden_dim)  # (T, H)
        scores, logits = block.router(hidden)  # (T, E): sigmoid of the top-k logits, 0 elsewhere
        picks = torch.topk(logits, block.top_k, dim=1).indices  # the router's own picks (its topk on the same logits)
        rows = (hidden[:, None, :] * scores.gather(1, picks)[..., None]).reshape(-1, hidden.shape[-1])  # (T k, H)
        ones = rows.new_ones(rows.shape[0], 1)
        routed = dispatch_combine(rows, picks.reshape(-1, 1), ones, experts, ep, group, run_local)
        out = block.shared_expert(hidden)
        return out + routed.reshape(hidden.shape[0], block.top_k, -1).sum(dim=1), logits

    return forward


def apply_expert_parallel(model: nn.Module, emesh: ExpertMesh) -> int:
    """Split every experts module of ``model`` (a transformers causal LM or vision-language model) over ``emesh``'s
    expert groups, in place; returns how many were split. Families not in :data:`EXPERT_PARALLEL_FAMILIES` are
    refused by name. Call before FSDP2 (which then shards each rank's experts over the ranks holding the same ones)."""
    from torch.distributed.tensor import DTensor, Shard

    found = experts_modules(model)
    check_family(model, emesh.ep)
    check_expert_parallel(emesh.ep, experts=routed_experts(model), token_ranks=emesh.mesh.size(),
                          model=model.config.model_type)
    rank, ep = emesh.ep_rank, emesh.ep
    for module in found:
        n = module.num_experts // ep
        for name, p in list(module.named_parameters(recurse=False)):
            if p.shape[0] != module.num_experts:
                raise ValueError(f"{type(module).__name__}.{name} has shape {tuple(p.shape)}, not one row per expert; "
                                 "seqmesh cannot split it. Use ep=1.")
            local = p.detach()[rank * n:(rank + 1) * n].clone()
            sharded = DTensor.from_local(local, emesh.ep_mesh, [Shard(0)], run_check=False,
                                         shape=p.shape, stride=p.stride())
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        if model.config.get_text_config().model_type in SCALED_BEFORE_EXPERTS:
            block = next(m for m in model.modules() if getattr(m, "experts", None) is module)

            def run_local(rows, local_expert, module=module):
                weights = {n: p.to_local() for n, p in module.named_parameters(recurse=False)}
                return run_llama4_experts(module, weights, rows, local_expert)

            block.forward = llama4_moe_forward(block, module.num_experts, ep, emesh.ep_group, run_local)
        else:
            module.forward = _expert_parallel_forward(module, emesh,
                                                      model.config.get_text_config().model_type in SUMMED_IN_FLOAT32)
    return len(found)
