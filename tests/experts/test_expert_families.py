"""Every family seqmesh's expert parallelism accepts runs its experts exactly as split: the experts module's own
forward on all its experts (the reference) against seqmesh's dispatch with the experts cut into ``ep`` slices, each
slice run through the view of the module that holds it (what a rank of an expert group runs), the router's weights
applied on the token's side; forward and the gradients of the hidden states, routing weights and expert weights.
One process (the exchanges themselves are tested on several in test_expert_parallel.py). Families with experts
that seqmesh has not measured are refused by name."""

from __future__ import annotations

import pytest
import torch

from census_configs import build, census_config, census_names
from seqmesh.experts.dispatch import dispatch_combine
from seqmesh.experts.layers import (EXPERT_PARALLEL_FAMILIES, SCALED_BEFORE_EXPERTS, SUMMED_IN_FLOAT32, check_family,
                                    experts_modules, llama4_moe_forward, run_llama4_experts, run_local_experts,
                                    run_summing_experts)

TOKENS = 23
NOISE_MULTIPLE = 8
# the text model of a vision-language family is built from its text config, which the census names
_CENSUS = {"qwen3_vl_moe_text": "qwen3_vl_moe", "qwen3_5_moe_text": "qwen3_5_moe"}


def _experts_of(family: str):
    """(an experts module of ``family``'s tiny model, its text config), float64 with seeded weights. A
    vision-language family's text model has no causal-LM entry of its own: its experts class is built from the
    text config."""
    import importlib

    name = _CENSUS.get(family, family)
    if name in census_names():
        model = build(census_config(name))
        return experts_modules(model)[-1], model.config.get_text_config()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        pytest.skip(f"{name} is not in this transformers")
    text = census_config_text(name)
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    cls = next(c for n, c in vars(modeling).items() if n.endswith("TextExperts") or n.endswith("Experts"))
    torch.manual_seed(0)
    module = cls(text).to(torch.float64)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.1)
    return module, text


def census_config_text(name: str):
    from census_configs import TINY
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = CONFIG_MAPPING[name]().get_text_config()
    for field in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "intermediate_size"):
        if hasattr(text, field):
            setattr(text, field, TINY[field])
    text._experts_implementation = "eager"
    return text


def _split_forward(module, hidden, index, weights, ep: int, family: str = "") -> torch.Tensor:
    experts = module.num_experts
    n = experts // ep
    params = dict(module.named_parameters(recurse=False))
    summing = family in SUMMED_IN_FLOAT32  # Inkling 2's: weighted and summed in float32 on the token's side
    run_slice = run_summing_experts if summing else run_local_experts

    def run(rows, expert):  # every "rank" r runs the rows of its experts [r n, (r + 1) n) through its slice
        out = rows.new_zeros(rows.shape)
        for r in range(ep):
            mine = (expert // n) == r
            piece = {k: v[r * n:(r + 1) * n] for k, v in params.items()}
            out = out.index_put((mine.nonzero().flatten(),), run_slice(module, piece, rows[mine], expert[mine] - r * n))
        return out

    return dispatch_combine(hidden, index, weights, experts, 1, None, run,
                            summed_in=torch.float32 if summing else None)


def _grads(module, hidden, weights, out, probe) -> list[torch.Tensor]:
    leaves = [hidden, weights, *module.parameters(recurse=False)]
    return list(torch.autograd.grad((out * probe).sum(), leaves))


@pytest.mark.parametrize("family", [f for f in EXPERT_PARALLEL_FAMILIES if f not in SCALED_BEFORE_EXPERTS])
def test_split_experts_equal_the_module(family):
    module, text = _experts_of(family)
    k = getattr(text, "num_experts_per_tok", None) or text.moe_topk  # Aria's is moe_topk
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, text.hidden_size, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(module.num_experts, generator=g)[:k] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, k, dtype=torch.float64, generator=g).requires_grad_()
    probe = torch.randn(TOKENS, text.hidden_size, dtype=torch.float64, generator=g)
    want = module(hidden, index, weights)
    want_grads = _grads(module, hidden, weights, want, probe)
    # the reference's own noise: the same tokens in the other order (another summation order), put back; each
    # token's picks in the other order, and the experts numbered the other way (a module that sums a token's picks
    # by pick or by expert sums them in another order: Inkling 2's float32 sum rounds there)
    flip = torch.arange(TOKENS - 1, -1, -1)
    turn = torch.arange(k - 1, -1, -1)
    others = [module(hidden[flip], index[flip], weights[flip])[flip], module(hidden, index[:, turn], weights[:, turn]),
              _renumbered(module, hidden, index, weights)]
    others_grads = [_grads(module, hidden, weights, other, probe) for other in others]
    noise = max(_noise(other, want) for other in others)
    grad_noise = [max(_noise(g[i], want_grads[i]) for g in others_grads) for i in range(len(want_grads))]
    for ep in (e for e in (2, 4) if module.num_experts % e == 0):
        got = _split_forward(module, hidden, index, weights, ep, family)
        assert float((got - want).detach().abs().max()) <= NOISE_MULTIPLE * noise, (family, ep)
        for a, b, spread in zip(_grads(module, hidden, weights, got, probe), want_grads, grad_noise):
            assert float((a - b).abs().max()) <= NOISE_MULTIPLE * spread, (family, ep)


