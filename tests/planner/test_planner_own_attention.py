"""seqmesh plan on the families whose attention layers seqmesh runs itself (seqmesh.hf.own_attention): Falcon's,
GPT-Neo's, the original GPT's, XGLM's, GPT-NeoX-Japanese's, Doge's and XLM's config.json read into shapes whose matrices equal the model transformers builds on the meta device (Falcon's
one or grouped kv heads, a two-matrix MLP, GPT-Neo's local layers as sliding ones), planned without tensor parallelism
as the runtime runs them (the one rule, seqmesh.rules.own_attention), and BLOOM's and MPT's ALiBi planned."""

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
    # the original GPT (its Conv1D projections, a learned table of 512 positions), XGLM 564M (sinusoidal positions),
    # GPT-NeoX-Japanese 2.7B, Doge 160M (its dynamic mask's dt_proj and A; the experts its config names unused
    # without is_moe)
    "openai-gpt": dict(model_type="openai-gpt", n_embd=768, n_layer=12, n_head=12, vocab_size=40478, n_positions=512),
    "xglm-564m": dict(model_type="xglm", d_model=1024, num_layers=24, attention_heads=16, ffn_dim=4096,
                      vocab_size=256008, max_position_embeddings=2048),
    "gpt-neox-japanese-2.7b": dict(model_type="gpt_neox_japanese", hidden_size=2560, num_hidden_layers=32,
                                   num_attention_heads=32, intermediate_multiple_size=4, vocab_size=32000),
    # BLOOM 7B1 and MPT-7B: ALiBi (MPT's vocabulary padded to 50,432)
    "bloom-7b1": dict(model_type="bloom", hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880),
    "mpt-7b": dict(model_type="mpt", d_model=4096, n_layers=32, n_heads=32, vocab_size=50432, expansion_ratio=4,
                   max_seq_len=2048),
    # XLM's MLM-en-2048 (emb_dim, n_layers, n_heads; a learned table of 512 positions; biased projections)
    "xlm-mlm-en-2048": dict(model_type="xlm", emb_dim=2048, n_layers=12, n_heads=16, vocab_size=30145,
                            max_position_embeddings=512),
    "doge-160m": dict(model_type="doge", hidden_size=768, num_hidden_layers=24, num_attention_heads=6,
                      num_key_value_heads=3, intermediate_size=1536, vocab_size=32768, keep_window_size=2048,
                      num_experts=16384),
}
# the families seqmesh runs through transformers' attention whose config.json keeps GPT-2's names (or its own) and
# whose MLP is two matrices: GPT-2 124M (a learned table of 1,024 positions), StarCoder's GPT-BigCode (multi-query,
# 8,192 positions), GPT-J 6B and CodeGen 350M (rotary, untied head), CTRL (sinusoids of 256 positions, its dff),
# OPT-350m (a table of 2,048 + 2 positions, embeddings projected to 512 and back)
PLAIN = {
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "starcoder": dict(model_type="gpt_bigcode", n_embd=6144, n_layer=40, n_head=48, vocab_size=49152,
                      n_positions=8192, multi_query=True),
    "gpt-j-6b": dict(model_type="gptj", n_embd=4096, n_layer=28, n_head=16, vocab_size=50400, n_positions=2048,
                     rotary_dim=64),
    "codegen-350m": dict(model_type="codegen", n_embd=1024, n_layer=20, n_head=16, vocab_size=51200,
                         n_positions=2048, rotary_dim=32),
    "ctrl": dict(model_type="ctrl", n_embd=1280, n_layer=48, n_head=16, dff=8192, vocab_size=246534, n_positions=256),
    "opt-350m": dict(model_type="opt", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
                     vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=512),
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
    """One layer's matrices (what the planner's matmul time multiplies every token by; Doge's A beside them) and the
    embeddings equal the model's; the whole count within the norms', biases' and position table's share (under 0.5%:
    the original GPT's table of 512 positions is 0.34% of it)."""
    from transformers.pytorch_utils import Conv1D

    from seqmesh.model.lm import decoder_layers

    path = _write(tmp_path, name, CONFIGS[name])
    shape, model = model_shape(path), _meta_model(path)
    assert not shape.unplanned, shape.unplanned
    layers = decoder_layers(model)
    per_layer = 2 if name.startswith("xlm") else 1  # XLM's units: each layer's attention, then its MLP
    layer = layers[0]
    matrices = sum(m.weight.numel() for unit in layers[:per_layer] for m in unit.modules()
                   if isinstance(m, (torch.nn.Linear, Conv1D)))
    matrices += layer.self_attn.A.numel() if name.startswith("doge") else 0
    assert shape.attention_params + shape.mlp_params == matrices, (shape.attention_params, shape.mlp_params, matrices)
    assert shape.gated_mlp == name.startswith("doge") and shape.layers == len(layers) // per_layer
    total = sum(p.numel() for p in model.parameters())
    assert abs(shape.params - total) < 0.005 * total, (shape.params, total)
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


def test_doge_is_planned_within_its_window_only(tmp_path, capsys):
    """Past keep_window_size keys Doge's dynamic mask keeps each query's largest-bias keys, which seqmesh does not
    compute: the planner refuses a longer sequence in the runtime's words and plans one within it."""
    from seqmesh.tools.cli import main

    path = _write(tmp_path, "doge-160m", CONFIGS["doge-160m"])
    assert main(["plan", "--model", path, "--seq-len", "4096", "--gpus", "2"]) != 0
    said = capsys.readouterr().err
    assert "longer than keep_window_size=2048" in said and "--seq-len at most keep_window_size" in said, said
    assert main(["plan", "--model", path, "--seq-len", "2048", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] is not None


def test_xlm_is_planned_without_checkpointing(tmp_path, capsys):
    """transformers checkpoints none of XLM's layers (the runtime refuses checkpointing in the same words): the plan
    asks for --no-checkpointing, and is made with it, within XLM's 512 positions."""
    from seqmesh.rules.own_attention import checkpointing_refusal
    from seqmesh.tools.cli import main

    path = _write(tmp_path, "xlm-mlm-en-2048", CONFIGS["xlm-mlm-en-2048"])
    assert main(["plan", "--model", path, "--seq-len", "512", "--gpus", "2"]) != 0
    assert checkpointing_refusal("xlm") in capsys.readouterr().err
    assert main(["plan", "--model", path, "--seq-len", "512", "--gpus", "2", "--no-checkpointing", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] is not None


@pytest.mark.parametrize("name", ["bloom-7b1", "mpt-7b"])
def test_alibi_families_are_planned(tmp_path, name, capsys):
    """BLOOM's and MPT's ALiBi: on CUDA seqmesh's Triton flash kernel computes the bias by distance, no score block
    held, so the planner sizes their attention as any other's; 128K tokens on 8 H100s fit."""
    from seqmesh.tools.cli import main

    path = _write(tmp_path, name, CONFIGS[name])
    assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recommended"] is not None and any(row["feasible"] for row in report["candidates"])


@pytest.mark.parametrize("name", list(PLAIN))
def test_gpt2_style_config_json_is_read(tmp_path, name):
    """GPT-2's names (n_embd, n_layer, n_head, n_inner or four times the width), GPT-BigCode's multi-query heads,
    CTRL's dff and OPT's ffn_dim are read, each with its config class's tied embeddings: one layer's matrices and the
    embeddings equal the model transformers builds, the whole count within its biases' and norms' share (a learned
    table of positions counted). Before, seqmesh plan, train and verify refused every such config.json: "no
    hidden_size entry"."""
    from transformers.pytorch_utils import Conv1D

    from seqmesh.model.lm import decoder_layers

    path = _write(tmp_path, name, PLAIN[name])
    shape, model = model_shape(path), _meta_model(path)
    assert not shape.unplanned and not shape.gated_mlp, shape
    layer = decoder_layers(model)[0]
    matrices = sum(m.weight.numel() for m in layer.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
    assert shape.attention_params + shape.mlp_params == matrices, (shape.attention_params, shape.mlp_params, matrices)
    assert shape.layers == len(decoder_layers(model))
    total = sum(p.numel() for p in model.parameters())
    assert abs(shape.params - total) < 0.005 * total, (shape.params, total)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert shape.tie_embeddings == tied, (shape.tie_embeddings, tied)


@pytest.mark.parametrize("name,rows", [("gpt2", 1024), ("opt-350m", 2048), ("ctrl", 256)])
def test_a_sequence_past_the_table_of_positions_is_refused_before_any_work(tmp_path, capsys, name, rows):
    """A position past a learned table's (or CTRL's sinusoids') last row is an index out of range inside the
    embedding (a device-side assert on a GPU): seqmesh plan, and seqmesh train and verify as they read the model
    (before anything is built), refuse the sequence, naming the table's entry and the fix; at the table's length the
    plan is made. A generation's prompt and new tokens together are held to it too (plan --inference, and
    seqmesh.inference before any work)."""
    from seqmesh.tools.cli import main
    from seqmesh.training.config import TrainConfig
    from seqmesh.training.run_data import read_run_model

    path = _write(tmp_path, name, PLAIN[name])
    entry = "max_position_embeddings" if name == "opt-350m" else "n_positions"
    want = (f"table of {rows} positions ({entry}={rows})", f"--seq-len at most {rows}")
    assert main(["plan", "--model", path, "--seq-len", str(2 * rows), "--gpus", "2"]) != 0
    said = capsys.readouterr().err
    assert all(w in said for w in want), said
    with pytest.raises(ValueError) as refused:
        read_run_model(TrainConfig(model=path, seq_len=2 * rows))
    assert all(w in str(refused.value) for w in want), refused.value
    assert main(["plan", "--model", path, "--seq-len", str(rows), "--gpus", "2"]) == 0
    read_run_model(TrainConfig(model=path, seq_len=rows))
    # a generation's prompt and new tokens alike: seqmesh plan --inference, and seqmesh.inference before any work
    from seqmesh.inference.generate import _check_windows

    assert main(["plan", "--model", path, "--seq-len", str(rows - 8), "--new-tokens", "16", "--gpus", "2",
                 "--inference"]) != 0
    said = capsys.readouterr().err
    assert all(w in said for w in want), said
    with pytest.raises(ValueError, match=f"run {rows + 7} tokens: .*{entry}={rows}"):
        _check_windows(_meta_model(path), rows + 7)
    _check_windows(_meta_model(path), rows)


@pytest.mark.parametrize("config_class,said", [("BltConfig", "BLT reads bytes with a local encoder"),
                                               ("XLNetConfig", "XLNet's two-stream relative attention"),
                                               ("BigBirdConfig", "set attention_type='original_full'")])
def test_a_family_refused_whatever_its_sizes_is_refused_by_its_reason(tmp_path, capsys, config_class, said):
    """seqmesh plan (and train and verify, which read the file the same way) refuses a family seqmesh never runs with
    the runtime's own reason (seqmesh.rules.families), before its sizes are read: before, BLT's and XLNet's files
    said "no hidden_size entry", and BigBird's block-sparse default was planned as attention."""
    import transformers as tf

    from seqmesh.tools.cli import main

    getattr(tf, config_class)().save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "4096", "--gpus", "2"]) != 0
    assert said in capsys.readouterr().err


def test_trocr_is_sized_with_the_cross_attention_it_holds(tmp_path, capsys):
    """TrOCR's decoder (a file as TrOCR-base's, its encoder 768 wide): each layer's own attention and MLP equal the
    model's matrices; the cross-attention to its image encoder each layer holds (q and out over the width, k and v
    from the encoder's width, biases, its norm) is counted exactly as weights no text step multiplies; the whole
    within 0.5%; 512 tokens planned, a longer sequence refused at its table."""
    from seqmesh.model.lm import decoder_layers
    from seqmesh.tools.cli import main

    path = _write(tmp_path, "trocr", dict(model_type="trocr", d_model=1024, decoder_layers=12,
                                          decoder_attention_heads=16, decoder_ffn_dim=4096, vocab_size=50265,
                                          cross_attention_hidden_size=768, max_position_embeddings=512))
    shape, model = model_shape(path), _meta_model(path)
    layer = decoder_layers(model)[0]
    cross = list(layer.encoder_attn.parameters()) + list(layer.encoder_attn_layer_norm.parameters())
    assert shape.idle_params == sum(p.numel() for p in cross), shape.idle_params
    own = sum(m.weight.numel() for name, m in layer.named_modules()
              if isinstance(m, torch.nn.Linear) and not name.startswith("encoder_attn"))
    assert shape.attention_params + shape.mlp_params == own and not shape.gated_mlp
    total = sum(p.numel() for p in model.parameters())
    assert abs(shape.params - total) < 0.005 * total, (shape.params, total)
    assert main(["plan", "--model", path, "--seq-len", "512", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] is not None
    assert main(["plan", "--model", path, "--seq-len", "1024", "--gpus", "2"]) != 0


def test_moshis_text_decoder_is_planned_as_transformers_builds_it(tmp_path, capsys):
    """Moshi's config.json (its config class's 7B default): its text decoder's gated MLP makes gate and up in one
    fc1 of ffn_dim, so each is ffn_dim / 2 wide; its attention is full causal (its sliding_window reaches no mask of
    that decoder), not planned as sliding. One layer's matrices equal the model's, the whole within 0.01% (its
    embedding's one row more), and 32K tokens are planned on 8 GPUs."""
    import transformers as tf

    from seqmesh.tools.cli import main

    tf.MoshiConfig().save_pretrained(tmp_path)
    path = str(tmp_path / "config.json")
    shape, model = model_shape(path), _meta_model(path)
    layer = model.model.layers[0]
    assert shape.attention_params + shape.mlp_params == sum(
        m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert shape.gated_mlp and shape.sliding_window is None and not shape.unplanned, shape
    total = sum(p.numel() for p in model.parameters())
    assert abs(shape.params - total) < 1e-4 * total, (shape.params, total)
    assert main(["plan", "--model", path, "--seq-len", "32768", "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] is not None


@pytest.mark.parametrize("family", ["longcat_flash", "gemma3n_text"])
def test_a_file_whose_layers_the_planner_does_not_size_is_read_for_training(tmp_path, capsys, family):
    """LongCat-Flash's and Gemma 3n's config.json are read in their own names (num_layers, ffn_hidden_size, a width
    per layer ...), so seqmesh train and verify get the sizes they need; seqmesh plan says which layers it does not
    size. Before, each failed at the reader ("no hidden_size entry", "no num_hidden_layers entry",
    "intermediate_size ... (list)")."""
    from census_configs import census_config

    from seqmesh.tools.cli import main
    from seqmesh.training.config import TrainConfig
    from seqmesh.training.run_data import read_run_model

    config = census_config(family)
    config.save_pretrained(tmp_path)
    shape = read_run_model(TrainConfig(model=str(tmp_path), seq_len=64)).shape
    layers = {"longcat_flash": "num_layers"}.get(family, "num_hidden_layers")
    assert (shape.hidden, shape.layers, shape.heads) == (64, getattr(config, layers), 4), shape
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--seq-len", "4096", "--gpus", "2"]) != 0
    assert "seqmesh plan does not size" in capsys.readouterr().err
