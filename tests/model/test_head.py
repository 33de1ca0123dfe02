"""SequenceParallelLM's loss is the model's own: a constant logit scale (Cohere, Granite), a final soft-cap
(Gemma 2) and the LM head's bias (Phi) applied, anything else the model's forward does to its logits refused by name when the model is wrapped
(seqmesh.model.head)."""

from __future__ import annotations

import pytest
import torch

from seqmesh.model.lm import SequenceParallelLM

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(family: str, **settings):
    import transformers as tf

    config = {"cohere": tf.CohereConfig, "granite": tf.GraniteConfig, "gemma2": tf.Gemma2Config,
              "phi": tf.PhiConfig, "roberta": tf.RobertaConfig, "llama": tf.LlamaConfig, "bert": tf.BertConfig,
              "xlm": tf.XLMConfig}[family](**SMALL, **settings)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def _loss_and_gradients_match(sp, ids, targets, want, grads: dict) -> float:
    """``sp``'s loss of ``ids`` (one process, 40 tokens) within 64 float64 ulps of ``want``, and every parameter's
    gradient within 1e-12 of ``grads`` (the reference's, each relative to its largest entry); the loss's tolerance."""
    got = sp(ids, torch.arange(40)[None], targets)
    got.backward()
    tolerance = 64 * torch.finfo(torch.float64).eps * float(want)
    assert abs(float(got - want)) < tolerance, (float(got), float(want))
    for name, p in sp.lm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-12 * float(grads[name].abs().max()) + 1e-15, rtol=0,
                                   msg=name)
    return tolerance


@pytest.mark.parametrize("family,settings,scale,softcap", [
    ("cohere", {"logit_scale": 0.3}, 0.3, None),
    ("granite", {"logits_scaling": 4.0}, 0.25, None),
    ("gemma2", {"final_logit_softcapping": 0.5, "head_dim": 8}, 1.0, 0.5),  # a cap that bites: logits of about 1
    ("llama", {}, 1.0, None),
    ("phi", {}, 1.0, None),  # a bias on the LM head, here drawn away from its zero init
    ("bert", {"is_decoder": True, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, 1.0, None),
    # (bert: a prediction head, dense, activation and norm, holding the biased projection)
    ("xlm", {"causal": True, "dropout": 0.0, "attention_dropout": 0.0}, 1.0, None),
    # (xlm: a prediction layer holding its biased projection alone, returning a tuple of its logits)
])
def test_the_loss_is_the_models_own(family, settings, scale, softcap):
    """The wrapped loss (one process, chunks of 7 tokens) and every gradient (the head's bias too) equal the
    cross-entropy of the model's own logits (float64), whose forward scales, soft-caps or biases them; without the
    scale, the cap or the bias they would not."""
    model = _model(family, **settings)
    head_bias = model.get_output_embeddings().bias
    if head_bias is not None:
        with torch.no_grad():
            head_bias.copy_(torch.randn(head_bias.shape, generator=torch.Generator().manual_seed(3), dtype=head_bias.dtype))
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.cross_entropy(model(input_ids=ids, use_cache=False).logits[0, :-1], ids[0, 1:])
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    sp = SequenceParallelLM(model, None, chunk=7)
    assert (sp.logit_scale, sp.logit_softcap) == (pytest.approx(scale), softcap)
    tolerance = _loss_and_gradients_match(sp, ids, targets, want, grads)
    if (scale, softcap) != (1.0, None):  # the scale or the cap left out is far outside
        sp.logit_scale, sp.logit_softcap = 1.0, None
        with torch.no_grad():
            assert abs(float(sp(ids, torch.arange(40)[None], targets) - want)) > 1e6 * tolerance
    if head_bias is not None:  # and so is the bias left out
        model.get_output_embeddings().bias = None
        with torch.no_grad():
            assert abs(float(sp(ids, torch.arange(40)[None], targets) - want)) > 1e6 * tolerance


@pytest.mark.parametrize("family,settings,words", [
    ("cohere", {"logit_scale": 0.3}, None),  # a bias beside a scale: below, on a Phi made to scale its logits
    # XLM's prediction layer as if with adaptive softmax (transformers 5.24 cannot build one): its other branch
    ("xlm", {"causal": True}, ["XLMPredLayer", "does not return its proj's result as it is"]),
])
def test_what_the_loss_would_not_reproduce_is_refused(family, settings, words):
    model = _model(family, **settings)
    if family == "xlm":
        model.pred_layer.asm = True
    if words is None:  # a biased head whose logits are also scaled: the loss scales the hidden states, not the bias
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features, dtype=torch.float64))
        words = ["adds a bias to logits it also scales by 0.3"]
    with pytest.raises(ValueError) as err:
        SequenceParallelLM(model, None)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "model(**batch).logits" in str(err.value)


