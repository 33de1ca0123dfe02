"""The planner on DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): its parameter count against the model transformers
builds, its per-layer bytes against what seqmesh.hf.indexed_attention really sends (``comm_stats``), and
``seqmesh plan`` on a DeepSeek-V3.2-sized config.json against the same model with dense MLA."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from family_cases import family_config
from planner_cases import ModelTrafficCase, measured_model_traffic
from seqmesh.rules.degrees import Degrees
from seqmesh.model.presets import model_shape
from seqmesh.planner.hardware import PRESETS
from seqmesh.planner.memory import memory_at, memory_per_gpu
from seqmesh.planner.layers import IndexedAttention, indexer_pairs, layer_kinds, sparse_attention_flops
from seqmesh.planner.plan import communication
from seqmesh.planner.tensor_parallel import pooled_loss_bytes
from seqmesh.planner.timing import step_time
from seqmesh.planner.workload import Workload
from seqmesh.tools.cli import main

FAMILIES = ["deepseek-v3.2", "glm-5"]  # GLM-5's tiny config: a layer sharing the previous layer's selection
# DeepSeek-V3.2 as published (transformers does not build its multi-token-prediction layer)
V32 = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
           intermediate_size=18432, moe_intermediate_size=2048, q_lora_rank=1536, kv_lora_rank=512,
           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
           n_group=8, topk_group=4, first_k_dense_replace=3, n_shared_experts=1, max_position_embeddings=163840)
INDEXER = dict(index_topk=2048, index_head_dim=128, index_n_heads=64)


def _shape(config, folder):
    config.save_pretrained(folder)
    return model_shape(str(folder))


@pytest.mark.parametrize("family", ["deepseek-v3", *FAMILIES, "a.x-k2", "dots.llm3"])
def test_parameters_are_what_transformers_builds(family, tmp_path):
    """MLA's projections and norms, each indexer (none in GLM-5's shared layer), routed and shared experts and the
    first dense layers, counted exactly; A.X-K2's fused query and gate and its gated norms, dots.llm3's head gate."""
    from transformers import AutoModelForCausalLM

    config = family_config(family)
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert _shape(config, tmp_path).params == built


def test_dots_sliding_and_indexed_layers_are_counted_once(tmp_path):
    """dots.llm3's layers slide or are indexed, none full: one of each kind in its tiny config, and the step's ring
    traffic (the sliding layer's: forward, backward, recompute) is what that layer sends (it was once negative, the
    sliding layer counted as indexed too)."""
    work = Workload(_shape(family_config("dots.llm3"), tmp_path), 4096, bf16=False)
    kinds = layer_kinds(work, Degrees(1, 2, 1))
    assert [(type(k).__name__, getattr(k, "window", None), n) for k, n in kinds] == [
        ("Attention", work.model.sliding_window, 1), ("IndexedAttention", None, 1)]
    sliding = sum(phase.get("ring_p2p", 0) for phase in kinds[0][0].traffic().values())
    assert communication(work, Degrees(1, 2, 1), PRESETS["h100-nvlink"])[2]["ring_p2p"] == sliding > 0


def test_dots_sliding_layers_of_their_own_sizes_are_planned_at_them(tmp_path, capsys):
    """transformers' Dots3NoteTextConfig (279.6B): its sliding layers' MLA at their own sizes (per_layer_config: 64
    heads, a latent of 1,024, against the indexed layers' 128 and 512), counted exactly, planned as an attention kind
    of those sizes beside the indexed layers, whose time and saved tensors are theirs; its decode refused by name."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    config = tf.Dots3NoteTextConfig()
    shape = _shape(config, tmp_path)
    with torch.device("meta"):
        assert shape.params == sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert (shape.heads, shape.latent.kv_lora_rank, shape.sliding_heads, shape.sliding_latent.kv_lora_rank) == (
        128, 512, 64, 1024)
    work = Workload(shape, 131072)
    kinds = {type(k).__name__: (k, n) for k, n in layer_kinds(work, Degrees(8, 1, 1))}
    sliding, n = kinds["Attention"]
    assert (sliding.work.model.heads, sliding.window, n) == (64, 512, shape.sliding_layers) and n > 0
    assert sliding.params() != kinds["IndexedAttention"][0].params()
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "131072", "--gpus", "64", "--ulysses", "8",
                 "--ring", "1"]) == 0
    assert f"{n} sliding layers of 64 heads x 256 (latent 1024" in capsys.readouterr().out
    assert main(["plan", "--inference", "--model", str(tmp_path), "--seq-len", "131072", "--gpus", "8"]) == 2
    assert "per_layer_config" in capsys.readouterr().err


