"""Bytes each rank sends, per collective, from first principles (counted as ``seqmesh.comm.stats`` counts): pure
functions of shapes and degrees that import none of seqmesh's attention code, so tests compare two independent
derivations. What each collective sends: docs/planner.md ("Traffic").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rules.heads import HeadDeal
from ..rules.padding import padded_length

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
VALIDATION_FIELDS = 15  # the problem flag + 14 fields of seqmesh.sharded_attention.checks.FIELDS (image blocks the 14th)
INT64 = 8


def dtype_bytes(dtype: str) -> int:
    """Element size of a dtype named as torch names it ("bfloat16", "float32", ...)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}.")
    return DTYPE_BYTES[dtype]


def partial_bytes(dtype: str) -> int:
    """Element size of the ring's dK/dV partials: float32, or float64 for float64 inputs."""
    return 8 if dtype == "float64" else 4


def ring_steps(ring: int, padded_len: int, layout: str = "zigzag", window: int | None = None) -> int:
    """How many ring steps compute anything under a causal sliding ``window`` (``ring`` without one)."""
    return len(ring_step_list(ring, padded_len, layout, window))


def _document_steps(ring: int, padded_len: int, documents: tuple[int, ...], causal: bool) -> tuple[int, ...]:
    """The ring steps of a contiguous layout packed with ``documents`` (their boundaries) that share a document."""
    c = padded_len // ring
    bounds = tuple(documents) + ((padded_len,) if documents[-1] < padded_len else ())
    first = lambda pos: max(i for i, b in enumerate(bounds) if b <= pos)  # noqa: E731  the document holding pos
    spans = [range(first(r * c), first((r + 1) * c - 1) + 1) for r in range(ring)]
    needed = {0}
    for r in range(ring):
        for s in range(ring):
            if (s <= r or not causal) and set(spans[r]) & set(spans[s]):
                needed.add((r - s) % ring)
    return tuple(sorted(needed))


def ring_step_list(ring: int, padded_len: int, layout: str = "zigzag", window: int | None = None,
                   documents: tuple[int, ...] | None = None, causal: bool = True) -> tuple[int, ...]:
    """The ring steps that compute anything under a causal sliding ``window`` or, in a contiguous layout, between
    packed ``documents``, ascending (docs/planner.md, "Traffic", derives which)."""
    if documents is not None and ring > 1:
        if layout != "contiguous" or window is not None:
            raise ValueError("ring steps by documents are modelled for the contiguous layout without a window.")
        return _document_steps(ring, padded_len, documents, causal)
    if window is None or ring == 1:
        return tuple(range(ring))
    zigzag = layout == "zigzag"
    c = padded_len // (2 * ring) if zigzag else padded_len // ring
    chunks = (lambda r: (r, 2 * ring - 1 - r)) if zigzag else (lambda r: (r,))  # noqa: E731
    needed = {0}
    for r in range(ring):
        for s in range(ring):
            if any(b < a and (a - b - 1) * c + 1 < window for a in chunks(r) for b in chunks(s)):
                needed.add((r - s) % ring)
    return tuple(sorted(needed))


@dataclass(frozen=True)
class Collective:
    """One kind of collective in one phase: how often and how many bytes this rank sends."""

    kind: str  # as seqmesh.comm.stats counts it: all_to_all, p2p, all_gather, reduce_scatter, control
    phase: str  # forward or backward
    calls: int
    bytes_sent: int


@dataclass(frozen=True)
class RankTraffic:
    """Everything one rank sends for one attention call (forward and backward)."""

    ulysses_rank: int
    ring_rank: int
    collectives: tuple[Collective, ...] = field(default_factory=tuple)

    def sent(self, kind: str, phase: str) -> int:
        return sum(c.bytes_sent for c in self.collectives if c.kind == kind and c.phase == phase)

    def calls(self, kind: str, phase: str) -> int:
        return sum(c.calls for c in self.collectives if c.kind == kind and c.phase == phase)


