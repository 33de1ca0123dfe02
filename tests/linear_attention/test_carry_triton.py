"""The delta rule's carry across chunks as Triton kernels (seqmesh.linear_attention.carry_triton: a GPU's form of
the loops, one launch each way), run on this CPU by Triton's interpreter (tests/conftest.py). Gated DeltaNet's and
KDA's rules in float32 on the kernels against the recurrence written token by token in float64
(kda_cases.token_loop_kda; Gated DeltaNet's scalar decay is KDA's with every channel alike): outputs, each segment's
final state and the gradient of every input, within 4x the torch loops' own float32 error measured in the same run,
over packed segments (of one token, mid-chunk, from initial states). A state not carried across chunks fails; the
probe a GPU runs first passes the kernels and fails that one."""

from __future__ import annotations

import pytest
import torch

from kda_cases import token_loop_kda

pytest.importorskip("triton")

ROUNDING_MULTIPLE = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled on a GPU, interpreted here
BOUNDS = (0, 1, 2, 40, 41, 90, 100)  # segments of one token, across and inside chunks of 16


def _inputs(decay_per_channel: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, s, h, dk, dv = 2, BOUNDS[-1], 2, 24, 40  # 40 value columns: a block of the kernel's 32 and a partial one
    q, k = (torch.randn(b, s, h, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=g, dtype=torch.float64)
    shape = (b, s, h, dk) if decay_per_channel else (b, s, h)
    decay = -torch.rand(*shape, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(b, s, h, generator=g, dtype=torch.float64)
    initial = torch.randn(b, len(BOUNDS) - 1, h, dk, dv, generator=g, dtype=torch.float64) * 0.3
    return [q, k, v, decay, beta, initial]


def _rule(name: str):
    from seqmesh.linear_attention.gated_delta import chunk_gated_delta_rule_states
    from seqmesh.linear_attention.kda import chunk_kda_states

    if name == "gated_delta":
        return lambda q, k, v, g, beta, initial: chunk_gated_delta_rule_states(q, k, v, g, beta, BOUNDS, initial,
                                                                                chunk=16)
    return lambda q, k, v, g, beta, initial: chunk_kda_states(q, k, v, g, beta, BOUNDS, initial, chunk=16)


def _reference(q, k, v, g, beta, initial):
    per_channel = g if g.dim() == 4 else g[..., None].expand_as(k)
    return token_loop_kda(q, k, v, per_channel, beta, BOUNDS[:-1], initial)


def _values_and_grads(fn, inputs, dtype, device: str = "cpu") -> list[torch.Tensor]:
    leaves = [x.detach().to(device, dtype).requires_grad_() for x in inputs]
    out, finals = fn(*leaves)
    weights = [torch.linspace(-1, 1, x.numel(), dtype=torch.float64, device=device).view(x.shape)
               for x in (out, finals)]
    ((out.double() * weights[0]).sum() + (finals.double() * weights[1]).sum()).backward()
    return [x.detach().double().cpu() for x in [out, finals] + [leaf.grad for leaf in leaves]]


def _errors(got, want) -> list[float]:
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


def _on_the_kernel(monkeypatch):
    """The rules' loops on the Triton kernels, as :func:`gated_delta.carry_kernel` chooses them on a GPU."""
    from seqmesh.linear_attention import carry_triton, gated_delta

    monkeypatch.setattr(gated_delta, "carry_kernel", lambda x: carry_triton)


def _not_carried(monkeypatch):
    """The mutation: every chunk starts its segment again from the segment's initial state, as if the state were not
    carried from the chunk before."""
    from seqmesh.linear_attention import carry_triton

    real = carry_triton.segment_flags

    def restarting(first_chunks, n, device):
        start, end = real(first_chunks, n, device)
        return ((start >= 0).cumsum(0) - 1).to(torch.int32), end

    monkeypatch.setattr(carry_triton, "segment_flags", restarting)


@pytest.mark.parametrize("name", ["gated_delta", "kda"])
def test_the_rules_on_the_kernels_match_the_token_recurrence(name, monkeypatch):
    inputs = _inputs(decay_per_channel=name == "kda")
    exact = _values_and_grads(_reference, inputs, torch.float64)
    rounding = _errors(_values_and_grads(_rule(name), inputs, torch.float32), exact)  # the torch loops
    _on_the_kernel(monkeypatch)
    errors = _errors(_values_and_grads(_rule(name), inputs, torch.float32, DEVICE), exact)
    print(f"{name}: kernel {['%.2g' % e for e in errors]}, torch loops {['%.2g' % r for r in rounding]}")
    assert all(e <= ROUNDING_MULTIPLE * r for e, r in zip(errors, rounding)) and max(rounding) < 1e-4, \
        (errors, rounding)


def test_a_state_not_carried_is_seen(monkeypatch):
    inputs = _inputs(decay_per_channel=False)
    exact = _values_and_grads(_reference, inputs, torch.float64)
    rounding = _errors(_values_and_grads(_rule("gated_delta"), inputs, torch.float32), exact)
    _on_the_kernel(monkeypatch)
    _not_carried(monkeypatch)
    errors = _errors(_values_and_grads(_rule("gated_delta"), inputs, torch.float32, DEVICE), exact)
    assert errors[0] > 100 * ROUNDING_MULTIPLE * rounding[0], (errors, rounding)


def test_the_probe_passes_the_kernels_and_fails_a_wrong_one(monkeypatch):
    """The probe a GPU runs before the kernels' first use (gated_delta.CARRY_PROBE): the kernels pass it; ones that
    do not carry the state fail it, so that device keeps the torch loops."""
    from seqmesh.linear_attention.gated_delta import _probe_carry

    def probe():
        _probe_carry(None, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))

    probe()
    _not_carried(monkeypatch)
    with pytest.raises(RuntimeError, match="carry kernel's loops"):
        probe()


def test_the_kernels_compile_for_hopper_without_spilling(tmp_path):
    """Both kernels compiled for an H100/H200 (sm_90) on this CPU at Gated DeltaNet's and KDA's released sizes (heads
    of 128, chunks of 64; a decay a head and one a state row), within the register file but for the backward's few
    bytes (24 to 32: its float32 product over the 128 key channels holds them in each thread; whole (64, 128) tiles
    spilled 8 KB and asked for 278 KB of shared memory, past Hopper's 227). tests/kernel_compile_cases.py does the
    same for DeepSeek Sparse Attention's kernels."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(here, "kernel_compile_cases.py"), "carry"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    print(report)
    assert set(report) == {"carry forward rows 1", "carry forward rows 128", "carry backward rows 1",
                           "carry backward rows 128"}, report
    for name, usage in report.items():
        assert usage["stack"] <= (64 if "backward" in name else 0) and usage["registers"] <= 255, (name, usage)
        assert usage["shared"] <= 64 * 1024, (name, usage)