def test_a_condition_that_does_not_hold_is_not_refused():
    """Gemma 2 without final soft-capping: the capping branch of its forward does not run, and the loss is its own."""
    sp = SequenceParallelLM(_model("gemma2", final_logit_softcapping=None, head_dim=8), None)
    assert (sp.logit_scale, sp.logit_softcap) == (1.0, None)


def test_modernbert_decoders_prediction_head_is_applied_by_the_loss():
    """ModernBERT-decoder names its LM's output projection ``decoder``, which transformers' get_decoder() returns:
    seqmesh takes its model as the decoder (its positions then reach it: the census finds it exact). Its logits are
    ``decoder(lm_head(hidden))``, a per-token prediction head (dense, activation, norm) and a biased projection: the
    wrapped loss applies the head to each token's state and adds the bias, its value and every gradient those of the
    model's own logits; without the head it would not be."""
    from census_configs import build, census_config
    from seqmesh.model.lm import decoder_of

    model = build(census_config("modernbert-decoder"))
    assert decoder_of(model) is model.model
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.cross_entropy(model(input_ids=ids, use_cache=False).logits[0, :-1], ids[0, 1:])
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    sp = SequenceParallelLM(model, None, chunk=7)
    assert sp.logit_transform == "lm_head"
    got = sp(ids, torch.arange(40)[None], targets)
    got.backward()
    tolerance = 64 * torch.finfo(torch.float64).eps * float(want)
    assert abs(float(got - want)) < tolerance, (float(got), float(want))
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], atol=1e-12 * float(grads[name].abs().max()) + 1e-15,
                                       rtol=0, msg=name)
    sp.logit_transform = None
    with torch.no_grad():
        assert abs(float(sp(ids, torch.arange(40)[None], targets) - want)) > 1e6 * tolerance


