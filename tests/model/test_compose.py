"""The composition point: every plan's model computes the single-process loss and gradients (float64,
within a multiple of the reference's own rounding, as the family tests bound them), with FSDP2 as asked,
through the wrapper class given; plans that cannot work are refused before any model is touched."""

from __future__ import annotations

import pytest

from compose_cases import composed_parity
from seqmesh.compose import ParallelPlan

ROUNDING_MULTIPLE = 4

PLANS = [
    pytest.param({}, id="defaults"),
    pytest.param({"checkpointing": True, "tiled_mlp": True, "mlp_tiles": 3, "efficient_norm": True}, id="memory"),
    pytest.param({"fsdp": False}, id="no-fsdp"),
]


@pytest.mark.parametrize("plan", PLANS)
def test_composed_model_matches_the_single_process_model(pools, plan):
    for rank in pools.run(2, composed_parity, 2, 1, plan):
        for key in ("loss", "grad"):
            assert rank[key] <= ROUNDING_MULTIPLE * rank["rounding"][key], (key, rank)
        assert rank["sharded"] == plan.get("fsdp", True)
        assert rank["wrapper_calls"] == 1


def test_a_plan_that_cannot_work_is_refused():
    with pytest.raises(ValueError, match="fsdp_cpu_offload offloads FSDP2's shards"):
        ParallelPlan(fsdp=False, fsdp_cpu_offload=True)
    with pytest.raises(ValueError, match="loss_chunk must be at least 1"):
        ParallelPlan(loss_chunk=0)
    with pytest.raises(ValueError, match="compile=True with async_ulysses=True"):
        ParallelPlan(compile=True, async_ulysses=True)
