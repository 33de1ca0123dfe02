"""A KV cache that stays sharded over the sequence group, and the entries that carry it through a model call.

Every rank of the sequence group (Ulysses and ring alike) keeps the keys and values of its own share of the
sequence, all heads: after the prefill, the tokens the layout gave it (the prompt's activations were sharded the same
way); each new token's key and value go to the rank holding the fewest tokens (the lowest such rank on a tie), which
keeps the largest share within one token of the smallest after the prefill's own imbalance. Every rank knows every
share's count, so each decides the same owner without a message. A cache of ``T`` tokens costs each rank
``T / P`` tokens x layers x (Hk x (Dk + Dv)) values (:func:`cache_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn as nn

from ..mesh import SPMesh
from ..rules.kv_cache import cache_bytes  # noqa: F401 - seqmesh.inference.cache_bytes, the planner's too
from ..sequence.batch import SequenceInfo


class ShardedKVCache:
    """This rank's share of every attention layer's keys and values, (B, Hk, n, D) per layer, in the order the share's
    tokens came (``positions``: each one's index in the row), and every rank's share size (``counts``)."""

    def __init__(self, mesh: SPMesh):
        self.mesh = mesh
        self.keys: dict[int, torch.Tensor] = {}  # id(attention module) -> (B, Hk, n, Dk)
        self.values: dict[int, torch.Tensor] = {}  # -> (B, Hk, n, Dv)
        self.positions = torch.zeros(0, dtype=torch.long)
        self.counts: list[int] = [0] * mesh.sp_size
        # id(recurrent layer) -> (its state after the tokens so far, its conv's last inputs): the same on every rank
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._real: torch.Tensor | None = None  # the prefill's local tokens that are the prompt's, not padding

    def start(self, local_positions: torch.Tensor, seq_len: int) -> None:
        """Before the prefill: this rank's tokens' indices in the row (padding at ``seq_len`` and past is kept
        out); every rank's count, in one all-gather of the sequence group."""
        self._real = local_positions < seq_len
        self.positions = local_positions[self._real].cpu()
        count = torch.tensor([self.positions.numel()], dtype=torch.long, device=self.mesh.collective_device())
        everyone = [torch.zeros_like(count) for _ in range(self.mesh.sp_size)]
        dist.all_gather(everyone, count, group=self.mesh.sp_group)
        self.counts = [int(c) for c in everyone]

    def keep(self, module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        """The prefill's keys and values of ``module`` on this rank's tokens, (B, Hk, L, D), padding dropped."""
        real = self._real.to(key.device)
        self.keys[id(module)], self.values[id(module)] = key[:, :, real].clone(), value[:, :, real].clone()

    @property
    def length(self) -> int:
        """Tokens the cache holds, over every rank."""
        return sum(self.counts)

    def extend(self, every_rank: torch.Tensor, real: torch.Tensor, offset: int) -> None:
        """Before an extension (:class:`Extension`): ``every_rank`` (P, L) each rank's new tokens' indices in the
        new tokens, ``real`` (P, L) which are not the layout's padding; each rank counts its real ones, and this rank's
        positions (``offset`` + index) join its share (their keys and values join each layer's when it runs)."""
        self.counts = [c + int(n) for c, n in zip(self.counts, real.sum(dim=1).tolist())]
        mine = every_rank[self.mesh.sp_rank][real[self.mesh.sp_rank]]
        self.positions = torch.cat([self.positions, (mine + offset).cpu()])

    def kept(self) -> tuple:
        """What the cache holds now (its tensors are never written in place), for :meth:`restore`."""
        return dict(self.keys), dict(self.values), self.positions, list(self.counts), dict(self.states)

    def restore(self, kept: tuple) -> None:
        """Back to what :meth:`kept` saw (a prefill onto it that failed part way leaves it as it was)."""
        self.keys, self.values, self.positions, self.counts, self.states = (
            dict(kept[0]), dict(kept[1]), kept[2], list(kept[3]), dict(kept[4]))

    def next_owner(self) -> int:
        """The sequence rank that keeps the next token: the one holding fewest (the lowest on a tie)."""
        return min(range(len(self.counts)), key=lambda r: (self.counts[r], r))

    def advance(self, owner: int, position: int) -> None:
        """Count the next token (at ``position`` in the row) as ``owner``'s; on the owner, its position joins the share
        (its keys and values join each layer's when the layer runs, :meth:`append`)."""
        self.counts[owner] += 1
        if owner == self.mesh.sp_rank:
            self.positions = torch.cat([self.positions, torch.tensor([position])])

    def append(self, module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        """New tokens' keys and values (B, Hk, n, D) into ``module``'s share (a decode step's owner's only)."""
        k, v = self.keys.get(id(module)), self.values.get(id(module))
        self.keys[id(module)] = key if k is None else torch.cat([k, key], dim=2)
        self.values[id(module)] = value if v is None else torch.cat([v, value], dim=2)

    def share(self, module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.keys.get(id(module)), self.values.get(id(module))

    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds."""
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


@dataclass(frozen=True)
class RecurrentStates:
    """What a recurrent layer (seqmesh.hf's Gated DeltaNet) reads from a generation's entry: in a prefill
    (``decoding`` False) it runs sharded and leaves its final state and conv tail here (:meth:`put`); in a decode step
    it runs one token from them (:meth:`get`) and leaves the next. ``extension`` (a prefill onto a kept cache: the
    :class:`Extension`): the layer runs the new tokens whole from them (:meth:`whole`), on every rank alike."""

    cache: ShardedKVCache
    decoding: bool
    extension: Extension | None = None

    def whole(self, run, *local: torch.Tensor) -> torch.Tensor:
        """``run`` on the new tokens whole: each of ``local`` (B, L, ...) this rank's, in the layout's order, gathered
        into the new tokens' order (B, T, ...); ``run``'s output (B, T, ...) back at this rank's tokens (B, L, ...)
        (padding zero). Every rank runs the same tokens from the same state: one all-gather an input, nothing else."""
        from ..sequence.sharding import gather_sequence, shard_sequence

        info = self.extension
        whole = [gather_sequence(x.contiguous(), self.cache.mesh, layout=info.layout, length=info.seq_len)
                 for x in local]
        out = run(*whole)
        padded = local[0].shape[1] * self.cache.mesh.sp_size
        out = torch.cat([out, out.new_zeros(out.shape[0], padded - out.shape[1], *out.shape[2:])], dim=1)
        return shard_sequence(out, self.cache.mesh, layout=info.layout)

    def get(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.states[id(module)]

    def put(self, module: nn.Module, state: torch.Tensor, tail: torch.Tensor) -> None:
        self.cache.states[id(module)] = (state, tail)


@dataclass(frozen=True, eq=False)
class Prefill(SequenceInfo):
    """The entry of the prefill call: the prompt's :class:`SequenceInfo`, and the cache its attention layers fill."""

    cache: ShardedKVCache | None = None

    @classmethod
    def of(cls, info: SequenceInfo, cache: ShardedKVCache) -> Prefill:
        return cls(**{f.name: getattr(info, f.name) for f in fields(SequenceInfo)}, cache=cache)

    @property
    def recurrent_state(self) -> RecurrentStates:
        return RecurrentStates(self.cache, decoding=False)

    def intercept_attention(self, module, query, key, value, mesh, scaling, kwargs) -> None:
        """Called by seqmesh's registered attention before it attends (``seqmesh.hf``): keep this rank's keys and
        values (B, Hk, L, D) of ``module``; the attention then runs as in training."""
        self.cache.keep(module, key, value)

    def keep_block_sparse(self, module, key: torch.Tensor, value: torch.Tensor, index_key: torch.Tensor) -> None:
        """Called by a MiniMax-M3 block-sparse layer (``seqmesh.hf.block_sparse_attention``) in its prefill: this
        rank's keys and values (B, Hkv, L, D), and its indexer's keys (B, 1, L, Di), filed under the indexer
        (:mod:`.block_sparse_decode`)."""
        self.cache.keep(module, key, value)
        self.cache.keep(module.indexer, index_key, index_key[..., :0])

    def keep_indexed(self, module, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Called by a DeepSeek Sparse Attention layer (``seqmesh.hf.indexed_attention``) in its prefill: this rank's
        tokens' latent and rotated key (B, L, R + Dr) and indexer keys (B, L, Di; None in a shared layer), kept as
        one cache head (:mod:`.indexed_decode`)."""
        self.cache.keep(module, rows[:, None], (rows[..., :0] if index_keys is None else index_keys)[:, None])


@dataclass(frozen=True, eq=False)
class DecodeStep(SequenceInfo):
    """The entry of one decode call: every rank runs the same new token at ``position``; ``owner`` keeps it."""

    cache: ShardedKVCache | None = None
    position: int = 0
    owner: int = 0

    @property
    def recurrent_state(self) -> RecurrentStates:
        return RecurrentStates(self.cache, decoding=True)

    def row_positions(self, device: torch.device) -> torch.Tensor:
        """The new token's position in the row (1,)."""
        return torch.tensor([self.position], device=device)

    def intercept_attention(self, module, query, key, value, mesh, scaling, kwargs) -> torch.Tensor:
        """Called by seqmesh's registered attention in place of it (``seqmesh.hf``): the new token's attention over
        the sharded cache, (B, 1, Hq, Dv) (:func:`.decode.attend_step`)."""
        from .decode import attend_step

        return attend_step(module, query, key, value, self, mesh, scaling, kwargs)

    def block_sparse_step(self, module, hidden, position_embeddings, query, key, value):
        """Called by a MiniMax-M3 block-sparse layer in place of its attention: the new token's, over the sharded
        cache (:func:`.block_sparse_decode.block_sparse_step`) -> (B, 1, Hq, D)."""
        from .block_sparse_decode import block_sparse_step

        return block_sparse_step(module, hidden, position_embeddings, query, key, value, self, self.cache.mesh)

    def indexed_step(self, module, hidden, q_resid, q_pass, q_rot, row, position_embeddings, prev_picks):
        """Called by a DeepSeek Sparse Attention layer in place of its attention: the new token's, over the sharded
        cache (:func:`.indexed_decode.indexed_step`) -> ((B, 1, H, Dv), its picks (B, 1, k))."""
        from .indexed_decode import indexed_step

        return indexed_step(module, hidden, q_resid, q_pass, q_rot, row, position_embeddings, prev_picks, self,
                            self.cache.mesh)


@dataclass(frozen=True, eq=False)
class Extension(SequenceInfo):
    """The entry of a call that prefills new tokens onto a kept cache (:mod:`.extend`): the new tokens' own
    :class:`SequenceInfo` (sharded by a layout as a prompt), ``query_positions`` (P, L) every rank's new tokens'
    positions in the row (-1 for the layout's padding, which sees nothing), ``real`` (L,) which of this rank's are
    real, ``schedule`` (:data:`.extend.SCHEDULES`), and ``chosen``: the schedules its layers ran."""

    cache: ShardedKVCache | None = None
    query_positions: torch.Tensor | None = None
    real: torch.Tensor | None = None
    schedule: str = "auto"
    chosen: set = field(default_factory=set, compare=False)

    @classmethod
    def of(cls, info: SequenceInfo, cache: ShardedKVCache, offset: int, schedule: str) -> Extension:
        """The entry of ``info``'s new tokens after ``offset`` kept ones; counts them into ``cache``
        (:meth:`ShardedKVCache.extend`)."""
        from ..sequence.sharding import sequence_layout

        mesh = cache.mesh
        lay = sequence_layout(mesh, info.seq_len, info.layout, info.cu_seqlens)
        every = torch.stack([lay.local_positions(r) for r in range(mesh.sp_size)])  # (P, L)
        real = every < info.seq_len
        cache.extend(every, real, offset)
        return cls(**{f.name: getattr(info, f.name) for f in fields(SequenceInfo)}, cache=cache,
                   query_positions=torch.where(real, every + offset, -1), real=real[mesh.sp_rank], schedule=schedule)

    @property
    def recurrent_state(self) -> RecurrentStates:
        return RecurrentStates(self.cache, decoding=False, extension=self)

    def row_positions(self, device: torch.device) -> torch.Tensor:
        """This rank's new tokens' positions in the row (L,) (the layout's padding at 0)."""
        return self.query_positions[self.cache.mesh.sp_rank].clamp(min=0).to(device)

    def intercept_attention(self, module, query, key, value, mesh, scaling, kwargs) -> torch.Tensor:
        """Called by seqmesh's registered attention in place of it: this rank's new tokens' attention over the kept
        cache and every new token before them, (B, L, Hq, Dv) (:func:`.extend.attend_chunk`)."""
        from .extend import attend_chunk

        return attend_chunk(module, query, key, value, self, mesh, scaling, kwargs)
