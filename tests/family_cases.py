"""The 2026 decoder families through seqmesh.hf on every rank, against the unmodified transformers
model (its own attention, which applies sliding windows, sinks and MLA head dims itself) on the whole
sequence: logits and every parameter's gradient.

Tiny random-weight configs built from transformers' own config classes, each exercising what makes
the family different: Gemma 3 (sliding and full layers, query_pre_attn_scalar), Mistral with a
window, gpt-oss (sinks, alternating sliding/full layers, MoE), DeepSeek-V3 (MLA: q/k head dim
12, v head dim 6; MoE).
"""

from __future__ import annotations

import contextlib

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import seqmesh
from dist_cases import get_mesh
from seqmesh.hf import parallelize, unparallelize
from seqmesh.model.fsdp import sync_gradients
from seqmesh.model.lm import SequenceParallelLM

WINDOW = 5  # shorter than a zigzag chunk of the 45-token sequences on 4 ring ranks (48 / 8 = 6)
# DeepSeek Sparse Attention's other layouts, as the census builds them (tests/census_configs.py)
CENSUS_NAMED = {"hy-v4": "hy_v4", "a.x-k2": "axk2", "dots.llm3": "dots3_note_text",
                "dots.llm3-own-heads": "dots3_note_text+own_heads"}
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64, attention_dropout=0.0)


