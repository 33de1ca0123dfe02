"""The indexed-MLA layouts transformers ships, read from each module: what the latent-space attention of
:mod:`seqmesh.hf.indexed_attention` needs from a layer (its queries, its latent and rotated key, its rotary, its
sinks and output gate) and how its lightning indexer scores.

Every family below is DeepSeek-V3.2's MLA with a lightning indexer; they differ per token only, before or after the
attention, never in what a query reads from other tokens:

==============  ============================================================================================
DeepSeek-V3.2   the reference: interleaved MLA rotary; the indexer half-split, its rotated part first, its
                scale on the head products
GLM-5           the same; an interleaved indexer rotary; ``shared`` layers reuse the previous selection
HY-V4           a half-split MLA rotary; an attention sink per head; a sigmoid gate per value channel from the
                hidden state (``gate_proj``); its indexer's rotated part last, its scale on the head weights, its
                key norm in the norm's own dtype; ``shared`` layers as GLM-5
A.X-K2          no ``q_b_proj``: one product of ``[q_a_layernorm(q_a(x)), q_a(x)]`` (``q_gate_proj``) gives the
                query and a sigmoid gate per value channel, applied in float32
dots.llm3       the query and latent scaled after their norms (``q_lora_scale``, ``kv_lora_scale``), the rotary
                key normed (``k_rope_only_layernorm``) and cast back after the rotary; a sigmoid gate per head
                (``g_proj``); its non-indexed layers are plain MLA through the attention interface
==============  ============================================================================================

Each difference is found from the module's attributes and confirmed in its ``forward``'s source; a layer whose
source does not say what seqmesh computes is refused by name (:func:`layout_problem`), never guessed.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

# the families whose layouts these are, as the refusal names them
FAMILIES = ("DeepSeek-V3.2", "GLM-5", "HY-V4", "A.X-K2", "dots.llm3")
_KV = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_INDEXER = ("wq_b", "wk", "k_norm", "weights_proj")
# the statement of each per-token feature in the forward that has it (transformers 5.24)
_INTERLEAVED = "apply_rotary_pos_emb_interleave(q_rot, k_rot"
_HALF_SPLIT = "apply_rotary_pos_emb(q_rot, k_rot, cos, sin)"
_FUSED_QUERY = "self.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1))"
_GATES = {"gate_proj": "attn_output * torch.sigmoid(gate_states)",
          "g_proj": "attn_output * gate.sigmoid()",
          "q_gate_proj": "attn_output * torch.sigmoid(gate_states.float())"}
_SCALES = {"q_lora_scale": "q_resid = q_resid * self.q_lora_scale",
           "kv_lora_scale": "k_pass = k_pass * self.kv_lora_scale",
           "k_rope_only_layernorm": "k_rot = self.k_rope_only_layernorm(k_rot)"}
_SINKS = "s_aux=self.sinks"


@functools.lru_cache(maxsize=None)  # read once a class: each layer's forward asks on every call
def source(function) -> str:
    """``function``'s source, or "" where Python cannot read it."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def module_function(module: nn.Module, name: str):
    """The function ``name`` of the transformers module that defines ``module``'s class (its rotary, say)."""
    return getattr(sys.modules[type(module).__module__], name)


def checked_layers(model: nn.Module, mesh, kind, problem, computes: str) -> list[nn.Module]:
    """The modules of ``model`` for which ``kind(module)`` holds; a ValueError naming the first for which
    ``problem(module, mesh)`` gives a reason, followed by what seqmesh ``computes``."""
    found = [m for m in model.modules() if kind(m)]
    for module in found:
        reason = problem(module, mesh)
        if reason:
            raise ValueError(f"seqmesh cannot run {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) "
                             f"exactly: {reason}. seqmesh computes {computes}.")
    return found


def selection_problem(module: nn.Module, mesh, attention: tuple[str, ...], indexer: tuple[str, ...],
                      selection: tuple[str, ...], layout: str, what: str) -> str | None:
    """Why seqmesh cannot run a layer whose indexer selects blocks of keys (MiniMax-M3's, Qwen4-Exp's QSA): a part of
    ``layout`` missing (``attention`` on the module, ``indexer`` on its indexer), tensor parallelism, or an indexer
    whose forward lacks one of transformers' own ``selection`` statements; ``what`` names the attention."""
    missing = [n for n in attention if not hasattr(module, n)] + [
        f"indexer.{n}" for n in indexer if not hasattr(module.indexer, n)]
    if missing:
        return f"it is not {layout}'s layout (no {', '.join(missing)})"
    if getattr(mesh, "tp", 1) > 1:
        return f"tensor parallelism (tp={mesh.tp}) is not combined with {what}; use tp=1"
    found = source(type(module.indexer).forward)
    unknown = [s for s in selection if s not in found]
    return f"its indexer selects otherwise than seqmesh knows (no {unknown[0]!r})" if unknown else None


