"""Doge's config.json as the planner reads it: its dynamic mask's window (``keep_window_size``, which the planner checks
the length against) and, with ``is_moe``, its cross-domain experts (:class:`CrossDomainExperts`), as
``seqmesh.hf.doge_moe`` runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..rules.own_attention import DOGE_WINDOW

_PARTS = ("router_gate", "down_embed", "up_embed", "gate_proj", "up_proj", "down_proj", "num_keys", "top_k",
          "norm_topk_prob", "act_fn")


def is_doge_moe(module) -> bool:
    """Whether ``module`` (an ``nn.Module``) is Doge's cross-domain mixture of experts with its parts where expected
    (``seqmesh.hf.doge_moe`` runs it; ``seqmesh.memory.tiled_mlp`` refuses to tile it)."""
    return type(module).__name__ == "DogeCDMoE" and all(hasattr(module, p) for p in _PARTS)


# the runtime's (seqmesh.memory.tiled_mlp) and the planner's (seqmesh.planner.workload) words for the one rule
TILED_MLP_REFUSAL = ("Doge's cross-domain experts route each token by other tokens' router logits over the whole call, "
                     "which tiles of the sequence would route within each tile; train this model without tiled_mlp")


@dataclass(frozen=True)
class CrossDomainExperts:
    """Doge's cross-domain experts beside its dense gated MLP (``DogeCDMoE``): ``experts`` rows of two embeddings
    (down and up, ``hidden`` wide each), a router of ``2 x keys`` logits a token (``keys = floor(sqrt(experts))``),
    and ``per_token`` rows a token picked among the ``keys^2`` sums of its two halves' top keys."""

    experts: int
    per_token: int
    norm_topk: bool = False

    def __post_init__(self) -> None:
        if self.experts < 1 or self.per_token < 1:
            raise ValueError(f"Doge's cross-domain experts need num_experts >= 1 and num_experts_per_tok >= 1, got "
                             f"{self.experts} and {self.per_token}; fix the config.json.")
        if self.per_token > self.keys ** 2:
            raise ValueError(f"num_experts_per_tok={self.per_token} is more than the {self.keys ** 2} experts Doge's "
                             f"router can pick from (floor(sqrt(num_experts={self.experts}))^2); fix the config.json.")

    @property
    def keys(self) -> int:
        """Router logits of each half: transformers' ``floor(sqrt(num_experts))``."""
        return math.floor(math.sqrt(self.experts))

    def params(self, hidden: int) -> int:
        """The two embeddings and the router (the dense MLP beside them is the layer's own)."""
        return 2 * self.experts * hidden + 2 * self.keys * hidden

    def matmul_params(self, hidden: int) -> int:
        """Multiply-adds a token: the router, and each picked row's two products (down with the token, the weighted
        sum of the up rows)."""
        return 2 * self.keys * hidden + 2 * self.per_token * hidden

    def saved_bytes(self, hidden: int, act_bytes: int) -> int:
        """Bytes a token keeps for backward beyond the dense MLP's, in the compute dtype as FSDP2's mixed precision
        runs it: its picked down and up rows, the activation's input and output, the routing weights and their
        weighted activations (with ``norm_topk`` the normalised weights and their sum too), the int64 picks (the
        embeddings' and the top-k's), the router's sorted keys of both halves and the two places its halves were
        read from."""
        k, e = self.per_token, act_bytes
        weights = (k + 1) * e if self.norm_topk else 0
        return 2 * k * hidden * e + 4 * k * e + weights + 2 * 8 * k + 2 * 8 * self.keys + 2 * 8

    def row_bytes(self, hidden: int, act_bytes: int) -> int:
        """Bytes of one token's picked rows of one embedding: a row gradient's size in backward."""
        return self.per_token * hidden * act_bytes

    def logits_bytes(self, act_bytes: int) -> int:
        """Bytes of one token's router logits, what the layer's all-gather moves a token."""
        return 2 * self.keys * act_bytes


def doge_fields(cfg: dict) -> dict:
    """The ModelShape fields of Doge's config.json: its window in ``extra``; with ``is_moe`` its cross-domain
    experts, without it no experts (the ones its config names are unused)."""
    fields: dict = {"extra": (("keep_window_size", cfg.get("keep_window_size", DOGE_WINDOW)),),
                    "experts": 0, "experts_per_token": 0}
    if cfg.get("is_moe"):
        fields["cross_domain"] = CrossDomainExperts(int(cfg.get("num_experts", 16384)),
                                                    int(cfg.get("num_experts_per_tok", 64)),
                                                    bool(cfg.get("norm_topk_prob", False)))
    return fields