def family_config(family: str):
    """A tiny config of ``family`` from transformers' config classes."""
    import transformers as tf

    if family == "gemma3":
        return tf.Gemma3TextConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                   sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=8)
    if family == "gemma2":  # soft-capped attention scores and logits; caps that bite (without either, the logits move by 1.6e-3 and 5e-2)
        return tf.Gemma2Config(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8,
                               attn_logit_softcapping=0.05, final_logit_softcapping=0.6)
    if family == "mistral":
        return tf.MistralConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW)
    if family == "gpt-oss":
        return tf.GptOssConfig(**SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                               num_experts_per_tok=2)
    if family == "llama":
        return tf.LlamaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    if family == "llama4-chunked":  # layer 0 rotary and chunked (chunks of 8), layer 1 no-RoPE with the temperature
        return tf.Llama4TextConfig(**SMALL, intermediate_size=64, intermediate_size_mlp=64, num_key_value_heads=2,
                                   head_dim=8, attention_chunk_size=8, floor_scale=8, attn_scale=0.5,
                                   no_rope_layers=[1, 0], num_local_experts=2, moe_layers=[0])
    if family == "qwen3":  # per-head q/k norms; tied embeddings
        return tf.Qwen3Config(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    if family == "qwen3_5":  # a Gated DeltaNet layer, then full attention
        return tf.Qwen3_5TextConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                    linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    if family == "deepseek-v3":
        return tf.DeepseekV3Config(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4,
                                   q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                   first_k_dense_replace=1, n_shared_experts=1)
    if family in ("deepseek-v3.2", "glm-5"):  # MLA whose queries see their indexer's top 6 earlier keys only
        dsa = dict(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, q_lora_rank=16,
                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                   index_topk=6, index_head_dim=8, index_n_heads=4)
        if family == "deepseek-v3.2":
            return tf.DeepseekV32Config(**dsa)
        return tf.GlmMoeDsaConfig(**{**dsa, "num_hidden_layers": 3}, indexer_types=["full", "shared", "full"])
    if family == "deepseek-v4":  # an HCA layer (windows of 8), then a CSA layer (windows of 4, each query's top 3)
        return tf.DeepseekV4Config(**SMALL, head_dim=16, q_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4,
                                   num_experts_per_tok=2, sliding_window=6, o_groups=2, o_lora_rank=8, hc_mult=2,
                                   index_n_heads=8, index_head_dim=8, index_topk=3, partial_rotary_factor=0.5,
                                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                                   layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                                   mlp_layer_types=["hash_moe", "moe"])
    if family == "minimax-m3-sparse":  # a block-sparse layer, then a full one: blocks of 4 keys, the top 2 and its own
        from census_configs import census_config

        config = census_config("minimax_m3_vl_text+sparse")
        config.index_block_size, config.index_topk_blocks = 4, 2
        return config
    if family in CENSUS_NAMED:  # the census's tiny config: an indexer's top 16 of up to 45 keys
        from census_configs import census_config

        return census_config(CENSUS_NAMED[family])
    mamba2 = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, intermediate_size=64,
                  attention_dropout=0.0)  # Mamba2: 4 heads of 16 in 2 groups of B/C (state 8), a conv of 4
    if family == "nemotron-h":  # Mamba2, MoE, attention and MLP layers
        return tf.NemotronHConfig(**mamba2, num_hidden_layers=5, layer_types=["linear_attention", "moe", "full_attention",
                                  "mlp", "linear_attention"], mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
                                  head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  moe_shared_expert_intermediate_size=16)
    if family == "granite-4-hybrid":
        return tf.GraniteMoeHybridConfig(**mamba2, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                         mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2)
    if family == "bamba":
        return tf.BambaConfig(**mamba2, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                              mamba_d_state=8, mamba_n_groups=2)
    if family == "falcon-h1":  # attention and Mamba2 side by side in every layer, muP multipliers that bite
        return tf.FalconH1Config(**mamba2, num_hidden_layers=2, head_dim=8, mamba_n_heads=4, mamba_d_head=16,
                                 mamba_d_ssm=64, mamba_d_state=8, mamba_n_groups=2,
                                 ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9], ssm_in_multiplier=1.25,
                                 lm_head_multiplier=0.8)
    if family == "minimax":  # a lightning attention layer (decay slope per head), then full attention; MoE
        return tf.MiniMaxConfig(**SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, block_size=8,
                                layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                                num_experts_per_tok=2, linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.1)
    if family == "stablelm":  # a decoder layer that calls its attention without its **kwargs; partial rotary
        return tf.StableLmConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, partial_rotary_factor=0.5)
    if family == "nemotron":  # the same kind of layer; squared-ReLU MLP, LayerNorm1P
        return tf.NemotronConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    if family == "mamba2":  # a pure state space model: no attention layer at all
        return tf.Mamba2Config(hidden_size=32, num_hidden_layers=2, vocab_size=64, num_heads=4, head_dim=16, expand=2,
                               state_size=8, n_groups=2, conv_kernel=4)
    if family in ("lfm2", "lfm2-hybrid"):  # gated short convs (width conv_L_cache) and attention; no ff auto-sizing
        lfm = dict(**SMALL, intermediate_size=64, num_key_value_heads=2, block_auto_adjust_ff_dim=False)
        if family == "lfm2":
            return tf.Lfm2Config(**lfm, layer_types=["conv", "full_attention"])
        return tf.Lfm2Config(**{**lfm, "num_hidden_layers": 4}, layer_types=["conv", "conv", "full_attention", "conv"],
                             conv_bias=True, conv_L_cache=5)  # a bias, and a halo of 4 tokens
    if family == "lfm2_moe":  # a dense conv layer, attention, then a conv layer with 4 experts
        return tf.Lfm2MoeConfig(**{**SMALL, "num_hidden_layers": 3}, intermediate_size=64, moe_intermediate_size=16,
                                num_key_value_heads=2, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                layer_types=["conv", "full_attention", "conv"])
    if family == "lfm3":  # convs of width 7 (a halo of 6: a whole zigzag run on U2xR2), sliding and full attention
        return tf.Lfm3Config(**{**SMALL, "num_hidden_layers": 4}, intermediate_size=64, num_key_value_heads=2,
                             head_dim=8, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             layer_types=["conv", "sliding_attention", "conv", "full_attention"])
    if family == "jamba":  # a Mamba (v1) layer, then attention with a small MoE
        return tf.JambaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, attn_layer_period=2,
                              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                              num_experts_per_tok=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)
    if family in ("mamba", "falcon-mamba"):  # pure Mamba (v1) models: no attention layer at all
        cls = tf.MambaConfig if family == "mamba" else tf.FalconMambaConfig
        return cls(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4, conv_kernel=4, expand=2,
                   time_step_rank=8)
    if family == "kimi_linear":  # KDA layers around Kimi Linear's MLA (NoPE); a dense MLP, then MoE
        return tf.KimiLinearConfig(**{**SMALL, "num_hidden_layers": 3}, intermediate_size=64, num_key_value_heads=4,
                                   q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=6, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
                                   layer_types=["linear_attention", "full_attention", "linear_attention"],
                                   mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    if family == "recurrent_gemma":  # RG-LRU blocks (conv width 4, a state of 48), then local attention; soft-capped
        return tf.RecurrentGemmaConfig(**{**SMALL, "num_hidden_layers": 3}, intermediate_size=64, lru_width=48,
                                       num_key_value_heads=2, attention_window_size=WINDOW,
                                       block_types=["recurrent", "recurrent", "attention"])
    if family == "zamba":  # multi-head Mamba (v1) layers (x_proj, dt_proj per head), two hybrid layers sharing one
        # attention block; the mixer's memory lengthened (zamba_memory)
        return tf.ZambaConfig(**{**SMALL, "num_hidden_layers": 3}, intermediate_size=64, num_key_value_heads=4,
                              attention_head_dim=16, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                              n_mamba_heads=2, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                              use_mamba_kernels=False)
    if family == "zamba2":  # Mamba2 layers (4 heads, 2 groups), hybrid layers running two shared blocks in turn,
        # each hybrid layer's LoRA adapters on q, k, v and the MLP; rotary positions; the mixer's memory lengthened
        return tf.Zamba2Config(**{**SMALL, "num_hidden_layers": 4}, intermediate_size=48, n_mamba_heads=4,
                               mamba_d_state=4, mamba_ngroups=2, mamba_d_conv=4, chunk_size=8, num_mem_blocks=2,
                               use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
                               layers_block_type=["linear_attention", "hybrid", "hybrid", "hybrid"])
    if family == "zaya":  # ZAYA's CCA: q | k convolved over 2 + 3 - 2 = 3 earlier rows, a delayed half of each
        # value; a sliding layer (a window shorter than a zigzag chunk), then a full one; biased projections; 4 experts
        return tf.ZayaConfig(**SMALL, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                             num_experts_per_tok=1, router_hidden_size=16, cca_time0=2, cca_time1=3,
                             attention_bias=True, sliding_window=WINDOW, layer_types=["hybrid_sliding", "hybrid"],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "bloom":  # ALiBi with 6 heads: BLOOM's slopes past the power of two (2^-0.5, 2^-1.5, ...) too
        return tf.BloomConfig(hidden_size=48, n_layer=2, n_head=6, vocab_size=64, attention_dropout=0.0)
    if family == "bloom-sliced":  # pretraining_tp with slow_but_exact: the output product by slices, no bias
        return tf.BloomConfig(hidden_size=48, n_layer=2, n_head=6, vocab_size=64, attention_dropout=0.0, pretraining_tp=2,
                              slow_but_exact=True, apply_residual_connection_post_layernorm=True)
    if family == "mpt":  # ALiBi with MPT's own slopes (6 heads: its reordered ones), a q/k/v clip that bites
        return tf.MptConfig(d_model=48, n_layers=2, n_heads=6, vocab_size=64, expansion_ratio=2,
                            attn_config={"clip_qkv": 0.06})
    if family == "falcon":  # rotary, one key and value head (multi_query), attention and MLP side by side
        return tf.FalconConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, vocab_size=64)
    if family == "falcon-mha":  # every head its own key and value, biases, attention then MLP in sequence
        return tf.FalconConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, vocab_size=64,
                               multi_query=False, parallel_attn=False, bias=True)
    if family == "falcon-new":  # Falcon-40B/180B's layout: 2 kv heads, each after its group of query heads; 2 norms
        return tf.FalconConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, vocab_size=64,
                               new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2)
    if family == "gpt-neo":  # unscaled scores; a local layer (a window shorter than a zigzag chunk), then a global one
        return tf.GPTNeoConfig(hidden_size=48, num_layers=2, num_heads=6, vocab_size=64, window_size=WINDOW,
                               attention_types=[[["local", "global"], 1]], max_position_embeddings=128)
    if family == "doge":  # a bias of each key (its dynamic mask), 2 kv heads; the sequence within keep_window_size
        return tf.DogeConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, keep_window_size=96)
    if family == "doge-moe":  # its cross-domain experts: 16 (4 keys a half), 4 a token, routed by others' logits
        return tf.DogeConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, keep_window_size=96, is_moe=True,
                             num_experts=16, num_experts_per_tok=4)
    if family == "openai-gpt":  # the original GPT: its class named Attention, blocks that take no **kwargs
        return tf.OpenAIGPTConfig(vocab_size=64, n_positions=128, n_embd=48, n_layer=2, n_head=6, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "xglm":  # the query scaled before its product; sinusoidal positions with an offset
        return tf.XGLMConfig(vocab_size=64, max_position_embeddings=128, d_model=48, ffn_dim=96, num_layers=2,
                             attention_heads=6, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    if family in ("xlm", "xlm-both-ways"):  # its class named MultiHeadAttention, called by index without **kwargs;
        # its padding counted over each document: pad_index 16, four times in the parity batch (the last tokens of
        # three documents zeroed, one, two and one; four of the row); -both-ways: XLM's default, no padding id there
        both = family == "xlm-both-ways"
        return tf.XLMConfig(vocab_size=64, emb_dim=48, n_layers=2, n_heads=6, dropout=0.0, attention_dropout=0.0,
                            max_position_embeddings=128, causal=not both, pad_index=2 if both else 16)
    if family == "gpt-neox-japanese":  # a partial rotary (the leading half of each head)
        return tf.GPTNeoXJapaneseConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                        intermediate_multiple_size=2, max_position_embeddings=128, attention_dropout=0.0,
                                        hidden_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                             "partial_rotary_factor": 0.5})
    if family in ("qwen4-exp", "qwen4-exp-ple", "qwen4-exp-ple-linear"):  # a Gated DeltaNet layer, then QSA: blocks
        # of 4 tokens, each query the top 4 and its tail; -ple: a PLE layer before each (trigrams, a conv of 4 dilated
        # by 3: 9 earlier tokens), 231 the end-of-sequence id (at 10 and 21 in the parity batch: the n-gram context
        # restarts there); -ple-linear: before the Gated DeltaNet layer only (a file transformers writes: its config
        # class refuses PLE on another layer)
        from census_configs import census_config as census_built

        config = census_built("qwen4_exp_text")
        if family != "qwen4-exp":
            config.ple_layer_ids, config.eos_token_id = [1, 2] if family == "qwen4-exp-ple" else [1], 231
            config.ngram_vocab_size_base, config.make_ngram_vocab_size_divisible_by = 101, 8
        return config
    if family == "inkling":  # a sliding layer (window 6), then a full one whose relative bias reaches 8 keys back and
        # whose queries are log-scaled past the 4th token of their document
        from census_configs import census_config as census_built

        config = census_built("inkling_text")
        config.sliding_window_size, config.rel_extent, config.log_scaling_n_floor = 6, 8, 4
        config.swa_num_attention_heads, config.swa_head_dim, config.swa_num_key_value_heads = 4, 16, 2
        return config
    if family in ("inkling2", "inkling2-loop"):  # Inkling 2: a sliding layer (window 6, its own 4 heads), a full one
        # (dynamic convolutions on its keys and values, a relative bias 8 keys back, queries and bias log-scaled past
        # the 4th token of their document), block states kept after every layer, clips that bite; -loop: a third
        # layer, the middle one run in 2 passes with its message gates
        from census_configs import census_config as census_built

        config = census_built("inkling2_text" if family == "inkling2" else "inkling2_loop_text")
        config.sliding_window_size, config.rel_extent, config.log_scaling_n_floor = 6, 8, 4
        config.swa_num_attention_heads, config.swa_head_dim, config.swa_num_key_value_heads = 4, 16, 2
        config.n_layers_per_attn_res_block, config.qk_l2_clip_threshold, config.rel_l2_clip_threshold = 1, 2.0, 1.0
        if family == "inkling2-loop":
            config.layer_types = ["hybrid_sliding", "hybrid", "hybrid_sliding"]
            config.num_hidden_layers, config.loop_layer_index_start, config.loop_layer_index_end = 3, 1, 2
            config.loop_num_passes = 2
        return config
    if family == "xlstm":  # mLSTM layers: the chunkwise kernel over chunks of 8, the recurrent one for the rest
        from census_configs import census_config as census_built

        config = census_built("xlstm")
        config.chunk_size = 8
        return config
    if family == "rwkv":  # RWKV-4: a token shift before both mixes, the time mix's WKV recurrence (decays spread
        # from e^-e^-5 to e^-e^3 a token by its own init)
        return tf.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                             intermediate_size=64, context_length=128, rescale_every=0)
    if family == "rembert":  # BERT-style attention as a decoder (is_decoder): its own, called without **kwargs
        return tf.RemBertConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                input_embedding_size=16, output_embedding_size=16, intermediate_size=96,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                                max_position_embeddings=128, is_decoder=True)
    if family == "roformer":  # BERT-style as a decoder, rotated (values too) at its encoder's sinusoidal table
        return tf.RoFormerConfig(vocab_size=64, hidden_size=48, embedding_size=48, num_hidden_layers=2,
                                 num_attention_heads=6, intermediate_size=96, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, max_position_embeddings=128, is_decoder=True,
                                 rotary_value=True)
    if family == "megatron-bert":  # as RemBERT's, pre-norm
        return tf.MegatronBertConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                     intermediate_size=96, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     max_position_embeddings=128, is_decoder=True)
    raise ValueError(f"unknown family {family!r}")