def is_block_sparse(module: nn.Module) -> bool:
    """Whether ``module`` is the attention of a block-sparse layer (MiniMax-M3's: its indexer selects blocks of keys,
    :mod:`.block_sparse_attention`), not one of the layouts above."""
    indexer = getattr(module, "indexer", None)
    return indexer is not None and hasattr(indexer, "topk_blocks") and hasattr(indexer, "block_size")


def layout_problem(module: nn.Module) -> str | None:
    """Why seqmesh cannot compute ``module``'s indexed MLA in latent space, or None."""
    query = ("q_gate_proj",) if hasattr(module, "q_gate_proj") else ("q_b_proj",)
    missing = [n for n in _KV + query if not hasattr(module, n)]
    if missing:
        return f"it is not MLA as DeepSeek lays it out (no {', '.join(missing)})"
    if getattr(module.kv_b_proj, "bias", None) is not None:
        return "its kv_b_proj has a bias, which the latent-space attention does not carry"
    forward = source(type(module).forward)
    if _INTERLEAVED not in forward and _HALF_SPLIT not in forward:
        return "its MLA rotary is neither the interleaved one of DeepSeek-V3.2 nor the half-split one of HY-V4"
    if hasattr(module, "q_gate_proj") and _FUSED_QUERY not in forward:
        return "its q_gate_proj is not A.X-K2's product of the normed and raw query latents"
    for name, statement in {**_GATES, **_SCALES}.items():
        if hasattr(module, name) and statement not in forward:
            return f"its {name} is not applied as seqmesh knows it ({statement!r})"
    gates = [n for n in _GATES if hasattr(module, n)]
    if len(gates) > 1:
        return f"it has more than one output gate ({', '.join(gates)})"
    if "sigmoid" in forward and not gates:
        return "it gates its output by a projection seqmesh does not know"
    if "s_aux=" in forward and not (_SINKS in forward and isinstance(getattr(module, "sinks", None), torch.Tensor)):
        return "it passes attention sinks other than one learned logit per head (self.sinks)"
    return None


def queries(module: nn.Module, hidden: torch.Tensor):
    """hidden (B, L, E) -> (the indexer's query input (B, L, q_lora_rank), the query (B, L, H, Dn + Dr), A.X-K2's gate
    (B, L, H, Dv) or None)."""
    b, length = hidden.shape[:-1]
    compressed = module.q_a_proj(hidden)
    q_resid = module.q_a_layernorm(compressed)
    if hasattr(module, "q_gate_proj"):  # A.X-K2: the query and the output gate from one product
        width = module.qk_head_dim + module.v_head_dim
        both = module.q_gate_proj(torch.cat([q_resid, compressed], dim=-1)).view(b, length, -1, width)
        query, gate = torch.split(both, [module.qk_head_dim, module.v_head_dim], dim=-1)
        return q_resid, query, gate
    if hasattr(module, "q_lora_scale"):  # dots.llm3 scales the normed latent, the indexer's input too
        q_resid = q_resid * module.q_lora_scale
    return q_resid, module.q_b_proj(q_resid).view(b, length, -1, module.qk_head_dim), None


def latent(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (B, L, E) -> (the normed latent (B, L, R), the key's part to rotate (B, L, Dr))."""
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden), [module.kv_lora_rank, module.qk_rope_head_dim],
                                 dim=-1)
    kv = module.kv_a_layernorm(kv_pass)
    if hasattr(module, "kv_lora_scale"):
        kv = kv * module.kv_lora_scale
    if hasattr(module, "k_rope_only_layernorm"):
        k_rot = module.k_rope_only_layernorm(k_rot)
    return kv, k_rot


def rotate(module: nn.Module, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings):
    """MLA's rotary as the module applies it: q_rot (B, H, L, Dr), k_rot (B, 1, L, Dr)."""
    forward = source(type(module).forward)
    interleaved = _INTERLEAVED in forward
    fn = module_function(module, "apply_rotary_pos_emb_interleave" if interleaved else "apply_rotary_pos_emb")
    dtypes = q_rot.dtype, k_rot.dtype
    q_rot, k_rot = fn(q_rot, k_rot, *position_embeddings)
    if "q_rot.to(q_dtype)" in forward:  # dots.llm3 casts back what the rotary promoted
        q_rot, k_rot = q_rot.to(dtypes[0]), k_rot.to(dtypes[1])
    return q_rot, k_rot


def sinks(module: nn.Module) -> torch.Tensor | None:
    """(H,) the learned sink logit of each head (HY-V4), or None."""
    return module.sinks if _SINKS in source(type(module).forward) else None