def test_dots_layers_of_sizes_the_planner_does_not_size_say_why(tmp_path):
    """A per_layer_config entry for an indexed layer (its sizes differ from the file's) is not sized: refused by
    name, never planned at the file's sizes."""
    config = family_config("dots.llm3")
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written["per_layer_config"] = {"0": {"num_attention_heads": 2, "num_key_value_heads": 2}}
    (tmp_path / "config.json").write_text(json.dumps(written))
    shape = model_shape(str(tmp_path))
    assert "per_layer_config" in shape.unplanned
    with pytest.raises(ValueError, match="per_layer_config"):
        Workload(shape, 4096)


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_dots_sliding_layers_send_what_their_own_heads_do(pools, tmp_path, ulysses, ring):
    """dots.llm3 whose sliding layer has 2 heads beside its indexed layer's 4: what comm_stats counts on each rank in
    one step equals the planner's two kinds, the sliding one at its own heads (the Ulysses all-to-alls or the
    ring's K/V blocks) and the indexed one's gathers; at the file's heads the sliding bytes would be twice as many."""
    case = ModelTrafficCase("dots.llm3-own-heads", 45, dtype="float32")
    per_rank = pools.run(ulysses * ring, measured_model_traffic, ulysses, ring, 1, [case], timeout=600)
    layout = Degrees(ulysses, ring, 1)
    work = _measured_workload(case, per_rank[0][0], tmp_path / "config.json")
    assert work.model.sliding_heads == 2 and work.model.heads == 4
    kinds = layer_kinds(work, layout)
    for rank in per_rank:
        got = {(kind, ph): v["bytes_sent"] for kind, phases in rank[0]["stats"].items() for ph, v in phases.items()}
        for (kind, phase), sent in got.items():
            if kind in ("all_reduce", "control"):  # the loss's, the input check's: the step's, not a layer's
                continue
            want = sum(n * k.ranks()[_rank(k, rank[0])].sent(kind, phase) for k, n in kinds)
            assert sent == want, (kind, phase, sent, want)


def _rank(kind, measured: dict) -> int:
    """The index of the measured rank in ``kind.ranks()`` (ranks ordered ulysses-fastest)."""
    return next(i for i, r in enumerate(kind.ranks())
                if (r.ulysses_rank, r.ring_rank) == (measured["ulysses_rank"], measured["ring_rank"]))


@pytest.mark.parametrize("streams", [1, 4])
def test_hy_v4_hyper_connections_are_sized(tmp_path, streams):
    """HY-V4 with one and with four residual streams: its parameters equal transformers' model's (the two
    hyper-connections of every layer and the head's), and each checkpointed layer keeps its streams."""
    import transformers as tf

    from seqmesh.planner.activations import layer_input_bytes

    config = family_config("hy-v4")
    config.hc_mult = streams
    shape = _shape(config, tmp_path)
    with torch.device("meta"):
        built = tf.AutoModelForCausalLM.from_config(config)
    assert shape.hc_mult == streams and not shape.unplanned
    assert shape.params == sum(p.numel() for p in built.parameters())
    work = Workload(shape, 4096, bf16=True, checkpointing=True)
    assert layer_input_bytes(work, Degrees(1, 1, 1)) == 4096 * shape.hidden * 2 * streams


def test_deepseek_v32_has_671_9b_parameters(tmp_path):
    import transformers as tf

    assert _shape(tf.DeepseekV32Config(**V32, **INDEXER), tmp_path / "v32").params == 671_877_929_216
    assert _shape(tf.DeepseekV3Config(**V32), tmp_path / "v3").params == 671_026_404_352


