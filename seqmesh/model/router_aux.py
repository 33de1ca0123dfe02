"""The mixture-of-experts load-balancing loss, pooled over the ranks like the cross-entropy.

transformers' MoE causal LMs with ``config.output_router_logits`` add ``router_aux_loss_coef * aux`` to the loss
(Switch Transformer's balance term), over the ``N`` rows of the batch (one per real token and MoE layer, every
layer's rows together)::

    aux = E * sum_e f_e * P_e      f_e = (top-k picks of expert e) / N      P_e = (sum of softmax p_e) / N

Both are means over the whole batch, so aux is not a mean of per-shard terms. Each rank sums its own tokens' picks
and probabilities; one all-reduce (``loss.pool_sum``) pools ``(picks, probabilities, rows)`` over the group the
cross-entropy is pooled over, and every rank computes the whole batch's aux, its gradient flowing through its own
tokens' probabilities (the picks are discrete). What "the whole batch" is, as for the cross-entropy:

- data-parallel replicas: one process on the global batch (all replicas' samples), the reference every seqmesh loss
  has; a per-replica aux averaged over replicas would differ, aux being a product of two means;
- packed documents: one aux over every token of the packed row, what transformers' model computes on that row (the
  router is per token, so its logits do not depend on how the documents are separated);
- padding: seqmesh's layout padding is not in the batch, and a row's right padding (the batch's ``attention_mask``)
  is left out as transformers leaves it out with the mask: neither counts.

Families whose causal LM adds no such term (DeepSeek-V3: its router's balance is a bias, not a loss) get none.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .loss import pool_sum

# model_type of the causal LMs (and vision-language models) whose aux seqmesh reproduces: each adds the term above,
# with its config's top-k over every MoE layer's router logits, masked by the batch's attention_mask (read in
# transformers 5.15 and 5.24; measured against the model in tests/model/test_router_aux.py for qwen3_moe, gpt_oss,
# mixtral and qwen3_vl_moe, the others read only)
SAME_AUX = ("qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "olmoe", "phimoe", "qwen3_vl_moe",
            "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class RouterAux:
    """The load-balancing term a model adds to its loss."""

    coef: float  # router_aux_loss_coef
    experts: int  # E, the routed experts of each MoE layer
    top_k: int  # experts picked per token


def router_aux(lm: nn.Module) -> RouterAux | None:
    """The load-balancing term ``lm``'s own forward adds to its loss (read from the attributes and config entries
    that forward reads), or None where it adds none. A family adding one seqmesh has not checked is refused."""
    text = lm.config.get_text_config()
    if not getattr(text, "output_router_logits", False):
        return None
    coef = float(getattr(lm, "router_aux_loss_coef", getattr(text, "router_aux_loss_coef", 0.0)))
    family = lm.config.model_type
    if family not in SAME_AUX:
        if not hasattr(sys.modules[type(lm).__module__], "load_balancing_loss_func") or coef == 0.0:
            return None  # the model adds no aux term (DeepSeek-V3), or adds zero
        raise ValueError(
            f"{type(lm).__name__} ({family}) adds router_aux_loss_coef={coef} x a router load-balancing loss with "
            f"config.output_router_logits=True, which seqmesh reproduces for {', '.join(SAME_AUX)} only. Set "
            "output_router_logits=False in the config (trains without the term, on one device as with seqmesh) or "
            "router_aux_loss_coef=0.")
    if coef == 0.0:
        return None
    experts = getattr(lm, "num_experts", None) or getattr(text, "num_experts", None) or text.num_local_experts
    return RouterAux(coef, int(experts), int(getattr(lm, "num_experts_per_tok", text.num_experts_per_tok)))


def load_balancing_loss(router_logits: Sequence[torch.Tensor], aux: RouterAux, real: torch.Tensor | None,
                        group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole batch's ``aux`` (without the coefficient; float64) on every rank of ``group``.

    ``router_logits``: one ``(B * L, E)`` per MoE layer, this rank's ``B x L`` tokens; ``real``: ``(B, L)`` bool,
    the tokens that count (None: all). Probabilities and picks are taken in the logits' dtype, as transformers does;
    the sums in float64, so counts stay exact for any length.
    """
    experts = aux.experts
    if not router_logits:  # no MoE layer: no term (every rank alike, the layers being the same)
        return torch.zeros((), dtype=torch.float64)
    device = router_logits[0].device
    picks = torch.zeros(experts, dtype=torch.float64, device=device)
    probs = torch.zeros(experts, dtype=torch.float64, device=device)
    rows = 0
    keep = real.reshape(-1) if real is not None else None  # (B * L,)
    for layer in router_logits:
        logits = layer.reshape(-1, layer.shape[-1])  # (B * L, E)
        if logits.shape[-1] != experts:
            raise ValueError(f"a router returned {logits.shape[-1]} logits per token but the model has {experts} experts.")
        if keep is not None:
            if keep.shape[0] != logits.shape[0]:
                raise ValueError(f"a router saw {logits.shape[0]} tokens, the shard holds {keep.shape[0]}.")
            logits = logits[keep]  # (n, E) the batch's own tokens
        p = torch.softmax(logits, dim=-1)
        chosen = p.topk(aux.top_k, dim=-1).indices  # (n, k)
        picks.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float64, device=device))
        probs = probs + p.to(torch.float64).sum(dim=0)
        rows += logits.shape[0]
    rows_t = torch.tensor([float(rows)], dtype=torch.float64, device=device)
    totals = pool_sum(torch.cat([picks, probs, rows_t]), group)  # (2E + 1,): whole batch's values, own gradients
    total_picks, total_probs, total_rows = totals[:experts].detach(), totals[experts:-1], totals[-1].detach()
    return experts * (total_picks * total_probs).sum() / total_rows.clamp(min=1.0) ** 2
