"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5 with a shared-selection layer; HY-V4, A.X-K2 and dots.llm3's
layouts of it) through seqmesh.hf: logits, loss and every parameter's gradient against transformers' model on the
whole sequence, within the reference's own rounding, on Ulysses, ring and both, plain and with packed documents; a
selection one key short is seen, and so is each layout difference left out."""

from __future__ import annotations

import dataclasses

import pytest

from family_cases import family_parity, share_references

FAMILIES = ["deepseek-v3.2", "glm-5", "hy-v4", "a.x-k2", "dots.llm3"]
MESHES = [(1, 2), (2, 1)]  # U2 x R2 reached no line they do not (docs/testing.md)
# as tests/hf/test_hf_families.py: a multiple of how far the reference's own float32 rounding moves it
ROUNDING_MULTIPLE = 4


def _run_all(cases: list[tuple], **kwargs) -> list[dict]:
    share_references(cases, kwargs.get("seq_len", 45))
    return [{"case": c, **family_parity(*c, **kwargs)} for c in cases]


def _outside_rounding(r: dict) -> list[str]:
    return [key for key in ("logits", "loss", "grad") if not r[key] <= ROUNDING_MULTIPLE * r["rounding"][key]]


def _run_in_small_blocks(cases: list[tuple]) -> list[dict]:
    """:func:`_run_all` with blocks of 3 queries for the indexer and 1 for the attention (the sizes of the test's
    models), so that each block scores only the keys up to its last query and the rest of the row is filled, and
    the attention's backward sums its weights' and row's gradients over blocks."""
    from seqmesh.hf import indexed_attention
    from seqmesh.kernels import sparse_latent_blocks

    saved = (indexed_attention.BLOCK_ELEMENTS, indexed_attention.CPU_INDEXER_ELEMENTS,
             sparse_latent_blocks.CPU_BLOCK_ELEMENTS)
    (indexed_attention.BLOCK_ELEMENTS, indexed_attention.CPU_INDEXER_ELEMENTS,
     sparse_latent_blocks.CPU_BLOCK_ELEMENTS) = 3 * 4 * 45, 3 * 4 * 45, 1
    try:
        return _run_all(cases)
    finally:
        (indexed_attention.BLOCK_ELEMENTS, indexed_attention.CPU_INDEXER_ELEMENTS,
         sparse_latent_blocks.CPU_BLOCK_ELEMENTS) = saved


def _run_on_the_kernel(cases: list[tuple]) -> list[dict]:
    """:func:`_run_all` with every layer's indexer and latent attention on the Triton kernels
    (seqmesh.kernels.sparse_latent_triton, a GPU's path), here under Triton's interpreter (tests/conftest.py)."""
    from seqmesh.hf import indexed_attention
    from seqmesh.kernels import sparse_latent

    saved = sparse_latent.uses_kernel
    indexed_attention.uses_kernel = sparse_latent.uses_kernel = lambda x, name="sparse_latent": True
    try:
        return _run_all(cases)
    finally:
        indexed_attention.uses_kernel = sparse_latent.uses_kernel = saved


def one_key_short(model) -> None:
    """The mutation: every indexer of the parallelized model keeps one key fewer than the model's top-k."""
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk -= 1


def _without_kv_scale(latent):
    def unscaled(module, hidden):
        kv, k_rot = latent(module, hidden)
        return kv / module.kv_lora_scale, k_rot
    return unscaled


# one deliberate error in each layout difference seqmesh reads from a family (seqmesh.hf.indexed_layouts): the family,
# the function replaced, and its replacement made from the original
LAYOUT_MUTATIONS = {
    "HY-V4's sinks dropped": ("hy-v4", "sinks", lambda sinks: lambda module: None),
    "HY-V4's indexer rotating the leading part": (
        "hy-v4", "indexer_rule", lambda rule: lambda indexer: dataclasses.replace(rule(indexer), rotated_first=True)),
    "A.X-K2's gate skipped": ("a.x-k2", "gated", lambda gated: lambda module, hidden, out, gate: out),
    "dots.llm3's latent unscaled": ("dots.llm3", "latent", _without_kv_scale),
}


