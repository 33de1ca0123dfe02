"""FSDP2 shards one dtype per unit: a model whose weights of another dtype sit where no unit of their own can hold
them is refused before anything is sharded, by name and with the fix (FSDP2's own assertion came at the first
forward); the float32 routers a float64 or bfloat16 model keeps are units of their own and pass."""

from __future__ import annotations

import pytest

from census_configs import build, census_config
from seqmesh.model.fsdp import _check_one_dtype_per_unit, decoder_layers


def test_hy_v4_in_float64_is_refused_with_the_fix():
    """HY-V4 keeps its attention sinks and LM head in float32 (transformers' strict float32 modules) whatever the
    model's dtype: the sinks sit on the attention module beside its float64 projections."""
    model = build(census_config("hy_v4"))
    with pytest.raises(ValueError, match=r"more than one dtype .*sinks.*Load the model in float32"):
        _check_one_dtype_per_unit(model, decoder_layers(model))
    model.double()  # one dtype: nothing to refuse
    _check_one_dtype_per_unit(model, decoder_layers(model))


@pytest.mark.parametrize("family", ["deepseek_v3", "ernie4_5_moe"])
def test_float32_routers_are_not_refused(family):
    """DeepSeek-V3's and ERNIE-4.5-MoE's float32 routers in a float64 model: each module holds one dtype, so each is
    a unit of its own (seqmesh.model.fsdp._other_dtype_modules), and they train (tests/experts)."""
    model = build(census_config(family))
    assert len({p.dtype for p in model.parameters()}) == 2
    _check_one_dtype_per_unit(model, decoder_layers(model))
