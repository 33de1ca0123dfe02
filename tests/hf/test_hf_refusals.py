"""Attention variants seqmesh does not compute are refused, never silently replaced by full attention."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def refusals() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import seqmesh
    from dist_cases import get_mesh
    from seqmesh.hf import parallelize

    mesh = get_mesh(1, 1)
    answers = {}
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    config.attention_chunk_size = 8  # Llama-4 style chunked attention
    try:
        parallelize(LlamaForCausalLM(config), mesh)
        answers["chunked"] = "no error"
    except ValueError as err:
        answers["chunked"] = str(err)

    config.attention_chunk_size = None
    model = parallelize(LlamaForCausalLM(config), mesh)
    layer = model.model.layers[0].self_attn
    attention = seqmesh.hf._make_attention(mesh, "auto")
    q = torch.randn(1, 4, 8, 8)
    info = seqmesh.SequenceInfo(seq_len=8, cu_seqlens=None, layout="zigzag")
    try:  # a model that builds its own (B, 1, S, S) mask
        attention(layer, q, q[:, :2], q[:, :2], torch.zeros(1, 1, 8, 8), seqmesh=info)
        answers["own_mask"] = "no error"
    except ValueError as err:
        answers["own_mask"] = str(err)
    out, _ = attention(layer, q, q[:, :2], q[:, :2], None, seqmesh=info)
    answers["plain_shape"] = list(out.shape)
    return answers


def test_chunked_attention_and_model_built_masks_are_refused(pools):
    (answers,) = pools.run(1, refusals)
    assert "attention_chunk_size=8" in answers["chunked"] and "Set config.attention_chunk_size = None" in answers["chunked"]
    assert "passed its own attention mask (shape (1, 1, 8, 8))" in answers["own_mask"], answers
    assert answers["plain_shape"] == [1, 8, 4, 8]


def test_layers_seqmesh_would_not_compute_are_named():
    """Bidirectional windows are refused by name before any work; Gemma 3 as published passes, and so does
    soft-capping (Gemma 2 style, set on Gemma 3), which seqmesh computes."""
    import pytest
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from seqmesh.hf.layers import check_layers, family_reason

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, vocab_size=64, sliding_window=4)
    check_layers(Gemma3ForCausalLM(Gemma3TextConfig(**small)))
    assert Gemma3TextConfig().attn_logit_softcapping is None
    check_layers(Gemma3ForCausalLM(Gemma3TextConfig(**small, attn_logit_softcapping=30.0)))
    with pytest.raises(ValueError, match="bidirectional"):
        check_layers(Gemma3ForCausalLM(Gemma3TextConfig(**small, use_bidirectional_attention=True)))
    # Gemma 4 unified: "vision" (both ways within an image's tokens: none in a text batch, which the census runs
    # exact) passes; "all" (every layer both ways) is refused
    from transformers import AutoConfig, AutoModelForCausalLM

    gemma4 = dict(small, num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"])
    check_layers(AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_unified_text", **gemma4,
                                                                       use_bidirectional_attention="vision")))
    with pytest.raises(ValueError, match="bidirectional"):
        check_layers(AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_unified_text", **gemma4,
                                                                           use_bidirectional_attention="all")))


def _parallelize_refusal(config, layer: type | None = None) -> str:
    """parallelize's refusal of the model of ``config`` (its decoder layers made ``layer``s, if given) on one rank (a
    mesh of 1 x 1: every check runs, none of them needs peers), or "" where it accepts it."""
    from transformers import AutoModelForCausalLM

    from dist_cases import get_mesh
    from seqmesh.hf import parallelize, unparallelize

    model = AutoModelForCausalLM.from_config(config)
    for decoder_layer in model.model.layers if layer is not None else ():
        decoder_layer.__class__ = layer
    try:
        unparallelize(parallelize(model, get_mesh(1, 1)))
    except ValueError as err:
        return str(err)
    return ""


class ClosedLayer(LlamaDecoderLayer):
    """A Llama layer that takes no ``**kwargs`` and calls its attention with named arguments only: seqmesh's entry
    cannot reach it, as it can a layer that receives the entry and drops it (StableLM's, carried by hooks)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None):
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                     position_ids=position_ids, position_embeddings=position_embeddings)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def refusals_first() -> dict:
    """parallelize on models whose refusal used to come late or wrong (issue 30)."""
    import transformers as tf

    small = dict(hidden_size=32, num_hidden_layers=2, vocab_size=64)
    heads = dict(small, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "mamba": _parallelize_refusal(tf.MambaConfig(**small)),  # no attention heads at all: its mixers are seqmesh's
        "rwkv": _parallelize_refusal(tf.RwkvConfig(**small)),
        "nemotron": _parallelize_refusal(tf.NemotronConfig(**heads)),  # layers drop **kwargs: carried by hooks
        "stablelm": _parallelize_refusal(tf.StableLmConfig(**heads)),
        "closed layer": _parallelize_refusal(tf.LlamaConfig(**heads), layer=ClosedLayer),
        "kimi": _parallelize_refusal(tf.KimiLinearConfig(**heads, **ids, layer_types=["linear_attention",
                                                                                    "full_attention"])),
        "llama": _parallelize_refusal(tf.LlamaConfig(**heads)),
    }


