"""The recurrent rules' loops over chunks as Triton kernels, a GPU's form of them (one launch each way): the delta
rule's carry (seqmesh.linear_attention.carry_triton: Gated DeltaNet, KDA) and the scalar-decay scan's
(decay_scan_triton: Mamba2, lightning attention), run on this CPU by Triton's interpreter (tests/conftest.py). Each
rule in float32 on its kernels against the recurrence written token by token in float64 (kda_cases.token_loop_kda;
Gated DeltaNet's scalar decay is KDA's with every channel alike; linear_cases.token_loop_decay): outputs, each
segment's final state and the gradient of every input, within 4x the torch loops' own float32 error measured in the
same run, over packed segments (of one token, mid-chunk, from initial states). A state not carried across chunks
fails; the probe a GPU runs first passes the kernels and fails that one; both compile for Hopper."""

from __future__ import annotations

import pytest
import torch

from kda_cases import token_loop_kda
from linear_cases import token_loop_decay

pytest.importorskip("triton")

ROUNDING_MULTIPLE = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled on a GPU, interpreted here
BOUNDS = (0, 1, 2, 40, 41, 90, 100)  # segments of one token, across and inside chunks of 16


def _inputs(name: str, seed: int = 0, from_zero: bool = False):
    """Two rows of 100 tokens, 2 heads of 24 keys and 40 values (a block of the carry kernel's 16 columns and a partial
    one; the scan kernel's state elements past a block), the segments :data:`BOUNDS` each from an initial state: q,
    k, v, g, beta (not the scan's: it writes k v^T whole), initial."""
    g = torch.Generator().manual_seed(seed)
    b, s, h, dk, dv = 2, BOUNDS[-1], 2, 24, 40
    q, k = (torch.randn(b, s, h, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=g, dtype=torch.float64)
    shape = (b, s, h, dk) if name == "kda" else (b, s, h)
    decay = -torch.rand(*shape, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(b, s, h, generator=g, dtype=torch.float64)
    initial = torch.randn(b, len(BOUNDS) - 1, h, dk, dv, generator=g, dtype=torch.float64) * 0.3
    initial = None if from_zero else initial  # None: each kernel's form without an initial state
    return [q, k, v, decay, initial] if name == "decay_scan" else [q, k, v, decay, beta, initial]


def _rule(name: str, chunk: int = 16):
    from seqmesh.linear_attention.decay_scan import chunk_decay_scan
    from seqmesh.linear_attention.gated_delta import chunk_gated_delta_rule_states
    from seqmesh.linear_attention.kda import chunk_kda_states

    if name == "decay_scan":
        return lambda q, k, v, g, initial: chunk_decay_scan(q, k, v, g, BOUNDS, initial, chunk=chunk)
    rule = chunk_gated_delta_rule_states if name == "gated_delta" else chunk_kda_states
    return lambda q, k, v, g, beta, initial: rule(q, k, v, g, beta, BOUNDS, initial, chunk=chunk)


def _reference(name: str):
    if name == "decay_scan":
        return lambda q, k, v, g, initial: token_loop_decay(q, k, v, g, list(BOUNDS[:-1]), initial)

    def delta(q, k, v, g, beta, initial):
        per_channel = g if g.dim() == 4 else g[..., None].expand_as(k)  # Gated DeltaNet: every channel alike
        return token_loop_kda(q, k, v, per_channel, beta, BOUNDS[:-1], initial)
    return delta


def _values_and_grads(fn, inputs, dtype, device: str = "cpu") -> list[torch.Tensor]:
    leaves = [None if x is None else x.detach().to(device, dtype).requires_grad_() for x in inputs]
    out, finals = fn(*leaves)
    weights = [torch.linspace(-1, 1, x.numel(), dtype=torch.float64, device=device).view(x.shape)
               for x in (out, finals)]
    ((out.double() * weights[0]).sum() + (finals.double() * weights[1]).sum()).backward()
    return [x.detach().double().cpu() for x in [out, finals] + [leaf.grad for leaf in leaves if leaf is not None]]


def _errors(got, want) -> list[float]:
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


def _on_the_kernels(monkeypatch):
    """The rules' loops on the Triton kernels, as ``carry_kernel`` and ``scan_kernel`` choose them on a GPU."""
    from seqmesh.linear_attention import carry, carry_triton, decay_scan, decay_scan_triton

    monkeypatch.setattr(carry, "carry_kernel", lambda x: carry_triton)
    monkeypatch.setattr(decay_scan, "scan_kernel", lambda x: decay_scan_triton)


def _not_carried(monkeypatch):
    """The mutation: every chunk starts its segment again from the segment's initial state, as if the state were not
    carried from the chunk before (in both kernels)."""
    from seqmesh.linear_attention import carry_triton

    def restarting(real):
        def flags(*args):
            start, end = real(*args)
            return ((start >= 0).cumsum(0) - 1).to(torch.int32), end
        return flags

    monkeypatch.setattr(carry_triton, "segment_flags", restarting(carry_triton.segment_flags))  # both kernels' flags


RULES = ["gated_delta", "kda", "decay_scan"]


@pytest.mark.parametrize("name,chunk,from_zero", [(name, 16, False) for name in RULES] + [("kda", 64, True)],
                         ids=[*RULES, "kda-chunks-of-64-from-zero"])
def test_the_rules_on_the_kernels_match_the_token_recurrence(name, chunk, from_zero, monkeypatch):
    """Chunks of 16 (one block of the carry kernel's rows) from initial states; and chunks of 64, the rules' own
    (four blocks of rows: the backward's blocks of intra below the diagonal), from zero, as a layer's step runs."""
    inputs = _inputs(name, from_zero=from_zero)
    exact = _values_and_grads(_reference(name), inputs, torch.float64)
    rounding = _errors(_values_and_grads(_rule(name, chunk), inputs, torch.float32), exact)  # the torch loops
    _on_the_kernels(monkeypatch)
    errors = _errors(_values_and_grads(_rule(name, chunk), inputs, torch.float32, DEVICE), exact)
    print(f"{name}: kernel {['%.2g' % e for e in errors]}, torch loops {['%.2g' % r for r in rounding]}")
    assert all(e <= ROUNDING_MULTIPLE * r for e, r in zip(errors, rounding)) and max(rounding) < 1e-4, \
        (errors, rounding)


@pytest.mark.parametrize("name", ["gated_delta", "decay_scan"])
def test_a_state_not_carried_is_seen(name, monkeypatch):
    inputs = _inputs(name)
    exact = _values_and_grads(_reference(name), inputs, torch.float64)
    rounding = _errors(_values_and_grads(_rule(name), inputs, torch.float32), exact)
    _on_the_kernels(monkeypatch)
    _not_carried(monkeypatch)
    errors = _errors(_values_and_grads(_rule(name), inputs, torch.float32, DEVICE), exact)
    assert errors[0] > 100 * ROUNDING_MULTIPLE * rounding[0], (errors, rounding)


def test_the_probes_pass_the_kernels_and_fail_wrong_ones(monkeypatch):
    """The probes a GPU runs before the kernels' first use (carry.CARRY_PROBE, decay_scan.SCAN_PROBE): the
    kernels pass them; ones that do not carry the state fail them, so that device keeps the torch loops."""
    from seqmesh.linear_attention import carry_triton, decay_scan_triton
    from seqmesh.linear_attention.carry import _probe_carry
    from seqmesh.linear_attention.decay_scan import _probe_scan

    def probes():
        _probe_carry(carry_triton, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))
        _probe_scan(decay_scan_triton, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))

    probes()
    _not_carried(monkeypatch)
    with pytest.raises(RuntimeError, match="carry kernel's loops"):
        _probe_carry(carry_triton, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))
    with pytest.raises(RuntimeError, match="scan kernel's loops"):
        _probe_scan(decay_scan_triton, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))


def test_the_kernels_compile_for_hopper_without_spilling(tmp_path):
    """The kernels compiled for an H100/H200 (sm_90) on this CPU, the carry's at Gated DeltaNet's and KDA's released
    sizes (heads of 128, chunks of 64; a decay a head and one a state row), within the register file but for its
    backward's few
    bytes (16 to 24: its float32 product over the 128 key channels holds them in each thread; whole (64, 128) tiles
    spilled 8 KB and asked for 278 KB of shared memory, past Hopper's 227), and the scan's.
    tests/kernel_compile_cases.py does the same for DeepSeek Sparse Attention's kernels."""
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
                           "carry backward rows 128", "scan forward", "scan backward"}, report
    for name, usage in report.items():
        assert usage["stack"] <= (32 if name.startswith("carry backward") else 0), (name, usage)
        assert usage["registers"] <= 255, (name, usage)
        assert usage["shared"] <= 64 * 1024, (name, usage)