def _run_mutated(name: str) -> list[dict]:
    from seqmesh.hf import indexed_layouts

    family, function, mutant = LAYOUT_MUTATIONS[name]
    original = getattr(indexed_layouts, function)
    setattr(indexed_layouts, function, mutant(original))
    try:
        return _run_all([(family, 1, 2, "zigzag", False)])
    finally:
        setattr(indexed_layouts, function, original)


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=[f"u{u}xr{r}" for u, r in MESHES])
def test_indexed_attention_exact(pools, ulysses, ring):
    """Each query's top-k keys chosen from its document's earlier keys of the whole row, and MLA over them, as
    transformers computes on one process: zigzag without documents, per_document with packed documents."""
    cases = [(f, ulysses, ring, layout, docs) for f in FAMILIES
             for layout, docs in (("zigzag", False), ("per_document", True))]
    worst = {}
    for results in pools.run(ulysses * ring, _run_all, cases):
        for r in results:
            assert not _outside_rounding(r), r
            assert r["rounding"]["logits"] < 1e-4, r  # a bound that could not hide a wrong selection (~1e-2)
            key = r["case"][0]
            errors = tuple(r[k] for k in ("logits", "loss", "grad"))
            worst[key] = tuple(max(a, b) for a, b in zip(worst.get(key, (0.0,) * 3), errors))
    print(f"u{ulysses}xr{ring} worst (logits, loss, relative grad): {worst}")


def test_exact_in_blocks_of_a_few_queries(pools):
    cases = [(f, 2, 2, layout, docs) for f in FAMILIES for layout, docs in (("zigzag", False), ("per_document", True))]
    for results in pools.run(4, _run_in_small_blocks, cases):
        for r in results:
            assert not _outside_rounding(r), r


# the kernels' cases (Triton's interpreter is slow): DeepSeek-V3.2 plain and packed, GLM-5's shared selection and
# HY-V4's sinks and indexer scale packed; A.X-K2's and dots.llm3's differences lie outside the kernels (their gates,
# norms and latent scale, each held in the torch form's cases above)
KERNEL_CASES = [("deepseek-v3.2", "zigzag", False), ("deepseek-v3.2", "per_document", True),
                ("glm-5", "per_document", True), ("hy-v4", "per_document", True)]


def test_exact_on_the_triton_kernel(pools):
    """The layers as a GPU runs them: the indexer's scores and the latent attention on the Triton kernels, the
    attention one call for all of a rank's queries, the hidden picks folded into the indices, HY-V4's sinks in the
    kernel's softmax and their gradient, its indexer scale where it puts it."""
    pytest.importorskip("triton")
    cases = [(f, 1, 2, layout, docs) for f, layout, docs in KERNEL_CASES]
    for results in pools.run(2, _run_on_the_kernel, cases):
        for r in results:
            assert not _outside_rounding(r), r


# tokens of the bf16 indexer's cases: at 45 no pick of the test model's changes with the rounding, at 128 2% to 4%
# of each layer's queries' picks do (so the float32 reference then differs)
ROUNDED_SEQ_LEN = 128


def bf16_indexer(model) -> None:
    """The reference of ``indexer_precision='bfloat16'``: each DeepSeek-V3.2 indexer of ``model`` as transformers
    (5.24) computes it, but for its rotated queries and keys rounded to bfloat16 before the float32 products."""
    import types

    for module in model.modules():
        if type(module).__name__ == "DeepseekV32Indexer":
            module.forward = types.MethodType(_rounded_indexer_forward, module)