def _renumbered(module, hidden, index, weights) -> torch.Tensor:
    """The module with its experts numbered the other way round and each token's picks renamed to match: the same
    products, summed in another order by a module that sums by expert."""
    back = torch.arange(module.num_experts - 1, -1, -1)
    params = {name: p[back] for name, p in module.named_parameters(recurse=False)}
    return torch.func.functional_call(module, params, (hidden, back[index], weights))


def _noise(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far two summation orders of the same values are apart (at least a unit roundoff of the values' size)."""
    a, b = a.detach(), b.detach()
    return max(float((a - b).abs().max()), float(torch.finfo(torch.float64).eps * b.abs().max()))


def test_llama4_split_experts_equal_the_moe_block():
    """Llama 4's MoE block (every token scaled by its router score before the experts, all E x T rows through them)
    against seqmesh's replacement: each token's k picks scaled on its side, dispatched alone, the experts cut into
    2 and 4 slices (each run as a rank runs its own), summed back; forward and the gradients of the hidden states, the
    experts', the router's and the shared expert's weights, within the block's own noise (the tokens in the other
    order)."""
    model = build(census_config("llama4_text"))
    block = next(m for m in model.modules() if type(m).__name__ == "Llama4TextMoe")
    experts = block.experts
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, TOKENS, block.hidden_dim, dtype=torch.float64, generator=g, requires_grad=True)
    probe = torch.randn(TOKENS, block.hidden_dim, dtype=torch.float64, generator=g)
    leaves = [hidden, *block.parameters()]

    def grads(out):
        return list(torch.autograd.grad((out * probe).sum(), leaves))

    want = block(hidden)[0]
    want_grads = grads(want)
    flip = torch.arange(TOKENS - 1, -1, -1)
    again = block(hidden[:, flip])[0][flip]
    noise = _noise(again, want)
    grad_noise = [_noise(a, b) for a, b in zip(grads(again), want_grads)]
    params = dict(experts.named_parameters(recurse=False))
    for ep in (2, 4):
        n = experts.num_experts // ep

        def run(rows, expert):  # every "rank" r runs the rows of its experts [r n, (r + 1) n) through its slice
            out = rows.new_zeros(rows.shape)
            for r in range(ep):
                mine = (expert // n) == r
                piece = {k: v[r * n:(r + 1) * n] for k, v in params.items()}
                out = out.index_put((mine.nonzero().flatten(),),
                                    run_llama4_experts(experts, piece, rows[mine], expert[mine] - r * n))
            return out

        got, logits = llama4_moe_forward(block, experts.num_experts, 1, None, run)(hidden)
        assert torch.equal(logits, block.router(hidden.reshape(-1, block.hidden_dim))[1])
        assert float((got - want).detach().abs().max()) <= NOISE_MULTIPLE * noise, ep
        for a, b, spread in zip(grads(got), want_grads, grad_noise):
            assert float((a - b).abs().max()) <= NOISE_MULTIPLE * spread, ep
    # the mutation: the router's weight applied after the expert, as every other family's is (measured 1.3e-2 off,
    # against a block output of 4.3e-2)
    flat = hidden.detach().reshape(-1, block.hidden_dim)
    scores, logits = block.router(flat)
    picks = torch.topk(logits, block.top_k, dim=1).indices
    after = dispatch_combine(flat, picks, scores.gather(1, picks), experts.num_experts, 1, None,
                             lambda rows, expert: run_llama4_experts(experts, params, rows, expert))
    assert float((after + block.shared_expert(flat) - want).detach().abs().max()) > 1e6 * NOISE_MULTIPLE * noise


def test_unmeasured_families_are_refused_by_name():
    model = build(census_config("jetmoe"))
    assert experts_modules(model)
    with pytest.raises(ValueError, match="ep=2: seqmesh splits the experts of qwen3_moe.*jetmoe .* sorted by expert"):
        check_family(model, 2)
    check_family(model, 1)


def test_doges_embedding_experts_are_refused_by_name():
    """Doge's cross-domain experts are rows of two embeddings, which no experts module holds: ep > 1 says so."""
    model = build(census_config("doge+moe"))
    assert not experts_modules(model)
    with pytest.raises(ValueError, match="ep=2: .*doge .*rows of two embeddings"):
        check_family(model, 2)
    check_family(model, 1)
