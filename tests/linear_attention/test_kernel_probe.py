"""A recurrent kernel that fails on its device falls back to seqmesh's torch rule with one warning (issue 46).

flash-linear-attention 0.6 on an H200 with torch 2.11's Triton 3.6 built the model, ran the forward and raised in the
first backward: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg ...".
No GPU here: stand-ins for the package, with its call signature, run on the CPU (the probe's device types are an
argument), one raising that error in its backward as the package does, one that works."""

from __future__ import annotations

import warnings

import pytest
import torch

from seqmesh.linear_attention import kernels
from seqmesh.kernels.probe import Kernel, KernelFallbackWarning, KernelProbe

HOPPER_ERROR = ("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg. "
                "Please upgrade Triton to >= 3.7.1 or install tilelang")
NO_STATE = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(HOPPER_ERROR)


class StandIn:
    """``chunk_gated_delta_rule``'s keyword signature (flash-linear-attention 0.6); records each call and the
    backward passes it took part in; ``refuses``: raise the Hopper error in backward, as the package does."""

    def __init__(self, refuses: bool):
        self.refuses, self.calls, self.backwards = refuses, [], 0

    def __call__(self, q, k, v, *, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, initial_state=None,
                 output_final_state=False):
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and int(cu_seqlens[-1]) == q.shape[1]
        assert g.dtype == torch.float32 and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        self.calls.append(q.shape)
        out = (v * beta[..., None]).float()
        out = _RaisesInBackward.apply(out) if self.refuses else out
        if out.requires_grad:
            out.register_hook(self._count)
        final = initial_state.clone() if output_final_state else None
        return out.to(v.dtype), final

    def _count(self, grad):
        self.backwards += 1


def _probe(stand_in: StandIn | None) -> KernelProbe:
    return KernelProbe({"chunk_gated_delta_rule": Kernel("flash-linear-attention", lambda: stand_in,
                                                         kernels._probe_gated_delta)}, devices=("cpu",))


def test_a_kernel_that_fails_in_backward_is_refused_once_with_the_fix():
    stand_in = StandIn(refuses=True)
    probe = _probe(stand_in)
    with pytest.warns(KernelFallbackWarning) as caught:
        assert not probe.works("chunk_gated_delta_rule", torch.device("cpu"))
    (warning,) = caught
    said = str(warning.message)
    for part in ("flash-linear-attention's chunk_gated_delta_rule fails on cpu", "RuntimeError: Triton >= 3.4.0",
                 "torch rule", "upgrade Triton to >= 3.7.1 or install tilelang", "uninstall flash-linear-attention"):
        assert part in said, said
    assert len(stand_in.calls) == 2  # the all-to-all design's call and state passing's, forward both
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is kept: no second probe, no second warning
        assert not probe.works("chunk_gated_delta_rule", torch.device("cpu"))
        assert probe.probe_all(torch.device("cpu")) == {"chunk_gated_delta_rule": False}
    assert len(stand_in.calls) == 2


def test_a_refusal_the_package_states_is_read_before_the_kernel_runs():
    """A package whose flags say it will refuse this device is not run (on an H200 the probe otherwise compiled and
    autotuned the forward's kernels for over a minute before the backward raised): one warning, with its words."""
    stand_in = StandIn(refuses=True)
    probe = KernelProbe({"chunk_gated_delta_rule": Kernel(
        "flash-linear-attention", lambda: stand_in, kernels._probe_gated_delta,
        lambda device: f"RuntimeError: {HOPPER_ERROR} (read from its flags)")}, devices=("cpu",))
    with pytest.warns(KernelFallbackWarning) as caught:
        assert not probe.works("chunk_gated_delta_rule", torch.device("cpu"))
    (warning,) = caught
    assert "fails on cpu (RuntimeError: Triton >= 3.4.0" in str(warning.message)
    assert "(read from its flags)" in str(warning.message)
    assert stand_in.calls == []


