"""The shapes of a hybrid model's layers as the planner sizes them, below the readers of config.json that make them
(:mod:`.hybrid` for the Mamba2 families, :mod:`.lfm`, :mod:`.kimi`, :mod:`.minimax`, :mod:`.recurrent_gemma`,
:mod:`.jamba`): each layer's mixer kind, a Mamba2 mixer, a gated short convolution, a KDA and a lightning attention
mixer, an RG-LRU block, a Mamba (v1) mixer, a feed-forward block, and the whole ``HybridShape``. What each mixer holds:
the docstring of the module that reads its family.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MAMBA2 = "mamba2"
CONV = "conv"  # LFM2's gated short convolution (seqmesh.model.lfm)
KDA = "kda"  # Kimi Linear's Kimi Delta Attention (seqmesh.model.kimi)
LIGHTNING = "lightning"  # MiniMax-01's lightning attention (seqmesh.model.minimax)
RG_LRU = "rg_lru"  # RecurrentGemma's recurrent block (seqmesh.model.recurrent_gemma)
MAMBA1 = "mamba1"  # Jamba's Mamba (v1) mixer (seqmesh.model.jamba)
RWKV = "rwkv"  # RWKV-4's time mix (seqmesh.model.rwkv)
XLSTM = "mlstm"  # xLSTM's mLSTM layer (seqmesh.model.xlstm)
ATTENTION = "attention"
SLIDING = "sliding_attention"  # attention over a window (LFM3's sliding layers, beside its full ones)
PARALLEL = "attention+mamba2"  # Falcon-H1: attention and Mamba2 side by side on the same normed input
SHARED_MAMBA1 = "shared+mamba1"  # Zamba's hybrid layer: a shared attention block, then the layer's Mamba (v1)
SHARED_MAMBA2 = "shared+mamba2"  # Zamba2's: one of its shared blocks, then the layer's Mamba2
SHARED_MIXERS = (SHARED_MAMBA1, SHARED_MAMBA2)
ATTENDING = (ATTENTION, PARALLEL, SLIDING, *SHARED_MIXERS)  # the mixers whose layer runs attention


def positive_sizes(shape, names: tuple[str, ...], what: str, entries: str = "") -> None:
    """A ValueError naming the first of ``shape``'s ``names`` that is not a positive integer: "the {what}' {name} =
    {value} must be a positive integer ({entries}); fix the config.json." (``entries``: the config.json's names)."""
    for name in names:
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            where = f" ({entries})" if entries else ""
            raise ValueError(f"the {what}' {name} = {value!r} must be a positive integer{where}; fix the config.json.")


def ssd_widths(heads: int, head_dim: int, groups: int, state: int) -> tuple[int, int]:
    """``(d_inner, conv channels)`` of a Mamba2 mixer: the channels its scan runs (heads x head_dim), and its conv's
    (x | B | C), which the conv halo carries. The one formula the planner's shape (:class:`Mamba2Shape`) and the
    runtime's scan (``seqmesh.linear_attention.mamba2.SSDHeads``) use."""
    inner = heads * head_dim
    return inner, inner + 2 * groups * state


