"""Qwen4-Exp (``qwen4_exp_text``, and the language model of ``qwen4_exp``) as the planner sizes it, read from a
transformers ``config.json`` (``seqmesh.hf.qsa_attention`` and ``seqmesh.hf.ngram_ple`` run it).

Its layers are Gated DeltaNet layers (Qwen3.5's) and QSA layers (``indexed_attention``), each followed by experts
with a gated shared expert. A token carries ``hc_count`` ``n`` residual streams of the hidden size ``E``. No layer
has an RMSNorm of its own; a *gated residual* stands around each block instead (two a layer)::

    hc_norm n E (one weight a channel, a norm per stream); down n E x r; up r x n E; inject n E x n

It norms the streams, mixes them into the block's input (a sigmoid weight a channel, their mean), and after the block
adds its output into each stream by a weight of its own. The model's last one (before the head) has no ``inject``.

A QSA layer is gated grouped-query attention (q_proj twice as wide: the gate) with q and k norms of ``D``, in which
each query reads ``budget / ratio`` blocks of ``ratio`` of its earlier tokens, and its incomplete block's tail (up to
``ratio - 1`` tokens), chosen by an indexer of ``Hi`` query heads of ``Di`` and one key head::

    index_qk_proj E x (Hi + 1) Di, q_layernorm Di, k_layernorm Di

The indexer's key of a block is its tokens' mean, normed and rotated at its first token; every query head reads the
same picks. PLE layers (``ple_layer_ids``: hashed n-gram tables added to the streams) the planner does not size yet.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("qwen4_exp", "qwen4_exp_text")
QSA = "indexed_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class QwenExpShape:
    """Qwen4-Exp's sizes beyond a Qwen3.5 hybrid's (module docstring)."""

    streams: int  # n: hc_count
    lowrank: int  # r: hc_lowrank
    index_heads: int  # Hi
    index_head_dim: int  # Di
    budget: int  # the tokens of a query's chosen blocks (indexer_budget)
    ratio: int  # the tokens of a block (indexer_compress_ratio)
    rotary: int  # the rotary tables' width (head_dim x partial_rotary_factor), which the indexer gathers

    @property
    def block_topk(self) -> int:
        """Blocks each query picks."""
        return self.budget // self.ratio

    @property
    def keys_per_query(self) -> int:
        """Keys each query head reads as ``seqmesh.hf.qsa_attention`` gathers them: its picked blocks' slots (a pick
        its document lacks masked, not skipped) and its tail's ``ratio - 1``."""
        return self.block_topk * self.ratio + self.ratio - 1

    def blocks(self, seq_len: int) -> int:
        """Complete blocks of a ``seq_len``-token document: the indexer's keys."""
        return seq_len // self.ratio

    def indexer_params(self, hidden: int) -> int:
        """One QSA layer's indexer: its projection (queries and the one key head) and two norms."""
        return hidden * (self.index_heads + 1) * self.index_head_dim + 2 * self.index_head_dim

    def residual_params(self, hidden: int, inject: bool = True) -> int:
        """One gated residual: its norm, the low-rank mixing weights and (not the model's last) the injection's."""
        wide = self.streams * hidden
        return wide + 2 * wide * self.lowrank + (wide * self.streams if inject else 0)


def _positive(cfg: dict, name: str) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Qwen4-Exp's {name} = {value!r} must be a positive integer; fix the config.json.")
    return value


def layer_types(cfg: dict) -> tuple[str, ...]:
    """Each layer's kind as transformers' config class makes it: ``layer_types`` as given (``full_attention`` read as
    QSA), else a QSA layer every ``full_attention_interval`` (4) layers, the rest Gated DeltaNet."""
    types = cfg.get("layer_types")
    if types:
        return tuple(QSA if t == "full_attention" else t for t in types)
    every = cfg.get("full_attention_interval") or 4
    return tuple(LINEAR if (i + 1) % every else QSA for i in range(cfg["num_hidden_layers"]))


def qwen4_exp_fields(cfg: dict) -> dict:
    """The ModelShape fields of a Qwen4-Exp config.json beyond the common ones (its Gated DeltaNet sizes are read as
    Qwen3.5's, its experts as Qwen3-Next's), or why the planner does not size it; a ValueError naming the fix for
    sizes its runtime refuses."""
    types = layer_types(cfg)
    if set(types) - {QSA, LINEAR}:
        raise ValueError(f"Qwen4-Exp's layer_types name {sorted(set(types) - {QSA, LINEAR})}: its layers are "
                         f"{LINEAR!r} and {QSA!r} (or 'full_attention'); fix the config.json.")
    rope = cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shape = QwenExpShape(cfg.get("hc_count", 4), cfg.get("hc_lowrank", 320), *(
        _positive(cfg, f"indexer_{name}") for name in ("n_heads", "head_dim", "budget", "compress_ratio")),
        rotary=int(head_dim * factor))
    if cfg.get("indexer_kv_heads", 1) != 1:  # seqmesh.hf.qsa_attention refuses the same
        raise ValueError(f"Qwen4-Exp's indexer_kv_heads = {cfg.get('indexer_kv_heads')}: its indexer reads one key "
                         "head (transformers' too); fix the config.json.")
    if not isinstance(shape.streams, int) or shape.streams < 2 or not isinstance(shape.lowrank, int) \
            or shape.lowrank < 1:
        raise ValueError(f"Qwen4-Exp's hc_count = {shape.streams!r} must be an integer above 1 and hc_lowrank = "
                         f"{shape.lowrank!r} a positive one (transformers refuses fewer streams); fix the config.json.")
    fields = {"qwen_exp": shape, "given_layer_types": types}
    if cfg.get("ple_layer_ids"):
        fields["unplanned"] = ("seqmesh plan does not size Qwen4-Exp's PLE layers yet (ple_layer_ids: hashed n-gram "
                               "tables added to the residual streams, each gathered whole by its layer's FSDP unit); "
                               "seqmesh train runs them all the same")
    return fields