def test_a_phi_config_json_with_its_head_bias_verifies_and_trains(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` on a ring of 2 with FSDP2 from Phi's config.json (its LM head's
    bias sharded with the head, its gradient from the chunked loss): the single process's loss, then training."""
    import math

    from census_configs import census_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, census_config("phi"))
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_a_soft_cap_module_is_read_and_anything_else_refused():
    """Inkling 2 soft-caps its logits with a module (``logit_softcap``, ``tanh(x / c) * c``): the loss reads it as the
    cap, and its loss equals the model's own; a module of the same shape that does anything more is refused."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Inkling2TextConfig"):
        pytest.skip("Inkling 2 is not in this transformers")
    from census_configs import build, census_config

    model = build(census_config("inkling2_text"))  # float64 but its router; final_logit_softcapping 30
    model.config.final_logit_softcapping = 2.0  # a cap that bites
    model.logit_softcap.softcap = 2.0
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(1))
    sp = SequenceParallelLM(model, None, chunk=7)
    assert sp.logit_softcap == 2.0
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():  # its logits are float32 (the head's output cast): their rounding bounds the difference
        want = torch.nn.functional.cross_entropy(model(input_ids=ids, use_cache=False).logits[0, :-1].double(),
                                                 ids[0, 1:])
        got = sp(ids, torch.arange(40)[None], targets)
    assert abs(float(got - want)) < 1e-6 * float(want), (float(got), float(want))

    class Doubled(torch.nn.Module):  # a cap, then twice it: not a soft-cap
        softcap = 2.0

        def forward(self, x):
            return torch.tanh(x / self.softcap) * self.softcap * 2

    model.logit_softcap = Doubled()
    with pytest.raises(ValueError, match="logits = self.logit_softcap"):
        SequenceParallelLM(model, None)


def _reads_a_cap_of_two(model, ids) -> None:
    """The loss of ``model`` (its final soft-cap 2) reads the cap, and its loss of ``ids`` (1, 40) equals the capped
    logits' in float64, plain PyTorch on the decoder's output; without the cap, far outside."""
    sp = SequenceParallelLM(model, None, chunk=7)
    assert sp.logit_softcap == 2.0
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # float64
        want = torch.nn.functional.cross_entropy(2.0 * torch.tanh(model.lm_head(hidden) / 2.0)[0, :-1], ids[0, 1:])
        got = sp(ids, torch.arange(40)[None], targets)
    tolerance = 64 * torch.finfo(torch.float64).eps * float(want)
    assert abs(float(got - want)) < tolerance, (float(got), float(want))
    sp.logit_softcap = None  # without the cap: far outside
    with torch.no_grad():
        assert abs(float(sp(ids, torch.arange(40)[None], targets) - want)) > 1e6 * tolerance


def test_beams_soft_cap_after_a_float32_cast_is_read():
    """Beam soft-caps like Gemma 2 but casts first (``logits = logits.float() / cap``): the cast changes no value the
    loss sees, so the loss reads the cap, and its loss equals the capped logits' in float64 (plain PyTorch on the
    decoder's output; the model's own rounds them to float32: 1.8e-9 off here)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "BeamConfig"):
        pytest.skip("Beam is not in this transformers")
    from census_configs import build, census_config

    config = census_config("beam")
    config.final_logit_softcapping = 2.0  # a cap that bites
    _reads_a_cap_of_two(build(config), torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", ["gemma4", "gemma4_unified"])
def test_gemma4s_soft_cap_behind_an_assignment_in_its_condition_is_read(name):
    """Gemma 4's multimodal class reads its cap inside the condition (``if (c := self.config.get_text_config()
    .final_logit_softcapping) is not None``) and divides by the local name: the loss reads the cap, and its loss
    equals the capped logits' in float64 (plain PyTorch on the decoder's output); without a cap, none is read."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4Config"):
        pytest.skip("Gemma 4 is not in this transformers")
    from census_configs import build, census_config

    config = census_config(name)
    assert SequenceParallelLM(build(config), None).logit_softcap is None  # the census's config: no cap
    config.get_text_config().final_logit_softcapping = 2.0  # a cap that bites
    _reads_a_cap_of_two(build(config), torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(1)))


def test_dorys_learned_logit_scale_is_a_scale_of_the_heads_rows():
    """Dory's head scales each logit by a learned weight (``(x W^T).float() * (s * f)``): the loss scales W's rows by
    ``s f`` instead, and its loss and the gradients of W, s and the decoder equal plain PyTorch's on the decoder's
    output in float64 (the model's own casts its logits to float32)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DoryConfig"):
        pytest.skip("Dory is not in this transformers")
    from census_configs import build, census_config

    model = build(census_config("dory"))
    head = model.lm_head
    with torch.no_grad():  # a scale that differs from logit to logit
        head.logit_scale.copy_(torch.rand(head.logit_scale.shape, generator=torch.Generator().manual_seed(2),
                                          dtype=torch.float64) / head.logit_scale_factor)
    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(1))
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # float64
    logits = (hidden @ head.weight.T) * (head.logit_scale * head.logit_scale_factor)
    want = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sp = SequenceParallelLM(model, None, chunk=7)
    assert sp.logit_column_scale == ("logit_scale", head.logit_scale_factor)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    tolerance = _loss_and_gradients_match(sp, ids, targets, want, grads)
    sp.logit_column_scale = None  # without the scale: far outside
    with torch.no_grad():
        assert abs(float(sp(ids, torch.arange(40)[None], targets) - want)) > 1e6 * tolerance


def test_a_head_that_does_more_than_scale_its_logits_is_refused():
    """A Dory-shaped head whose linear map reads another input (``super().forward(x * 3)``), or whose ``super()`` is
    not ``nn.Linear``'s own forward (a parent that caps), is not a scale of W's rows: refused, as any head with a
    forward of its own."""
    class Scaled(torch.nn.Linear):
        def __init__(self):
            super().__init__(32, 64, bias=False)
            self.logit_scale = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            logits = super().forward(x * 3).float()
            return logits * (self.logit_scale.float() * 2.0)

    class Capped(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x).tanh()

    class OverCapped(Capped):
        def __init__(self):
            super().__init__(32, 64, bias=False)
            self.logit_scale = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            logits = super().forward(x).float()
            return logits * (self.logit_scale.float() * 2.0)

    for head in (Scaled(), OverCapped()):
        model = _model("llama")
        model.lm_head = head.to(torch.float64)
        with pytest.raises(ValueError, match="computes its logits with a forward of its own"):
            SequenceParallelLM(model, None)