def _measured_workload(case: ModelTrafficCase, measured: dict, path) -> Workload:
    """The planner's workload of the model a measured case ran (its config.json written to ``path``)."""
    path.write_text(json.dumps(measured["config"]))
    return Workload(model_shape(str(path)), case.seq_len, bf16=False, checkpointing=case.checkpointing)


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_predicted_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """One step's all-gathers (forward; with checkpointing, again in the recompute, filed as forward) and
    reduce-scatter (backward: the latent with the rotary key, never the indexer's key) per rank, calls and bytes,
    against the planner's per-layer figures times the layers of each kind; the loss's all-reduce beside them."""
    cases = [ModelTrafficCase(f, 45, dtype="float32", checkpointing=c) for f in FAMILIES for c in (False, True)]
    per_rank = pools.run(ulysses * ring, measured_model_traffic, ulysses, ring, 1, cases, timeout=600)
    layout = Degrees(ulysses, ring, 1)
    for i, case in enumerate(cases):
        work = _measured_workload(case, per_rank[0][i], tmp_path / f"{i}.json")
        kinds = layer_kinds(work, layout)
        assert all(isinstance(k, IndexedAttention) for k, _ in kinds) and sum(n for _, n in kinds) == work.model.layers
        sent = {(kind, ph): 0 for kind, ph in (("all_gather", "forward"), ("reduce_scatter", "backward"))}
        calls = dict.fromkeys(sent, 0)
        for kind, count in kinds:
            mine = kind.ranks()[0]
            runs = 2 if case.checkpointing else 1
            for key, repeats in ((("all_gather", "forward"), runs), (("reduce_scatter", "backward"), 1)):
                sent[key] += count * repeats * mine.sent(*key)
                calls[key] += count * repeats * mine.calls(*key)
            per_layer = kind.traffic()
            assert per_layer["forward"]["indexed_row_gather"] == mine.sent("all_gather", "forward")
            assert per_layer["backward"]["indexed_row_gather"] == mine.sent("reduce_scatter", "backward")
        want = {**{k: {"calls": calls[k], "bytes_sent": v} for k, v in sent.items()},
                ("all_reduce", "forward"): {"calls": 1, "bytes_sent": pooled_loss_bytes(work, layout)}}
        for rank in per_rank:
            got = {(kind, ph): {"calls": v["calls"], "bytes_sent": v["bytes_sent"]}
                   for kind, phases in rank[i]["stats"].items() for ph, v in phases.items()}
            assert got == want, (case, ulysses, ring)


def test_bytes_are_the_same_for_every_split_of_the_group(tmp_path):
    """The row is gathered over the whole sequence group: U8 x R1, U2 x R4 and U1 x R8 send the same, per rank,
    ``7/8 x S x 704`` values forward and ``7/8 x S x 576`` backward at DeepSeek-V3.2's sizes, and hold the same (no
    Ulysses output all-to-all, no ring); only the indexer's work differs, with the layout's balance."""
    import transformers as tf

    work = Workload(_shape(tf.DeepseekV32Config(**V32, **INDEXER), tmp_path), 131072)
    hw = PRESETS["h100-nvlink"]
    seen, seen_memory, seen_time = set(), set(), {}
    for u, r in ((8, 1), (2, 4), (1, 8)):
        per_layer, links, _ = communication(work, Degrees(u, r, 1), hw)
        seen.add(tuple(per_layer[ph]["indexed_row_gather"] for ph in ("forward", "backward", "recompute")))
        seen_memory.add(tuple(memory_at(work, Degrees(u, r, 1), "layer backward").as_dict().items()))
        seen_time[u, r] = step_time(work, Degrees(u, r, 1), hw).total
        assert "ulysses_all_to_all" not in per_layer["forward"] and links["indexed_row_gather"] == "nvlink4"
    local = 131072 // 8
    assert seen == {(7 * local * 704 * 2, 7 * local * 576 * 2, 7 * local * 704 * 2)}
    assert len(seen_memory) == 1
    # the time is the busiest rank's indexer: zigzag over 8 ring ranks balances it (each scores about half the row);
    # a ring of 1 or 4 cuts its chunks over the Ulysses ranks, whose last ranks score nearly the whole row
    assert indexer_pairs("zigzag", 1, 8, 131072, 1, 64) < 0.51 * local * 131072
    assert indexer_pairs("zigzag", 2, 4, 131072, 1, 64) > 0.9 * local * 131072
    assert seen_time[1, 8] < seen_time[2, 4] == pytest.approx(seen_time[8, 1])