def attention_traffic(q_heads: int, kv_heads: int, head_dim: int, *, seq_len: int, batch: int, ulysses: int, ring: int,
                      dtype: str, layout: str = "zigzag", validate: bool = True, window: int | None = None,
                      documents: tuple[int, ...] | None = None, causal: bool = True,
                      value_dim: int | None = None) -> list[RankTraffic]:
    """Per-rank traffic of one ``seqmesh.attention`` forward+backward, indexed by sequence rank ``ring_rank * ulysses
    + ulysses_rank``, with a causal sliding ``window`` or packed ``documents`` if given (:func:`ring_step_list`).
    ``value_dim`` (MLA: v's head dim, not q's and k's): Ulysses moves q and k in one all-to-all, v in another, the
    output at v's dim; the ring's K/V blocks are ``head_dim + value_dim`` wide."""
    deal = HeadDeal(q_heads, kv_heads, ulysses)
    p = ulysses * ring
    local = padded_length(seq_len, ulysses, ring, layout) // p
    e, ep = dtype_bytes(dtype), partial_bytes(dtype)
    dv = head_dim if value_dim is None else value_dim
    row, v_row = batch * local * head_dim * e, batch * local * dv * e  # one head of this rank's tokens: q/k, v
    all_heads = sum(deal.q_count(v) + 2 * deal.kv_count(v) for v in range(ulysses))
    all_kv = sum(deal.kv_count(v) for v in range(ulysses))
    all_qk = all_heads - all_kv
    steps = ring_step_list(ring, local * p, layout, window, documents, causal)  # the same on every rank
    hops = len(steps) - 1
    relay = steps == tuple(range(len(steps)))  # relayed partials make one more hop, home
    partials = hops + 1 if relay else hops
    out: list[RankTraffic] = []
    for r in range(ring):
        for u in range(ulysses):
            q, kv = deal.q_count(u), deal.kv_count(u)
            items: list[Collective] = []
            if validate and p > 1:
                items.append(Collective("control", "forward", 1, (p - 1) * VALIDATION_FIELDS * INT64))
            if ulysses > 1 and dv == head_dim:
                items += [Collective("all_to_all", "forward", 1, (all_heads - q - 2 * kv) * row),
                          Collective("all_to_all", "forward", 1, (ulysses - 1) * q * row),
                          Collective("all_to_all", "backward", 1, (q_heads - q) * row),
                          Collective("all_to_all", "backward", 1, (ulysses - 1) * (q + 2 * kv) * row)]
            elif ulysses > 1:  # q and k packed, v on its own (seqmesh.sharded_attention.ulysses), output at dv
                items += [Collective("all_to_all", "forward", 1, (all_qk - q - kv) * row),
                          Collective("all_to_all", "forward", 1, (all_kv - kv) * v_row),
                          Collective("all_to_all", "forward", 1, (ulysses - 1) * q * v_row),
                          Collective("all_to_all", "backward", 1, (q_heads - q) * v_row),
                          Collective("all_to_all", "backward", 1, (ulysses - 1) * kv * v_row),
                          Collective("all_to_all", "backward", 1, (ulysses - 1) * (q + kv) * row)]
            if hops:
                block = batch * ulysses * local * kv * (head_dim + dv)  # elements of one K/V block
                items += [Collective("p2p", "forward", hops, hops * block * e),
                          Collective("p2p", "backward", hops, hops * block * e),
                          Collective("p2p", "backward", partials, partials * block * ep)]
            out.append(RankTraffic(u, r, tuple(items)))
    return out


def linear_attention_traffic(key_heads: int, value_heads: int, key_dim: int, value_dim: int, *, seq_len: int,
                             batch: int, ulysses: int, ring: int, dtype: str,
                             layout: str = "zigzag") -> list[RankTraffic]:
    """Per-rank traffic of one Gated DeltaNet layer (``seqmesh.linear_attention``), forward+backward, indexed by
    sequence rank: all-to-alls over the whole sequence group, each rank's channel count ``c_v`` as docs/planner.md
    ("Traffic") derives it (q, k of its key heads; v, beta and the decay input of its value heads)."""
    p = ulysses * ring
    if p == 1:
        return [RankTraffic(0, 0, ())]
    deal = HeadDeal(value_heads, key_heads, p)
    local = padded_length(seq_len, ulysses, ring, layout) // p
    unit = batch * local * dtype_bytes(dtype)  # one channel of this rank's tokens
    channels = [2 * deal.kv_count(v) * key_dim + deal.q_count(v) * (value_dim + 2) for v in range(p)]
    out = []
    for rank in range(p):
        h, c = deal.q_count(rank), channels[rank]
        out.append(RankTraffic(rank % ulysses, rank // ulysses, (
            Collective("all_to_all", "forward", 1, (sum(channels) - c) * unit),
            Collective("all_to_all", "forward", 1, (p - 1) * h * value_dim * unit),
            Collective("all_to_all", "backward", 1, (value_heads - h) * value_dim * unit),
            Collective("all_to_all", "backward", 1, (p - 1) * c * unit))))
    return out