def _rounded_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                             cache=None):
    import torch
    import torch.nn.functional as F
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    b, length, _ = hidden_states.shape
    rope, width = self.qk_rope_head_dim, self.head_dim
    q_rot, q_pass = torch.split(self.wq_b(q_resid).view(b, length, self.n_heads, width), [rope, width - rope], -1)
    k_rot, k_pass = torch.split(self.k_norm(self.wk(hidden_states)).unsqueeze(2), [rope, width - rope], -1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, *position_embeddings, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1).bfloat16().float()  # (B, L, H, D): the rounding under test
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).bfloat16().float()  # (B, L, D)
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * self.softmax_scale)  # (B, L, H, L)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    index = index.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
        else index + attention_mask
    return index.topk(min(self.index_topk, index.shape[-1]), dim=-1).indices.to(torch.int32)


def _run_bf16_indexer(cases: list[tuple]) -> list[dict]:
    """Each case with ``indexer_precision='bfloat16'``, against the rounded reference (:func:`bf16_indexer`) and
    against transformers' float32 one."""
    kwargs = {"options": {"indexer_precision": "bfloat16"}, "seq_len": ROUNDED_SEQ_LEN}
    return [{"case": c, "rounded": family_parity(*c, **kwargs, reference_alter=bf16_indexer),
             "float32": family_parity(*c, **kwargs)} for c in cases]


def test_the_bf16_indexer_is_exact_to_its_rounding(pools):
    """``indexer_precision='bfloat16'`` on Ulysses and ring, plain and packed: exact against transformers' model
    with its indexer's queries and keys rounded to bfloat16 first, and (at these sizes) not against the float32 one,
    so the setting reaches every layer and changes the picks the rounding changes."""
    cases = [("deepseek-v3.2", u, r, layout, docs) for u, r in MESHES
             for layout, docs in (("zigzag", False), ("per_document", True))]
    for results in pools.run(2, _run_bf16_indexer, cases):
        for r in results:
            assert not _outside_rounding(r["rounded"]), r
        assert all(_outside_rounding(r["float32"]) for r in results), results


def test_the_indexer_precision_is_refused_without_an_indexer(pools):
    """A model without DeepSeek Sparse Attention's indexer refuses indexer_precision='bfloat16' by name."""
    message = pools.run(1, _precision_refusal)[0]
    assert "indexer_precision='bfloat16' (--indexer-precision)" in message and "'float32'" in message, message


def _precision_refusal() -> str:
    import transformers as tf

    from dist_cases import get_mesh
    from family_cases import family_config
    from seqmesh.hf import parallelize

    try:
        parallelize(tf.AutoModelForCausalLM.from_config(family_config("llama")), get_mesh(1, 1),
                    indexer_precision="bfloat16")
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("name", LAYOUT_MUTATIONS)
def test_each_layout_difference_is_needed(pools, name):
    """Each per-family difference seqmesh computes changes the logits beyond rounding when it is left out."""
    for results in pools.run(2, _run_mutated, name):
        for r in results:
            assert "logits" in _outside_rounding(r), r


def test_a_selection_one_key_short_is_seen(pools):
    for results in pools.run(2, _run_all, [("deepseek-v3.2", 1, 2, "zigzag", False)], alter=one_key_short):
        for r in results:
            assert "logits" in _outside_rounding(r), r
            assert r["logits"] > 100 * ROUNDING_MULTIPLE * r["rounding"]["logits"], r


