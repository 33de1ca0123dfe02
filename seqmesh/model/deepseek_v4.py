"""DeepSeek-V4 (``deepseek_v4``) as the planner sizes it, read from a transformers ``config.json``.

Every layer's attention is multi-query attention with one shared key that is also the value (``D`` = ``head_dim``
wide), ``H`` query heads from a low-rank query (``q_lora_rank`` ``Q``), a sink per head and a grouped low-rank
output (``o_groups`` ``G`` groups to ``o_lora_rank`` ``O`` each); its ``layer_types`` say what else it attends to
beside a window of ``sliding_window`` ``W`` tokens (``seqmesh.hf.compressed_attention``):

- ``sliding_attention``: nothing else (seqmesh attention with a window);
- ``heavily_compressed_attention`` (HCA): every entry of ``m'`` tokens (``compress_rates``) whose window has closed;
- ``compressed_sparse_attention`` (CSA): the ``index_topk`` entries of ``m`` tokens (each gated over ``2m``) that a
  lightning indexer (``index_n_heads`` ``Hi`` heads of ``index_head_dim`` ``Di``) picks.

With hidden ``E``, a layer holds::

    q_a_proj E x Q, q_a_norm Q, q_b_proj Q x H D; kv_proj E x D, kv_norm D; sinks H
    o_a_proj H D x O (G groups of H D / G to O), o_b_proj G O x E
    HCA's compressor: kv_proj and gate_proj E x D each, position_bias m' x D, kv_norm D
    CSA's compressor: kv_proj and gate_proj E x 2D each, position_bias m x 2D, kv_norm D; its indexer: kv_proj and
        gate_proj E x 2 Di each, position_bias m x 2 Di, kv_norm Di, q_b_proj Q x Hi Di, weights_proj E x Hi
    two RMSNorms E; two hyper-connections of ``hc_mult`` n streams: fn (2 + n) n x n E, base (2 + n) n, scale 3
    a mixture of experts (routed by top k, or by a token's id in ``hash_moe`` layers: the same weights)

and the model an embedding, the head's hyper-connection (n x n E, n, 1), a final RMSNorm and the head. transformers
builds no multi-token-prediction layer, nor does the planner count one.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
KINDS = (SLIDING, CSA, HCA)
_RATES = {CSA: 4, HCA: 128}  # transformers' defaults (DeepseekV4Config.default_compress_rates)


@dataclass(frozen=True)
class CompressedShape:
    """The sizes of DeepSeek-V4's attention beside the model's heads, ``head_dim`` and hidden size (module docstring)."""

    kinds: tuple[str, ...]  # each layer's kind: SLIDING, CSA or HCA
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # the sliding window every layer attends over, its own token included
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_iters: int  # the Sinkhorn iterations that make each token's comb matrix doubly stochastic

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"layer_types {unknown} are none of DeepSeek-V4's {', '.join(KINDS)}; fix the "
                             "config.json.")
        sizes = {"q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
                 "sliding_window": self.window, "compress_rates' CSA rate": self.csa_rate,
                 "compress_rates' HCA rate": self.hca_rate, "index_n_heads": self.index_n_heads,
                 "index_head_dim": self.index_head_dim, "index_topk": self.index_topk, "hc_mult": self.hc_mult,
                 "hc_sinkhorn_iters": self.hc_iters}
        bad = [f"{name} {value}" for name, value in sizes.items() if not isinstance(value, int) or value < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: each must be a positive whole number; fix the config.json.")

    def count(self, kind: str) -> int:
        """How many layers are of ``kind``."""
        return self.kinds.count(kind)

    def rate(self, kind: str) -> int:
        """Tokens an entry of ``kind`` compresses (0: a sliding layer has none)."""
        return {CSA: self.csa_rate, HCA: self.hca_rate}.get(kind, 0)

    def halo(self, kind: str) -> int:
        """The rows a rank reads before each run of its tokens, plus one (``halo.extend``'s kernel): the window's,
        and an entry's window (CSA's gated over two of them)."""
        return max(self.window, 2 * self.csa_rate if kind == CSA else self.rate(kind))

    def compressor_params(self, hidden: int, head_dim: int, kind: str) -> int:
        """A compressed layer's compressor, and CSA's indexer (no gradient reaches its selection, but its weights are
        the model's)."""
        if kind == SLIDING:
            return 0
        wide = 2 if kind == CSA else 1  # CSA's windows overlap: two halves a token
        own = 2 * hidden * wide * head_dim + self.rate(kind) * wide * head_dim + head_dim
        if kind == HCA:
            return own
        di, hi = self.index_head_dim, self.index_n_heads
        return own + 4 * hidden * di + self.csa_rate * 2 * di + di + self.q_lora_rank * hi * di + hidden * hi

    def attention_params(self, hidden: int, heads: int, head_dim: int, kind: str) -> int:
        """One layer's attention of ``kind``: the query, the shared key, the output, the sinks and its compressor."""
        q, o = self.q_lora_rank, self.o_lora_rank
        query = hidden * q + q + q * heads * head_dim
        key = hidden * head_dim + head_dim
        out = heads * head_dim * o + self.o_groups * o * hidden
        return query + key + out + heads + self.compressor_params(hidden, head_dim, kind)

    def hc_params(self, hidden: int, mixes: int) -> int:
        """One hyper-connection's weights: ``mixes`` weights a stream (a block's: pre, post and an n x n comb,
        ``2 + n``; the head's: 1), each from every stream's values, with their biases, and a scale per kind."""
        n = self.hc_mult
        rows = mixes * n
        return rows * n * hidden + rows + (3 if mixes > 1 else 1)

    def layer_hc_params(self, hidden: int) -> int:
        """A layer's two hyper-connections (around its attention and its experts)."""
        return 2 * self.hc_params(hidden, 2 + self.hc_mult)


def deepseek_v4_fields(cfg: dict) -> dict:
    """The :class:`ModelShape` fields of a DeepSeek-V4 config.json (``compressed``, the streams, the window, one key
    head whatever ``num_key_value_heads`` says: its ``kv_proj`` makes one), with transformers' defaults for what the
    file leaves out."""
    layers = cfg.get("num_hidden_layers") or 43
    kinds = cfg.get("layer_types")
    if not kinds and cfg.get("compress_ratios"):  # older checkpoints: each layer's rate (0: sliding only)
        ratios = {0: SLIDING, 4: CSA, 128: HCA}
        unknown = sorted({r for r in cfg["compress_ratios"] if r not in ratios})
        if unknown:
            raise ValueError(f"compress_ratios {unknown} are none of DeepSeek-V4's 0, 4 and 128; give layer_types "
                             "instead.")
        kinds = [ratios[r] for r in cfg["compress_ratios"]]
    if not kinds:  # transformers' default: two HCA layers, then CSA and HCA in turn
        kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    if len(kinds) < layers:
        raise ValueError(f"layer_types names {len(kinds)} layers but num_hidden_layers is {layers}; give one kind a "
                         "layer (transformers refuses the file too).")
    kinds = kinds[:layers]  # a longer list: its first layers, as transformers reads it
    rates = {**_RATES, **(cfg.get("compress_rates") or {})}
    if cfg.get("compress_rate_csa"):
        rates[CSA] = cfg["compress_rate_csa"]
    if cfg.get("compress_rate_hca"):
        rates[HCA] = cfg["compress_rate_hca"]
    shape = CompressedShape(
        tuple(kinds), cfg.get("q_lora_rank") or 1024, cfg.get("o_groups") or 8, cfg.get("o_lora_rank") or 1024,
        cfg.get("sliding_window") or 128, rates[CSA], rates[HCA], cfg.get("index_n_heads") or 64,
        cfg.get("index_head_dim") or 128, cfg.get("index_topk") or 512, cfg.get("hc_mult") or 4,
        cfg.get("hc_sinkhorn_iters") or 20)
    return {"compressed": shape, "hc_mult": shape.hc_mult, "sliding_window": shape.window, "kv_heads": 1,
            "head_dim": cfg.get("head_dim") or 512}