def build(config, seed: int = 0):
    """The float64 model with transformers' own attention: SDPA (float64 throughout; eager attention
    would take its softmax in float32), or eager where the family has no SDPA path (gpt-oss, whose
    eager softmax keeps the input dtype) or soft-caps its attention scores: transformers' SDPA call
    drops the cap, and Gemma 2 still claimed SDPA up to transformers 5.15 (its reference then had no
    cap, 1.6e-3 off on these logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    sdpa = AutoModelForCausalLM._model_mapping[type(config)]._supports_sdpa and not capped
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa" if sdpa else "eager", dtype=torch.float64,
                                             experts_implementation="eager")  # grouped_mm has no float64
    return _long_memory(_hashed(_attending(model)))


def _hashed(model):
    """DeepSeek-V4's hash router reads each token's experts from a table (``tid2eid``) a checkpoint fills; built from
    a config it is all zeros, every token's two picks the same expert, their weights a constant half and the router's
    gradient zero but for rounding. Here token t routes to experts t and t + 1 (mod the count)."""
    with torch.no_grad():
        for m in model.modules():
            table = getattr(m, "tid2eid", None)
            if table is not None:
                vocab, k = table.shape
                table.copy_((torch.arange(vocab)[:, None] + torch.arange(k)) % m.num_experts)
    return model


def _attending(model):
    """ZAYA's key scale (``ZayaQKNorm.temp``) starts at zero: every score is zero, attention is uniform and q and k
    (their convs, the halo seqmesh brings them) reach nothing. Here it is 2, and the convs' weights ten times their
    init, so a wrong q | k row shows in the logits. Doge's dynamic mask (a bias of each key) is a constant until its
    A moves from zero: here A spreads over [-2, 2] and its dt projection is twenty times its init."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "ZayaQKNorm":
                m.temp.fill_(2.0)
            if type(m).__name__ == "ZayaCCAProjection":
                m.conv_qk_depthwise.weight.mul_(10.0)
                m.conv_qk_grouped.weight.mul_(10.0)
            if type(m).__name__ == "DogeAttention":  # A starts at zero: every key's bias 1, which the softmax ignores
                m.A.copy_(torch.linspace(-2.0, 2.0, m.A.numel()))
                m.dt_proj.weight.mul_(20.0)
    return model


