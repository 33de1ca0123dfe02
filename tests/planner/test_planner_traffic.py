"""The planner's traffic figures against what seqmesh really sends, and against textbook arithmetic.

The planner derives every byte from shapes (``seqmesh.planner.traffic``, which does not import
seqmesh's attention code); the real attention's counters (``seqmesh.comm_stats``) measure them. They
must agree exactly, per rank, per collective kind and phase, calls included.
"""

from __future__ import annotations

import pytest

from planner_cases import ModelTrafficCase, TrafficCase, measured_model_traffic, measured_traffic
from seqmesh.planner.hardware import PRESETS
from seqmesh.planner.plan import communication
from seqmesh.rules.padding import padded_length
from seqmesh.rules.heads import HeadDeal
from seqmesh.planner.attention_layer import Attention
from seqmesh.planner.tensor_parallel import layer_traffic, pooled_loss_bytes, step_traffic
from seqmesh.planner.traffic import attention_traffic, fsdp_traffic
from seqmesh.rules.degrees import Degrees
from seqmesh.planner.workload import Workload
from seqmesh.model.presets import MODELS, model_shape
from seqmesh.model.shapes import ModelShape

CASES = [
    TrafficCase(32, 4, 4, "float64"),  # MHA
    TrafficCase(30, 8, 4, "float32", batch=2),  # GQA, padded length
    TrafficCase(32, 8, 2, "bfloat16"),  # GQA: kv replicated when ulysses = 4
    TrafficCase(28, 4, 1, "float64", layout="contiguous", causal=False),  # MQA, replicated
    TrafficCase(26, 6, 2, "float32"),  # uneven query heads over 4 (2,2,1,1), rank 1 needs both kv heads
    TrafficCase(32, 5, 5, "bfloat16", batch=2),  # uneven MHA heads
    TrafficCase(21, 5, 1, "float64", layout="contiguous"),  # uneven MQA, odd length
]


def _predicted(case: dict, ulysses: int, ring: int) -> list:
    return attention_traffic(case["q_heads"], case["kv_heads"], case["head_dim"], seq_len=case["seq_len"],
                             batch=case["batch"], ulysses=ulysses, ring=ring, dtype=case["dtype"],
                             layout=case["layout"])


def _as_counters(rank_traffic) -> dict:
    """Predicted traffic in the shape of ``CommStats.as_dict()`` (calls and bytes sent)."""
    out: dict = {}
    for c in rank_traffic.collectives:
        entry = out.setdefault(c.kind, {}).setdefault(c.phase, {"calls": 0, "bytes_sent": 0})
        entry["calls"] += c.calls
        entry["bytes_sent"] += c.bytes_sent
    return out


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4), (2, 1), (1, 2)])
def test_predicted_bytes_equal_measured(pools, ulysses, ring):
    per_rank = pools.run(ulysses * ring, measured_traffic, ulysses, ring, CASES)
    checked_uneven = False
    for rank_results in per_rank:
        for r in rank_results:
            case = r["case"]
            predicted = _predicted(case, ulysses, ring)
            mine = predicted[r["ring_rank"] * ulysses + r["ulysses_rank"]]
            assert (mine.ulysses_rank, mine.ring_rank) == (r["ulysses_rank"], r["ring_rank"])
            measured = {kind: {phase: {"calls": v["calls"], "bytes_sent": v["bytes_sent"]} for phase, v in phases.items()}
                        for kind, phases in r["stats"].items()}
            assert measured == _as_counters(mine), (case, r["ulysses_rank"], r["ring_rank"])
            if len({t.sent("all_to_all", "forward") for t in predicted}) > 1:
                checked_uneven = True
    if ulysses == 4:  # uneven heads really give ranks different byte counts, and each one matched
        assert checked_uneven


