"""Links several GPUs share inside a node (a PCIe switch's uplink): loads computed by hand, and the layouts
the published measurements put first on 8 L20s over PCIe, one NVLink node and two."""

from __future__ import annotations

import json

import pytest

from planner_cases import in_process
from seqmesh.planner.hardware import PRESETS as HARDWARE
from seqmesh.planner.network import shared_links_load, shared_links_seconds

L20 = HARDWARE["l20-pcie"]
HOST = 1  # the pcie-host level: 4 GPUs per switch share one 12 GB/s uplink


def test_an_all_to_all_over_both_switches_loads_each_uplink_with_16_7():
    """U8: each of a switch's 4 ranks sends 4 of its 7 shares across: 4 x 4/7 per uplink."""
    assert shared_links_load(L20, ((0, 1, 2, 3, 4, 5, 6, 7),)) == {HOST: pytest.approx(16 / 7)}
    seconds = shared_links_seconds(7 << 20, L20, [(0, 1, 2, 3, 4, 5, 6, 7)])
    assert seconds == pytest.approx(15e-6 + (7 << 20) * 16 / 7 / 12e9)


def test_ring_hops_across_the_switches_share_the_uplink():
    """U4 x R2: the 4 ring groups (u, u + 4) each cross once per hop from each switch: 4 messages at once.
    U2 x R4: rings (0, 2, 4, 6) and (1, 3, 5, 7) cross at 2 -> 4 and 3 -> 5 from the first switch: 2."""
    assert shared_links_load(L20, ((0, 4), (1, 5), (2, 6), (3, 7)), ring=True) == {HOST: 4.0}
    assert shared_links_load(L20, ((0, 2, 4, 6), (1, 3, 5, 7)), ring=True) == {HOST: 2.0}
    assert shared_links_load(L20, ((0, 1), (2, 3), (4, 5), (6, 7))) == {}  # Ulysses 2 stays inside its switch


def test_nvlink_gives_every_gpu_its_own_link():
    assert shared_links_load(HARDWARE["h100-nvlink"], ((0, 1, 2, 3, 4, 5, 6, 7),)) == {}


def _recommended(*argv: str) -> dict:
    done = in_process(["plan", "--model", "llama3-8b", "--one-group", "--json", *argv])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["recommended"]["layout"]


@pytest.mark.parametrize("seq_len", [32768, 131072])
def test_l20_pcie_ranks_a_ulysses_ring_hybrid_first(seq_len):
    """The USP paper's ordering on this box: the head-split degrees (Ulysses, and tensor parallelism inside it)
    inside a switch, the ring across (one sequence group)."""
    layout = _recommended("--seq-len", str(seq_len), "--gpus", "8", "--hardware", "l20-pcie")
    assert layout["ring"] > 1 and 1 < layout["ulysses"] * layout["tp"] <= 4, layout


@pytest.mark.parametrize("hardware", ["h100-nvlink", "a100-nvlink"])
def test_nvlink_ranks_ulysses_inside_a_node_and_the_ring_across_nodes(hardware):
    """Ulysses (with tensor parallelism inside it, when that is predicted as fast: TP splits the loss's logits and
    the ring's K/V heads too) fills the node; the ring crosses nodes."""
    for gpus, ring in ((8, 1), (16, 2)):
        layout = _recommended("--seq-len", "131072", "--gpus", str(gpus), "--hardware", hardware)
        assert layout["ulysses"] * layout["tp"] == 8 and layout["ring"] == ring and layout["dp_shard"] == 1, layout
