"""``seqmesh.comm.ranks``: a tensor cut twice along one dimension gathered whole without torch's warning."""

from __future__ import annotations

from dist_cases import nested_gather_warnings


def test_full_value_gathers_nested_cuts_without_torchs_warning(pools):
    """FSDP2 over tensor-parallel shards of the same dimension nests two cuts, which torch gathers in two steps and
    warns about on every rank (export and verify gather every weight so). full_value gathers them exactly and
    silences that warning, which the same gather through full_tensor gives (the test's own check that it would)."""
    for heard in pools.run(4, nested_gather_warnings):
        assert heard["full_value"] == [], heard
        assert any("sequential all_gather" in line for line in heard["full_tensor"]), heard
