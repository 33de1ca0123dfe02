"""Models seqmesh does not train are refused by name, with the true reason, when built (``seqmesh train`` and
``verify`` build through ``build_model``): an encoder-decoder (T5: a raw KeyError, before) and an encoder whose
attention sees both ways (BERT: refused at the first step for its "attention dropout", before)."""

from __future__ import annotations

import json

import pytest

from seqmesh.model.lm import build_model

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)


@pytest.mark.parametrize("family,model", [("bert", "BertLMHeadModel"), ("rembert", "RemBertForCausalLM")])
def test_an_encoder_is_refused(tmp_path, family, model):
    """BERT (its attention says is_causal=False) and RemBERT (its own attention, whose flag is is_decoder=False)."""
    from transformers import AutoConfig

    AutoConfig.for_model(family, **SIZES).to_json_file(str(tmp_path / "config.json"))
    with pytest.raises(ValueError) as err:
        build_model(str(tmp_path), device="meta")
    assert (f"{model}'s attention (encoder.layer.0.attention.self) sees the whole sequence both ways "
            f"(is_causal=False, or is_decoder=False): {family} is an encoder, not a causal decoder") in str(err.value), \
        str(err.value)


@pytest.mark.parametrize("encoder_decoder,message", [
    (True, "describes an encoder-decoder model (t5); seqmesh trains and plans decoder-only causal language models"),
    (False, "transformers has no AutoModelForCausalLM for model type 't5'; seqmesh trains decoder-only causal "
            "language models"),  # the raw KeyError
])
def test_t5_is_refused_by_name(tmp_path, encoder_decoder, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": encoder_decoder,
                                                      "num_key_value_heads": 4, **SIZES}))
    with pytest.raises(ValueError) as err:
        build_model(str(tmp_path), device="meta")
    assert message in str(err.value), str(err.value)


def test_a_decoder_is_built(tmp_path):
    from transformers import GPTNeoXConfig

    GPTNeoXConfig(**SIZES).to_json_file(str(tmp_path / "config.json"))  # declares is_decoder=False, attends causally
    assert type(build_model(str(tmp_path), device="meta")).__name__ == "GPTNeoXForCausalLM"


def test_no_preset_names_a_token_outside_its_vocabulary():
    """qwen2.5-vl-tiny kept Qwen's BOS/EOS ids (151643, 151645) in a 256-token vocabulary, and transformers warned of
    them on every rank of every run."""
    from seqmesh.model.lm import hf_config
    from seqmesh.model.presets import MODELS

    for name, shape in MODELS.items():
        text = hf_config(shape).get_text_config(decoder=True)
        outside = {k: getattr(text, k) for k in text if k.endswith("_token_id") and isinstance(getattr(text, k), int)
                   and not 0 <= getattr(text, k) < shape.vocab}
        assert not outside, (name, outside)
