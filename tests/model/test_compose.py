"""The composition point: every plan's model computes the single-process loss and gradients (float64,
within a multiple of the reference's own rounding, as the family tests bound them), with FSDP2 as asked,
through the wrapper class given; plans that cannot work are refused before any model is touched."""

from __future__ import annotations

import pytest

from compose_cases import composed_parity
from seqmesh.compose import ParallelPlan

ROUNDING_MULTIPLE = 4

SEQUENCE = "sequence parallelism (ulysses 2 x ring 1, attention backend auto, linear attention auto)"
LOSS = "the loss (_CountingLM, 16 tokens a chunk)"
FSDP = "FSDP2 over dp_shard x ring x ulysses = 2 ranks"
PLANS = [  # (plan, the steps rank 0 logs applying, in order)
    pytest.param({}, [SEQUENCE, LOSS, FSDP], id="defaults"),
    pytest.param({"checkpointing": True, "tiled_mlp": True, "mlp_tiles": 3, "efficient_norm": True},
                 [SEQUENCE, LOSS, "memory techniques (activation checkpointing, tiled MLP (3 tiles), lean RMSNorm)",
                  FSDP],
                 id="memory"),
    pytest.param({"fsdp": False}, [SEQUENCE, LOSS], id="no-fsdp"),
]


@pytest.mark.parametrize("plan, steps", PLANS)
def test_composed_model_matches_the_single_process_model(pools, plan, steps):
    ranks = pools.run(2, composed_parity, 2, 1, plan)
    for rank in ranks:
        for key in ("loss", "grad"):
            assert rank[key] <= ROUNDING_MULTIPLE * rank["rounding"][key], (key, rank)
        assert rank["sharded"] == plan.get("fsdp", True)
        assert rank["wrapper_calls"] == 1
    mesh = "parallelize: mesh dp_replicate=1 dp_shard=1 ring=1 ulysses=2 tp=1 (2 ranks)"
    numbered = [f"parallelize: {i}/{len(steps)} {step}" for i, step in enumerate(steps, 1)]
    assert ranks[0]["log"] == [mesh, *numbered], "rank 0 logs the mesh, then each step in the order applied"
    assert ranks[1]["log"] == [], "only rank 0 logs the composition"


def test_a_plan_that_cannot_work_is_refused():
    with pytest.raises(ValueError, match="fsdp_cpu_offload offloads FSDP2's shards"):
        ParallelPlan(fsdp=False, fsdp_cpu_offload=True)
    with pytest.raises(ValueError, match="loss_chunk must be at least 1"):
        ParallelPlan(loss_chunk=0)
    with pytest.raises(ValueError, match="compile=True with async_ulysses=True"):
        ParallelPlan(compile=True, async_ulysses=True)
