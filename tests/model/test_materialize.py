"""A model built on the meta device and made real by seqmesh (seqmesh.model.materialize) gets the values transformers'
own construction gives, drawn per module name: here the modules whose values come from their constructor, which a
meta build never runs, and which the family's _init_weights does not redraw (transformers' Conv1D in OpenAI-GPT)."""

from __future__ import annotations

import torch


def _built(tmp_path, family: str, seed: int = 0):
    from family_cases import family_config
    from seqmesh.model.lm import build_model

    path = tmp_path / family / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(family_config(family).to_json_string())
    return build_model(str(path), seed=seed)


def test_openai_gpt_conv1d_layers_get_their_constructors_values(tmp_path):
    """Each Conv1D's weight from N(0, 0.02) and its bias zero, as transformers' own from_config gives them (they were
    whatever memory held: 1e24 and 1e-41, the first loss nan), the same for the same seed."""
    import transformers as tf
    from family_cases import family_config

    model, again = _built(tmp_path, "openai-gpt"), _built(tmp_path, "openai-gpt")
    theirs = tf.AutoModelForCausalLM.from_config(family_config("openai-gpt"))
    convs = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(convs) == 8
    for name, conv in convs:
        mine_std, their_std = float(conv.weight.std()), float(theirs.get_submodule(name).weight.std())
        assert abs(mine_std - 0.02) < 0.004 and abs(their_std - 0.02) < 0.004, (name, mine_std, their_std)
        assert torch.equal(conv.bias, torch.zeros_like(conv.bias)), name
        assert torch.equal(conv.weight, again.get_submodule(name).weight), name
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(0, 64, (1, 20))).logits).all()


def test_every_family_is_materialized_as_transformers_initializes_it():
    """Every census family built on the meta device and made real by seqmesh (seqmesh.model.materialize, what
    ``seqmesh train`` does from a config.json) against the same config built by transformers on the CPU: each
    parameter's spread within a factor of 5 of transformers' (both draw from the same distributions, other seeds),
    and a parameter transformers makes constant (a norm's ones, a bias's zeros) equal to it. A parameter no init
    function writes would hold whatever memory held (OpenAI-GPT's Conv1D layers did: 1e24 and 1e-41; Reformer's head
    bias: 7e20)."""
    import transformers as tf

    from census_configs import census_config, census_names
    from seqmesh.model.materialize import materialize

    wrong, compared = [], 0
    for name in census_names():
        config = census_config(name)
        auto = tf.AutoModelForCausalLM if type(config) in tf.AutoModelForCausalLM._model_mapping \
            else tf.AutoModelForImageTextToText
        try:
            torch.manual_seed(0)
            theirs = dict(auto.from_config(config).named_parameters())
            with torch.device("meta"):
                mine = auto.from_config(config)
        except (ImportError, AttributeError):  # a family this environment cannot build (timm; MusicGen's config)
            continue
        materialize(mine, "cpu", 0)
        compared += 1
        for key, p in mine.named_parameters():
            q = theirs.get(key)
            if q is None or p.numel() < 2:
                continue
            p, q = p.detach().double(), q.detach().double()
            spread, their_spread = float(p.std()), float(q.std())
            if not torch.isfinite(p).all() or (their_spread == 0 and not torch.equal(p, q)) or (
                    their_spread > 0 and not 0.2 < spread / their_spread < 5):
                wrong.append(f"{name} {key}: spread {spread:.3g} against {their_spread:.3g}")
    assert compared > 190 and not wrong, (compared, wrong[:10])
