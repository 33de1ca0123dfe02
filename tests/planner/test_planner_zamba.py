"""seqmesh plan on Zamba and Zamba2 (seqmesh.model.zamba): every layer's own parameters and the whole model's against
the model transformers builds on the meta device (its shared blocks, Zamba2's adapters, and the untied model, in
which transformers ties nothing); the FSDP units ``seqmesh.model.fsdp.units_of`` makes of its layers against the
planner's largest unit and its shared-block units; plans of the released shapes. The peak memory against the real
step: tests/rehearsal/test_rehearse.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from seqmesh.model.presets import model_shape

SMALL = dict(hidden_size=64, num_attention_heads=4, vocab_size=100)
ZAMBA2_LAYERS = ["linear_attention", "hybrid", "linear_attention", "hybrid", "hybrid", "linear_attention"]
CASES = {
    # transformers' default pattern over 9 layers: hybrid layers 2 and 7, sharing one block
    "zamba": ("zamba", dict(num_hidden_layers=9, num_key_value_heads=2, intermediate_size=96)),
    # biased projections, no conv bias, its own head size and dt rank, untied: each hybrid layer its own block
    "zamba: biases, head_dim, untied": (
        "zamba", dict(num_hidden_layers=9, num_key_value_heads=4, intermediate_size=96, mamba_proj_bias=True,
                      mamba_conv_bias=False, attention_head_dim=24, mamba_dt_rank=5, tie_word_embeddings=False)),
    "zamba2": ("zamba2", dict(num_hidden_layers=6, n_mamba_heads=4, mamba_d_state=8, layers_block_type=ZAMBA2_LAYERS, adapter_rank=8)),
    # two blocks (hybrid layers 0, 2 run one, 1 the other), attention adapters, biases, groups, untied
    "zamba2: two blocks, attention adapters, biases, untied": (
        "zamba2", dict(num_hidden_layers=6, num_key_value_heads=2, n_mamba_heads=4, mamba_d_state=8, layers_block_type=ZAMBA2_LAYERS,
                       adapter_rank=8, num_mem_blocks=2, use_shared_attention_adapter=True, add_bias_linear=True,
                       mamba_ngroups=2, intermediate_size=80, tie_word_embeddings=False)),
    # the same tied: two blocks shared, each hybrid layer's adapters in its block
    "zamba2: two blocks, attention adapters, tied": (
        "zamba2", dict(num_hidden_layers=6, n_mamba_heads=4, mamba_d_state=8, layers_block_type=ZAMBA2_LAYERS, adapter_rank=8,
                       num_mem_blocks=2, use_shared_attention_adapter=True)),
}


def _config(family: str, **entries):
    import transformers as tf

    return (tf.ZambaConfig if family == "zamba" else tf.Zamba2Config)(**entries)


def _write(tmp_path, config) -> str:
    path = tmp_path / config.model_type / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json_string())
    return str(path)


def _meta_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.dirname(path),
                                                                           local_files_only=True))


def _block(layer):
    return getattr(layer, "shared_transf", None) or getattr(layer, "shared_transformer", None)


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_and_units_equal_the_transformers_model(tmp_path, name):
    """Each layer's own parameters (its mixer, norm and linear, its shared block apart), the whole model's, and the
    FSDP units seqmesh makes of its layers: the largest unit of one layer the planner's ``layer``, the units that
    share a block together its ``held`` (none in an untied model, whose hybrid layers each hold their own)."""
    from seqmesh.model.fsdp import units_of
    from seqmesh.planner.placement import split_params

    family, entries = CASES[name]
    path = _write(tmp_path, _config(family, **SMALL, **entries))
    model, shape = _meta_model(path), model_shape(path)
    layers = list(model.model.layers)
    count = lambda params: sum(p.numel() for p in params)  # noqa: E731
    own = [count(p for p in layer.parameters() if _block(layer) is None
                 or all(p is not q for q in _block(layer).parameters())) for layer in layers]
    hybrid = shape.hybrid
    assert [hybrid.layer_params(b, shape.hidden, shape.attention_params) for b in hybrid.blocks] == own
    assert shape.params == count(model.parameters())
    assert shape.attention_params == count(_block(next(x for x in layers if _block(x))).self_attn.parameters()) - (
        count(p for n, p in _block(next(x for x in layers if _block(x))).self_attn.named_parameters() if "adapter" in n))
    units = [count({id(p): p for layer in unit for p in layer.parameters()}.values()) for unit in units_of(layers)]
    shared = [n for unit, n in zip(units_of(layers), units) if len(unit) > 1]
    split = split_params(shape, 1)
    assert split["held"] == sum(shared)
    assert split["layer"] == max(n for unit, n in zip(units_of(layers), units) if len(unit) == 1)
    assert bool(shared) == ("untied" not in name)


@pytest.mark.parametrize("family", ["zamba", "zamba2"])
def test_sizes_the_file_leaves_out_are_the_config_classes(tmp_path, family):
    """A config.json without its heads, kv heads or MLP width: read at the config class's defaults (Zamba's 16 heads
    and 16 kv heads, Zamba2's 32 and as many kv heads, and its MLP four times the width), as transformers builds it."""
    config = _config(family, hidden_size=128, num_hidden_layers=6, vocab_size=100, layers_block_type=ZAMBA2_LAYERS)
    path = _write(tmp_path, config)
    written = json.loads(open(path).read())
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "attention_head_dim",
                "attention_hidden_size"):
        written.pop(key, None)
    open(path, "w").write(json.dumps(written))
    assert model_shape(path).params == sum(p.numel() for p in _meta_model(path).parameters())


