"""seqmesh.memory.rmsnorm against transformers' own RMSNorm: the same loss and gradients in tiny Llama and
Qwen3 models (fp32 and bf16, with and without checkpointing), the saved activations it removes, and the
norms it must leave alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers import GemmaConfig, LlamaConfig, Qwen3Config
from transformers import AutoModelForCausalLM

from seqmesh.memory import MemoryTracker
from seqmesh.memory.rmsnorm import disable_efficient_norm, enable_efficient_norm
from seqmesh.model.fsdp import enable_checkpointing

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5)
CONFIGS = {"llama": (LlamaConfig, 2 * 2 + 1), "qwen3": (Qwen3Config, 2 * 4 + 1)}  # (config, norms): q/k norms in Qwen3
BATCH, LENGTH = 2, 150  # 300 tokens: 5 tiles of hidden 64 in each norm's backward


def _model(kind: str, dtype: torch.dtype, checkpointing: bool) -> nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[kind][0](**SHAPE, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from their all-ones start, so a wrong weight gradient shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.to(dtype)  # the same values in every dtype, rounded
    model.train()
    if checkpointing:
        enable_checkpointing(model)
    return model


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.double() for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    """Largest difference over every parameter gradient, relative to that gradient's largest value."""
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)) for n in a)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_loss_and_every_gradient_match_transformers_norm(kind, checkpointing):
    ids = torch.randint(0, 256, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    exact = _model(kind, torch.float64, checkpointing)  # the noise floor: transformers' model in float64
    _, grads64 = _loss_and_grads(exact, ids)
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(kind, dtype, checkpointing)
        loss, grads = _loss_and_grads(model, ids)
        assert enable_efficient_norm(model) == CONFIGS[kind][1]
        lean_loss, lean_grads = _loss_and_grads(model, ids)
        assert disable_efficient_norm(model) == CONFIGS[kind][1]
        again_loss, again_grads = _loss_and_grads(model, ids)
        assert torch.equal(lean_loss, loss)  # the forward is bitwise transformers'
        assert torch.equal(again_loss, loss) and _worst(again_grads, grads) == 0  # disabled: the class's forward
        floor = _worst(grads, grads64)  # transformers' own error in this dtype
        # measured: fp32 3.3e-7 (Llama) and 6.5e-7 (Qwen3) from transformers' norm against floors of 8.0e-7
        # and 1.1e-6, and 1.04 x the floor from float64 alone; in a fresh clone's suite (another test before it in
        # the worker) Qwen3's read 1.16 x. Each float32 run is one draw of rounding of about the floor's size, so the
        # bound is twice the floor, not a ratio inside the draws' spread; bf16 0 (the same roundings) against
        # 1.4e-2, 2.5e-2
        assert _worst(lean_grads, grads) <= 2 * floor
        assert _worst(lean_grads, grads64) <= 2 * floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_activations_drop_by_the_normalized_tensor(dtype):
    model = _model("llama", dtype, checkpointing=False)
    ids = torch.randint(0, 256, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))

    def saved() -> int:
        with MemoryTracker(model) as tracker:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            after_forward = tracker.current()
            loss.backward()
        model.zero_grad(set_to_none=True)
        return after_forward["activations"]

    plain = saved()
    norms = enable_efficient_norm(model)
    lean = saved()
    # each norm kept its float32 input (in bf16 a copy; in fp32 x itself), float32 rstd and the normalized
    # tensor (compute dtype); now x in its own dtype and rstd: 4 x hidden bytes per token less (fp32: the
    # normalized tensor; bf16: the float32 copy 4H and the bf16 normalized 2H, less x's own 2H kept)
    assert plain - lean == norms * BATCH * LENGTH * 4 * SHAPE["hidden_size"]


class LlamaRMSNorm(nn.Module):
    """A look-alike with a known class name but another formula (the cast before the weight, as Olmo2)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)


def test_other_norms_are_left_as_they_are():
    gemma = AutoModelForCausalLM.from_config(GemmaConfig(**SHAPE))  # (1 + weight): not this formula
    with pytest.warns(UserWarning, match="GemmaRMSNorm"):
        assert enable_efficient_norm(gemma) == 0
    impostor = nn.Sequential(LlamaRMSNorm(8))
    with pytest.warns(UserWarning, match="LlamaRMSNorm"):
        assert enable_efficient_norm(impostor) == 0  # the name matches, the bitwise probe does not
    assert "forward" not in impostor[0].__dict__
    with pytest.raises(ValueError, match="tiles"):
        enable_efficient_norm(impostor, tiles=0)



def test_the_probe_runs_on_fake_modules_without_copying_them():
    """Under a rehearsal's fake mode the probe decides as on real tensors (Llama's norm yes, Gemma's and the
    impostor's no) and leaves the module untouched; it used to deep-copy the module, which fake mode refuses."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as TransformersNorm

    from seqmesh.memory.rmsnorm import matches_llama_norm

    with FakeTensorMode():
        norms = [TransformersNorm(8), GemmaRMSNorm(8), LlamaRMSNorm(8)]
        weights = [norm.weight for norm in norms]
        assert [matches_llama_norm(norm) for norm in norms] == [True, False, False]
    assert all(norm.weight is w and is_fake(w) for norm, w in zip(norms, weights))

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_holds_one_tile_of_float32_temporaries(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as TransformersNorm

    hidden, length = 64, 4096  # 64 tiles of 64 tokens
    grown = {}
    for lean in (False, True):
        norm = TransformersNorm(hidden).to(dtype)
        if lean:
            enable_efficient_norm(norm)
        x = torch.randn(1, length, hidden, dtype=dtype, requires_grad=True)
        y = norm(x)  # (1, L, H); forward outside the tracker: its own temporaries would set the peak
        grad = torch.randn_like(y)
        with MemoryTracker(norm) as tracker:  # counts storages as ops touch them: x, y and grad now
            for t in (x, y, grad):
                t.view_as(t)
            before = sum(tracker.current().values())
            y.backward(grad)
        grown[lean] = tracker.report().peak_bytes - before  # + tensors first touched in backward (saved ones)
    full, tile = length * hidden * 4, hidden * hidden * 4  # one float32 (L, H) / (tile, H) tensor
    dx = length * hidden * x.element_size()
    working = (2 if dtype == torch.float32 else 3) * tile  # x.float() (a copy in bf16), dn and one product
    rstd = length * 4  # the saved float32 scale, first touched in backward
    assert dx + working <= grown[True] <= dx + working + rstd + tile // 8  # + the (tile, 1) scales and sums
    # transformers' norm: 5.0 (fp32) and 6.0 (bf16) float32 (L, H) tensors, its saved ones included
    assert grown[False] >= 4.9 * full
