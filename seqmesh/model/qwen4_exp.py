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
same picks.

A PLE layer (``ple_layer_ids``, one-indexed) adds hashed n-gram embeddings to the streams before its layer runs: an
embedding of ``ple_embed_dim`` ``P`` a token (``g = (ngram_size - 1) x heads_per_ngram`` heads of ``P / g``, each head
its own table, whose rows are the next prime at or above ``ngram_vocab_size_base``, the layer's heads after the
earlier PLE layers'; their sum padded to ``make_ngram_vocab_size_divisible_by``), and::

    key_proj P x n E, value_proj P x E, norm_key, norm_query, norm_conv n E each, a depthwise conv1d n E x K

its conv dilated by ``ngram_size``: it reads ``(K - 1) x ngram_size`` earlier tokens, the n-gram ``ngram_size - 1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FAMILIES = ("qwen4_exp", "qwen4_exp_text")
QSA = "indexed_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class PleShape:
    """Qwen4-Exp's PLE layers (module docstring)."""

    layers: tuple[int, ...]  # the layers that have one (0-indexed)
    embed_dim: int  # P
    heads: int  # g: n-gram heads (a table each)
    ngram: int  # the n-gram's tokens: the conv's dilation
    kernel: int  # K
    tables: tuple[int, ...]  # each PLE layer's rows, all its heads' tables, padded

    @property
    def reach(self) -> int:
        """Earlier tokens a PLE layer reads (``seqmesh.hf.ngram_ple.reach``): its conv's, or its n-gram's."""
        return max((self.kernel - 1) * self.ngram, self.ngram - 1)

    def params(self, hidden: int, streams: int, rows: int) -> int:
        """One PLE layer of ``rows`` table rows: its tables, projections, three norms and conv."""
        wide = streams * hidden
        return rows * (self.embed_dim // self.heads) + self.embed_dim * (wide + hidden) + 3 * wide + wide * self.kernel


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
    ple: PleShape | None = None  # its PLE layers (None: none)

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

    def ple_params(self, hidden: int, largest: bool = False) -> int:
        """Every PLE layer's parameters (``largest``: the largest one's, its FSDP unit's share); 0 without."""
        if self.ple is None:
            return 0
        each = [self.ple.params(hidden, self.streams, rows) for rows in self.ple.tables]
        return max(each) if largest else sum(each)

    def residual_params(self, hidden: int, inject: bool = True) -> int:
        """One gated residual: its norm, the low-rank mixing weights and (not the model's last) the injection's."""
        wide = self.streams * hidden
        return wide + 2 * wide * self.lowrank + (wide * self.streams if inject else 0)


def _primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes at or above ``start`` (trial division by the primes up to their square root)."""
    out, n = [], max(2, start)
    small = [2]
    while len(out) < count:
        while small[-1] * small[-1] <= n:
            m = small[-1] + 1
            while any(m % p == 0 for p in small if p * p <= m):
                m += 1
            small.append(m)
        if all(n % p for p in small if p * p <= n):
            out.append(n)
        n += 1
    return out


def ple_shape(cfg: dict) -> PleShape | None:
    """The PLE layers of a Qwen4-Exp config.json (None without), each table's rows as transformers' layer counts them;
    a ValueError naming the fix for sizes transformers refuses."""
    ids = sorted(set(cfg.get("ple_layer_ids") or ()))
    if not ids:
        return None
    layers = cfg["num_hidden_layers"]
    if ids[0] < 1 or ids[-1] > layers:
        raise ValueError(f"Qwen4-Exp's ple_layer_ids {ids} must be one-indexed layers in [1, {layers}]; fix the "
                         "config.json.")
    ngram, per = cfg.get("ngram_size", 3), cfg.get("heads_per_ngram", 8)
    dim = cfg.get("ple_embed_dim") or cfg["hidden_size"]
    heads = (ngram - 1) * per
    if heads < 1 or dim % heads:
        raise ValueError(f"Qwen4-Exp's ple_embed_dim {dim} must be a positive multiple of its {heads} n-gram heads "
                         "((ngram_size - 1) x heads_per_ngram); fix the config.json.")
    primes = _primes_from(cfg.get("ngram_vocab_size_base", 20_000_000), heads * len(ids))
    divisor = cfg.get("make_ngram_vocab_size_divisible_by", 128)
    tables = tuple(-(-sum(primes[i * heads:(i + 1) * heads]) // divisor) * divisor for i in range(len(ids)))
    return PleShape(tuple(i - 1 for i in ids), dim, heads, ngram, cfg.get("ple_conv_kernel_size", 4), tables)


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
    Qwen3.5's, its experts as Qwen3-Next's); a ValueError naming the fix for sizes its runtime or transformers
    refuses."""
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
    ple = ple_shape(cfg)
    if ple is not None and any(types[i] != LINEAR for i in ple.layers):  # transformers' config class refuses it too
        raise ValueError(f"Qwen4-Exp's ple_layer_ids {[i + 1 for i in ple.layers]} name a layer that is not "
                         f"{LINEAR!r} (layer_types); PLE layers are Gated DeltaNet layers: fix the config.json.")
    return {"qwen_exp": dataclasses.replace(shape, ple=ple), "given_layer_types": types}
