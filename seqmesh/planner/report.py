"""The text of a plan: the table, the recommendation and its memory, traffic and time (JSON is ``Plan.as_dict``)."""

from __future__ import annotations

from dataclasses import replace

from .hardware import Cluster
from .experts import moe_layers
from .plan import PHASES, Candidate, Plan, evaluate
from .recommend import gib, percent
from .vision import TOWER_KEYS, Tower
from .workload import Workload, keep_attention_unplanned

SP_COLLECTIVES = ("ulysses_all_to_all", "ring_p2p", "indexed_row_gather", "compressed_gather",
                  "block_sparse_row_gather", "qsa_row_gather", "relative_row_gather", "conv_halo_gather",
                  "router_logits_gather", "tp_all_gather",
                  "tp_reduce_scatter")  # the table's SP comm


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def short_number(x: float) -> str:
    """3 significant digits, without exponents for everyday magnitudes."""
    if x == 0:
        return "0"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x >= 0.001 else f"{x:.1e}"


def human_count(n: float) -> str:
    """A parameter count with the unit that fits: 8.0B, 596.0M, 70.3K, 512."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def header(work: Workload, cluster: Cluster) -> str:
    m, hw = work.model, cluster.hardware
    checkpointing = "checkpointing" + (" keeping the attention outputs" if work.keep_attention else "")
    flags = ", ".join([work.dtype, checkpointing if work.checkpointing else "no checkpointing",
                       "chunked loss" if work.chunked_loss else "full logits"]
                      + (["async Ulysses (layouts without TP)"] if work.async_ulysses else []))
    return (f"model {m.name}: {human_count(m.params)} params, {m.layers} layers, {attention_heads(m)}"
            f"{_latent(m)}{_hybrid(m)}{_compressed(m)}{_block_sparse(m)}{_qsa(m)}{_inkling(m)}, "
            f"vocab {m.vocab:,}; {flags}\n"
            f"cluster: {cluster.gpus} GPUs = {cluster.nodes} node(s) x {min(cluster.gpus, hw.gpus_per_node)}; "
            f"{hw.describe()}")


def attention_heads(m) -> str:
    """The header's attention heads: ``"32 query / 8 kv heads x 128"``, or ``"no attention"`` for a model without an
    attention layer (pure Mamba, RWKV), whose shape names one nominal head."""
    if m.hybrid is not None and not m.hybrid.attention_layers:
        return "no attention"
    return f"{m.heads} query / {m.kv_heads} kv heads x {m.head_dim}"


def _hybrid(m) -> str:
    """A hybrid's layers by kind and its recurrent mixer's sizes (Mamba2's, LFM2's short conv or Kimi Linear's KDA),
    as the header names them."""
    if m.hybrid is None:
        return ""
    kinds = ", ".join(f"{n} {'+'.join(x for x in block if x)}" for block, n in m.hybrid.kinds())
    mb, conv = m.hybrid.mamba, m.hybrid.conv
    if mb is not None:
        return (f" (layers: {kinds}; Mamba2 {mb.heads} heads x {mb.head_dim}, state {mb.state}, {mb.groups} groups, "
                f"conv {mb.conv})")
    if m.hybrid.lightning is not None:
        mixer = m.hybrid.lightning
        return f" (layers: {kinds}; lightning attention {mixer.heads} heads x {mixer.head_dim})"
    if m.hybrid.kda is not None:
        kda = m.hybrid.kda
        return f" (layers: {kinds}; KDA {kda.heads} heads x {kda.head_dim}, conv {kda.conv})"
    if m.hybrid.cca is not None:
        cca = m.hybrid.cca
        return f" (layers: {kinds}; CCA projections, their q | k convs {cca.time0} and {cca.time1} taps)"
    return f" (layers: {kinds}; gated short conv width {conv.kernel})" if conv is not None else f" (layers: {kinds})"


def _latent(m) -> str:
    """MLA's latent and, with DeepSeek Sparse Attention, its selection, as the header names them."""
    lat = m.latent
    if lat is None:
        return ""
    text = f" (MLA: latent {lat.kv_lora_rank} + rotary {lat.qk_rope_head_dim}, v {lat.v_head_dim})"
    if lat.indexed_layers:
        shared = f", {lat.shared_layers} sharing the previous selection" if lat.shared_layers else ""
        text += (f", sparse attention on {lat.indexed_layers} layers: top {lat.index_topk:,} keys a query, indexer "
                 f"{lat.index_n_heads} heads x {lat.index_head_dim}{shared}")
    own = m.sliding_latent
    if own is not None:  # dots.llm3's sliding layers at their own sizes
        text += (f", {m.sliding_layers} sliding layers of {m.sliding_heads} heads x {own.qk_head_dim} (latent "
                 f"{own.kv_lora_rank} + rotary {own.qk_rope_head_dim}, v {own.v_head_dim})")
    return text


def _block_sparse(m) -> str:
    """MiniMax-M3's block-sparse layers and their selection, as the header names them."""
    sparse = m.block_sparse
    if sparse is None:
        return ""
    return (f" (block-sparse attention on {sparse.layers} layers: top {sparse.topk_blocks} blocks of "
            f"{sparse.block_size} keys a query, indexer {sparse.index_heads} heads x {sparse.index_head_dim})")


def _inkling(m) -> str:
    """Inkling's layers by kind, as the header names them."""
    from ..model.inkling import FULL, SLIDING

    ink = m.inkling
    if ink is None:
        return ""
    h, hk, d = ink.heads(SLIDING, m.heads, m.kv_heads, m.head_dim)
    dynamic = " (the full layers' keys' and values' dynamic)" if ink.second else ""
    blocks = (f"; block states of {ink.block_layers} layers, {ink.blocks(m.layers)} a token at the last layer"
              if ink.second else "")
    if ink.gate_rank:
        blocks += (f"; layers {ink.loop_start}-{ink.loop_end - 1} looped, {ink.passes} passes, message gates of rank "
                   f"{ink.gate_rank}")
    return (f" ({ink.count(SLIDING)} sliding layers of {h} query / {hk} kv heads x {d}, window {ink.window}; "
            f"{ink.count(FULL)} full, bias {ink.rel_extent} keys back; relative bias over the gathered row, four "
            f"short convolutions of {ink.kernel} a layer{dynamic}{blocks})")


def _qsa(m) -> str:
    """Qwen4-Exp's layers, its selection and its streams, as the header names them."""
    q = m.qwen_exp
    if q is None:
        return ""
    ple = (f"; PLE before {len(q.ple.layers)} of them: n-gram tables of {human_count(sum(q.ple.tables))} rows, "
           f"{human_count(q.ple_params(m.hidden))} params") if q.ple is not None else ""
    return (f" ({m.linear_layers} Gated DeltaNet{ple}; {m.layers - m.linear_layers} QSA layers: top {q.block_topk} "
            f"blocks of {q.ratio} keys a query and its block's tail, indexer {q.index_heads} heads x "
            f"{q.index_head_dim}; {q.streams} residual streams, gated residuals of rank {q.lowrank})")


def _compressed(m) -> str:
    """DeepSeek-V4's layers by kind, as the header names them."""
    from ..model.deepseek_v4 import CSA, HCA, SLIDING

    c = m.compressed
    if c is None:
        return ""
    kinds = [f"{c.count(SLIDING)} sliding"] if c.count(SLIDING) else []
    if c.count(HCA):
        kinds.append(f"{c.count(HCA)} HCA (entries of {c.hca_rate} tokens)")
    if c.count(CSA):
        kinds.append(f"{c.count(CSA)} CSA (entries of {c.csa_rate} tokens, top {c.index_topk:,} a query, indexer "
                     f"{c.index_n_heads} heads x {c.index_head_dim})")
    return f" (layers: {', '.join(kinds)}; window {c.window}, {c.hc_mult} residual streams)"


def format_plan(p: Plan, top: int) -> str:
    work, target = p.work, p.target
    accum = target.sequences is not None
    lines = [header(work, p.cluster),
             f"sequence {work.seq_len:,} tokens x micro-batch {work.batch} per sequence group; "
             + ("row 1 is the recommendation (why: below), the others " if p.recommended is not None else "")
             + "ranked by predicted tokens/s (a step of a layout with DP groups processes that many micro-batches); "
             "SP comm/layer: sequence-parallel bytes the busiest rank sends per layer, forward + backward"
             + (" + checkpoint recompute" if work.checkpointing else "")]
    if accum or target.one_group:
        lines.append(global_batch_line(p))
    best_tps = max((c.tokens_per_s for c in p.candidates if c.feasible), default=0.0)
    lines += ["", f"{'#':>3}  {'layout':<20}{'fits':>5}{'GiB/GPU':>9}{'step s':>9}"
              + (f"{'accum':>7}{'opt step s':>11}" if accum else "") + f"{'tokens/s':>11}{'vs best':>8}"
              f"{'SP comm/layer':>15}{'exposed':>9}  {'Ulysses link':<15}{'ring link':<15}notes"]
    for i, c in enumerate(p.candidates[:top], 1):
        rel = f"{c.tokens_per_s / best_tps:.3f}" if c.feasible and best_tps else "-"
        exposed = percent(c.time.exposed_comm / c.time.total)
        ulink = c.comm_links.get("ulysses_all_to_all") or c.comm_links.get("tp_all_gather", "-")
        opt = f"{c.accumulation:>7}{short_number(c.optimizer_step_s):>11}" if accum else ""
        sp = sum(v for phase in c.comm_per_layer.values() for k, v in phase.items() if k in SP_COLLECTIVES)
        lines.append(f"{i:>3}  {c.layout.label():<20}{'yes' if c.feasible else 'NO':>5}{gib(c.memory.total):>9}"
                     f"{short_number(c.time.total):>9}{opt}{short_number(c.tokens_per_s):>11}{rel:>8}"
                     f"{human_bytes(sp):>15}{exposed:>9}  "
                     f"{ulink:<15}{c.comm_links.get('ring_p2p', '-'):<15}{'; '.join(c.notes)}")
    if len(p.candidates) > top:
        lines.append(f"     ... {len(p.candidates) - top} more (--top {len(p.candidates)} shows all)")
    if p.excluded:
        shown = "; ".join(f"{lay.label()}: {why}" for lay, why in p.excluded[:2])
        more = f"; and {len(p.excluded) - 2} more" if len(p.excluded) > 2 else ""
        lines.append(f"     not possible: {shown}{more}")
    lines.append("")
    if p.recommended is None:
        return "\n".join(lines + [f"no seqmesh layout fits: {p.reason}"])
    c = p.recommended
    phases, layer = _per_phase(c.comm_per_layer, [k for k in sorted(c.comm_per_layer["forward"]) if k != "total"])
    step = [f"{k} {human_bytes(v)}" for k, v in sorted(c.comm_per_step.items()) if k != "total" and v]
    lines += [f"recommended: {c.layout.label()} -- {p.reason}", format_memory(c, p.cluster),
              f"traffic per layer, busiest rank, {' / '.join(phases)}: " + (layer or "none"),
              f"traffic per step, busiest rank (every FSDP unit included): {'; '.join(step) or 'none'}; "
              f"total {human_bytes(c.comm_per_step['total'])}",
              f"step: {short_number(c.time.total)} s = compute {short_number(c.time.compute)} s + exposed communication "
              f"{short_number(c.time.exposed_comm)} s"]
    kept = keep_attention_line(c, work, p.cluster)
    if kept:
        lines.append(kept)
    if c.layout.ep > 1:
        lines += format_experts(c, work, p.cluster)
    if work.media is not None:
        lines += format_tower(c, work, p.cluster)
    if accum:
        tokens = target.sequences * work.seq_len
        lines.append(f"optimizer step (global batch {target.sequences:,} sequences = {tokens:,} tokens): "
                     f"{c.accumulation} micro-step(s) x {short_number(c.time.total)} s = {short_number(c.optimizer_step_s)} s, "
                     f"{short_number(tokens / c.optimizer_step_s)} tokens/s")
    return "\n".join(lines)


def keep_attention_line(c: Candidate, work: Workload, cluster: Cluster) -> str | None:
    """What ``--keep-attention`` would give the recommended layout (checkpointed, not asked for, a model whose kept
    outputs the planner counts): its tokens/s and memory, and whether it still fits; None where it does not apply or
    the model has no seqmesh attention layer to keep."""
    if (not work.checkpointing or work.keep_attention or work.compile
            or keep_attention_unplanned(work.model, work.media is not None)):
        return None
    kept = evaluate(replace(work, keep_attention=True), c.layout, cluster)
    if kept.memory.total == c.memory.total and kept.time.total == c.time.total:
        return None
    fits = "fits" if kept.feasible else f"does not fit in {gib(cluster.hardware.memory_bytes)} GiB"
    return (f"with --keep-attention (the recompute skips the attention, each layer keeps its output): "
            f"{short_number(kept.tokens_per_s)} tokens/s ({kept.tokens_per_s / c.tokens_per_s - 1:+.1%}), "
            f"{gib(kept.memory.total)} GiB per GPU ({fits})")


def format_experts(c: Candidate, work: Workload, cluster: Cluster) -> list[str]:
    """What expert parallelism changes on ``c``'s layout: its experts per rank, and its memory, bytes per MoE layer
    and step beside the same layout without EP."""
    m, lay = work.model, c.layout
    base = evaluate(work, replace(lay, ep=1), cluster)
    a2a = " / ".join(human_bytes(c.comm_per_layer[ph]["ep_all_to_all"]) for ph in PHASES)
    return [f"expert parallelism EP{lay.ep}: {m.experts // lay.ep} of the {m.experts} routed experts per rank in each of "
            f"{moe_layers(m)} MoE layers, sharded over the {lay.fsdp_group // lay.ep} ranks holding them; per MoE "
            f"layer, busiest rank: ep_all_to_all {a2a} (forward / backward / recompute)",
            f"without EP ({base.layout.label()}): memory {gib(base.memory.total)} -> {gib(c.memory.total)} GiB per GPU; "
            f"FSDP all-gather per layer {human_bytes(base.comm_per_layer['forward']['fsdp_all_gather'])} -> "
            f"{human_bytes(c.comm_per_layer['forward']['fsdp_all_gather'])} each way; traffic per step "
            f"{human_bytes(base.comm_per_step['total'])} -> {human_bytes(c.comm_per_step['total'])}; step "
            f"{short_number(base.time.total)} -> {short_number(c.time.total)} s" + ("" if base.feasible else " (without EP it does not fit)")]


def _per_phase(sent: dict[str, dict[str, int]], keys: list[str]) -> tuple[list[str], str]:
    """The phases in which anything of ``keys`` is sent, and "key a / b / c" (its bytes in each) per key sent."""
    phases = [ph for ph in PHASES if any(sent[ph][k] for k in keys)]
    return phases, "; ".join(f"{k} {' / '.join(human_bytes(sent[ph][k]) for ph in phases)}" for k in keys
                             if any(sent[ph][k] for ph in phases))


def format_tower(c: Candidate, work: Workload, cluster: Cluster) -> list[str]:
    """The vision tower's part of ``c``: its sequence, memory, traffic and time on the busiest rank (:mod:`.vision`)."""
    tower, media, v = Tower(work, c.layout), work.media, work.model.vision
    shown = [f"{media.images} image(s)"] if media.images else []
    shown += [f"a video of {media.video_frames} frames"] if media.video_frames else []
    each = " and ".join(x for x, n in (("image", media.images), (f"{v.temporal} video frames", media.video_frames))
                        if n)
    frame, tokens = media.frame_patches(v), media.tokens(v) // media.frames(v)
    kept, peak = tower.memory()
    phases, sent = _per_phase(tower.traffic(), list(TOWER_KEYS))
    sent = f" ({' / '.join(phases)}): {sent}" if sent else ": no sequence-parallel traffic (one rank per group)"
    fsdp = "; ".join(f"{k} {human_bytes(n)}" for k, n in tower.fsdp().items())
    s = tower.seconds(cluster.hardware)
    return [f"vision tower ({c.layout.label()}): {' + '.join(shown)} of {media.height}x{media.width} px per "
            f"sequence, {frame:,} patches ({tokens:,} tokens) per {each}; {tower.patches:,} patches and "
            f"{work.batch * media.tokens(v):,} placeholder tokens per sequence group, {tower.rank_patches:,} "
            + ("places (patches, class windows, padding)" if v.class_token else "patches") + " per rank",
            f"vision tower memory per GPU: {gib(kept)} GiB kept through the decoder, {gib(peak)} GiB in its top "
            "block's backward",
            f"vision tower traffic per step, busiest rank{sent}; {fsdp}",
            f"vision tower time: {short_number(s['total'])} s of the {short_number(c.time.total)} s step "
            f"({percent(s['total'] / c.time.total)}): compute {short_number(s['compute'])} s, exposed communication "
            f"{short_number(s['total'] - s['compute'])} s"]


def global_batch_line(p: Plan) -> str:
    """What the global batch asks and how gradient accumulation is counted."""
    t, work, gpus = p.target, p.work, p.cluster.gpus
    parts = [f"one sequence group over all {gpus} GPUs (ulysses x ring = {gpus})"] if t.one_group else []
    if t.sequences is not None:
        parts.append(f"global batch {t.sequences:,} sequences ({t.sequences * work.seq_len:,} tokens) per optimizer "
                     f"step = dp_shard x micro-batch {work.batch} x gradient accumulation; each accumulation "
                     "micro-step repeats FSDP's gathers and reduce-scatter")
    return "; ".join(parts)


def format_memory(c: Candidate, cluster: Cluster) -> str:
    mb = c.memory
    body = ", ".join(f"{k} {gib(v)}" for k, v in mb.as_dict().items() if k != "total")
    return (f"memory per GPU ({c.layout.label()}) at its peak ({mb.moment}), GiB: {body}; total "
            f"{gib(mb.total)} of {gib(cluster.hardware.memory_bytes)}")


def format_longest(result: dict, work: Workload, cluster: Cluster, top: int) -> str:
    """The ``--max-seq-len`` table (``result`` as :func:`.plan.longest_plan` returns it)."""
    rows = result["candidates"]
    lines = [header(work, cluster), "longest sequence that fits per layout (micro-batch "
             f"{work.batch}), ranked by length then tokens/s at that length", "",
             f"{'#':>3}  {'layout':<20}{'max tokens':>14}{'GiB/GPU':>9}{'step s':>9}{'tokens/s':>11}"]
    for i, r in enumerate(rows[:top], 1):
        step = short_number(r["step_time_s"]) if r["step_time_s"] is not None else "-"
        lines.append(f"{i:>3}  {r['label']:<20}{r['max_seq_len']:>14,}{gib(r['memory_bytes']['total']):>9}"
                     f"{step:>9}{short_number(r['tokens_per_s']):>11}")
    if len(rows) > top:
        lines.append(f"     ... {len(rows) - top} more")
    rec = result["recommended"]
    lines += ["", f"longest with seqmesh: {rec['label']} -- {result['reason']}" if rec
              else f"nothing fits: {result['reason']}"]
    return "\n".join(lines)
