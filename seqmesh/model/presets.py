"""Model shapes: tiny ones for CPU tests and demos, and the real shapes of public models.

Shapes come from the models' published configurations; weights are never downloaded (training
presets start from random initialisation). ``model_shape`` also reads a transformers
``config.json`` (a file or a directory holding one).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from ..model_sizes import check_model_sizes
from .hybrid import hybrid_fields
from .hybrid_shape import HybridShape


@dataclass(frozen=True)
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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_params(self, hidden: int, heads: int, indexer: bool = False) -> int:
        """One layer's MLA (q_a, its norm, q_b or q; kv_a, its norm, kv_b; o) and, with ``indexer``, its lightning
        indexer (wq_b, wk, the key's LayerNorm, weights_proj)."""
        r, q = self.kv_lora_rank, heads * self.qk_head_dim
        query = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q if self.q_lora_rank else hidden * q
        kv = hidden * (r + self.qk_rope_head_dim) + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        own = query + kv + heads * self.v_head_dim * hidden
        if not indexer:
            return own
        di, hi = self.index_head_dim, self.index_n_heads
        return own + (self.q_lora_rank or hidden) * hi * di + hidden * di + 2 * di + hidden * hi


@dataclass(frozen=True)
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
    dense_layers: int = 0  # MoE: the first layers, whose MLP is one dense gated MLP of ``dense_intermediate``
    dense_intermediate: int = 0
    hybrid: HybridShape | None = None  # a hybrid's layers (Nemotron-H, Granite-4 hybrid, Bamba, LFM2; .hybrid)
    unplanned: str = ""  # why seqmesh plan cannot size this model (Falcon-H1, other Mamba mixers); "" when it can

    def __post_init__(self) -> None:
        check_model_sizes(self.config_sizes(), self.name)  # the rules a config.json's sizes obey (seqmesh.model_sizes)
        if self.full_attention_interval and (not self.linear_key_heads or self.linear_value_heads % self.linear_key_heads):
            raise ValueError(f"{self.name}: {self.linear_value_heads} linear value heads must be a positive multiple of "
                             f"{self.linear_key_heads} linear key heads.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.name}: sliding_window must be a positive number of tokens, got {self.sliding_window}.")

    def config_sizes(self) -> dict[str, object]:
        """The sizes as a config.json names them (what :func:`seqmesh.model_sizes.check_model_sizes` reads)."""
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
    def linear_layer_params(self) -> int:
        """One Gated DeltaNet layer's token mixer: projections q|k|v, z, b, a, out; conv; A_log, dt_bias; gated norm."""
        kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        conv_dim = 2 * kd + vd
        return (self.hidden * (conv_dim + vd + 2 * self.linear_value_heads) + vd * self.hidden + conv_dim * self.linear_conv
                + 2 * self.linear_value_heads + self.linear_value_dim)

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: a gated MLP, or ``experts`` of them, the shared experts and a router (the MoE layer's,
        where the first ``dense_layers`` have a dense MLP: the larger FSDP unit); a hybrid's largest feed-forward."""
        if self.hybrid is not None:
            return max(ffn.params for _, ffn in self.hybrid.ffns) if self.hybrid.ffns else 0
        if self.experts:
            experts = (self.experts + self.shared_experts) * 3 * self.hidden * self.intermediate
            return experts + self.experts * self.hidden  # + the router
        return 3 * self.hidden * self.intermediate

    @property
    def norm_params(self) -> int:
        """One layer's RMSNorms: two (Gemma 3: four) of the hidden size, plus q/k norms (Qwen3, Qwen3.5, Gemma 3)."""
        if self.family == "gemma3_text":
            return 4 * self.hidden + 2 * self.head_dim
        if self.hybrid is not None:
            return self.hybrid.norms * self.hidden
        return 2 * self.hidden + (2 * self.head_dim if self.family in ("qwen3", "qwen3_5_text", "qwen3_vl") else 0)

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
        """One attention layer's projections (the largest kind: with MLA and an indexer, an indexed layer's)."""
        if self.latent is not None:
            return self.latent.attention_params(self.hidden, self.heads, indexer=self.indexed_layers > 0)
        bias = self.head_dim * (self.heads + 2 * self.kv_heads) + self.hidden if self.hybrid and self.hybrid.attention_bias else 0
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + bias

    @property
    def params(self) -> int:
        """Parameter count (embeddings, attention, gated MLP or experts, RMSNorms, Gated DeltaNet mixers, LM head
        unless tied; gpt-oss's biases and sinks, under 0.01%, are left out). As transformers builds the model:
        DeepSeek-V3.2's multi-token-prediction layer is not built, nor counted. A Mamba2 hybrid: its layers
        (:meth:`.hybrid.HybridShape.params`)."""
        if self.hybrid is not None:
            embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
            return embed + self.hidden + self.hybrid.params(self.hidden, self.attention_params)
        gated = self.family == "qwen3_5_text"  # Qwen3.5's full attention gates its output: q_proj is twice as wide
        attn = self.hidden * self.head_dim * ((3 if gated else 2) * self.heads + 2 * self.kv_heads)
        if self.family == "qwen2_5_vl":  # Qwen2's decoder: q, k and v projections with biases
            attn += self.head_dim * (self.heads + 2 * self.kv_heads)
        embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        full = self.layers - self.linear_layers
        attention = full * attn
        if self.latent is not None:  # MLA; an indexer in each indexed layer but GLM-5's shared ones
            own = self.latent.indexed_layers - self.latent.shared_layers
            attention = (own * self.latent.attention_params(self.hidden, self.heads, indexer=True)
                         + (full - own) * self.latent.attention_params(self.hidden, self.heads))
        tower = self.vision.params if self.vision is not None else 0
        dense = self.dense_layers * (self.mlp_params - 3 * self.hidden * self.dense_intermediate)
        per_layer = self.mlp_params + self.norm_params
        return (attention + self.linear_layers * self.linear_layer_params + self.layers * per_layer
                - self.linear_layers * (2 * self.head_dim if gated else 0) - dense + embed + self.hidden + tower)

    def as_dict(self) -> dict:
        """The decoder's shape as plain data (the family's ``extra`` config entries left out: they size
        nothing; a vision tower is reported apart, by the planner's vision section)."""
        shape = asdict(self)
        del shape["extra"], shape["vision"], shape["unplanned"]
        shape["hybrid"] = self.hybrid.as_dict() if self.hybrid is not None else None
        return shape


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-tiny", "llama", 64, 2, 4, 2, 16, 128, 256, rope_theta=10000.0),
        ModelShape("qwen3-tiny", "qwen3", 64, 2, 4, 2, 16, 128, 256, tie_embeddings=True, rope_theta=1e6),
        ModelShape("llama3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
        ModelShape("llama3-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
        ModelShape("llama3-70b", "llama", 8192, 80, 64, 8, 128, 28672, 128256, False, 500000.0),
        ModelShape("qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6),
        ModelShape("qwen3-4b", "qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1e6),
        ModelShape("qwen3-32b", "qwen3", 5120, 64, 64, 8, 128, 25600, 151936, False, 1e6),
        ModelShape("mistral-7b", "mistral", 4096, 32, 32, 8, 128, 14336, 32768, False, 1e6),
        # hybrid: Gated DeltaNet layers with full attention every 4th layer
        ModelShape("qwen3.5-tiny", "qwen3_5_text", 64, 4, 4, 2, 16, 128, 256, True, 1e6, full_attention_interval=4,
                   linear_key_heads=2, linear_value_heads=4, linear_key_dim=16, linear_value_dim=16),
        # transformers' Qwen3_5TextConfig defaults, its "Qwen3.5-9B style configuration"
        ModelShape("qwen3.5-9b", "qwen3_5_text", 4096, 32, 16, 4, 256, 12288, 248320, False, 1e7,
                   full_attention_interval=4, linear_key_heads=16, linear_value_heads=32, linear_key_dim=128,
                   linear_value_dim=128),
        # sliding windows and sinks (published configs: Mistral-7B-v0.1, Gemma 3 4B/27B, gpt-oss 20b/120b)
        ModelShape("mistral-window-tiny", "mistral", 64, 2, 4, 2, 16, 128, 256, sliding_window=8),
        ModelShape("mistral-7b-window", "mistral", 4096, 32, 32, 8, 128, 14336, 32000, False, 10000.0,
                   sliding_window=4096),
        ModelShape("gemma3-tiny", "gemma3_text", 64, 2, 4, 2, 16, 128, 256, True, 1e6, sliding_window=8, full_every=2,
                   extra=(("query_pre_attn_scalar", 16),)),
        ModelShape("gemma3-4b", "gemma3_text", 2560, 34, 8, 4, 256, 10240, 262208, True, 1e6, sliding_window=1024,
                   full_every=6, extra=(("query_pre_attn_scalar", 256),)),
        ModelShape("gemma3-27b", "gemma3_text", 5376, 62, 32, 16, 128, 21504, 262208, True, 1e6, sliding_window=1024,
                   full_every=6, extra=(("query_pre_attn_scalar", 168),)),
        ModelShape("gpt-oss-tiny", "gpt_oss", 64, 2, 4, 2, 16, 64, 256, False, 150000.0, sliding_window=8,
                   full_every=2, experts=4, experts_per_token=2),
        ModelShape("gpt-oss-20b", "gpt_oss", 2880, 24, 64, 8, 64, 2880, 201088, False, 150000.0, sliding_window=128,
                   full_every=2, experts=32, experts_per_token=4),
        ModelShape("gpt-oss-120b", "gpt_oss", 2880, 36, 64, 8, 64, 2880, 201088, False, 150000.0, sliding_window=128,
                   full_every=2, experts=128, experts_per_token=4),
        # vision-language: a tower of 2x2-pixel patches before a tiny decoder; published Qwen2.5-VL-7B, Qwen3-VL-8B
        ModelShape("qwen2.5-vl-tiny", "qwen2_5_vl", 64, 2, 4, 2, 16, 128, 256, False, 10000.0,
                   vision=VisionShape(3, 32, 4, 48, 64, patch=2, window=8, full_blocks=(1,))),
        ModelShape("qwen3-vl-tiny", "qwen3_vl", 64, 2, 4, 2, 16, 128, 256, False, 10000.0,
                   vision=VisionShape(3, 32, 4, 48, 64, patch=2, deepstack=(0, 2), position_table=16, gated=False)),
        ModelShape("qwen2.5-vl-7b", "qwen2_5_vl", 3584, 28, 28, 4, 128, 18944, 152064, False, 1e6,
                   vision=VisionShape(32, 1280, 16, 3420, 3584, window=112, full_blocks=(7, 15, 23, 31))),
        ModelShape("qwen3-vl-8b", "qwen3_vl", 4096, 36, 32, 8, 128, 12288, 151936, False, 5e6,
                   vision=VisionShape(27, 1152, 16, 4304, 4096, patch=16, deepstack=(8, 16, 24), position_table=2304,
                                      gated=False)),
    )
}


def read_config_json(path: str) -> dict:
    """The object in a ``config.json``; a file that is not JSON is named with the line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); a transformers config.json "
                         "is a UTF-8 JSON file.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}, column {err.colno}, is not valid JSON ({err.msg}). Fix the file, "
                         "or give a preset name or another config.json.") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, not an object of config fields.")
    return cfg


def _window_fields(cfg: dict) -> dict:
    """sliding_window and full_every from a config.json: its layer_types (the first full layer gives
    the period), or one window for every layer (Mistral)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or []
    if not window or cfg.get("use_sliding_window") is False or (types and "sliding_attention" not in types):
        return {}
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    return {"sliding_window": int(window), "full_every": full[0] + 1 if full else 0}


def model_shape(name_or_path: str) -> ModelShape:
    """A preset by name, or the shape in a transformers ``config.json`` (file or directory)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(MODELS)}) and no config.json at {path!r}."
        )
    cfg = read_config_json(path)
    if cfg.get("is_encoder_decoder"):
        raise ValueError(f"{path} describes an encoder-decoder model ({cfg.get('model_type', 'is_encoder_decoder')}); "
                         "seqmesh trains and plans decoder-only causal language models (Llama, Qwen, Mistral, ...). "
                         "Give a preset or a decoder's config.json.")
    vision = _vision_fields(cfg, path)
    where = path
    if vision is not None and isinstance(cfg.get("text_config"), dict):  # the decoder's sizes in text_config
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type"),
               "tie_word_embeddings": cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings"))}
        where = f"{path} (text_config)"
    # otherwise (the original Qwen2.5-VL releases) they are at the top level, beside vision_config
    cfg = _with_layer_count(cfg)
    hybrid = hybrid_fields(cfg)  # a hybrid's layers are its list's (transformers ignores a differing count)
    cfg = {**cfg, **hybrid.pop("config", {})}  # entries a family's reader renames (LFM2's tie_embedding, ...)
    if "layers" in hybrid:
        cfg = {**cfg, "num_hidden_layers": hybrid.pop("layers")}
    check_model_sizes(cfg, where)  # before any size is used: each named with its value and the fix
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return ModelShape(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            family=cfg.get("model_type", "llama"),
            hidden=hidden,
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            vocab=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            **({"head_dim": cfg.get("head_dim") or hidden // heads} | _latent_fields(cfg)),
            **_mlp_fields(cfg),
            **_linear_fields(cfg),
            **_window_fields(cfg),
            **hybrid,
            vision=vision,
        )
    except KeyError as missing:
        raise ValueError(f"{path} has no {missing} entry; seqmesh needs a decoder-only transformer config.") from None


def _with_layer_count(cfg: dict) -> dict:
    """``cfg`` with ``num_hidden_layers`` counted from its list of layer kinds where it names the kinds only (Nemotron-H
    as transformers 5.24 writes it: ``layers_block_type``; its older releases: ``hybrid_override_pattern``)."""
    if cfg.get("num_hidden_layers") is not None:
        return cfg
    for key in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        kinds = cfg.get(key)
        if isinstance(kinds, (list, str)) and kinds:
            return {**cfg, "num_hidden_layers": len(kinds)}
    return cfg


def _vision_fields(cfg: dict, path: str) -> VisionShape | None:
    """The tower of a vision-language config.json (its ``vision_config``), or None for a text model: a Qwen-VL
    tower, or a fixed-size one (LLaVA's CLIP, Gemma 3's SigLIP, InternVL's InternViT: :func:`_fixed_size_tower`).
    ``seqmesh train`` builds Qwen-VL towers only; the others train through ``parallelize_model`` in your loop."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        return None
    if v.get("model_type") in FIXED_SIZE_TOWERS:
        return _fixed_size_tower(cfg, v)
    if "depth" not in v:
        raise ValueError(f"{path} describes a {cfg.get('model_type')} model with a {v.get('model_type')} tower; seqmesh "
                         "plan sizes Qwen-VL towers (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5) and the fixed-size towers of "
                         "LLaVA (clip_vision_model), Gemma 3 (siglip_vision_model) and InternVL (internvl_vision).")
    try:
        if "embed_dim" in v:  # Qwen2-VL: the tower's width is embed_dim, hidden_size the merger's output
            widths = dict(hidden=v["embed_dim"], intermediate=int(v["embed_dim"] * v.get("mlp_ratio", 4)),
                          out_hidden=v["hidden_size"])
        else:
            widths = dict(hidden=v["hidden_size"], intermediate=v["intermediate_size"], out_hidden=v["out_hidden_size"])
        table = v.get("num_position_embeddings") or 0
        return VisionShape(depth=v["depth"], heads=v["num_heads"], **widths,
                           patch=v.get("patch_size", 14), merge=v.get("spatial_merge_size", 2),
                           temporal=v.get("temporal_patch_size", 2), window=v.get("window_size") or 0,
                           full_blocks=tuple(v.get("fullatt_block_indexes") or ()),
                           deepstack=tuple(v.get("deepstack_visual_indexes") or ()),
                           position_table=table, in_channels=v.get("in_channels", 3),
                           gated=not table and "embed_dim" not in v)  # Qwen2.5-VL's blocks only
    except KeyError as missing:
        raise ValueError(f"its vision_config has no {missing} entry; seqmesh reads Qwen-VL style towers.") from None


FIXED_SIZE_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip", "internvl_vision": "internvit"}


def _side(value) -> int:
    """A square size given as one number or a pair (InternVL's image_size, patch_size)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"size {value}: seqmesh plans square images of square patches.")
        return int(value[0])
    return int(value)


def _fixed_size_tower(cfg: dict, v: dict) -> VisionShape:
    """A LLaVA, Gemma 3 or InternVL tower from its config.json, with transformers' defaults for what a saved
    config leaves out; ``merge`` is the side of the window each placeholder token takes (LLaVA: 1, a patch)."""
    tower = FIXED_SIZE_TOWERS[v["model_type"]]
    text = cfg.get("text_config") or {}
    default_size, default_patch = {"clip": (224, 32), "siglip": (224, 16), "internvit": (448, 14)}[tower]
    size, patch = _side(v.get("image_size", default_size)), _side(v.get("patch_size", default_patch))
    side = size // patch
    depth = v.get("num_hidden_layers", 12)
    extra: dict = {}
    if tower == "siglip":
        pooled = round(cfg.get("mm_tokens_per_image", 256) ** 0.5)
        if pooled < 1 or side % pooled:
            raise ValueError(f"mm_tokens_per_image={cfg.get('mm_tokens_per_image', 256)} must be a square whose side "
                             f"divides the {side} patches of an image side, so each token pools whole patches.")
        extra = dict(merge=side // pooled, head=bool(v.get("vision_use_head", True)))
    else:  # both read one layer's hidden states (InternVL: -1, LLaVA: -2 by default); LLaVA may read several
        layers = cfg.get("vision_feature_layer", -1 if tower == "internvit" else -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        read = max(x % (depth + 1) for x in layers)  # index into the hidden states: 0 the embeddings
        extra = dict(read_blocks=read, feature_layers=len(layers))
        if tower == "clip":
            extra.update(merge=1, routes_class=cfg.get("vision_feature_select_strategy", "default") == "full")
        else:
            ratio = cfg.get("downsample_ratio", 0.5)
            extra.update(merge=max(round(1 / ratio), 1), qkv_bias=bool(v.get("attention_bias", False)),
                         qk_norm=bool(v.get("use_qk_norm", False)), final_norm=not v.get("use_mean_pooling", True),
                         mask_token=bool(v.get("use_mask_token", False)))
    return VisionShape(depth=depth, hidden=v.get("hidden_size", 768), heads=v.get("num_attention_heads", 12),
                       intermediate=v.get("intermediate_size", 3072), out_hidden=text.get("hidden_size", 4096),
                       patch=patch, temporal=1, in_channels=v.get("num_channels", 3), gated=False, tower=tower,
                       image_size=size, **extra)


def _mlp_fields(cfg: dict) -> dict:
    """The MLP of a config.json: its experts (each of ``moe_intermediate_size`` where the config names one, as
    Qwen3.5-MoE, whose config has no dense ``intermediate_size``; gpt-oss's are ``intermediate_size``), or one
    dense MLP. DeepSeek's and GLM's ``n_shared_experts`` (each an expert's size) and first dense layers
    (``mlp_layer_types`` "dense", or the first ``first_k_dense_replace``; of ``intermediate_size``) are counted."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return dict(intermediate=cfg["intermediate_size"])
    kinds = cfg.get("mlp_layer_types")
    dense = kinds.count("dense") if kinds else min(cfg.get("first_k_dense_replace") or 0, cfg["num_hidden_layers"])
    return dict(intermediate=cfg.get("moe_intermediate_size") or cfg["intermediate_size"], experts=experts,
                experts_per_token=cfg.get("num_experts_per_tok") or 1, shared_experts=cfg.get("n_shared_experts") or 0,
                dense_layers=dense, dense_intermediate=cfg.get("intermediate_size") or 0 if dense else 0)


def _latent_fields(cfg: dict) -> dict:
    """MLA's sizes (DeepSeek-V3, V3.2, GLM-5) and the head dim its attention runs at (the query/key head's, no-RoPE
    and RoPE parts; config.json's ``head_dim`` is the RoPE part only), with DeepSeek Sparse Attention's indexer where
    ``layer_types`` names ``indexed_attention`` layers (GLM-5's ``indexer_types`` "shared": no indexer of their own)."""
    if not cfg.get("kv_lora_rank"):
        return {}
    types = cfg.get("layer_types") or []
    indexed = types.count("indexed_attention")
    if indexed and not cfg.get("index_topk"):
        raise ValueError(f"{indexed} indexed_attention layers but no index_topk: DeepSeek Sparse Attention needs the "
                         "keys each query attends to (index_topk), index_head_dim and index_n_heads.")
    shared = [k for t, k in zip(types, cfg.get("indexer_types") or ["full"] * len(types)) if t == "indexed_attention"]
    latent = LatentShape(cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                         cfg["qk_rope_head_dim"], cfg["v_head_dim"],
                         **(dict(index_topk=cfg["index_topk"], index_head_dim=cfg["index_head_dim"],
                                 index_n_heads=cfg["index_n_heads"], indexed_layers=indexed,
                                 shared_layers=shared.count("shared")) if indexed else {}))
    return dict(latent=latent, head_dim=latent.qk_head_dim)


def _linear_fields(cfg: dict) -> dict:
    """The Gated DeltaNet shape of a hybrid config.json (Qwen3.5, Qwen3-Next), or nothing."""
    if not cfg.get("linear_num_value_heads"):
        return {}
    types = cfg.get("layer_types") or []
    interval = cfg.get("full_attention_interval") or (types.index("full_attention") + 1 if "full_attention" in types else 4)
    return dict(full_attention_interval=interval, linear_key_heads=cfg["linear_num_key_heads"],
                linear_value_heads=cfg["linear_num_value_heads"], linear_key_dim=cfg["linear_key_head_dim"],
                linear_value_dim=cfg["linear_value_head_dim"], linear_conv=cfg.get("linear_conv_kernel_dim", 4))