@dataclass(frozen=True)
class Mamba2Shape:
    """One Mamba2 mixer: ``heads`` of ``head_dim`` channels, a ``state``-wide state per channel, B and C shared by the
    heads of each of ``groups``, a depthwise causal conv of ``conv`` taps."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv: int = 4
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj's bias (and out_proj's unless out_bias says otherwise)
    out_bias: bool | None = None  # out_proj's bias where it differs from in_proj's (Falcon-H1's projectors_bias)
    gated_norm: bool = True  # the gated RMSNorm (Falcon-H1 without mamba_rms_norm gates with silu(z) alone)
    float32_mixing: bool = False  # in_proj's output and all after it float32 (Falcon-H1's float32 muP multipliers)

    def __post_init__(self) -> None:
        positive_sizes(self, ("heads", "head_dim", "state", "groups", "conv"), "Mamba2 layers")
        if self.heads % self.groups:
            raise ValueError(f"the Mamba2 layers' {self.groups} groups do not divide their {self.heads} heads "
                             "(n_groups / mamba_n_groups); each group's B and C serve whole heads: fix the config.json.")

    @property
    def inner(self) -> int:
        """d_inner: the channels the scan runs (heads x head_dim)."""
        return ssd_widths(self.heads, self.head_dim, self.groups, self.state)[0]

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (x | B | C), which the conv halo carries."""
        return ssd_widths(self.heads, self.head_dim, self.groups, self.state)[1]

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: in_proj and out_proj."""
        return hidden * (self.inner + self.conv_dim + self.heads) + self.inner * hidden

    def params(self, hidden: int) -> int:
        """Every parameter of the mixer (the module docstring's list)."""
        out_bias = self.proj_bias if self.out_bias is None else self.out_bias
        biases = (self.inner + self.conv_dim + self.heads if self.proj_bias else 0) + (hidden if out_bias else 0)
        conv = self.conv_dim * self.conv + (self.conv_dim if self.conv_bias else 0)
        return self.matmul_params(hidden) + biases + conv + 3 * self.heads + (self.inner if self.gated_norm else 0)


@dataclass(frozen=True)
class FeedForward:
    """One layer's MLP or MoE block: its parameters, and the multiply-adds per token (a token's routed experts, the
    shared experts, the router); ``kept``: the activation elements per token it keeps for backward (an estimate:
    its input and its intermediates; not yet checked against a run)."""

    params: int
    macs: int
    kept: int


@dataclass(frozen=True)
class HybridShape:
    """A hybrid's layers: ``blocks[i] = (mixer, ffn)``, mixer ``"mamba2"``, ``"conv"`` (LFM2's gated short conv),
    ``"attention"``, ``"sliding_attention"`` (LFM3's windowed layers), ``"attention+mamba2"`` (Falcon-H1) or ``""`` (a Nemotron-H MLP/MoE block), ffn ``"mlp"``,
    ``"moe"`` or ``""`` (a Nemotron-H mixer block); ``ffns`` the feed-forward of each name; ``norms`` RMSNorms of the
    hidden size per layer; ``attention_bias``: q, k, v, o biased; ``attention_norms``: further parameters of each
    attention layer (LFM2's q and k RMSNorms); ``mamba`` / ``conv`` / ``kda``: the shape of the recurrent mixer it
    has (mixer ``"kda"``: Kimi Linear's; ``lightning``, mixer ``"lightning"``: MiniMax-01's; ``rg_lru``, mixer
    ``"rg_lru"``: RecurrentGemma's recurrent block; ``mamba1``, mixer ``"mamba1"``: Jamba's Mamba (v1)); a Zamba
    hybrid layer's mixer ``"shared+mamba1"`` or ``"shared+mamba2"`` (``shared``: its blocks), ffn ``"linear"`` (its
    own linear, with its block's MLP and adapters a token passes through)."""

    mamba: Mamba2Shape | None
    blocks: tuple[tuple[str, str], ...]
    ffns: tuple[tuple[str, FeedForward], ...]
    norms: int
    attention_bias: bool = False
    conv: ShortConvShape | None = None
    attention_norms: int = 0
    kda: KdaShape | None = None
    lightning: LightningShape | None = None
    rg_lru: RgLruShape | None = None
    mamba1: Mamba1Shape | None = None
    rwkv: RwkvShape | None = None
    xlstm: XlstmShape | None = None
    cca: CcaShape | None = None  # ZAYA's attention projections (its attention layers' mixer otherwise attention)
    shared: SharedBlocks | None = None  # Zamba's and Zamba2's shared attention blocks (mixers "shared+...")
    extra_params: int = 0  # parameters beside the layers, the embeddings and a final norm's weight (RWKV's LayerNorms)

    def ffn(self, name: str) -> FeedForward:
        return dict(self.ffns).get(name, FeedForward(0, 0, 0))

    def count(self, mixer: str | None = None, ffn: str | None = None) -> int:
        """Layers with this mixer and/or this feed-forward."""
        return sum((mixer is None or m == mixer) and (ffn is None or f == ffn) for m, f in self.blocks)

    @property
    def attention_layers(self) -> int:
        """Layers with attention (alone, windowed, beside Mamba2 in Falcon-H1, or a Zamba's shared block)."""
        return sum(self.count(mixer) for mixer in ATTENDING)

    def attention_ffn(self) -> str:
        """The feed-forward of the attention layers (one per family: Nemotron-H's none; Zamba's hybrid layers' own
        linear and its shared block's MLP)."""
        return next((f for m, f in self.blocks if m in ATTENDING), "")

    def kinds(self) -> list[tuple[tuple[str, str], int]]:
        """Each distinct (mixer, ffn) with its number of layers, in the order they first appear."""
        seen: dict[tuple[str, str], int] = {}
        for block in self.blocks:
            seen[block] = seen.get(block, 0) + 1
        return list(seen.items())

    def layer_params(self, block: tuple[str, str], hidden: int, attention: int) -> int:
        """One layer's parameters: its mixer (``attention``: an attention mixer's projections), feed-forward, norms."""
        mixer, ffn = block
        own = 0
        if mixer in (ATTENTION, PARALLEL, SLIDING):
            own += attention + self.attention_norms
        if mixer in (MAMBA2, PARALLEL, SHARED_MAMBA2):
            own += self.mamba.params(hidden)
        if mixer == CONV:
            own += self.conv.params(hidden)
        if mixer == KDA:
            own += self.kda.params(hidden)
        if mixer == LIGHTNING:
            own += self.lightning.params(hidden)
        if mixer == RG_LRU:
            own += self.rg_lru.params(hidden)
        if mixer in (MAMBA1, SHARED_MAMBA1):
            own += self.mamba1.params(hidden)
        if mixer == RWKV:
            own += self.rwkv.params(hidden)
        if mixer == XLSTM:
            own += self.xlstm.params(hidden)
        return own + self.ffn(ffn).params + self.norms * hidden

    @property
    def shared_layers(self) -> int:
        """Zamba's hybrid layers: those that run a shared block."""
        return sum(self.count(mixer) for mixer in SHARED_MIXERS)

    def shared_layer_params(self, hidden: int) -> int:
        """A Zamba hybrid layer's parameters beside its mixer's: its linear and norm, and its share of the shared
        blocks and their adapters (FSDP2 gathers a block once for all the layers that run it: the same bytes a step)."""
        return self._beside_mixer(hidden) + -(-self.shared.params // self.shared_layers)

    def shared_layer_reads(self, hidden: int) -> int:
        """The parameters a decoded token reads in a Zamba hybrid layer beside its mixer: its linear and norm, its
        block whole and its adapter set."""
        return self._beside_mixer(hidden) + self.shared.block + self.shared.adapter

    def _beside_mixer(self, hidden: int) -> int:
        """A Zamba hybrid layer's own parameters beside its mixer and its block: its linear and its norm."""
        return self.ffn(self.attention_ffn()).params + self.norms * hidden

    def held_params(self, hidden: int, attention: int) -> int:
        """The parameters of Zamba's shared-block units (``seqmesh.model.fsdp.units_of``: the hybrid layers that run a
        block, with it, where there are two or more), which FSDP2 keeps gathered from the first such layer's forward
        to its last's, and in backward from the last's to the first's; 0 for another model."""
        if self.shared is None or not self.shared.tied:
            return 0
        own = self._hybrid_own(hidden, attention)
        return sum(self.shared.block + n * (self.shared.adapter + own) for n in self.shared.served if n > 1)

    def _hybrid_own(self, hidden: int, attention: int) -> int:
        """A Zamba hybrid layer's own parameters (its mixer, norm and linear)."""
        return next(self.layer_params(block, hidden, attention) for block in self.blocks if block[0] in SHARED_MIXERS)

    def largest_unit(self, hidden: int, attention: int) -> int:
        """The largest FSDP unit of one layer (Zamba's hybrid layers that share a block apart: :meth:`held_params`); a
        Zamba hybrid layer alone with its block (untied, or its block's only layer) holds the block and its adapters."""
        units = [self.layer_params(block, hidden, attention) for block, _ in self.kinds()
                 if block[0] not in SHARED_MIXERS]
        if self.shared is not None:  # a hybrid layer alone with a block: untied, or the one layer its block serves
            alone = not self.shared.tied or 1 in self.shared.served
            adapters = self.shared.unit_adapters if not self.shared.tied else 1
            if alone:
                units.append(self._hybrid_own(hidden, attention) + self.shared.block + adapters * self.shared.adapter)
        return max(units or [0])

    def params(self, hidden: int, attention: int) -> int:
        """Every layer's parameters (no embedding, final norm or head), and the shared blocks' once."""
        shared = self.shared.params if self.shared is not None else 0
        return sum(n * self.layer_params(block, hidden, attention) for block, n in self.kinds()) + shared

    def as_dict(self) -> dict:
        """Plain data for ``seqmesh plan --json`` (docs/planner.md, ``@hybrid``): each layer as ``mixer+ffn``."""
        return {"mamba": asdict(self.mamba) if self.mamba else None,
                "conv": asdict(self.conv) if self.conv else None, "kda": asdict(self.kda) if self.kda else None,
                "lightning": asdict(self.lightning) if self.lightning else None,
                "rg_lru": asdict(self.rg_lru) if self.rg_lru else None,
                "mamba1": asdict(self.mamba1) if self.mamba1 else None,
                "rwkv": asdict(self.rwkv) if self.rwkv else None,
                "xlstm": asdict(self.xlstm) if self.xlstm else None,
                "cca": asdict(self.cca) if self.cca else None,
                "shared": asdict(self.shared) if self.shared else None,
                "blocks": ["+".join(x for x in block if x) for block in self.blocks],
                "ffn_params": {name: ffn.params for name, ffn in self.ffns}, "norms": self.norms,
                "attention_bias": self.attention_bias, "attention_norms": self.attention_norms,
                "extra_params": self.extra_params}


@dataclass(frozen=True)
class SharedBlocks:
    """Zamba's and Zamba2's shared transformer blocks (:mod:`.zamba`): ``blocks`` of them (tied: Zamba2's
    ``num_mem_blocks``, the ``i``-th hybrid layer running block ``i % blocks``; untied: one a hybrid layer), each
    ``block`` parameters (its attention's ``attention`` over the layer's input beside the embeddings, its MLP, its two
    RMSNorms), and
    ``adapters``: Zamba2's LoRA adapter sets, ``adapter`` parameters each, held in the blocks. FSDP2 puts the hybrid
    layers that share a block in one unit (``seqmesh.model.fsdp.units_of``). ``tied`` False: transformers ties
    nothing in a model whose embeddings are untied, so each hybrid layer builds a block of its own (``blocks`` of
    them), each with the adapter sets of every layer its block id serves (``unit_adapters`` the most)."""

    blocks: int
    block: int
    attention: int
    adapters: int = 0
    adapter: int = 0
    tied: bool = True
    unit_adapters: int = 0
    served: tuple[int, ...] = ()  # tied: the hybrid layers each block serves (a block that serves one: a plain unit)

    @property
    def params(self) -> int:
        """Every block's parameters, their adapters included."""
        return self.blocks * self.block + self.adapters * self.adapter


@dataclass(frozen=True)
class ShortConvShape:
    """One gated short convolution of ``kernel`` taps over the hidden channels; ``bias``: every part biased."""

    kernel: int
    bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, int) or isinstance(self.kernel, bool) or self.kernel < 1:
            raise ValueError(f"conv_L_cache = {self.kernel!r}: the short convolutions' width must be a positive "
                             "integer; fix the config.json.")

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: in_proj and out_proj."""
        return 4 * hidden * hidden

    def params(self, hidden: int) -> int:
        """Every parameter of the mixer (:mod:`.lfm`'s docstring lists them)."""
        return self.matmul_params(hidden) + hidden * self.kernel + (5 * hidden if self.bias else 0)


@dataclass(frozen=True)
class KdaShape:
    """One KDA mixer: ``heads`` of ``head_dim`` key and value channels, a depthwise causal conv of ``conv`` taps."""

    heads: int
    head_dim: int
    conv: int = 4

    def __post_init__(self) -> None:
        positive_sizes(self, ("heads", "head_dim", "conv"), "KDA layers",
                       "linear_num_heads, linear_head_dim, linear_conv_kernel_dim")

    @property
    def inner(self) -> int:
        """Channels of q, of k and of v (heads x head_dim)."""
        return self.heads * self.head_dim

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: q, k, v, the gates' two-step projections, b_proj and o_proj."""
        q, d = self.inner, self.head_dim
        return 3 * hidden * q + 2 * (hidden * d + d * q) + hidden * self.heads + q * hidden

    def params(self, hidden: int) -> int:
        """Every parameter of the mixer (:mod:`.kimi`'s docstring lists them)."""
        return self.matmul_params(hidden) + 3 * self.inner * self.conv + self.inner + self.heads + self.head_dim


@dataclass(frozen=True)
class LightningShape:
    """One lightning attention mixer: ``heads`` of ``head_dim`` key and value channels."""

    heads: int
    head_dim: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: qkv_proj, output_gate, out_proj."""
        return 5 * hidden * self.inner

    def params(self, hidden: int) -> int:
        """Every parameter of the mixer (:mod:`.minimax`'s docstring lists them)."""
        return self.matmul_params(hidden) + self.inner


@dataclass(frozen=True)
class RgLruShape:
    """One RecurrentGemma recurrent block: an RG-LRU ``width`` channels wide whose gates are ``heads`` block-diagonal
    matrices, after a depthwise causal conv of ``conv`` taps."""

    width: int
    heads: int
    conv: int = 4

    def __post_init__(self) -> None:
        positive_sizes(self, ("width", "heads", "conv"), "RG-LRU blocks",
                       "lru_width, num_attention_heads, conv1d_width")
        if self.width % self.heads:
            raise ValueError(f"the RG-LRU's {self.heads} gate blocks (num_attention_heads) do not divide its width "
                             f"{self.width} (lru_width); fix the config.json.")

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: linear_x, linear_y, linear_out and the two gates' blocks."""
        return 3 * hidden * self.width + 2 * self.width * self.width // self.heads

    def params(self, hidden: int) -> int:
        """Every parameter of the block (:mod:`.recurrent_gemma`'s docstring lists them)."""
        return self.matmul_params(hidden) + self.width * (self.conv + 6) + hidden


@dataclass(frozen=True)
class Mamba1Shape:
    """One Mamba (v1) mixer: ``inner`` channels, a ``state``-wide state per channel, a depthwise causal conv of
    ``conv`` taps, dt through a rank-``dt_rank`` bottleneck; ``norms``: RMSNorms on dt, B and C (Jamba's, and
    FalconMamba's without weights: ``norm_weights`` False); pure Mamba has none. ``heads``: Zamba's heads, each with
    its own x_proj and dt_proj over its share of the channels (the same parameters, ``heads`` times the dt, B and C
    a token)."""

    inner: int
    state: int
    dt_rank: int
    conv: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    norms: bool = True
    norm_weights: bool = True
    heads: int = 1

    def __post_init__(self) -> None:
        positive_sizes(self, ("inner", "state", "dt_rank", "conv", "heads"), "Mamba layers",
                       "mamba_expand x hidden_size, mamba_d_state, mamba_dt_rank, mamba_d_conv, n_mamba_heads")
        if self.inner % self.heads:
            raise ValueError(f"the Mamba layers' {self.heads} heads (n_mamba_heads) do not divide their {self.inner} "
                             "channels (mamba_expand x hidden_size); fix the config.json.")

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: in_proj, x_proj, dt_proj and out_proj."""
        i = self.inner
        return 2 * hidden * i + i * (self.dt_rank + 2 * self.state) + self.dt_rank * i + i * hidden

    def params(self, hidden: int) -> int:
        """Every parameter of the mixer (:mod:`.jamba`'s docstring lists them)."""
        i = self.inner
        biases = (2 * i + hidden if self.proj_bias else 0) + (i if self.conv_bias else 0) + i  # dt_proj's bias
        norms = self.dt_rank + 2 * self.state if self.norms and self.norm_weights else 0
        return self.matmul_params(hidden) + biases + i * self.conv + i * self.state + i + norms


@dataclass(frozen=True)
class CcaShape:
    """ZAYA's Compressed Convolutional Attention projection (:mod:`.zaya`): q (``heads`` x ``head_dim``) and k
    (``kv_heads`` x ``head_dim``) mixed over time by a depthwise conv of ``time0`` taps then a conv of ``time1`` taps
    grouped by head, the value's second half projected from the token before."""

    heads: int
    kv_heads: int
    head_dim: int
    time0: int = 2
    time1: int = 2

    def __post_init__(self) -> None:
        positive_sizes(self, ("heads", "kv_heads", "head_dim", "time0", "time1"), "CCA projections",
                       "num_attention_heads, num_key_value_heads, head_dim, cca_time0, cca_time1")

    @property
    def channels(self) -> int:
        """q | k: the convs' channels, which their halo carries."""
        return (self.heads + self.kv_heads) * self.head_dim

    @property
    def halo_kernel(self) -> int:
        """The width of one conv reading the two convs' earlier rows (``time0 + time1 - 2``, plus the token itself)."""
        return self.time0 + self.time1 - 1

    @property
    def delayed(self) -> int:
        """Channels of the delayed value projection (half the kv heads' values), whose one earlier row a token reads."""
        return self.kv_heads * self.head_dim // 2

    def conv_params(self) -> int:
        """The two convs' weights and biases (the grouped one's groups each a head's ``head_dim`` channels)."""
        c = self.channels
        return c * self.time0 + c + c * self.head_dim * self.time1 + c


@dataclass(frozen=True)
class RwkvShape:
    """One RWKV-4 time mix: key, value and receptance of ``attention`` channels, its recurrence's state three values a
    channel (``[a | b | p]``)."""

    attention: int

    def __post_init__(self) -> None:
        if not isinstance(self.attention, int) or isinstance(self.attention, bool) or self.attention < 1:
            raise ValueError(f"the RWKV time mix's attention_hidden_size = {self.attention!r} must be a positive "
                             "integer; fix the config.json.")

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: key, value, receptance and output."""
        return 4 * hidden * self.attention

    def params(self, hidden: int) -> int:
        """Every parameter of the time mix (:mod:`.rwkv`'s docstring lists them)."""
        return self.matmul_params(hidden) + 2 * self.attention + 3 * hidden


@dataclass(frozen=True)
class XlstmShape:
    """One xLSTM mLSTM layer: ``heads`` heads over ``qk`` query/key and ``v`` value channels (each head's memory
    ``(qk / heads) x (v / heads)``), ``bias``: its projections and norm biased (``use_bias``); ``chunk``: the
    chunkwise kernel's tokens a chunk."""

    heads: int
    qk: int
    v: int
    bias: bool = False
    chunk: int = 64

    def __post_init__(self) -> None:
        positive_sizes(self, ("heads", "qk", "v", "chunk"), "xLSTM layers",
                       "num_heads, hidden_size x qk_dim_factor / v_dim_factor, chunk_size")
        if self.qk % self.heads or self.v % self.heads:
            raise ValueError(f"the xLSTM layers' {self.heads} heads do not divide their {self.qk} query/key and "
                             f"{self.v} value channels (qk_dim_factor, v_dim_factor); fix the config.json.")

    @property
    def state_values(self) -> int:
        """A run's ``[C | n | m | F]`` values, every head's: its memory, normaliser, stabiliser and log forget."""
        dk, dv = self.qk // self.heads, self.v // self.heads
        return self.heads * (dk * dv + dk + 2)

    def matmul_params(self, hidden: int) -> int:
        """Weights that multiply every token: q, k, v, the three gates and out_proj."""
        return hidden * (2 * self.qk + 2 * self.v + 2 * self.heads) + self.v * hidden

    def params(self, hidden: int) -> int:
        """Every parameter of the layer (:mod:`.xlstm`'s docstring lists them)."""
        biases = 2 * self.qk + 3 * self.v + hidden if self.bias else 0  # q, k, v, ogate, norm; out_proj's
        return self.matmul_params(hidden) + 2 * self.heads + self.v + biases