def test_uneven_heads_forward_and_backward_differ_per_rank():
    """6 query heads over 4 Ulysses ranks deal (2, 2, 1, 1) with 2 kv heads of 3 query heads each: rank 1
    holds query heads 2 and 3, which read both kv heads. Rows of B*L*D elements (here 1*8*8*4 bytes)."""
    deal = HeadDeal(6, 2, 4)
    assert [deal.q_count(u) for u in range(4)] == [2, 2, 1, 1]
    assert [deal.kv_count(u) for u in range(4)] == [1, 2, 1, 1]
    ranks = attention_traffic(6, 2, 8, seq_len=32, batch=1, ulysses=4, ring=1, dtype="float32")
    # Worked by hand in rows of 256 bytes. Forward: rank u sends every other rank the q, k and v heads
    # it reads (16 head-rows in all, less its own q_u + 2*kv_u), then 3 ranks' shares of its q_u output
    # heads: rank 0 (16 - 4) + 3*2 = 18, rank 1 (16 - 6) + 3*2 = 16, ranks 2 and 3 (16 - 3) + 3*1 = 16.
    # Backward: the output gradient of the 6 - q_u heads others hold, then dq, dk, dv of its heads to 3
    # ranks: rank 0 4 + 3*4 = 16, rank 1 4 + 3*6 = 22, ranks 2 and 3 5 + 3*3 = 14.
    assert [t.sent("all_to_all", "forward") for t in ranks] == [4608, 4096, 4096, 4096]
    assert [t.sent("all_to_all", "backward") for t in ranks] == [4096, 5632, 3584, 3584]
    assert ranks[1].sent("all_to_all", "forward") != ranks[1].sent("all_to_all", "backward")


def test_padding_follows_the_layout():
    assert padded_length(30, 2, 2) == 32  # zigzag over a ring: multiple of ring * lcm(2, ulysses) = 4
    assert padded_length(30, 3, 2) == 36  # ring 2 x lcm(2, 3) = 12
    assert padded_length(30, 3, 2, "contiguous") == 30
    assert padded_length(30, 4, 1) == 32  # no ring: multiple of ulysses
    assert padded_length(100, 3, 2, "per_document") == 108  # balanced like zigzag: 12 (the planner said 102)