def indexed_attention_traffic(index_head_dim: int, kv_lora_rank: int, rope_dim: int, *, seq_len: int, batch: int,
                              ulysses: int, ring: int, dtype: str, layout: str = "zigzag",
                              indexer: bool = True) -> list[RankTraffic]:
    """Per-rank traffic of one DeepSeek Sparse Attention layer (``indexed_attention``), forward+backward, indexed by
    sequence rank: forward one all-gather over the whole sequence group per tensor of the row every query may read,
    the indexer's key (``index_head_dim`` a token; without ``indexer``, a layer reusing the previous selection, not
    gathered), and MLA's latent (``kv_lora_rank``) with its rotary key (``rope_dim``) in one; backward one
    reduce-scatter of their gradients (the indexer runs without gradients). ``(P - 1) x`` this rank's share
    each, the same on every rank and for every ``ulysses x ring`` split of ``P``."""
    p = ulysses * ring
    if p == 1:
        return [RankTraffic(0, 0, ())]
    local = padded_length(seq_len, ulysses, ring, layout) // p
    unit = (p - 1) * batch * local * dtype_bytes(dtype)  # one value of each token of every other rank
    gathered = ((index_head_dim,) if indexer else ()) + (kv_lora_rank + rope_dim,)
    calls = (Collective("all_gather", "forward", len(gathered), sum(gathered) * unit),
             Collective("reduce_scatter", "backward", 1, (kv_lora_rank + rope_dim) * unit))
    return [RankTraffic(rank % ulysses, rank // ulysses, calls) for rank in range(p)]


def worst_rank(ranks: list[RankTraffic], kind: str, phase: str) -> int:
    """The most bytes any rank sends for ``kind`` in ``phase``."""
    return max(t.sent(kind, phase) for t in ranks)


def call_bytes(ranks: list[RankTraffic], kind: str, phase: str) -> list[int]:
    """Bytes of each ``kind`` call in ``phase``, in issue order, on the rank that sends the most in that call
    (every rank issues the same calls)."""
    sent = [[c.bytes_sent for c in t.collectives if c.kind == kind and c.phase == phase] for t in ranks]
    return [max(call) for call in zip(*sent)]


def ring_block_bytes(q_heads: int, kv_heads: int, head_dim: int, *, seq_len: int, batch: int, ulysses: int,
                     ring: int, dtype: str, layout: str = "zigzag", value_dim: int | None = None) -> tuple[int, int]:
    """``(K/V block, dK/dV partial)`` bytes of one ring hop on the busiest rank (``value_dim``: v's, MLA's)."""
    deal = HeadDeal(q_heads, kv_heads, ulysses)
    local = padded_length(seq_len, ulysses, ring, layout) // (ulysses * ring)
    block = batch * ulysses * local * deal.max_kv * (head_dim + (head_dim if value_dim is None else value_dim))
    return block * dtype_bytes(dtype), block * partial_bytes(dtype)


def fsdp_traffic(params: int, group: int, param_dtype: str, reduce_dtype: str = "float32") -> dict[str, int]:
    """One FSDP unit of ``params`` parameters sharded over ``group`` ranks, per rank: gathered in ``param_dtype``
    forward and again backward (FSDP2 frees it after forward), its gradients reduce-scattered in ``reduce_dtype``;
    each moves ``(G - 1) x shard`` bytes."""
    if group == 1:
        return {"all_gather_forward": 0, "all_gather_backward": 0, "reduce_scatter_backward": 0}
    shard = -(-params // group)
    gather = (group - 1) * shard * dtype_bytes(param_dtype)
    return {"all_gather_forward": gather, "all_gather_backward": gather,
            "reduce_scatter_backward": (group - 1) * shard * dtype_bytes(reduce_dtype)}


def vision_tower_traffic(depth: int, heads: int, head_dim: int, *, frames: tuple[int, ...], merge: int, ulysses: int,
                         ring: int, dtype: str, windows: tuple[int, ...] | None = None,
                         full_blocks: int = 0) -> list[RankTraffic]:
    """Per-rank traffic of a sharded vision tower's ``depth`` blocks, forward+backward, indexed by sequence rank:
    per block one bidirectional attention call whose documents end at ``frames`` (or, for all but ``full_blocks``
    blocks when given, at ``windows``), as docs/planner.md, "Vision towers", says; the tower's one or two input
    checks a step are left out."""
    p = ulysses * ring
    unit = merge * merge
    padded = unit * p * -(-frames[-1] // (unit * p))

    def blocks(documents: tuple[int, ...], count: int) -> list[RankTraffic]:
        ranks = attention_traffic(heads, heads, head_dim, seq_len=padded, batch=1, ulysses=ulysses, ring=ring,
                                  dtype=dtype, layout="contiguous", validate=False, documents=tuple(documents),
                                  causal=False)
        return [[Collective(c.kind, c.phase, count * c.calls, count * c.bytes_sent) for c in t.collectives]
                for t in ranks]

    windowed = depth - full_blocks if windows is not None else 0
    parts = [blocks(frames, depth - windowed)] + ([blocks(windows, windowed)] if windowed else [])
    return [RankTraffic(rank % ulysses, rank // ulysses, tuple(c for part in parts for c in part[rank]))
            for rank in range(p)]


def vision_route_traffic(units_sent: int, units_received: int, width: int, dtype: str) -> dict[str, int]:
    """The route of the merged image embeddings, per rank: forward the ``units_sent`` merged units (``width`` values
    each) whose token lies on another rank, backward the gradients of the ``units_received`` that came from one."""
    row = width * dtype_bytes(dtype)
    return {"forward": units_sent * row, "backward": units_received * row}