def test_plans_of_the_released_shapes(tmp_path, capsys):
    """transformers' defaults (Zamba-7B's and Zamba2-2.7B's shapes): the models count as transformers builds them
    (7.23B and 2.48B), each hybrid layer is planned as attention beside its mixer (its Ulysses all-to-all and its
    Mamba's collectives), the shared blocks' units and their gradients are held at the top layer's backward, and a
    decoded token reads every layer's weights and each hybrid layer's whole block."""
    import transformers as tf

    from seqmesh.planner.inference import _read_bytes
    from seqmesh.planner.layers import layer_kinds
    from seqmesh.planner.memory import memory_at
    from seqmesh.planner.placement import placement
    from seqmesh.planner.workload import Workload
    from seqmesh.rules.degrees import Degrees
    from seqmesh.tools.cli import main

    for config, layers, hybrids, billions in ((tf.ZambaConfig(), 76, 13, 7.23), (tf.Zamba2Config(), 54, 9, 2.48)):
        path = _write(tmp_path, config)
        shape = model_shape(path)
        assert shape.params == sum(p.numel() for p in _meta_model(path).parameters())
        assert round(shape.params / 1e9, 2) == billions
        assert shape.layers == layers and shape.hybrid.attention_layers == hybrids
        work, layout = Workload(shape, 32768), Degrees(2, 1, 1)
        split, e = placement(work, layout).split, work.act_bytes
        top, loss = (memory_at(work, layout, moment) for moment in ("layer backward", "loss backward"))
        assert split["held"] > 0  # gathered beside the two largest one-layer units (the loss's backward: one)
        assert top.weights - loss.weights == (split["layer"] + split["held"]) * e
        assert top.grads == (split["root"] + split["layer"] + split["held"]) * e
        shared = shape.hybrid.shared
        layer_params = shape.params - shape.vocab * shape.hidden - shape.hidden - shared.params
        reads = sum(n * _read_bytes(kind, shape, 1) for kind, n in layer_kinds(work, layout))
        assert reads == layer_params + hybrids * (shared.block + shared.adapter)
        assert main(["plan", "--model", path, "--seq-len", "131072", "--gpus", "8", "--ulysses", "2", "--ring", "4",
                     "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        row = plan["candidates"][0]
        forward = row["comm_bytes_per_layer"]["forward"]
        assert forward["ulysses_all_to_all"] > 0 and forward["ring_p2p"] > 0
        assert any(key.startswith("mamba") and forward[key] > 0 for key in forward), forward
        assert sum(b.startswith("shared+") for b in plan["model"]["hybrid"]["blocks"]) == hybrids
