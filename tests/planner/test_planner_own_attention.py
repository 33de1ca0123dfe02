"""seqmesh plan on the families whose attention layers seqmesh runs itself (seqmesh.hf.own_attention): Falcon's and
GPT-Neo's config.json read into shapes whose matrices equal the model transformers builds on the meta device (Falcon's
one or grouped kv heads, a two-matrix MLP, GPT-Neo's local layers as sliding ones), planned without tensor parallelism
as the runtime runs them (the one rule, seqmesh.rules.own_attention), and BLOOM's and MPT's ALiBi refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch

from seqmesh.model.presets import model_shape

# published shapes as remembered (not checked against the releases' files): Falcon-7B (multi-query, parallel
# attention), Falcon-40B's layout (8 kv heads, each after its group of 16 query heads), GPT-Neo 1.3B (global, local)
CONFIGS = {
    "falcon-7b": dict(model_type="falcon", hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                      vocab_size=65024, multi_query=True, parallel_attn=True, bias=False, alibi=False),
    "falcon-40b": dict(model_type="falcon", hidden_size=8192, num_hidden_layers=60, num_attention_heads=128,
                       num_kv_heads=8, vocab_size=65024, new_decoder_architecture=True, parallel_attn=True,
                       bias=False, alibi=False),
    "gpt-neo-1.3b": dict(model_type="gpt_neo", hidden_size=2048, num_layers=24, num_heads=16, vocab_size=50257,
                         attention_layers=["global", "local"] * 12, attention_types=[[["global", "local"], 12]],
                         window_size=256, intermediate_size=None),
}


def _write(tmp_path, name: str, cfg: dict) -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return str(path)


def _meta_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.dirname(path), local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matrices_equal_the_transformers_model(tmp_path, name):
    """One layer's matrices (what the planner's matmul time multiplies every token by) and the embeddings equal the
    model's; the whole count within the norms', biases' and position table's share (under 0.4%)."""
    path = _write(tmp_path, name, CONFIGS[name])
    shape, model = model_shape(path), _meta_model(path)
    layer = model.transformer.h[0]
    matrices = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert shape.attention_params + shape.mlp_params == matrices, (shape.attention_params, shape.mlp_params, matrices)
    assert not shape.gated_mlp and shape.layers == len(model.transformer.h)
    total = sum(p.numel() for p in model.parameters())
    assert abs(shape.params - total) < 0.004 * total, (shape.params, total)
    if name == "gpt-neo-1.3b":
        assert shape.layer_types.count("sliding_attention") == 12 and shape.sliding_window == 256


def test_planned_without_tensor_parallelism_as_the_runtime_runs_them(tmp_path, capsys):
    """Falcon-7B on 8 H100s at 256K: a layout that fits, none with TP, each TP layout refused with the runtime's own
    words (seqmesh.rules.own_attention, which seqmesh.hf.own_attention raises)."""
    from seqmesh.rules.own_attention import tensor_parallel_refusal
    from seqmesh.tools.cli import main

    path = _write(tmp_path, "falcon-7b", CONFIGS["falcon-7b"])
    assert main(["plan", "--model", path, "--seq-len", "262144", "--gpus", "8", "--hardware", "h100-nvlink",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    fitting = [row for row in report["candidates"] if row["feasible"]]
    assert fitting and all(row["layout"]["tp"] == 1 for row in report["candidates"]), report["candidates"][:2]
    assert tensor_parallel_refusal("falcon") in json.dumps(report["excluded"])


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_families_are_refused_by_name(tmp_path, family, capsys):
    """BLOOM's and MPT's ALiBi runs on the math kernel, which the planner does not size: refused, naming why and that
    seqmesh train runs them."""
    from family_cases import family_config

    from seqmesh.tools.cli import main

    path = _write(tmp_path, family, json.loads(family_config(family).to_json_string()))
    assert main(["plan", "--model", path, "--seq-len", "4096", "--gpus", "2"]) != 0
    said = capsys.readouterr().err
    assert f"does not size {family}'s ALiBi attention" in said and "seqmesh train" in said, said