def test_refusals_are_right_and_first(pools):
    """A model without attention heads runs when seqmesh runs its mixers (Mamba: it raised AttributeError on
    num_attention_heads, then was refused for its mixer);
    layers that receive **kwargs and do not pass them to attention (StableLM's, Nemotron's) are taken, seqmesh's entry
    carried across by hooks; a layer that takes none is refused at parallelize (such layers were refused at the first
    forward for a missing 'seqmesh' entry); Kimi Linear is taken: its delta attention is a mixer seqmesh runs
    (seqmesh.hf.kda), its MLA attention (KimiLinearAttention) goes through the interface, not named a token mixer."""
    (answers,) = pools.run(1, refusals_first)
    assert answers["mamba"] == "", answers["mamba"]  # taken now (it raised AttributeError, then was refused)
    assert answers["rwkv"] == "", answers["rwkv"]  # taken now: seqmesh runs its token shifts and time mix
    assert answers["nemotron"] == answers["stablelm"] == "", answers  # their layers' dropped entry is carried
    assert "(ClosedLayer) calls its self_attn without passing its **kwargs on" in answers["closed layer"], answers
    assert answers["kimi"] == "", answers["kimi"]
    assert answers["llama"] == ""


def test_deepseek_v4_compressed_attention_without_its_layout_is_refused_with_its_reason_once():
    """DeepSeek-V4's two compressed attentions where seqmesh does not find transformers 5.24's layout of them (here:
    check_layers alone, told of no compressed layer seqmesh runs): each kind named with what it computes, once
    however many layers have it. parallelize takes the same model (seqmesh.hf.compressed_attention)."""
    import pytest
    import transformers as tf

    from seqmesh.hf.layers import check_layers, family_reason

    config = tf.DeepseekV4Config(hidden_size=64, num_hidden_layers=4, vocab_size=64, num_attention_heads=4,
                                 layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                              "heavily_compressed_attention", "compressed_sparse_attention"])
    model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as refused:
        check_layers(model)
    message = str(refused.value)
    for kind in ("heavily compressed attention", "compressed sparse attention"):
        assert message.count(f"DeepSeek-V4's {kind}, which") == 1, message
    assert "layer 2 is a 'heavily_compressed_attention' layer" in message and "lightning indexer" in message
    assert "found no such module for this layer" in message, message


# each family refused with its own reason (seqmesh.hf.layers.FAMILY_REASONS): a phrase of it that the generic
# refusal (attention outside transformers' AttentionInterface) does not hold
PRECISE = {"big_bird": "attention_type='original_full'", "cpmant": "attends both ways",
           "reformer": "LSH", "xlnet": "two-stream", "prophetnet": "n-gram streams", "blt": "entropy model"}


def test_families_seqmesh_cannot_compute_are_refused_with_their_own_reason():
    """Each tiny model (the census's config) is refused by its reason and what would make it computable, not by the
    generic one; BigBird with full attention (attention_type='original_full', is_decoder) passes the same check."""
    import pytest
    from transformers import AutoModelForCausalLM

    from census_configs import census_config
    from seqmesh.hf.layers import check_layers, family_reason

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for family, phrase in PRECISE.items():
        if family not in CONFIG_MAPPING:  # newer than this transformers (Inkling 2)
            continue
        model = AutoModelForCausalLM.from_config(census_config(family))
        with pytest.raises(ValueError, match=f"seqmesh cannot run {type(model).__name__} exactly: .*{phrase}"):
            check_layers(model)
    assert family_reason(AutoModelForCausalLM.from_config(census_config("big_bird+original_full"))) is None


def test_cpmant_is_refused_because_its_causal_lm_attends_both_ways():
    """The reason seqmesh gives for CPM-Ant holds of the installed transformers: a later token moves earlier logits
    of CpmAntForCausalLM (were its LM causal, this fails, and its refusal must be revisited)."""
    import torch
    from transformers import AutoModelForCausalLM

    from census_configs import census_config

    model = AutoModelForCausalLM.from_config(census_config("cpmant")).eval()
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    later = ids.clone()
    later[0, 15] = 7
    with torch.no_grad():
        moved = (model(input_ids=ids, use_cache=False).logits - model(input_ids=later, use_cache=False).logits).abs()
    assert float(moved[0, :15].amax()) > 1e-3, moved.amax(-1)