@pytest.mark.parametrize("capability, above_3_4, above_3_7_1, tilelang, refused", [
    ((9, 0), True, False, False, True),   # an H100 or H200 with torch 2.11's Triton 3.6
    ((9, 0), True, True, False, False),   # Triton 3.7.1
    ((9, 0), False, False, False, False),  # Triton 3.3
    ((9, 0), True, False, True, False),   # tilelang installed: the package computes that backward with it
    ((8, 0), True, False, False, False),  # an A100
    ((9, 0), None, None, False, False),   # a release without these flags: the probe runs the kernel
])
def test_flash_linear_attentions_refusal_is_read_from_its_flags(monkeypatch, capability, above_3_4, above_3_7_1,
                                                                 tilelang, refused):
    import importlib.machinery
    import sys
    import types

    env = types.ModuleType("fla.utils.env")
    if above_3_4 is not None:
        env.TRITON_ABOVE_3_4_0, env.TRITON_ABOVE_3_7_1 = above_3_4, above_3_7_1
    utils = types.ModuleType("fla.utils")
    utils.env = env
    for name, module in (("fla", types.ModuleType("fla")), ("fla.utils", utils), ("fla.utils.env", env)):
        monkeypatch.setitem(sys.modules, name, module)
    if tilelang:
        stand_in = types.ModuleType("tilelang")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("tilelang", None)
        monkeypatch.setitem(sys.modules, "tilelang", stand_in)
    else:
        monkeypatch.setitem(sys.modules, "tilelang", None)  # not importable, whatever this machine has
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = kernels._fla_refuses_gated_backward(torch.device("cuda", 0))
    assert (reason is not None) == refused, reason
    if refused:
        assert "Hopper" in reason and "Triton >= 3.4.0 and < 3.7.1" in reason
    assert kernels._fla_refuses_gated_backward(torch.device("cpu")) is None


def test_a_kernel_that_runs_is_kept_and_the_callers_step_sees_nothing_of_the_probe():
    """The probe runs forward and backward in its own thread: the caller's no_grad, its saved-tensor hooks
    (checkpointing, the memory tracker) and its random stream are untouched."""
    stand_in = StandIn(refuses=False)
    probe = _probe(stand_in)
    packed = []
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with warnings.catch_warnings(), torch.no_grad(), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        warnings.simplefilter("error")
        assert probe.works("chunk_gated_delta_rule", torch.device("cpu"))
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.rand(3), expected)
    assert packed == [] and stand_in.backwards == 2 and len(stand_in.calls) == 2


def test_an_absent_package_or_another_device_is_not_probed():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _probe(None).works("chunk_gated_delta_rule", torch.device("cpu"))
        stand_in = StandIn(refuses=True)
        assert not KernelProbe(_probe(stand_in).kernels).works("chunk_gated_delta_rule", torch.device("cpu"))
    assert stand_in.calls == []


def test_the_layer_runs_the_torch_rule_where_the_kernel_failed_and_the_kernel_where_it_runs(monkeypatch):
    """``kernels.gated_delta_rule`` as a Gated DeltaNet layer calls it: with the refusing package, one warning and
    transformers' chunked rule's result (the bound: 4x its distance from transformers' recurrent rule, as in
    test_linear_attention); with the working one, the package's output."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                               torch_recurrent_gated_delta_rule)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, 8, generator=g) for _ in range(3))
    decay, beta = -torch.rand(1, 70, 2, generator=g), torch.rand(1, 70, 2, generator=g)
    theirs = [rule(q, k, v, decay, beta, **NO_STATE)[0].double()
              for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)]
    rounding = float((theirs[0] - theirs[1]).abs().max())

    refusing = StandIn(refuses=True)
    monkeypatch.setattr(kernels, "PROBE", _probe(refusing))
    with pytest.warns(KernelFallbackWarning):
        out = kernels.gated_delta_rule(q, k, v, decay, beta, (0, 70))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = kernels.gated_delta_rule(q, k, v, decay, beta, (0, 70))
    assert len(refusing.calls) == 2  # the probe's two calls only: the layer never called the failing kernel
    assert float((out.double() - theirs[0]).abs().max()) <= 4 * rounding
    assert torch.equal(out, again)

    working = StandIn(refuses=False)
    monkeypatch.setattr(kernels, "PROBE", _probe(working))
    out = kernels.gated_delta_rule(q, k, v, decay, beta, (0, 70))
    assert working.calls[-1] == (1, 70, 2, 8) and len(working.calls) == 3
    assert torch.equal(out, v * beta[..., None])  # what the stand-in computes


def test_fake_tensors_never_reach_a_kernel(monkeypatch):
    """A rehearsal's fake tensors take the torch rule: no kernel is probed or launched for them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    stand_in = StandIn(refuses=False)
    monkeypatch.setattr(kernels, "PROBE", _probe(stand_in))
    with FakeTensorMode():
        q = torch.randn(1, 70, 2, 8)
        assert kernels.kernel("chunk_gated_delta_rule", q) is None
    assert stand_in.calls == []


