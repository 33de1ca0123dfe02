"""The shapes the planner and the job read a model by: its decoder (:class:`ModelShape`), a vision tower
(:class:`VisionShape`) and multi-head latent attention (:class:`LatentShape`). The presets are in :mod:`.presets`,
the reader of a transformers ``config.json`` in :mod:`.config_json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from ..rules.model_sizes import check_model_sizes
from .deepseek_v4 import CompressedShape
from .doge import CrossDomainExperts
from .minimax_m3 import BlockSparseShape
from .qwen4_exp import QwenExpShape
from .inkling import InklingShape
from .hybrid_shape import HybridShape


@dataclass(frozen=True, kw_only=True)  # every size named where a shape is built (the presets read as data)
class VisionShape:
    """A vision tower: ``patch x patch`` pixel patches over ``temporal`` frames, ``depth`` blocks, ``merge x merge``
    patches fused into one language-model token. ``tower`` "qwen_vl": Qwen-VL's (any image size, a patch merger;
    what ``seqmesh train`` and ``seqmesh plan`` size). The fixed-size towers of ``image_size`` images, which
    ``seqmesh plan`` sizes: "clip" (LLaVA, merge 1, a class token), "siglip" (Gemma 3, merge = the average pool's
    k), "internvit" (InternVL, merge = the pixel shuffle's k, a class token); each ends in a projector whose rows
    are the decoder's (``out_hidden``)."""

    depth: int
    hidden: int
    heads: int
    intermediate: int
    out_hidden: int  # the decoder's hidden size: what each merged unit becomes
    patch: int = 14
    merge: int = 2
    temporal: int = 2
    window: int = 0  # Qwen2.5-VL: side of the attention windows in pixels (0: every block attends per frame)
    full_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks that attend per frame despite the windows
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: blocks whose merged features join the first decoder layers
    position_table: int = 0  # Qwen3-VL: entries of the learned position table (a square)
    in_channels: int = 3
    gated: bool = True  # Qwen2.5-VL's blocks: a gated MLP and RMSNorms; Qwen2-VL's and Qwen3-VL's: two linears, LayerNorms
    tower: str = "qwen_vl"  # "qwen_vl", or a fixed-size tower: "clip" (LLaVA), "siglip" (Gemma 3), "internvit" (InternVL)
    image_size: int = 0  # fixed-size towers: pixels per image (InternVL: tile) side; 0 for Qwen-VL
    read_blocks: int = 0  # fixed-size towers: blocks run up to the layer the model reads (0: all ``depth``)
    feature_layers: int = 1  # LLaVA: layers whose features are concatenated into the projector's input
    routes_class: bool = False  # LLaVA's "full" strategy: the class token's row is a placeholder token too
    head: bool = False  # SigLIP's attention-pooling head: built, never run (Gemma 3 pools the patches itself)
    qkv_bias: bool = True  # InternViT: attention_bias
    qk_norm: bool = False  # InternViT: use_qk_norm (an RMSNorm over q and over k)
    final_norm: bool = True  # InternViT: its final LayerNorm (absent with use_mean_pooling)
    mask_token: bool = False  # InternViT: use_mask_token (a parameter, unused in training)

    def __post_init__(self) -> None:
        for name in ("depth", "hidden", "heads", "intermediate", "out_hidden", "patch", "merge", "temporal", "in_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the vision tower's {name} = {value!r} (its vision_config entry) must be a positive "
                                 "integer; fix the config.json.")
        if self.hidden % self.heads:
            raise ValueError(f"the vision tower's {self.heads} heads do not divide its width {self.hidden} (vision_config); "
                             "each head takes an equal part of it: fix the config.json.")

    @property
    def fixed_size(self) -> bool:
        """Every image is ``image_size`` pixels square (LLaVA, Gemma 3, InternVL)."""
        return self.tower != "qwen_vl"

    @property
    def class_token(self) -> bool:
        """Each image starts with a class token (LLaVA's CLIP, InternViT)."""
        return self.tower in ("clip", "internvit")

    @property
    def run_blocks(self) -> int:
        """Blocks a step runs (LLaVA reads the features of an earlier layer than the last, by default -2)."""
        return self.read_blocks or self.depth

    @property
    def projector_macs(self) -> int:
        """Multiply-accumulates per placeholder token's row from the tower's last block to the decoder: Qwen-VL's
        mergers (and DeepStack's), or a fixed-size tower's projector."""
        unit, out = self.hidden * self.merge * self.merge, self.out_hidden
        if self.tower == "siglip":
            return self.hidden * out
        if self.tower == "clip":
            return self.hidden * self.feature_layers * out + out * out
        if self.tower == "internvit":
            return unit * out + out * out
        return (1 + len(self.deepstack)) * (unit * unit + unit * out)

    @property
    def patch_features(self) -> int:
        """Values per patch (one row of ``pixel_values``)."""
        return self.in_channels * self.temporal * self.patch * self.patch

    @property
    def block_params(self) -> int:
        """Parameters of one block (one FSDP unit): qkv and proj with biases, the MLP with biases, two norms."""
        h, i = self.hidden, self.intermediate
        attention = 4 * h * h + 4 * h
        if self.tower == "internvit":  # q, k, v biased only with attention_bias; layer scale; RMSNorms are one vector
            attention += (0 if self.qkv_bias else -3 * h) + (2 * h if self.qk_norm else 0)
            return attention + 2 * h * i + i + h + 2 * h + 4 * h
        if self.gated:
            return attention + 3 * h * i + 2 * i + h + 2 * h
        return attention + 2 * h * i + i + h + 4 * h

    @property
    def params(self) -> int:
        """Parameters. Qwen2.5-VL: a bias-free patch embedding; blocks of qkv and proj with biases, a gated MLP
        with biases, two RMSNorms; a merger (RMSNorm, two linears). Qwen2-VL: the same with a two-linear MLP,
        LayerNorms in the blocks and the merger. Qwen3-VL (``position_table``): as Qwen2-VL, with a bias in the
        patch embedding, the learned positions, and each DeepStack merger (LayerNorm over the merged unit)."""
        h, unit = self.hidden, self.hidden * self.merge * self.merge
        if self.fixed_size:
            return self._fixed_size_params
        linears = unit * unit + unit + unit * self.out_hidden + self.out_hidden
        if self.gated:
            return self.patch_features * h + self.depth * self.block_params + h + linears
        learned = h + self.position_table * h + len(self.deepstack) * (2 * unit + linears) if self.position_table else 0
        return self.patch_features * h + self.depth * self.block_params + 2 * h + linears + learned

    @property
    def _fixed_size_params(self) -> int:
        """A fixed-size tower's parameters: the patch embedding (biased but in CLIP), class token and learned
        positions, every block (run or not), the final norm, and the projector; SigLIP's unused head counted."""
        h, i, out, unit = self.hidden, self.intermediate, self.out_hidden, self.hidden * self.merge * self.merge
        places = (self.image_size // self.patch) ** 2 + self.class_token
        embed = self.patch_features * h + (self.tower != "clip") * h + places * h + self.class_token * h
        blocks = self.depth * self.block_params + (2 * h if self.final_norm else 0)
        if self.tower == "clip":  # pre_layrnorm; linear_1, linear_2 with biases
            return embed + 2 * h + blocks + h * self.feature_layers * out + out + out * out + out
        if self.tower == "siglip":  # the head: probe, attention (in and out projections), LayerNorm, MLP
            head = h + 4 * h * h + 4 * h + 2 * h + 2 * h * i + i + h if self.head else 0
            return embed + blocks + head + h * out + h  # mm_input_projection_weight, mm_soft_emb_norm
        # InternViT: the mask token; the projector's LayerNorm over k*k patches, linear_1, linear_2 with biases
        return embed + self.mask_token * h + blocks + 2 * unit + unit * out + out + out * out + out

    def config(self, family: str) -> dict:
        """transformers' ``vision_config`` entries for a Qwen-VL tower of ``family`` (the model type)."""
        if self.fixed_size:
            raise ValueError(f"seqmesh builds Qwen-VL towers only; a {self.tower} tower is read from its config.json "
                             "for seqmesh plan. Train it with seqmesh.compose.parallelize_model in your own loop.")
        common = dict(depth=self.depth, num_heads=self.heads, patch_size=self.patch, spatial_merge_size=self.merge,
                      temporal_patch_size=self.temporal, in_channels=self.in_channels)
        if family == "qwen2_vl":  # the tower's width is embed_dim, hidden_size the merger's output, the MLP a ratio
            if self.intermediate % self.hidden:
                raise ValueError(f"a Qwen2-VL tower's MLP is a whole multiple (mlp_ratio) of its width {self.hidden}; "
                                 f"intermediate {self.intermediate} is not. Use a multiple of {self.hidden}.")
            return dict(common, embed_dim=self.hidden, hidden_size=self.out_hidden,
                        mlp_ratio=self.intermediate // self.hidden)
        out = dict(common, hidden_size=self.hidden, intermediate_size=self.intermediate, out_hidden_size=self.out_hidden)
        if self.window:
            out.update(window_size=self.window, fullatt_block_indexes=list(self.full_blocks))
        if self.position_table:
            out.update(num_position_embeddings=self.position_table, deepstack_visual_indexes=list(self.deepstack))
        return out


@dataclass(frozen=True)
class LatentShape:
    """Multi-head latent attention (MLA: DeepSeek-V3, DeepSeek-V3.2, GLM-5): each token's keys and values come from
    one ``kv_lora_rank`` latent and one shared ``qk_rope_head_dim`` rotary key; with DeepSeek Sparse Attention
    (``index_topk`` > 0) ``indexed_layers`` of the layers are ``indexed_attention`` (``seqmesh.hf.indexed_attention``),
    each query attending to the top ``index_topk`` keys its lightning indexer (``index_n_heads`` heads of
    ``index_head_dim``) picks; ``shared_layers`` of them (GLM-5's indexer_types "shared") reuse the previous
    layer's selection and have no indexer."""

    q_lora_rank: int  # 0: queries projected from the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int = 0  # keys each query of an indexed layer attends to (0: no indexed layers)
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexed_layers: int = 0
    shared_layers: int = 0
    shared_runs: int = 0  # runs of consecutive shared layers: each run's layers take one selection as their input
    # the output gate: "fused" (A.X-K2: q_gate_proj, from [q_a_layernorm(x), q_a(x)], gives the query and one gate a
    # value channel), "head" (dots.llm3: g_proj, one a head, and a norm on the rotary key), "value" (HY-V4: gate_proj
    # from the hidden state, one a value channel, beside a sink a head), "" none
    gate: str = ""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_params(self, hidden: int, heads: int, indexer: bool = False) -> int:
        """One layer's MLA (q_a, its norm, q_b or q; kv_a, its norm, kv_b; o) and, with ``indexer``, its lightning
        indexer (wq_b, wk, the key's LayerNorm, weights_proj)."""
        r, q, ql = self.kv_lora_rank, heads * self.qk_head_dim, self.q_lora_rank
        if self.gate == "fused":  # the query and its gate from one product of both query latents
            query = hidden * ql + ql + 2 * ql * (q + heads * self.v_head_dim)
        else:
            query = hidden * ql + ql + ql * q if ql else hidden * q
        kv = hidden * (r + self.qk_rope_head_dim) + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        own = query + kv + heads * self.v_head_dim * hidden
        if self.gate == "head":
            own += hidden * heads + self.qk_rope_head_dim
        if self.gate == "value":  # HY-V4: gate_proj, one gate a value channel, and a sink a head
            own += hidden * heads * self.v_head_dim + heads
        if not indexer:
            return own
        di, hi = self.index_head_dim, self.index_n_heads
        return own + (self.q_lora_rank or hidden) * hi * di + hidden * di + 2 * di + hidden * hi


# families whose attention layers norm q and k per head (RMSNorms of head_dim): their parameters, and what they keep
QK_NORMED = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_vl", "qwen3_vl_moe_text", "gemma3_text", "doge",
             "minimax_m3_vl_text", "qwen4_exp", "qwen4_exp_text")


@dataclass(frozen=True, kw_only=True)  # every size named where a shape is built (the presets read as data)
class ModelShape:
    """What the planner and the trainer need to know of a decoder-only transformer."""

    name: str
    family: str  # transformers model type: "llama", "qwen3", "qwen2", "mistral"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    # Gated DeltaNet layers of hybrid models (Qwen3.5): every ``full_attention_interval``-th layer is full
    # attention, the others linear attention with these heads; 0 when every layer is full attention
    full_attention_interval: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 4  # the short causal conv's kernel
    sliding_window: int | None = None  # causal window of the sliding layers (transformers' sliding_window)
    full_every: int = 0  # with a window: every full_every-th layer is full attention, the others slide (0: all slide)
    experts: int = 0  # MoE experts per layer (0: a dense gated MLP)
    experts_per_token: int = 0
    extra: tuple[tuple[str, object], ...] = ()  # further config entries of the family (name, value)
    vision: VisionShape | None = None  # a vision-language model's tower (family "qwen2_5_vl", "qwen3_vl")
    latent: LatentShape | None = None  # MLA's sizes (head_dim is then its query/key head dim); None: q, k, v heads
    shared_experts: int = 0  # MoE: experts every token goes through, each of ``intermediate``
    shared_intermediate: int = 0  # their width where not ``intermediate`` (Qwen2-MoE's, Qwen3-Next's); 0: the same
    shared_gate: bool = False  # the shared expert's output gated by a (hidden -> 1) projection (Qwen's)
    dense_layers: int = 0  # MoE: the layers whose MLP is one dense gated MLP of ``dense_intermediate``
    dense_intermediate: int = 0
    dense_first: bool = True  # the first layer is one of the dense ones (where there are any)
    hybrid: HybridShape | None = None  # a hybrid's layers (Nemotron-H, Granite-4 hybrid, Bamba, LFM2; .hybrid)
    unplanned: str = ""  # why seqmesh plan cannot size this model (Falcon-H1, other Mamba mixers); "" when it can
    gated_mlp: bool = True  # a dense MLP of gate, up and down; False: up and down (BLOOM, MPT, Falcon, GPT-Neo)
    norm_gate_rank: int = 0  # A.X-K2: a sigmoid gate of this rank (hidden -> rank -> hidden) after each layer's input
    # norm and each MoE layer's post-attention norm (0: none)
    hc_mult: int = 0  # HY-V4's and DeepSeek-V4's hyper-connections: residual streams a token, mixed around each block
    # (0: none)
    compressed: CompressedShape | None = None  # DeepSeek-V4's attention (:mod:`.deepseek_v4`); None: another family's
    cross_domain: CrossDomainExperts | None = None  # Doge's experts beside its dense MLP (:mod:`.doge`; is_moe)
    block_sparse: BlockSparseShape | None = None  # MiniMax-M3's block-sparse layers (:mod:`.minimax_m3`)
    qwen_exp: QwenExpShape | None = None  # Qwen4-Exp's QSA layers and gated residuals (:mod:`.qwen4_exp`)
    inkling: InklingShape | None = None  # Inkling's relative-bias layers and short convolutions (:mod:`.inkling`)
    # dots.llm3's sliding layers' own MLA (per_layer_config): their latent sizes and heads (kv heads the same), and
    # the file's layer_types, which follow no period; None, 0, (): every attention layer of latent's sizes
    sliding_latent: LatentShape | None = None
    sliding_heads: int = 0
    given_layer_types: tuple[str, ...] = ()
    # a table of positions (GPT-2's, GPT-BigCode's, the original GPT's and OPT's learned; CTRL's of sinusoids): its
    # rows, the longest sequence the model can number (seqmesh.rules.positions); 0: none
    position_rows: int = 0
    embed_width: int = 0  # OPT's word_embed_proj_dim: its embeddings this wide, projected in and out (0: the width)
    # weights a layer holds that a text step never multiplies (TrOCR's cross-attention to its image encoder, with its
    # norm): gathered, reduced and stepped with the layer's unit, no compute and no activations
    idle_params: int = 0

    def __post_init__(self) -> None:
        check_model_sizes(self.config_sizes(), self.name)  # the rules a config.json's sizes obey (seqmesh.rules.model_sizes)
        if self.full_attention_interval and (not self.linear_key_heads or self.linear_value_heads % self.linear_key_heads):
            raise ValueError(f"{self.name}: {self.linear_value_heads} linear value heads must be a positive multiple of "
                             f"{self.linear_key_heads} linear key heads.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.name}: sliding_window must be a positive number of tokens, got {self.sliding_window}.")

    def config_sizes(self) -> dict[str, object]:
        """The sizes as a config.json names them (what :func:`seqmesh.rules.model_sizes.check_model_sizes` reads)."""
        sizes = {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                 "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab,
                 "intermediate_size": self.intermediate}
        if self.experts:
            sizes.update(num_experts=self.experts, num_experts_per_tok=self.experts_per_token)
        return sizes

    @property
    def layer_types(self) -> tuple[str, ...]:
        """transformers' per-layer kinds: a hybrid's Gated DeltaNet layers with every
        ``full_attention_interval``-th full; with a window every ``full_every``-th full, the rest sliding."""
        if self.compressed is not None:
            return self.compressed.kinds
        if self.given_layer_types:
            return self.given_layer_types
        n = self.full_attention_interval
        if n:
            return tuple("linear_attention" if (i + 1) % n else "full_attention" for i in range(self.layers))
        if self.sliding_window is None:
            return ("full_attention",) * self.layers
        return tuple("full_attention" if self.full_every and (i + 1) % self.full_every == 0 else "sliding_attention"
                     for i in range(self.layers))

    @property
    def linear_layers(self) -> int:
        """Gated DeltaNet layers (the rest are attention)."""
        return self.layer_types.count("linear_attention")

    @property
    def non_attention_layers(self) -> int:
        """Layers without attention: Gated DeltaNet, a hybrid's Mamba2 layers and Nemotron-H's MLP and MoE blocks."""
        if self.hybrid is not None:
            return self.layers - self.hybrid.attention_layers
        return self.linear_layers

    @property
    def sliding_layers(self) -> int:
        return self.layer_types.count("sliding_attention")

    @property
    def seqmesh_attention_layers(self) -> int:
        """Layers whose attention is seqmesh attention (full or sliding): not a recurrent mixer, nor DeepSeek Sparse
        Attention's, DeepSeek-V4's compressed or MiniMax-M3's block-sparse layers, which run their own."""
        return (self.layers - self.non_attention_layers - self.indexed_layers - self.compressed_layers
                - self.block_sparse_layers)

    @property
    def block_sparse_layers(self) -> int:
        """MiniMax-M3's block-sparse layers (the rest of its layers are full attention)."""
        return self.block_sparse.layers if self.block_sparse is not None else 0

    @property
    def compressed_layers(self) -> int:
        """DeepSeek-V4's compressed layers (HCA and CSA), which seqmesh attention does not run; its sliding ones it
        does."""
        return self.layers - self.sliding_layers if self.compressed is not None else 0

    @property
    def linear_layer_params(self) -> int:
        """One Gated DeltaNet layer's token mixer: projections q|k|v, z, b, a, out; conv; A_log, dt_bias; gated norm."""
        kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        conv_dim = 2 * kd + vd
        return (self.hidden * (conv_dim + vd + 2 * self.linear_value_heads) + vd * self.hidden + conv_dim * self.linear_conv
                + 2 * self.linear_value_heads + self.linear_value_dim)

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: a gated MLP (and Doge's cross-domain experts beside it), or ``experts`` of them, the shared
        experts and a router (the MoE layer's, where the first ``dense_layers`` have a dense MLP: the larger FSDP
        unit); a hybrid's largest feed-forward."""
        if self.hybrid is not None:
            return max(ffn.params for _, ffn in self.hybrid.ffns) if self.hybrid.ffns else 0
        if self.experts:
            experts = self.experts * 3 * self.hidden * self.intermediate
            return experts + self.shared_expert_params + self.experts * self.hidden  # + the router
        dense = self.mlp_matrices * self.hidden * self.intermediate
        return dense + (self.cross_domain.params(self.hidden) if self.cross_domain is not None else 0)

    @property
    def shared_expert_params(self) -> int:
        """An MoE layer's shared experts (gated MLPs of ``shared_intermediate``, or of an expert's width) and their
        gate."""
        width = self.shared_intermediate or self.intermediate
        return self.shared_experts * 3 * self.hidden * width + (self.hidden if self.shared_gate else 0)

    @property
    def mlp_matrices(self) -> int:
        """The matrices of a dense MLP (and of each expert): gate, up and down, or up and down."""
        return 3 if self.gated_mlp or self.experts else 2

    @property
    def norm_params(self) -> int:
        """One layer's RMSNorms: two (Gemma 3: four) of the hidden size, plus q/k norms (:attr:`qk_norms`) and the
        two gates of an A.X-K2 MoE layer's norms; Doge's two, its two residual scalings and q/k norms."""
        qk = 2 * self.head_dim if self.qk_norms else 0
        if self.family in ("gemma3_text", "doge"):  # Gemma 3's four norms; Doge's two and its two residual scalings
            return 4 * self.hidden + qk
        if self.hybrid is not None:
            return self.hybrid.norms * self.hidden
        if self.compressed is not None:  # and its two hyper-connections, whole on every rank as the norms
            return 2 * self.hidden + self.compressed.layer_hc_params(self.hidden)
        if self.qwen_exp is not None:  # no RMSNorm of its own: two gated residuals
            return self.mixer_norm_params + qk
        gates = 2 * 2 * self.hidden * self.norm_gate_rank  # an MoE layer's two gated norms (A.X-K2)
        return 2 * self.hidden + gates + qk

    @property
    def streams(self) -> int:
        """Residual streams a token carries between layers: HY-V4's and DeepSeek-V4's ``hc_mult``, Qwen4-Exp's
        ``hc_count``, else one."""
        return self.qwen_exp.streams if self.qwen_exp is not None else max(1, self.hc_mult)

    @property
    def mixer_norm_params(self) -> int:
        """The norms of a layer without attention (a Gated DeltaNet layer's): two RMSNorms, or Qwen4-Exp's two gated
        residuals."""
        if self.qwen_exp is not None:
            return 2 * self.qwen_exp.residual_params(self.hidden)
        return 2 * self.hidden

    @property
    def residual_macs(self) -> int:
        """Qwen4-Exp: the weights of a layer's two gated residuals that multiply every token (0 for another
        model)."""
        q = self.qwen_exp
        return 2 * (q.residual_params(self.hidden) - q.streams * self.hidden) if q is not None else 0

    @property
    def qk_norms(self) -> bool:
        """Whether each attention layer norms its queries and keys per head (an RMSNorm of ``head_dim``)."""
        return self.family in QK_NORMED

    @property
    def value_dim(self) -> int:
        """v's head dim (MLA's differs from q's and k's, ``head_dim``)."""
        return self.latent.v_head_dim if self.latent is not None else self.head_dim

    @property
    def indexed_layers(self) -> int:
        """DeepSeek Sparse Attention layers (``indexed_attention``; the rest of the attention layers are full)."""
        return self.latent.indexed_layers if self.latent is not None else 0

    @property
    def attention_params(self) -> int:
        """One attention layer's projections (the largest kind: with MLA and an indexer, an indexed layer's;
        MiniMax-M3's block-sparse layer's, with its indexer)."""
        if self.latent is not None:
            own = self.latent.attention_params(self.hidden, self.heads, indexer=self.indexed_layers > 0)
            return max(own, self.sliding_attention_params)
        if self.compressed is not None:
            return max(self.kind_attention_params(kind) for kind in set(self.layer_types))
        if self.hybrid is not None and self.hybrid.shared is not None:  # Zamba's: q, k and v over 2 x hidden
            return self.hybrid.shared.attention
        bias = self.head_dim * (self.heads + 2 * self.kv_heads) + self.hidden if self.hybrid and self.hybrid.attention_bias else 0
        indexer = self.block_sparse.indexer_params(self.hidden) if self.block_sparse is not None else 0
        if self.qwen_exp is not None:  # its gated q_proj (twice as wide) and its indexer
            return self.hidden * self.head_dim * (3 * self.heads + 2 * self.kv_heads) + self.qwen_exp.indexer_params(
                self.hidden)
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + bias + self.mask_params + indexer

    def kind_attention_params(self, kind: str) -> int:
        """One DeepSeek-V4 layer's attention of ``kind`` (``"sliding_attention"``, ``"compressed_sparse_attention"``,
        ``"heavily_compressed_attention"``)."""
        return self.compressed.attention_params(self.hidden, self.heads, self.head_dim, kind)

    @property
    def fewest_heads(self) -> int:
        """The fewest query heads of a layer kind (dots.llm3's sliding layers may have fewer than its file's): what
        bounds the Ulysses degree (``seqmesh.hf.parallelize`` checks each kind's heads)."""
        return min(self.heads, self.sliding_heads or self.heads)

    @property
    def sliding_attention_params(self) -> int:
        """One dots.llm3 sliding layer's MLA at its own sizes (0 for another model)."""
        return self.sliding_latent.attention_params(self.hidden, self.sliding_heads) if self.sliding_latent else 0

    def sliding_shape(self) -> ModelShape:
        """dots.llm3's sliding layers as a model of their own: every layer one of them (the planner's attention kind
        of those layers reads its heads, latent and window from it)."""
        return dataclasses.replace(self, heads=self.sliding_heads, kv_heads=self.sliding_heads,
                                   head_dim=self.sliding_latent.qk_head_dim, latent=self.sliding_latent,
                                   sliding_latent=None, sliding_heads=0,
                                   given_layer_types=("sliding_attention",) * self.layers)

    @property
    def mask_params(self) -> int:
        """Doge's dynamic mask: dt_proj (each kv head's bias from the values, kv x kv head_dim) and A (one a kv head)."""
        return self.kv_heads * (self.kv_heads * self.head_dim + 1) if self.family == "doge" else 0

    @property
    def params(self) -> int:
        """Parameter count (embeddings, attention, gated MLP or experts, RMSNorms, Gated DeltaNet mixers, LM head
        unless tied; gpt-oss's biases and sinks, under 0.01%, are left out). As transformers builds the model:
        DeepSeek-V3.2's multi-token-prediction layer is not built, nor counted. A Mamba2 hybrid: its layers
        (:meth:`.hybrid.HybridShape.params`)."""
        if self.hybrid is not None:
            embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
            return embed + self.hidden + self.hybrid.params(self.hidden, self.attention_params) + self.hybrid.extra_params
        tower = self.vision.params if self.vision is not None else 0
        if self.inkling is not None:  # each layer by its kind and its MLP's; the embedding's norm and the final one
            # (Inkling 2's: and its depth attention's query before it; its head of its own rows)
            embed = self.vocab * self.hidden + (0 if self.tie_embeddings else self.head_vocab * self.hidden)
            ink = self.inkling
            layers = sum(self.inkling_layer_params(kind, dense=i < self.dense_layers if self.dense_first else
                                                   i >= self.layers - self.dense_layers, first=i == 0,
                                                   looped=ink.looped(i))
                         for i, kind in enumerate(ink.kinds))
            messages = 4 * self.hidden * (ink.loop_end - ink.loop_start) if ink.gate_rank else 0  # Inkling2-Loop's
            return tower + embed + (3 if ink.second else 2) * self.hidden + layers + messages
        if self.qwen_exp is not None:  # its QSA and Gated DeltaNet layers, the gated residual before the head
            embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
            full = self.layers - self.linear_layers
            q = self.qwen_exp
            return (tower + embed + q.residual_params(self.hidden, inject=False) + q.ple_params(self.hidden)
                    + full * (self.attention_params + 2 * self.head_dim) + self.linear_layers * self.linear_layer_params
                    + self.layers * (self.mlp_params + self.mixer_norm_params))
        if self.compressed is not None:  # each layer's attention by its kind; the head's hyper-connection
            embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
            attention = sum(self.kind_attention_params(kind) for kind in self.layer_types)
            return (embed + self.hidden + self.compressed.hc_params(self.hidden, 1) + attention
                    + self.layers * (self.mlp_params + self.norm_params))
        gated = self.family == "qwen3_5_text"  # Qwen3.5's full attention gates its output: q_proj is twice as wide
        attn = self.hidden * self.head_dim * ((3 if gated else 2) * self.heads + 2 * self.kv_heads) + self.mask_params
        if self.family == "qwen2_5_vl":  # Qwen2's decoder: q, k and v projections with biases
            attn += self.head_dim * (self.heads + 2 * self.kv_heads)
        embed = self.vocab * (self.embed_width or self.hidden) * (1 if self.tie_embeddings else 2)
        embed += 2 * self.hidden * self.embed_width if self.embed_width else 0  # OPT's project_in and _out
        full = self.layers - self.linear_layers
        attention = full * attn
        if self.latent is not None:  # MLA; an indexer in each indexed layer but GLM-5's shared ones
            own = self.latent.indexed_layers - self.latent.shared_layers
            attention = (own * self.latent.attention_params(self.hidden, self.heads, indexer=True)
                         + (full - own) * self.latent.attention_params(self.hidden, self.heads))
            if self.sliding_latent is not None:  # dots.llm3's sliding layers at their own sizes
                attention += self.sliding_layers * (self.sliding_attention_params
                                                    - self.latent.attention_params(self.hidden, self.heads))
        if self.block_sparse is not None:  # an indexer in each block-sparse layer
            attention += self.block_sparse.layers * self.block_sparse.indexer_params(self.hidden)
        dense = self.dense_layers * (self.mlp_params - 3 * self.hidden * self.dense_intermediate
                                     + 2 * self.hidden * self.norm_gate_rank)  # and a dense layer's ungated norm
        per_layer = self.mlp_params + self.norm_params + 2 * self.hc_params(2) + self.idle_params  # a layer's two
        # hyper-connections (HY-V4's), its weights no text step multiplies (TrOCR's)
        return (attention + self.linear_layers * self.linear_layer_params + self.layers * per_layer
                - self.linear_layers * (2 * self.head_dim if gated else 0) - dense + embed + self.hidden + tower
                + self.hc_params(1) + self.position_params)  # and the head's; a learned table of positions

    @property
    def position_params(self) -> int:
        """A learned table of positions (:attr:`position_rows`; OPT's and TrOCR's two rows more, their offset);
        CTRL's sinusoids are no parameters."""
        if not self.position_rows or self.family == "ctrl":
            return 0
        return (self.position_rows + (2 if self.family in ("opt", "trocr") else 0)) * self.hidden

    def inkling_layer_params(self, kind: str, dense: bool = False, first: bool = False, looped: bool = False) -> int:
        """One Inkling layer of ``kind``: its attention, norms and convs, and its MLP (a dense one, or its experts
        with the router's shared rows), each with its scale; Inkling 2's (the ``first`` layer's depth attention
        has fewer queries; an Inkling2-Loop ``looped`` layer's message gates): its experts and router, no scale."""
        if self.inkling.second:
            mlp = self.mlp_params
        else:
            mlp = (3 * self.hidden * self.dense_intermediate if dense else
                   self.mlp_params + self.shared_experts * self.hidden) + 1
        return self.inkling.layer_params(kind, self.hidden, self.heads, self.kv_heads, self.head_dim, mlp, first,
                                         looped)

    @property
    def head_vocab(self) -> int:
        """The rows of the LM head (the logits a token gets): the vocabulary, or Inkling 2's unpadded one."""
        return self.inkling.head_vocab if self.inkling is not None and self.inkling.head_vocab else self.vocab

    def hc_params(self, mixes: int) -> int:
        """One hyper-connection's weights: ``mixes`` weights a stream from every stream's values, their biases and
        scales (a block's: pre and post, two; the head's: one)."""
        n = self.hc_mult
        return mixes * n * n * self.hidden + mixes * n + mixes if n else 0

    def as_dict(self) -> dict:
        """The decoder's shape as plain data (the family's ``extra`` config entries left out: they size
        nothing; a vision tower is reported apart, by the planner's vision section)."""
        shape = asdict(self)
        del shape["extra"], shape["vision"], shape["unplanned"]
        shape["hybrid"] = self.hybrid.as_dict() if self.hybrid is not None else None
        return shape
