"""MiniMax-M3's block-sparse layers (``minimax_m3_sparse`` in ``layer_types``) as the planner sizes them, read from a
transformers ``config.json`` (``seqmesh.hf.block_sparse_attention`` runs them).

A sparse layer is the model's grouped-query attention (``H`` query heads and ``Hkv`` key heads of ``head_dim`` ``D``,
q and k normed) in which each query reads ``index_topk_blocks`` ``k`` blocks of ``index_block_size`` ``bs`` earlier
keys of its document, picked by a lightning indexer of ``index_n_heads`` ``Hi`` heads of ``index_head_dim`` ``Di``
(each indexer head's picks shared by its ``H / Hi`` query heads). Beside the attention's projections the layer holds
the indexer's::

    q_proj E x Hi Di, k_proj E x Di, q_norm Di, k_norm Di

The model's other layers are its full attention; each has q and k norms of ``D``, and its MLP layers are experts with
a shared expert, or dense where ``mlp_layer_types`` says so (``dense_intermediate_size`` wide).
"""

from __future__ import annotations

from dataclasses import dataclass

SPARSE = "minimax_m3_sparse"
FAMILY = "minimax_m3_vl_text"
# the released checkpoints' names (in ``sparse_attention_config``) of the indexer's sizes, which transformers reads
# into the flat ones, the released names winning
_RELEASED = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
             "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
             "index_local_blocks": "sparse_local_block"}


def canonical_entries(cfg: dict) -> dict:
    """MiniMax-M3's config.json with its released checkpoints' entries read as transformers reads them: the indexer's
    sizes and ``sparse_attention_freq`` (each layer sparse or full) from ``sparse_attention_config``, ``moe_layer_freq``
    (each MLP layer experts or dense) into ``mlp_layer_types``; any other config as it is."""
    if cfg.get("model_type") != FAMILY:
        return cfg
    released = cfg.get("sparse_attention_config") or {}
    out = {**cfg, **{flat: released[name] for flat, name in _RELEASED.items() if name in released}}
    if out.get("layer_types") is None and "sparse_attention_freq" in released:
        out["layer_types"] = [SPARSE if f else "full_attention" for f in released["sparse_attention_freq"]]
    if out.get("mlp_layer_types") is None and cfg.get("moe_layer_freq") is not None:
        out["mlp_layer_types"] = ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]]
    return out


@dataclass(frozen=True)
class BlockSparseShape:
    """The sizes of MiniMax-M3's block-sparse layers beside the model's heads (module docstring)."""

    layers: int  # the sparse layers among the model's
    index_heads: int  # Hi
    index_head_dim: int  # Di
    block_size: int  # bs
    topk_blocks: int  # k
    local_blocks: int  # the blocks ending at the query's own, always kept

    def indexer_params(self, hidden: int) -> int:
        """One sparse layer's indexer: its two projections and two norms."""
        di = self.index_head_dim
        return hidden * self.index_heads * di + hidden * di + 2 * di

    def blocks(self, seq_len: int) -> int:
        """Blocks of a ``seq_len``-token document (the last one partial)."""
        return -(-seq_len // self.block_size)

    def keys_per_query(self, seq_len: int) -> int:
        """Keys each query head reads (its picked blocks whole, those past the query masked, not skipped), as
        ``seqmesh.hf.block_sparse_attention`` gathers them: ``min(k, blocks of the longest document) x bs``, the
        longest document taken as the whole ``seq_len`` (the planner's rows are one document)."""
        return min(self.topk_blocks, self.blocks(seq_len)) * self.block_size


def minimax_m3_fields(cfg: dict, heads: int) -> dict:
    """The ModelShape fields of MiniMax-M3's config.json beyond the common ones: its sparse layers, where it has any;
    a ValueError, naming the fix, for sizes its runtime refuses."""
    kinds = cfg.get("layer_types") or ()
    if SPARSE not in kinds:
        return {}
    shape = BlockSparseShape(kinds.count(SPARSE), int(cfg.get("index_n_heads", 4)), int(cfg.get("index_head_dim", 128)),
                             int(cfg.get("index_block_size", 128)), int(cfg.get("index_topk_blocks", 16)),
                             int(cfg.get("index_local_blocks", 1)))
    if min(shape.index_heads, shape.index_head_dim, shape.block_size, shape.topk_blocks) < 1:
        raise ValueError(f"MiniMax-M3's index_n_heads, index_head_dim, index_block_size and index_topk_blocks must be "
                         f"positive, got {shape.index_heads}, {shape.index_head_dim}, {shape.block_size} and "
                         f"{shape.topk_blocks}; fix the config.json.")
    if heads % shape.index_heads:  # seqmesh.hf.block_sparse_attention refuses the same
        raise ValueError(f"MiniMax-M3's {heads} query heads are not groups of its {shape.index_heads} indexer heads "
                         "(index_n_heads must divide num_attention_heads); fix the config.json.")
    return {"block_sparse": shape}