def test_selftest_reports_each_kernel_as_it_runs_here(monkeypatch):
    """``seqmesh selftest`` on a GPU names each optional kernel: runs, absent, or fails (the torch rule instead)."""
    from seqmesh.tools.selftest import recurrent_kernels

    stand_ins = {"refusing": StandIn(refuses=True), "working": StandIn(refuses=False), "absent": None}
    found = {name: Kernel("flash-linear-attention", lambda s=s: s, kernels._probe_gated_delta)
             for name, s in stand_ins.items()}
    monkeypatch.setattr(kernels, "KERNELS", found)
    monkeypatch.setattr(kernels, "PROBE", KernelProbe(found, devices=("cpu",)))
    with pytest.warns(KernelFallbackWarning):
        said = recurrent_kernels(torch.device("cpu"))
    assert said == {"refusing": "fails", "working": "runs", "absent": "absent"}


class KdaStandIn:
    """``chunk_kda``'s keyword signature (flash-linear-attention 0.6), computing the recurrence token by token
    (kda_cases.token_loop_kda) over each segment of ``cu_seqlens``; ``forgets``: it drops the initial state, the
    kind of kernel that runs but answers otherwise."""

    def __init__(self, forgets: bool = False):
        self.forgets, self.calls = forgets, []

    def __call__(self, q, k, v, *, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, initial_state=None,
                 output_final_state=False):
        from kda_cases import token_loop_kda

        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and int(cu_seqlens[-1]) == q.shape[1]
        assert g.dtype == torch.float32 and g.shape == q.shape and use_qk_l2norm_in_kernel
        assert scale == q.shape[-1] ** -0.5  # the loop scales by it too
        self.calls.append(q.shape)
        initial = None if initial_state is None or self.forgets else initial_state[None]
        out, finals = token_loop_kda(q.float(), k.float(), v.float(), g, beta.float(), tuple(cu_seqlens[:-1].tolist()),
                                     initial)
        return out.to(v.dtype), finals[0] if output_final_state else None


def _kda_probe(stand_in: KdaStandIn) -> KernelProbe:
    return KernelProbe({"chunk_kda": Kernel("flash-linear-attention", lambda: stand_in, kernels._probe_kda)},
                       devices=("cpu",))


def test_chunk_kda_is_called_as_the_package_takes_it_and_held_to_the_torch_rule(monkeypatch):
    """KDA's layers call flash-linear-attention's ``chunk_kda`` where it runs (kernels.kda_rule_states): rows laid
    end to end as segments, the l2norm in the kernel, the scale, initial and final states per segment. A stand-in
    that computes the recurrence token by token passes the probe, and the layers' call through it equals seqmesh's
    torch rule (float64, two rows of two documents from initial states); one that drops the initial states fails the
    probe, with one warning, and the torch rule runs."""
    from seqmesh.linear_attention.kda import chunk_kda_states

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    decay = -torch.rand(2, 40, 2, 8, generator=g, dtype=torch.float64)
    beta = torch.rand(2, 40, 2, generator=g, dtype=torch.float64)
    initial = torch.randn(2, 2, 2, 8, 8, generator=g, dtype=torch.float64)
    bounds = (0, 13, 40)
    want = chunk_kda_states(q, k, v, decay, beta, bounds, initial)

    faithful = KdaStandIn()
    monkeypatch.setattr(kernels, "PROBE", _kda_probe(faithful))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kernels.kda_rule_states(q, k, v, decay, beta, bounds, initial)
    assert len(faithful.calls) == 1 + 1  # the probe's, then the layer's
    for a, b in zip(got, want):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-6, float((a - b).abs().max())

    forgetting = KdaStandIn(forgets=True)
    monkeypatch.setattr(kernels, "PROBE", _kda_probe(forgetting))
    with pytest.warns(KernelFallbackWarning, match="chunk_kda"):
        got = kernels.kda_rule_states(q, k, v, decay, beta, bounds, initial)
    assert len(forgetting.calls) == 1  # the probe's only
    assert all(torch.equal(a, b) for a, b in zip(got, want))