def test_seqmesh_plan_reports_sparse_attention(tmp_path, capsys):
    """``seqmesh plan`` on DeepSeek-V3.2's config.json names the sparse attention and its row's traffic; its sparse
    attention is under a ninth of dense MLA's work at 128K (2,048 keys a query instead of 65,536 on average, each 3.4
    times dearer in latent space: ``2R + Dr`` = 1,088 multiply-adds a head against ``Dqk + Dv`` = 320)."""
    import transformers as tf

    tf.DeepseekV32Config(**V32, **INDEXER).save_pretrained(tmp_path / "v32")
    tf.DeepseekV3Config(**V32).save_pretrained(tmp_path / "v3")
    argv = ["plan", "--model", str(tmp_path / "v32" / "config.json"), "--seq-len", "131072", "--gpus", "8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "671.9B params" in text and "sparse attention on 61 layers: top 2,048 keys a query" in text, text
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert best["comm_bytes_per_layer"]["forward"]["indexed_row_gather"] == 7 * 16384 * 704 * 2

    sparse, dense = (Workload(model_shape(str(tmp_path / name)), 131072) for name in ("v32", "v3"))
    m, s = sparse.model, 131072
    dense_flops = 2 * s * (s + 1) // 2 * m.heads * (m.latent.qk_head_dim + m.latent.v_head_dim)
    assert 9 < dense_flops / sparse_attention_flops(m, s, s, 1) < 10
    layout, hw = Degrees(8, 1, 1), PRESETS["h100-nvlink"]
    # what seqmesh runs: transformers' float32 indexer scores every query against the whole row (64 heads x 128,
    # 8,192 multiply-adds a pair at the fp32 rate, its score blocks through memory six times); at 128K that costs
    # more than dense MLA's bf16 attention, so the step is slower, not faster
    assert step_time(sparse, layout, hw).total > step_time(dense, layout, hw).total
    quick = step_time(sparse, layout, replace(hw, peak_flops_fp32=hw.peak_flops, memory_bandwidth=1e18))
    assert quick.total < step_time(dense, layout, hw).total  # an indexer at the bf16 rate, in place: faster


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_dense_mla_bytes_equal_measured(pools, ulysses, ring, tmp_path):
    """Dense MLA (DeepSeek-V3) through seqmesh attention, v's head dim (6) apart from q's and k's (12): Ulysses' q/k
    and v all-to-alls and its output at v's dim, the ring's K/V blocks ``12 + 6`` wide, per rank, against the
    planner's per-layer figures (the recompute's filed as forward)."""
    cases = [ModelTrafficCase("deepseek-v3", 45, dtype="float32", checkpointing=c) for c in (False, True)]
    per_rank = pools.run(ulysses * ring, measured_model_traffic, ulysses, ring, 1, cases, timeout=600)
    layout = Degrees(ulysses, ring, 1)
    for i, case in enumerate(cases):
        work = _measured_workload(case, per_rank[0][i], tmp_path / f"{i}.json")
        assert work.model.value_dim == 6 and work.model.head_dim == 12
        per_layer, _, step = communication(work, layout, PRESETS["h100-nvlink"])
        n = work.model.layers
        want = {("all_to_all", "forward"): n * (per_layer["forward"]["ulysses_all_to_all"]
                                                + per_layer["recompute"]["ulysses_all_to_all"]),
                ("all_to_all", "backward"): n * per_layer["backward"]["ulysses_all_to_all"],
                ("p2p", "forward"): n * (per_layer["forward"]["ring_p2p"] + per_layer["recompute"]["ring_p2p"]),
                ("p2p", "backward"): n * per_layer["backward"]["ring_p2p"],
                ("control", "forward"): step["input_check_all_gather"],
                ("all_reduce", "forward"): pooled_loss_bytes(work, layout)}
        for rank in per_rank:
            got = {(kind, ph): v["bytes_sent"] for kind, phases in rank[i]["stats"].items() for ph, v in phases.items()}
            assert got == {k: v for k, v in want.items() if v}, (case, ulysses, ring)


def test_a_bf16_peak_alone_is_refused_by_name(tmp_path, capsys):
    """The indexer's float32 scores need the fp32 peak, which --peak-tflops clears: an error naming the fix."""
    family_config("deepseek-v3.2").save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--seq-len", "4096", "--gpus", "4", "--peak-tflops", "100"]
    assert main(argv) == 2
    assert "--peak-tflops-fp32" in capsys.readouterr().err
    assert main([*argv, "--peak-tflops-fp32", "10"]) == 0


DOTS_TINY = dict(model_type="dots3_note_text", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                 topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=8, head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
                 shared_experts_intermediate_size=32)
OLDER_DOTS = {
    # an older release: no per_layer_config, layer_types or mlp_layer_types (its class's patterns), the sliding
    # layers' sizes as swa_* entries, its window as sliding_window_size, three dense layers first
    "swa entries": dict(swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=24, swa_kv_lora_rank=12,
                        swa_head_dim=24, swa_qk_nope_head_dim=12, swa_v_head_dim=6, sliding_window_size=5,
                        first_k_dense_replace=3),
    # its indexed layers named full_attention (use_dsa by default), the sliding ones at the class's swa defaults
    "legacy layer names": dict(layer_types=["full_attention", "full_attention", "sliding_attention",
                                            "sliding_attention", "sliding_attention", "full_attention"]),
    # every layer at the file's sizes, per_layer_config empty: the file's layer kinds all the same
    "uniform sizes": dict(per_layer_config={}, layer_types=["indexed_attention", "indexed_attention",
                                                            "sliding_attention", "sliding_attention",
                                                            "sliding_attention", "indexed_attention"],
                          sliding_window=5),
    # transformers' explicit form: an entry for every layer, the indexed ones at the file's own sizes
    "an entry a layer": dict(layer_types=["indexed_attention", "sliding_attention"] * 3, sliding_window=5,
                             per_layer_config={str(i): ({"num_attention_heads": 2, "num_key_value_heads": 2}
                                                         if i % 2 else {"num_attention_heads": 4})
                                               for i in range(6)}),
}


@pytest.mark.parametrize("name", list(OLDER_DOTS))
def test_dots_files_of_every_release_are_read_as_transformers_builds_them(tmp_path, name):
    """Each layout a dots.llm3 config.json comes in: its parameters, its layer kinds and window as transformers builds
    the model from it (an older release's were planned as dense MLA in every layer, none sliding or indexed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps({**DOTS_TINY, **OLDER_DOTS[name]}))
    config = AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = model_shape(str(tmp_path))
    assert not shape.unplanned and shape.params == built
    assert list(shape.layer_types) == list(config.layer_types) and shape.sliding_window == config.sliding_window
    assert shape.indexed_layers == list(config.layer_types).count("indexed_attention") > 0
    kinds = [type(k).__name__ for k, _ in layer_kinds(Workload(shape, 64, bf16=False), Degrees(1, 2, 1))]
    assert kinds == ["Attention", "IndexedAttention"]


def test_dots_sliding_heads_bound_the_ulysses_degree(tmp_path):
    """Ulysses 4 splits the indexed layers' 4 heads but not the sliding layers' 2: the planner refuses it as the
    runtime does (each kind's heads checked), and an automatic degree stays within 2."""
    from seqmesh.planner.placement import ulysses_refusal
    from seqmesh.rules.degrees import resolve_degrees

    shape = _shape(family_config("dots.llm3-own-heads"), tmp_path)
    assert (shape.heads, shape.sliding_heads, shape.fewest_heads) == (4, 2, 2)
    assert "exceeds the 2 query heads" in ulysses_refusal(shape, 4, 1) and ulysses_refusal(shape, 2, 1) is None
    assert resolve_degrees(4, ulysses="auto", ring="auto", dp=1, q_heads=shape.fewest_heads, seq_len=64)[0] <= 2


def test_keep_attention_keeps_each_indexers_selection_and_skips_its_recompute(tmp_path):
    """DeepSeek Sparse Attention under --keep-attention: each layer with an indexer keeps its selection (``top-k``
    int64 indices a token: every layer's at the loss), and its recompute neither scores the keys again (the step's
    compute less one indexer a layer) nor gathers them (its traffic less one gather of the indexer's keys a layer)."""
    import transformers as tf
    from seqmesh.planner.layers import indexer_flops, indexer_memory_bytes

    shape = _shape(tf.DeepseekV32Config(**V32, **INDEXER), tmp_path)
    work, layout, hw = Workload(shape, 32768), Degrees(8, 1, 1), PRESETS["h100-nvlink"]
    kept = replace(work, keep_attention=True)
    grown = memory_at(kept, layout, "loss forward").activations - memory_at(work, layout, "loss forward").activations
    assert grown == 61 * (32768 // 8) * 2048 * 8
    pairs = indexer_pairs(work.layout, 8, 1, 32768, 1, 64)
    select = (indexer_flops(shape, pairs, 1) / (hw.flops_for("fp32") * hw.matmul_efficiency)
              + indexer_memory_bytes(shape, pairs, 1) / hw.memory_bandwidth)
    plain_time, kept_time = step_time(work, layout, hw), step_time(kept, layout, hw)
    assert plain_time.compute - kept_time.compute == pytest.approx(61 * select, rel=1e-9)
    assert kept_time.total < plain_time.total
    plain_sent, kept_sent = ({p: t["indexed_row_gather"] for p, t in IndexedAttention(w, layout).traffic().items()}
                             for w in (work, kept))
    # the recompute gathers the latent and rotary key (512 + 64 values a token), not the indexer's key (128)
    assert plain_sent["recompute"] == plain_sent["forward"] == kept_sent["forward"]
    assert kept_sent["recompute"] * (128 + 512 + 64) == plain_sent["recompute"] * (512 + 64)