def _long_memory(model):
    """State space mixers with a memory longer than a rank's tokens: transformers initialises Mamba2's decay per
    token to exp(-A dt) with A = 1..H and dt ~ 1.3 (Mamba (v1), Zamba's multi-head Mamba: A = 1..N), which forgets
    within a few tokens, so a state lost between ranks would barely show. Here A = 0.05..0.2 and dt ~ 0.13 (a decay of
    about 0.99 a token)."""
    with torch.no_grad():
        for m in model.modules():
            bias = getattr(m, "dt_bias", None) if hasattr(m, "dt_bias") else getattr(m, "dt_proj_bias", None)
            if bias is None and isinstance(getattr(m, "dt_proj", None), torch.nn.Linear):  # Mamba (v1): its dt_proj's
                bias = m.dt_proj.bias
            if ("Mamba" in type(m).__name__ or type(m).__name__.endswith("Mixer")) and hasattr(m, "A_log") \
                    and isinstance(bias, torch.Tensor):  # Mamba2's dt_bias; Zamba's dt_proj_bias; Mamba's dt_proj
                m.A_log.copy_(torch.linspace(0.05, 0.2, m.A_log.numel()).log().view_as(m.A_log))
                bias.fill_(-2.0)
    return model


def _batch(seq_len: int, vocab: int, documents: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    if not documents:
        return {"input_ids": ids}
    cuts = [0, 1, 9, 10, 30, seq_len]
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]}