def _shortest_even_split(seq_len: int, ulysses: int, ring: int, layout: str) -> int:
    """The shortest length >= seq_len whose tokens the ranks can split as the layout places them, by
    search: a balanced layout over a ring gives each ring rank two equal chunks (so 2 * ring divides
    it), and each ring rank's tokens are split evenly over its Ulysses ranks; a contiguous one (or no
    ring) gives every rank the same count."""
    length = seq_len
    while True:
        if layout != "contiguous" and ring > 1:
            fits = length % (2 * ring) == 0 and (length // ring) % ulysses == 0
        else:
            fits = length % (ring * ulysses) == 0
        if fits:
            return length
        length += 1


def test_planner_and_runtime_pad_to_the_shortest_even_split():
    """Both the planner's padded length and the runtime's SequenceLayout against the requirement itself
    (not against each other: they share seqmesh/rules/padding.py)."""
    from seqmesh.sequence.layout import SequenceLayout

    for layout in ("zigzag", "contiguous", "per_document"):
        for ulysses, ring in ((3, 2), (2, 2), (1, 4), (4, 1), (3, 1), (2, 3)):
            for seq_len in (1, 7, 100, 4099):
                want = _shortest_even_split(seq_len, ulysses, ring, layout)
                assert padded_length(seq_len, ulysses, ring, layout) == want, (layout, ulysses, ring, seq_len)
                assert SequenceLayout.for_length(layout, ring, ulysses, seq_len).padded_len == want


def test_llama70b_ulysses_versus_tensor_parallel_at_1m_tokens():
    """Llama-3-70B (64 query heads, 8 kv heads, head dim 128, hidden 8192), 1M tokens, 8 GPUs, bf16.

    Ulysses, per layer forward, per rank: q, k, v go out and the output comes back, each rank keeping
    its own share: (Hq + 2*Hkv + Hq) * D * (S/P) * (P-1)/P * 2 bytes.
    Tensor parallelism 8 with sequence-parallel norms (seqmesh's TP, as Megatron's TP + SP), per layer forward, per
    rank: the (S, hidden) activation is all-gathered and reduce-scattered twice (attention and MLP):
    4 * S * h * (P-1)/P * 2 bytes.
    Their ratio is 4*h*P / ((2*Hq + 2*Hkv) * D) = 14.2: TP's traffic does not shrink with P."""
    m = MODELS["llama3-70b"]
    s, p = 2**20, 8
    assert (m.heads, m.kv_heads, m.head_dim, m.hidden) == (64, 8, 128, 8192)
    ulysses_formula = (64 + 2 * 8 + 64) * 128 * (s // p) * (p - 1) // p * 2
    tp_formula = 4 * s * 8192 * (p - 1) // p * 2
    assert ulysses_formula == 4_227_858_432  # 3.94 GiB
    assert tp_formula == 60_129_542_144  # 56 GiB
    ranks = attention_traffic(64, 8, 128, seq_len=s, batch=1, ulysses=p, ring=1, dtype="bfloat16", validate=False)
    assert {t.sent("all_to_all", "forward") for t in ranks} == {ulysses_formula}
    tp = layer_traffic(Workload(m, s), Degrees(1, 1, 1, p))["forward"]
    assert tp["tp_all_gather"] + tp["tp_reduce_scatter"] == tp_formula
    assert tp_formula / ulysses_formula == pytest.approx(4 * 8192 * 8 / (144 * 128))
    assert tp_formula / ulysses_formula == pytest.approx(14.22, abs=0.01)


def test_ring_bytes_textbook():
    """Pure ring, Llama-3-8B shape (8 kv heads x 128), 128K tokens on 8 ranks, bf16: forward sends 7
    K/V blocks of 2 * (S/P) * Hkv * D * 2 bytes; backward 7 more and 8 float32 dK/dV partials, each
    travelling with its block from neighbour to neighbour and one hop more, home."""
    s, p = 131072, 8
    block = 2 * (s // p) * 8 * 128
    (t,) = {(x.sent("p2p", "forward"), x.sent("p2p", "backward"))
            for x in attention_traffic(32, 8, 128, seq_len=s, batch=1, ulysses=1, ring=p, dtype="bfloat16")}
    assert t == (7 * block * 2, 7 * block * 2 + 8 * block * 4)


# -- FSDP and tensor parallelism: per rank, per layer and per step, from the shapes by hand ----------------
LLAMA8B_LAYER = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336 + 2 * 4096  # 218,112,000 parameters
LLAMA8B_EMBEDDING = 128256 * 4096  # untied input embedding: its own FSDP unit
LLAMA8B_ROOT = 128256 * 4096 + 4096  # LM head + final norm: seqmesh's root FSDP unit


@pytest.mark.parametrize("layout", [Degrees(2, 2, 2), Degrees(8, 1, 1), Degrees(1, 1, 8), Degrees(1, 4, 2)])
def test_fsdp_traffic_per_rank_over_dp_times_sp(layout):
    """FSDP shards over every rank, dp_shard x ring x ulysses = 8 here, whatever the split. Per layer a
    rank sends 7 of the 8 shards: all-gather 7 x 218,112,000/8 x 2 B (bf16) in forward and again in
    backward, reduce-scatter 7 x 27,264,000 x 4 B (fp32 gradients). Per step: 32 layers, plus two more
    units, each gathered in forward and again for its backward and reduce-scattered once: the untied
    embedding (525,336,576 parameters) and the root (LM head + final norm, 525,340,672)."""
    shard, emb_shard, root_shard = LLAMA8B_LAYER // 8, LLAMA8B_EMBEDDING // 8, LLAMA8B_ROOT // 8
    assert (shard, emb_shard, root_shard) == (27_264_000, 65_667_072, 65_667_584)  # all divide evenly
    per_layer, links, per_step = communication(Workload(MODELS["llama3-8b"], 131072), layout, PRESETS["h100-nvlink"])
    assert per_layer["forward"]["fsdp_all_gather"] == per_layer["backward"]["fsdp_all_gather"] == 7 * shard * 2
    assert per_layer["backward"]["fsdp_reduce_scatter"] == 7 * shard * 4 == 763_392_000
    assert per_layer["forward"]["fsdp_reduce_scatter"] == per_layer["recompute"]["fsdp_all_gather"] == 0
    # layers and the embedding are gathered twice (forward, backward); the root once (kept for backward)
    assert per_step["fsdp_all_gather"] == 32 * 2 * 7 * shard * 2 + 2 * 7 * emb_shard * 2 + 7 * root_shard * 2
    assert per_step["fsdp_reduce_scatter"] == 32 * 7 * shard * 4 + 7 * emb_shard * 4 + 7 * root_shard * 4
    assert links["fsdp_all_gather"] == "nvlink4"


def test_tied_model_has_no_embedding_unit_in_its_fsdp_traffic():
    """Qwen3-0.6B ties its head: the root (151936 x 1024 + 1024 = 155,583,488 parameters, over 4 ranks
    38,895,872 each) is the only unit besides the 28 layers (1024 x 128 x 48 + 3 x 1024 x 3072 + 2 x 1024
    + 2 x 128 = 15,730,944 parameters, 3,932,736 per rank)."""
    layer, root = 1024 * 128 * 48 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128, 151936 * 1024 + 1024
    assert (layer // 4, root // 4) == (3_932_736, 38_895_872)
    _, _, per_step = communication(Workload(MODELS["qwen3-0.6b"], 4096), Degrees(4, 1, 1), PRESETS["h100-nvlink"])
    assert per_step["fsdp_all_gather"] == 28 * 2 * 3 * (layer // 4) * 2 + 3 * (root // 4) * 2  # root: once
    assert per_step["fsdp_reduce_scatter"] == 28 * 3 * (layer // 4) * 4 + 3 * (root // 4) * 4


def test_fsdp_shard_rounds_up_to_whole_parameters():
    """3 ranks and the tiny model's 36,992-parameter layer (64 x 16 x 12 + 3 x 64 x 128 + 128): shards of
    12,331 parameters (the last one padded); a rank sends 2 of them."""
    tiny = ModelShape(name="tiny", family="llama", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=256)
    assert 64 * 16 * 12 + 3 * 64 * 128 + 128 == 36_992
    assert fsdp_traffic(36_992, 3, "bfloat16") == {"all_gather_forward": 2 * 12_331 * 2,
                                                   "all_gather_backward": 2 * 12_331 * 2,
                                                   "reduce_scatter_backward": 2 * 12_331 * 4}
    per_layer, _, _ = communication(Workload(tiny, 96), Degrees(1, 3, 1), PRESETS["h100-nvlink"])
    assert per_layer["backward"]["fsdp_reduce_scatter"] == 2 * 12_331 * 4


def test_tensor_parallel_traffic_per_layer_and_step():
    """TP4 x DP2, Llama-3-8B (hidden 4096), 131072 tokens, bf16: per layer and direction 2 all-gathers and 2
    reduce-scatters of the (S, hidden) activation, each rank sending 3 of 4 slices: 3 x 32768 x 4096 x 2 B = 768 MiB
    per collective. Checkpointing replays the forward's in backward up to the MLP's down projection (torch's
    recompute stops at the last tensor backward needs): 2 all-gathers, 1 reduce-scatter. Per step also the
    embedding's reduce-scatter and the loss's all-gather forward, their adjoints backward. FSDP then shards over the
    2 data-parallel ranks only (each TP rank holds 1/4 of every projection and whole norms)."""
    one = 3 * 32768 * 4096 * 2
    assert one == 768 * 2**20
    per_layer, _, per_step = communication(Workload(MODELS["llama3-8b"], 131072), Degrees(1, 1, 2, tp=4),
                                           PRESETS["h100-nvlink"])
    for phase in ("forward", "backward"):
        assert per_layer[phase]["tp_all_gather"] == per_layer[phase]["tp_reduce_scatter"] == 2 * one
    assert per_layer["recompute"]["tp_all_gather"] == 2 * one and per_layer["recompute"]["tp_reduce_scatter"] == one
    assert per_step["tp_all_gather"] == 32 * 3 * 2 * one + 2 * one
    assert per_step["tp_reduce_scatter"] == 32 * 5 * one + 2 * one
    norms = 2 * 4096
    layer_shard = ((LLAMA8B_LAYER - norms) // 4 + norms) // 2  # TP-local weights over the 2 FSDP ranks
    assert per_layer["forward"]["fsdp_all_gather"] == 1 * layer_shard * 2


def test_per_step_traffic_adds_recompute_and_one_input_check():
    """Ulysses 8, Llama-3-8B (32 query / 8 kv heads), 128K, bf16. A row is one head of the 16384 local
    tokens: 16384 x 128 x 2 B = 4 MiB. Forward, a rank sends its q/k/v heads that other ranks work on,
    (32 + 2 x 8) - (4 + 2 x 1) = 42 rows, and its 4 output heads of the 7 other ranks' tokens, 28 rows:
    280 MiB; backward the adjoints, the same; checkpointing recomputes the forward (another 280 MiB). Per
    step: 32 x 840 MiB, and seqmesh.hf's input check once: 7 peers x 15 int64 (the problem flag and 14 fields)."""
    row = 16384 * 128 * 2
    per_layer, _, per_step = communication(Workload(MODELS["llama3-8b"], 131072), Degrees(8, 1, 1),
                                           PRESETS["h100-nvlink"])
    for phase in ("forward", "backward", "recompute"):
        assert per_layer[phase]["ulysses_all_to_all"] == (42 + 28) * row == 280 * 2**20
    assert per_step["ulysses_all_to_all"] == 32 * 3 * 280 * 2**20
    assert per_step["input_check_all_gather"] == 7 * 15 * 8
    no_ckpt, _, step2 = communication(Workload(MODELS["llama3-8b"], 131072, checkpointing=False), Degrees(8, 1, 1),
                                      PRESETS["h100-nvlink"])
    assert no_ckpt["recompute"]["total"] == 0 and step2["ulysses_all_to_all"] == 32 * 2 * 280 * 2**20
    assert per_step["total"] == sum(v for k, v in per_step.items() if k != "total")


# -- tensor parallelism inside the sequence mesh: a whole model's step, planner against comm_stats ----------------
# Tiny Llama (hidden 32, 4 query / 2 kv heads of 8, 2 layers) and Qwen3 (q/k norms, tied embeddings), float32 (the
# planner's dtypes are bf16 and fp32), one forward and backward each; FSDP2's own collectives are not counted
# (comm_stats sees seqmesh's and DTensor's), so FSDP2 matters only through the norm gradients' TP all-reduce.
TP_CASES = [
    ModelTrafficCase("llama", 45, dtype="float32"),
    ModelTrafficCase("llama", 37, batch=2, dtype="float32", checkpointing=True, loss_chunk=24),
    ModelTrafficCase("qwen3", 45, dtype="float32", checkpointing=True, fsdp=True),
    ModelTrafficCase("llama", 45, dtype="float32", fsdp=True, bf16=True),
    ModelTrafficCase("llama", 37, dtype="float32", checkpointing=True, mlp_tiles=3),  # the recompute runs the
    # tiled MLP's forward whole and stops before its reduce-scatter, as the untiled one stops before down_proj's
]
# U2 x R2 x TP2 on 8 ranks ran two of the cases too: these reach every line it did (docs/testing.md)
TP_LAYOUTS = {4: [(2, 1, 2), (1, 2, 2), (1, 1, 4)]}


def _tp_workload(case: ModelTrafficCase, config: dict, folder) -> Workload:
    path = folder / f"{case.family}-{config['num_key_value_heads']}.json"
    path.write_text(__import__("json").dumps(config))
    return Workload(model_shape(str(path)), case.seq_len, batch=case.batch, bf16=case.bf16,
                    checkpointing=case.checkpointing, loss_chunk=case.loss_chunk, tiled_mlp=case.mlp_tiles > 0,
                    mlp_tiles=case.mlp_tiles or None)


def _tp_predicted(work: Workload, layout: Degrees, fsdp: bool) -> dict:
    """The planner's bytes per (kind, phase) as comm_stats files them: the TP collectives of a checkpointed layer's
    recompute run inside autograd's backward (DTensor's phase), seqmesh's own all-to-alls and P2P count it as
    forward (their op's forward runs again)."""
    per_layer, _, _ = communication(work, layout, PRESETS["h100-nvlink"])
    n, extra = work.model.layers, step_traffic(work, layout)
    layer = {ph: {k: n * v for k, v in sent.items()} for ph, sent in per_layer.items()}
    out = {("all_gather", "forward"): layer["forward"]["tp_all_gather"] + extra["forward"]["tp_all_gather"],
           ("all_gather", "backward"): layer["backward"]["tp_all_gather"] + layer["recompute"]["tp_all_gather"]
           + extra["backward"]["tp_all_gather"],
           ("reduce_scatter", "forward"): layer["forward"]["tp_reduce_scatter"] + extra["forward"]["tp_reduce_scatter"],
           ("reduce_scatter", "backward"): layer["backward"]["tp_reduce_scatter"]
           + layer["recompute"]["tp_reduce_scatter"] + extra["backward"]["tp_reduce_scatter"],
           ("all_reduce", "forward"): extra["forward"]["tp_all_reduce"] + pooled_loss_bytes(work, layout),
           ("all_reduce", "backward"): extra["backward"]["tp_all_reduce"] if fsdp else 0,  # else sync_gradients'
           ("all_to_all", "forward"): layer["forward"]["ulysses_all_to_all"] + layer["recompute"]["ulysses_all_to_all"],
           ("all_to_all", "backward"): layer["backward"]["ulysses_all_to_all"],
           ("p2p", "forward"): layer["forward"]["ring_p2p"] + layer["recompute"]["ring_p2p"],
           ("p2p", "backward"): layer["backward"]["ring_p2p"],
           ("control", "forward"): Attention(work, layout).input_check()}
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("world", sorted(TP_LAYOUTS))
def test_tensor_parallel_bytes_equal_measured(pools, tmp_path, world):
    """U2 x TP2, R2 x TP2 and TP4 on 4 ranks: every rank's bytes per collective kind and phase,
    as comm_stats counts them in a whole training step, equal the planner's (per layer, per step outside the layers,
    the loss's all-reduces and input check), with checkpointing, a batch of 2, tied embeddings, q/k norms, FSDP2."""
    checked = 0
    for u, r, t in TP_LAYOUTS[world]:
        cases = [c if t < 4 else ModelTrafficCase(**{**c.__dict__, "kv_heads": 4}) for c in TP_CASES]
        per_rank = pools.run(world, measured_model_traffic, u, r, t, cases, timeout=600)
        layout = Degrees(u, r, 1, t)
        for i, case in enumerate(cases):
            work = _tp_workload(case, per_rank[0][i]["config"], tmp_path)
            want = _tp_predicted(work, layout, case.fsdp)
            for rank in per_rank:
                got = {(kind, ph): v["bytes_sent"] for kind, phases in rank[i]["stats"].items() for ph, v in phases.items()}
                assert got == want, (case, (u, r, t))
                checked += 1
    assert checked == sum(world * len(TP_CASES) for _ in TP_LAYOUTS[world])