def gated(module: nn.Module, hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """out (B, L, H, Dv) through the module's output gate, if it has one."""
    b, length = hidden.shape[:-1]
    if gate is not None:  # A.X-K2's, from the query's product, in float32
        return (out * torch.sigmoid(gate.float())).to(out.dtype)
    if hasattr(module, "gate_proj"):  # HY-V4: one gate a value channel
        return out * torch.sigmoid(module.gate_proj(hidden).view(b, length, -1, module.gate_projection_size))
    if hasattr(module, "g_proj"):  # dots.llm3: one gate a head
        return out * module.g_proj(hidden).view(b, length, -1, 1).sigmoid()
    return out


@dataclass(frozen=True)
class IndexerRule:
    """How an indexer computes its scores, from its forward: ``rotate`` its rotary function; ``rotated_first``
    whether the rotated part leads the head (DeepSeek-V3.2) or trails it (HY-V4); ``scale_on_weights`` whether the
    softmax scale multiplies the head weights (HY-V4) or the head products (DeepSeek-V3.2); ``norm_dtype`` whether
    the key norm runs in its weight's dtype and casts back (HY-V4)."""

    rotate: object
    rotated_first: bool
    scale_on_weights: bool
    norm_dtype: bool


def indexer_rule(indexer: nn.Module) -> IndexerRule | str:
    """The indexer's :class:`IndexerRule`, or why seqmesh does not compute it."""
    missing = [n for n in _INDEXER if not hasattr(indexer, n)]
    if missing:
        return f"its indexer ({type(indexer).__name__}) has no {', '.join(missing)}"
    forward = source(type(indexer).forward)
    if "torch.no_grad" not in forward:
        return (f"its indexer ({type(indexer).__name__}) is trained (its forward is not under torch.no_grad), which "
                "seqmesh's selection, a constant, would not train")
    if "F.relu(scores)" not in forward:
        return f"its indexer ({type(indexer).__name__}) does not score by a ReLU of its heads' products"
    first = "q_rot, q_pass = torch.split(q" in forward
    if first == ("q_pass, q_rot = torch.split(q" in forward):
        return f"its indexer ({type(indexer).__name__}) splits its heads' rotated part in a way seqmesh does not know"
    compact = "".join(forward.split())
    on_scores = ".unsqueeze(1))*self.softmax_scale" in compact
    on_weights = "*(self.n_heads**-0.5)*self.softmax_scale" in compact
    if on_scores == on_weights:
        return f"its indexer ({type(indexer).__name__}) applies its softmax_scale where seqmesh does not know"
    interleaved = "apply_rotary_pos_emb_interleave(q_rot, k_rot" in forward
    rotate = module_function(indexer, "apply_rotary_pos_emb_interleave" if interleaved else "apply_rotary_pos_emb")
    return IndexerRule(rotate, first, on_weights, "self.k_norm.weight.dtype" in forward)


def indexer_keys(indexer: nn.Module, rule: IndexerRule, hidden: torch.Tensor, q_resid: torch.Tensor,
                 position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's rotated queries (B, L, H, D) and keys (B, L, D) of the local tokens, as its forward makes them."""
    b, length, _ = hidden.shape
    rope, width = indexer.qk_rope_head_dim, indexer.head_dim
    sizes = [rope, width - rope] if rule.rotated_first else [width - rope, rope]
    q = indexer.wq_b(q_resid).view(b, length, indexer.n_heads, width)  # (B, L, H, D)
    k = indexer.wk(hidden)
    k = indexer.k_norm(k.to(indexer.k_norm.weight.dtype)).to(hidden.dtype) if rule.norm_dtype else indexer.k_norm(k)
    k = k.unsqueeze(2)  # (B, L, 1, D)
    q_parts, k_parts = list(torch.split(q, sizes, dim=-1)), list(torch.split(k, sizes, dim=-1))
    at = 0 if rule.rotated_first else 1
    q_parts[at], k_parts[at] = rule.rotate(q_parts[at], k_parts[at], *position_embeddings, unsqueeze_dim=2)
    return torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1).squeeze(2)


def head_weights(indexer: nn.Module, rule: IndexerRule, hidden: torch.Tensor) -> torch.Tensor:
    """(B, L, H) float32 each indexer head's weight for each token, the softmax scale in it where the indexer puts it
    there (HY-V4)."""
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads ** -0.5
    return weights * indexer.softmax_scale if rule.scale_on_weights else weights


def index_scores(indexer: nn.Module, rule: IndexerRule, q: torch.Tensor, keys: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h relu(q_h . k)`` as the indexer scores: q (B, l, H, D), keys (B, 1, D, n) float32, weights (B, l, H)
    from :func:`head_weights` -> (B, l, n) float32, the same products in the same order as transformers."""
    scores = torch.matmul(q.float(), keys)  # (B, l, H, n)
    if not rule.scale_on_weights:
        scores = scores.mul_(indexer.softmax_scale)
    scores = torch.relu_(scores)  # transformers' values, in place
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
