"""A model's sizes are checked once (``seqmesh.rules.model_sizes``), where every config.json is read: ``seqmesh train``,
``verify`` and ``plan`` refuse a size out of range with one line naming the field, its value and the rule, before
any work. Before, these gave "max() arg is an empty sequence", raw tracebacks, a 0-layer run that trained and
exited 0, and a plan for a "0 params" model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from seqmesh.model.presets import model_shape
from seqmesh.model.shapes import ModelShape
from seqmesh.rules.model_sizes import MAX_VOCAB, check_model_sizes
from seqmesh.tools.cli import main

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}

BAD = [  # (changes to LLAMA, what the message must say)
    ({"num_attention_heads": -4}, "num_attention_heads = -4: the number of query heads must be at least 1"),
    ({"hidden_size": 0}, "hidden_size = 0: the hidden size"),
    ({"hidden_size": "64"}, "hidden_size = '64' (str): the hidden size (the width of every token's state) is a positive "
                            "integer"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3},
     "num_attention_heads = 3 does not divide hidden_size = 64, and no head_dim is given"),
    ({"vocab_size": 1e12}, "vocab_size = 1000000000000.0 (float)"),
    ({"vocab_size": 10**12}, "vocab_size = 1,000,000,000,000 is above 4,294,967,296 (2**32): tokenizers number tokens"),
    ({"head_dim": 7}, "head_dim = 7 is odd: rotary position embeddings turn pairs of dimensions"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0: the number of decoder layers must be at least 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok = 5: each token goes to between 1 and "
                                                         "the 4 experts"),
    ({"hidden_size": 96, "num_attention_heads": 32, "num_key_value_heads": 8}, "hidden_size / num_attention_heads = 3 "
                                                                               "is odd"),
    ({"intermediate_size": None}, "has no intermediate_size entry"),
]


def _config(tmp_path, changes: dict) -> str:
    cfg = {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("changes,message", BAD)
def test_a_size_out_of_range_is_refused_naming_the_field_and_the_rule(tmp_path, changes, message):
    path = _config(tmp_path, changes)
    with pytest.raises(ValueError) as err:
        model_shape(path)
    assert str(err.value).startswith(path) and message in str(err.value), str(err.value)


def test_seqmesh_plan_refuses_a_model_of_hidden_size_0(tmp_path, capsys):
    """It recommended a layout for a "0 params" model at 112.5e9 tokens/s."""
    path = _config(tmp_path, {"hidden_size": 0})
    assert main(["plan", "--model", path, "--seq-len", "4096", "--gpus", "8"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.startswith("seqmesh plan: error: ") and "hidden_size = 0" in captured.err


def test_seqmesh_train_refuses_a_model_of_0_layers(tmp_path):
    """It trained, and exited 0. (A real process: the refusal comes from the job, with its exit code.)"""
    path = _config(tmp_path, {"num_hidden_layers": 0})
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    done = subprocess.run([sys.executable, "-m", "seqmesh", "train", "--model", path, "--seq-len", "32", "--steps", "1",
                           "--out", str(tmp_path / "run"), "--no-export"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (f"seqmesh: error: {path}: num_hidden_layers = 0: the number of decoder "
                                                    "layers must be at least 1. Fix num_hidden_layers in the config (the "
                                                    "model's published config.json has the right value).")
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_the_vision_language_decoder_and_its_tower_are_checked(tmp_path):
    tower = {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 48,
             "out_hidden_size": 64}
    cfg = {"model_type": "qwen2_5_vl", "text_config": {**LLAMA, "head_dim": 0}, "vision_config": tower}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json \(text_config\): head_dim = 0"):
        model_shape(str(path))
    path.write_text(json.dumps({**cfg, "text_config": LLAMA, "vision_config": {**tower, "num_heads": 5}}))
    with pytest.raises(ValueError, match="the vision tower's 5 heads do not divide its width 32"):
        model_shape(str(path))


def test_an_encoder_decoder_config_is_refused_by_name(tmp_path):
    path = _config(tmp_path, {"model_type": "t5", "is_encoder_decoder": True})
    with pytest.raises(ValueError, match="describes an encoder-decoder model \\(t5\\); seqmesh trains and plans "
                                         "decoder-only causal language models"):
        model_shape(path)


def test_a_model_whose_decoder_sits_in_text_config_beside_an_unrouted_tower_is_told_how_to_train_it(tmp_path):
    """Gemma 4's multimodal config.json keeps its decoder's sizes in text_config, beside towers seqmesh does not route:
    refused with the way to train its language model (its text_config as a config.json of its own), which then
    sizes."""
    text = {**LLAMA, "model_type": "gemma4_text"}
    top = {**dict.fromkeys(LLAMA), "model_type": "gemma4", "text_config": text, "audio_config": {"hidden_size": 8}}
    path = _config(tmp_path, top)  # nothing of the decoder's at the top level
    with pytest.raises(ValueError, match=r"decoder's sizes are in its text_config, beside towers seqmesh does not "
                                         r"route.*write its text_config as a config.json of its own \(model_type "
                                         r"'gemma4_text'\)"):
        model_shape(path)
    (tmp_path / "text").mkdir()
    assert model_shape(_config(tmp_path / "text", {"model_type": "gemma4_text"})).hidden == LLAMA["hidden_size"]


def test_shapes_built_in_python_obey_the_same_rules():
    """The planner's API takes a ModelShape: the same check, the same words."""
    with pytest.raises(ValueError, match="tiny: the head dim head_dim = 7 is odd"):
        ModelShape(name="tiny", family="llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=7, intermediate=128,
                   vocab=256)
    with pytest.raises(ValueError, match="tiny: num_hidden_layers = 0"):
        ModelShape(name="tiny", family="llama", hidden=64, layers=0, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                   vocab=256)
    check_model_sizes({**LLAMA, "vocab_size": MAX_VOCAB}, "largest")  # the bound itself is allowed


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3", "gpt-oss", "qwen3_5", "deepseek-v3"])
def test_the_families_seqmesh_runs_pass_as_transformers_configs(family):
    """The check reads a transformers config as well as a config.json (parallelize holds one): every family's passes,
    a rotary part of the head (partial_rotary_factor) included."""
    from family_cases import family_config

    config = family_config(family)
    check_model_sizes(config, family)
    with pytest.raises(ValueError, match="its rotary part, partial_rotary_factor 0.5, is 3"):
        check_model_sizes({**LLAMA, "head_dim": 6, "partial_rotary_factor": 0.5}, "partial")