def _reference_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and loss of the whole sequence on one process; packed documents run one model call each
    (gpt-oss's eager attention does not separate documents given by position_ids; this reference does
    not rely on it)."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits
                            for a, b in zip(starts[:-1], starts[1:])], dim=1)
    else:
        logits = model(input_ids=ids, use_cache=False).logits
    targets = ids[0, 1:].clone()
    if "position_ids" in batch:
        targets[batch["position_ids"][0, 1:] == 0] = -100
    loss = F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum") / (targets != -100).sum()
    return logits, loss


def _row_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_reference_loss`, with packed documents in one call over the whole row (transformers' packed-sequence
    mask from position_ids): the indexer of DeepSeek Sparse Attention then takes its top-k over the row, as seqmesh
    does, so ties among equal scores (a ReLU's zeros) fall the same way; per-document calls would break them over
    rows of another length."""
    logits = model(**batch, use_cache=False).logits
    targets = batch["input_ids"][0, 1:].clone()
    if "position_ids" in batch:
        targets[batch["position_ids"][0, 1:] == 0] = -100
    loss = F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum") / (targets != -100).sum()
    return logits, loss


# families whose reference is one call over the packed row (:func:`_row_loss`)
ONE_ROW_FAMILIES = ("deepseek-v3.2", "glm-5", *CENSUS_NAMED)


class Float32Ops(TorchDispatchMode):
    """Records whether any operator returns a float32 tensor (a float64 model that upcasts inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.seen:
            self.seen = any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in tree_leaves(out))
        return out


class KeepFloat64(TorchFunctionMode):
    """Runs a float64 model's own casts to float32 (an upcast norm, a float32 router, transformers' Gated
    DeltaNet, which computes in float32 whatever the model's dtype) in float64: the same model's code, in
    float64 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and isinstance(args[0], torch.Tensor):
            if func is torch.Tensor.float:
                return args[0].double()
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:  # casts and new tensors alike (the router loss's float32 sums)
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _worst_grad(model, want: dict, relative_floor: float = 0.0) -> tuple[float, str]:
    """The largest relative gradient error over the parameters, and whose it is. Each parameter's error is relative
    to its largest gradient, or with ``relative_floor`` to that fraction of the model's largest where its own is
    smaller: a gradient that is zero but for rounding (an attention key's bias, which every score of a query shares)
    has no scale of its own, and its noise would otherwise set the figure (positions_cases uses 1e-3, where a whole
    gradient wrong still reads 0.1 or more)."""
    floor = relative_floor * max((float(w.grad.abs().max()) for w in want.values() if w.grad is not None), default=0.0)
    worst, name_of = 0.0, ""
    for name, p in model.named_parameters():
        ref = want[name].grad
        if ref is None and p.grad is None:  # a parameter the loss does not reach (RoBERTa's token types), in both
            continue
        if ref is None or p.grad is None:
            return float("inf"), name
        err = float((p.grad - ref).abs().max() / ref.abs().max().clamp(min=max(floor, 1e-12)))
        if err > worst:
            worst, name_of = err, name
    return worst, name_of


# The least rounding a float64 figure is given, in units in the last place of the quantity (``math.ulp``): a sum in
# another order may move it by a few, so no bound built on the measured rounding (a multiple of it) is tighter.
ULPS = 4


def reference_rounding(config, batch: dict, ref_logits: torch.Tensor, ref_loss: torch.Tensor, reference,
                       loss_fn=_reference_loss, relative_floor: float = 0.0) -> dict:
    """How far rounding alone moves the float64 reference: the same model and weights run in float32,
    against float64 (logits, loss, relative gradients). Where the float64 model computes any operator
    in float32 itself (an upcast norm or router), that operator's rounding reaches its logits and
    gradients, so its tolerances are float32's; otherwise rounding is float64's, the float32 figure
    scaled by the ratio of the two unit roundoffs (2**-53 / 2**-24). ``loss_fn(model, batch)``: the
    reference's ``(logits, loss)``. No figure is below ``ULPS`` units in the last place of what it measures."""
    with Float32Ops() as ops, torch.no_grad():
        loss_fn(reference, batch)
    low = build(config).to(torch.float32)
    logits, loss = loss_fn(low, batch)
    loss.backward()
    scale = 1.0 if ops.seen else torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    grad = _worst_grad(low, dict(reference.named_parameters()), relative_floor)[0]
    rounding = {"float32_inside": ops.seen, "logits": scale * float((logits.detach().double() - ref_logits).abs().max()),
                "loss": scale * abs(loss.item() - ref_loss.item()), "grad": scale * grad}
    if ops.seen:  # the reference's own float32 steps: how far they move it from the same code all in float64
        exact = build(config).double()  # the parameters a family keeps in float32 (HY-V4's sinks), the same values
        with KeepFloat64():
            logits64, loss64 = loss_fn(exact, batch)
        loss64.backward()
        rounding["inside"] = {"logits": float((logits64 - ref_logits).abs().max()), "loss": abs(loss64.item() - ref_loss.item()),
                              "grad": _worst_grad(exact, dict(reference.named_parameters()), relative_floor)[0]}
        for key, value in rounding["inside"].items():
            rounding[key] += value
    # one float32 run is one draw of rounding, and it may land near the float64 value by chance (RoBERTa's loss once
    # within 4.3e-17 of it, a twentieth of one ulp of that loss): no figure is taken below a few ulps of what it
    # measures, the largest logit, the loss, and (relative to each gradient's largest) one
    magnitudes = {"logits": float(ref_logits.abs().max()), "loss": abs(ref_loss.item()), "grad": 1.0}
    for key, magnitude in magnitudes.items():
        rounding[key] = max(rounding[key], ULPS * math.ulp(magnitude))
    return rounding


def computed_once(keys: list, compute, cache: dict) -> None:
    """Put ``compute(*key)`` into ``cache`` for each of ``keys`` that some rank of the default group lacks, each
    computed by one rank (round robin) and handed to every rank: a reference every rank of a P-rank case needs then
    costs one rank's time, not P ranks'. Collective: every rank passes the same keys (hashable, picklable) and an
    equal ``compute``; a pool's ranks run the same cases, so they also lack the same ones."""
    world, rank = dist.get_world_size(), dist.get_rank()
    lacking: list = [None] * world
    dist.all_gather_object(lacking, [key for key in dict.fromkeys(keys) if key not in cache])
    todo = list(dict.fromkeys(key for said in lacking for key in said))
    if not todo:
        return
    mine = {key: cache[key] if key in cache else compute(*key) for i, key in enumerate(todo) if i % world == rank}
    told: list = [None] * world
    dist.all_gather_object(told, mine)
    for part in told:
        cache.update(part)


def gradients_of(model) -> dict:
    """``{name: p}`` with each parameter's gradient as ``p.grad`` (what :func:`_worst_grad` reads), without the
    model: small enough to hand from one rank to another."""
    return {name: SimpleNamespace(grad=p.grad) for name, p in model.named_parameters()}


# (family, seq_len, documents) -> family_reference's tuple, in each rank process (a pool outlives its tests)
REFERENCES: dict[tuple, tuple] = {}


# families with a parameter whose gradient is zero but for rounding: XGLM's, RemBERT's and MegatronBERT's key bias (a
# separate bias of the key projection, which every score of a query shares, so the softmax cancels it); its error is
# taken relative to this fraction of the model's largest gradient (_worst_grad), in the reference's rounding and in
# the comparison alike (as positions_cases)
GRAD_FLOORS = {"xglm": 1e-3, "rembert": 1e-3, "megatron-bert": 1e-3}
# families whose float64 reference needs float64 as torch's default dtype: XGLM clamps its scores with
# torch.full((), finfo(dtype).min), a default-dtype (float32) tensor that float64's minimum overflows
DEFAULT_FLOAT64 = ("xglm",)


@contextlib.contextmanager
def reference_dtype(family: str):
    """Float64 as torch's default dtype while ``family``'s float64 reference runs, where it needs it
    (:data:`DEFAULT_FLOAT64`); otherwise nothing."""
    saved = torch.get_default_dtype()
    if family in DEFAULT_FLOAT64:
        torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _family_reference(family: str, seq_len: int, documents: bool, alter=None) -> tuple:
    with reference_dtype(family):
        return _family_reference_of(family, seq_len, documents, alter)


def _family_reference_of(family: str, seq_len: int, documents: bool, alter=None) -> tuple:
    config = family_config(family)
    reference = build(config)
    if alter is not None:
        alter(reference)
    batch = _batch(seq_len, config.vocab_size, documents)
    loss_fn = _row_loss if family in ONE_ROW_FAMILIES else _reference_loss
    ref_logits, ref_loss = loss_fn(reference, batch)
    ref_loss.backward()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference, loss_fn,
                                  relative_floor=GRAD_FLOORS.get(family, 0.0))
    return gradients_of(reference), batch, ref_logits.detach(), ref_loss.detach(), rounding


def family_reference(family: str, seq_len: int, documents: bool, alter=None) -> tuple:
    """``(gradients, batch, logits, loss, rounding)`` of the single-process float64 reference (``gradients``:
    :func:`gradients_of`), the model first changed by ``alter(model)`` where given (a module-level function: a
    reference of another setting). It depends on the family and the batch alone, not on the mesh or layout: a rank
    process computes each once and the cases on its other meshes reuse it; :func:`share_references` has the ranks of
    a group split the ones its cases need."""
    key = (family, seq_len, documents, alter)
    if key not in REFERENCES:
        REFERENCES[key] = _family_reference(*key)
    return REFERENCES[key]


def share_references(cases: list[tuple], seq_len: int = 45) -> None:
    """Before a group's ``family_parity`` cases (each ``(family, ulysses, ring, layout, documents)``, the last two
    optional): every reference they need, computed once over the group (:func:`computed_once`)."""
    keys = [(c[0], seq_len, c[4] if len(c) > 4 else False, None) for c in cases]
    computed_once(keys, _family_reference, REFERENCES)


def family_parity(family: str, ulysses: int, ring: int, layout: str = "zigzag", documents: bool = False,
                  seq_len: int = 45, shift_positions_on: int | None = None, alter=None, design: str = "auto",
                  options: dict | None = None, reference_alter=None) -> dict:
    """Largest logit error and largest relative gradient error over all parameters, and the reference's
    own rounding of each (``reference_rounding``). ``shift_positions_on``: a deliberate sharding error
    for the test that the tolerance still sees one, the position ids of that rank's shard off by one
    (its rotary embedding rotated one step too far) in the logits' forward. ``alter(model)``: a deliberate change
    to the parallelized model only (a mutation its test must see). ``design``: the recurrent mixers' design
    (``linear_attention`` of ``parallelize``); ``options``: more of ``parallelize``'s settings, whose reference is
    the model changed by ``reference_alter`` (:func:`family_reference`)."""
    mesh = get_mesh(ulysses, ring)
    ref_grads, batch, ref_logits, ref_loss, rounding = family_reference(family, seq_len, documents, reference_alter)
    lm = parallelize(build(family_config(family)), mesh, linear_attention=design, **(options or {}))
    if alter is not None:
        alter(lm)
    local = seqmesh.shard_batch(batch, mesh, layout=layout)
    positions = local["position_ids"]
    if shift_positions_on == dist.get_rank():
        positions = positions + 1
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], position_ids=positions, seqmesh=local["seqmesh"],
                    use_cache=False).logits
    whole = seqmesh.gather_sequence(logits, mesh, layout=layout, length=seq_len)
    sp = SequenceParallelLM(lm, mesh, chunk=16)
    loss = sp(**seqmesh.shard_batch(batch, mesh, layout=layout))
    loss.backward()
    sync_gradients(sp, mesh)
    grad_err, worst_name = _worst_grad(lm, ref_grads, GRAD_FLOORS.get(family, 0.0))
    unparallelize(lm)
    return {"logits": float((whole - ref_logits).abs().max()), "loss": abs(loss.item() - ref_loss.detach().item()),
            "grad": grad_err, "worst": worst_name, "params": len(ref_grads),
            "rounding": rounding}


def plain_call_parity(family: str, ulysses: int, ring: int) -> dict:
    """A user's own loop: the parallelized model called as ``model(**seqmesh.shard_batch(batch, mesh))``,
    nothing else (so ``use_cache`` is the config's default, True), the loss taken from its logits as the
    mean over the whole batch's targets, against the single-process model. Errors as
    :func:`family_parity`'s, with the reference's rounding; the config's ``use_cache`` after
    parallelize and the call, and whether the call returned a cache; and the refusals of a model call
    that asks for a cache and of a Gated DeltaNet layer given one."""
    mesh = get_mesh(ulysses, ring)
    config = family_config(family)
    reference = build(config)
    batch = _batch(45, config.vocab_size, documents=False)
    ref_logits, ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference)

    lm = parallelize(build(family_config(family)), mesh)
    local = seqmesh.shard_batch(batch, mesh)
    out = lm(**local)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    targets = local["shift_labels"]
    count = (targets != -100).sum()
    dist.all_reduce(count, group=mesh.sp_group)
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / count
    loss.backward()
    for p in lm.parameters():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(p.grad, group=mesh.sp_group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.sp_group)
    whole = seqmesh.gather_sequence(out.logits.detach(), mesh, layout=local["seqmesh"].layout, length=45)
    grad_err, worst_name = _worst_grad(lm, dict(reference.named_parameters()))
    refusals = {}
    gated_delta = next((m for m in lm.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    for what in ("model", "layer"):
        try:
            if what == "model":
                lm(**local, use_cache=True)
            elif gated_delta is not None:  # given a cache by name, as transformers' decoder layer passes it
                from transformers import DynamicCache

                gated_delta(out.logits.new_zeros(1, local["input_ids"].shape[1], config.hidden_size),
                            cache=DynamicCache(config=lm.config), seqmesh=local["seqmesh"])
        except ValueError as err:
            refusals[what] = str(err)
    use_cache = lm.config.use_cache
    unparallelize(lm)
    return {"logits": float((whole - ref_logits).abs().max()), "loss": abs(total.item() - ref_loss.detach().item()),
            "grad": grad_err, "worst": worst_name, "rounding": rounding, "use_cache": use_cache,
            "cache_returned": cache is not None, "refusals": refusals}


def parity_cases(cases: list[tuple], **kwargs) -> list[dict]:
    """On every rank of a group: :func:`family_parity` of each case, their references shared first; each result with
    its ``case``."""
    share_references(cases, kwargs.get("seq_len", 45))
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def outside_rounding(r: dict, multiple: float) -> list[str]:
    """The figures of a :func:`family_parity` result beyond ``multiple`` times the reference's own rounding of each."""
    return [key for key in ("logits", "loss", "grad") if not r[key] <= multiple * r["rounding"][key]]


def parity_line(r: dict) -> str:
    return (f"{r['case']}: logits {r['logits']:.2e} (rounding {r['rounding']['logits']:.2e}), grad {r['grad']:.2e} "
            f"(rounding {r['rounding']['grad']:.2e})")


def two_rows_error(family: str, layout: str = "zigzag") -> tuple[float, float]:
    """Two rows of 45 tokens through ``family``'s parallelized model on ring 2 against transformers' float64 logits:
    the largest error, and how far the same model in float32 moves those logits (its rounding). The parity tests
    above run one row; this one holds each row to its own selections and windows."""
    import copy

    config = family_config(family)
    reference = build(config)
    ids = torch.randint(0, config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        rounding = float((copy.deepcopy(reference).float()(input_ids=ids).logits.double() - want).abs().max())
    mesh = get_mesh(1, 2)
    model = parallelize(build(config), mesh)
    local = seqmesh.shard_batch({"input_ids": ids}, mesh, layout=layout)
    with torch.no_grad():
        whole = seqmesh.gather_sequence(model(**local).logits, mesh, layout=layout, length=45)
    unparallelize(model)
    return float((whole - want).abs().max()), rounding


def two_rows_errors(families: list[str], layout: str = "zigzag") -> list[tuple[float, float]]:
    return [two_rows_error(f, layout) for f in families]


def conv_without_halo(module, x, place):
    """A mutation's conv: the depthwise causal conv of ``module.conv1d`` over this rank's rows of ``x`` (B, L, C) only
    (zeros where another rank's halo rows would be), in float32 -> (the conv (B, L, C), ``x`` in float32)."""
    import torch

    from seqmesh.linear_attention import halo
    from seqmesh.linear_attention.kernels import causal_conv

    wide = x.float()
    extended = halo.extend(wide, place)
    own = torch.zeros(extended.shape[1], dtype=torch.bool)
    own[place.mine.own] = True
    conv = causal_conv(extended.masked_fill(~own[None, :, None], 0.0), module.conv1d.weight.squeeze(1),
                       module.conv1d.bias, place.mine.conv_bounds, None).index_select(1, place.mine.own)
    return conv, wide


def during_calls(lm, is_layer, owner, name: str, value) -> None:
    """A mutation's tool: ``owner.<name>`` (a module of seqmesh) replaced by ``value`` during each call of the modules
    of ``lm`` for which ``is_layer`` holds, and restored after, so the pool's later cases see the library as it is."""
    for module in lm.modules():
        if is_layer(module):
            def patched(*args, _forward=module.forward, **kwargs):
                kept = getattr(owner, name)
                setattr(owner, name, value)
                try:
                    return _forward(*args, **kwargs)
                finally:
                    setattr(owner, name, kept)

            module.forward = patched