def test_a_deepseek_v32_config_json_verifies_and_trains_on_four_ranks(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` on a tiny DeepSeek-V3.2 config.json (selection of 16 keys among up
    to 77) over 2 x 2 Ulysses x ring with FSDP2: the loss and gradients of the single-process model, then training."""
    import json
    import math

    import transformers as tf

    from seqmesh.training.config import TrainConfig
    from train_job_cases import run_train, run_verify

    config = tf.DeepseekV32Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                                  intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, q_lora_rank=16,
                                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1, n_shared_experts=1, index_topk=16, index_head_dim=8,
                                  index_n_heads=4, attention_dropout=0.0)
    path = tmp_path / "dsa" / "config.json"
    path.parent.mkdir()
    path.write_text(config.to_json_string())
    base = dict(model=str(path), seq_len=77, ulysses=2, ring=2, dp=1, lr=1e-2, warmup=1, log_every=1, eval_every=0,
                symbols=16)
    good = pools.run(4, run_verify, TrainConfig(**base, steps=1, out=str(tmp_path / "verify")), None)[0]
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    pools.run(4, run_train, TrainConfig(**base, steps=6, out=str(tmp_path / "train")))
    with open(tmp_path / "train" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_an_hy_v4_config_json_verifies_and_trains_on_a_ring(pools, tmp_path):
    """``seqmesh verify`` and ``seqmesh train`` from HY-V4's config.json (hyper-connections, sinks, a shared layer,
    weights transformers keeps in float32 beside the float32 model) on ring 2 with FSDP2 and checkpointing."""
    import math

    from family_cases import family_config
    from train_job_cases import verify_then_train

    good, losses = verify_then_train(pools, tmp_path, family_config("hy-v4"), checkpointing=True)
    assert good["ok"] and good["loss_diff"] < 1e-5, good
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_an_hy_v4_trains_in_bf16_under_fsdp(pools, tmp_path):
    """In bf16 under FSDP2 (seqmesh train's one-GPU step and every larger one) HY-V4's hyper-connections, routers
    and indexer weights are float32 units, but its LM head, which it keeps in float32 too, stays with the root: the
    loss reads the head's weight outside the head's forward, where a unit of its own was still sharded (the step
    failed in the loss)."""
    import math

    import transformers

    from family_cases import family_config
    from seqmesh.model.fsdp import float32_modules
    from train_job_cases import train_from_config

    config = family_config("hy-v4")
    lm = transformers.AutoModelForCausalLM.from_config(config)
    kept = float32_modules(lm)
    assert lm.lm_head not in kept and {"HYV4HyperConnection", "HYV4TopkRouter"} <= {type(m).__name__ for m in kept}
    losses = train_from_config(pools, tmp_path, config, steps=6, bf16=True)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def _compile_refusal(family: str = "deepseek-v3.2") -> tuple[str, bool]:
    """parallelize_model's refusal of compile on a model with sparse layers, and whether anything was installed
    first."""
    import transformers as tf

    from dist_cases import get_mesh
    from family_cases import family_config
    from seqmesh.compose import ParallelPlan, parallelize_model

    model = tf.AutoModelForCausalLM.from_config(family_config(family))
    try:
        parallelize_model(model, get_mesh(1, 1), ParallelPlan(compile=True, fsdp=False))
        message = ""
    except ValueError as err:
        message = str(err)
    installed = ("_seqmesh_indexed", "_seqmesh_block_sparse", "_seqmesh_compressed")
    return message, any(hasattr(m, name) for m in model.modules() for name in installed)


@pytest.mark.parametrize("family", ["deepseek-v3.2", "minimax-m3-sparse", "deepseek-v4"])
def test_compile_is_refused_by_name_before_any_work(pools, family):
    message, installed = pools.run(1, _compile_refusal, family)[0]
    assert ("compile=True with DeepSeek Sparse Attention, DeepSeek-V4's compressed attention or MiniMax-M3's "
            "block-sparse layers") in message, message
    assert "--no-compile" in message and not installed, message


def test_a_batch_of_two_rows(pools):
    """Each row its own selection: two rows on ring 2, every family, within the float32 model's rounding (the
    training tests above run one row)."""
    from family_cases import two_rows_errors

    for results in pools.run(2, two_rows_errors, FAMILIES):
        for family, (error, rounding) in zip(FAMILIES, results):
            assert error <= 4 * rounding and rounding < 1e-4, (family, error, rounding)
