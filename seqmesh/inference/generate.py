"""Generation on the sequence mesh: the prompt's prefill sharded as in training, then decode over a KV cache that
stays sharded (:mod:`.cache`, :mod:`.decode`).

The prefill is the parallelized model's own forward on the prompt, sharded by a training layout (``zigzag`` by
default: balanced causal work); its attention layers keep each rank's keys and values as that rank's cache share. The
logits of the prompt's last token come from the rank that holds it (``logits_to_keep``: one row of the vocabulary, not
the prompt's), broadcast to the group. Each decode step runs the same new token on every rank (its per-token layers
are cheap beside the attention over the cache), one all-gather per attention layer merging the shares' partial
results. Every rank draws the same next token: greedy, or sampled from the same logits with a generator seeded alike on
every rank.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..inputs import shard_batch
from ..mesh import MeshAxis, SPMesh
from ..sequence.batch import SequenceInfo
from ..sequence.sharding import sequence_positions
from .cache import DecodeStep, Extension, Prefill, ShardedKVCache
from ..rules.kv_cache import SCHEDULES
from ..rules.own_attention import doge_window_problem
from ..rules.positions import position_problem, position_rows


DECODED_MIXERS = ("Gated DeltaNet", "RG-LRU", "Mamba", "Mamba2", "gated short convolution", "lightning attention",
                  "Kimi Delta Attention", "compressed convolutional attention", "Doge cross-domain experts")
# the recurrent layers whose decode runs (their state and conv tail kept by the prefill on every rank:
# seqmesh.hf.linear_attention, .rg_lru, .mamba, .mamba2, .short_conv, .lightning, .kda, .cca)
# and a prefill onto a kept cache runs them all, from that state; not Doge's experts, whose routing depends on where
# a row's calls are cut (check_extension)
EXTENDED_MIXERS = tuple(kind for kind in DECODED_MIXERS if kind != "Doge cross-domain experts")


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: ``temperature`` 0 is greedy (argmax); otherwise softmax(logits / temperature)
    restricted to the smallest set of tokens whose probability reaches ``top_p``, drawn with a generator seeded by
    ``seed`` (the same on every rank, so every rank draws the same token)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or positive.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")


@dataclass
class Generated:
    """``tokens`` (B, K) the new tokens; the cache as the decode left it (each rank's share)."""

    tokens: torch.Tensor
    cache: ShardedKVCache
    logits: torch.Tensor | None = None  # (B, K, V) each new token's logits (float32 or wider) with ``keep_logits``
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    schedules: tuple[str, ...] = ()  # prefill onto a kept cache: the schedules its layers ran (seqmesh.inference.extend)


def check_generate(model: nn.Module, mesh: SPMesh) -> None:
    """Raise, naming what to change, for what generation on the mesh does not run yet."""
    from ..hf.async_ulysses import is_async
    from ..hf.compressed_attention import is_compressed
    from ..hf.layers import OWN_ATTENTION
    from ..hf.mixer_kind import REPLACED_ATTR
    from ..hf.positions import counting_embeddings
    from ..hf.qsa_attention import is_qsa
    from ..vision.families import is_multimodal

    name = type(model).__name__
    if is_multimodal(model.config):
        raise ValueError(f"{name} is a vision-language model: seqmesh generates from text prompts of decoder-only "
                         "models so far.")
    if mesh.sp_size * mesh.tp != dist.get_world_size():
        raise ValueError(f"the mesh's sequence group holds {mesh.sp_size} x tp {mesh.tp} of the "
                         f"{dist.get_world_size()} ranks: seqmesh generates with every rank in the sequence group (no "
                         "data parallelism); launch ulysses x ring x tp processes.")
    if any(is_async(m) for m in model.modules()):
        raise ValueError(f"{name} was parallelized with async_ulysses=True, whose attention forward keeps no cache; "
                         "parallelize it without async_ulysses for generation.")
    if mesh.tp > 1 and not any(isinstance(p, DTensor) and MeshAxis.TP.value in (p.device_mesh.mesh_dim_names or ())
                               for p in model.parameters()):
        raise ValueError(f"tp={mesh.tp} but {name}'s weights are whole on every rank: split its heads first, "
                         "seqmesh.inference.split_heads(model, mesh) after seqmesh.hf.parallelize (each rank then keeps "
                         "the cache of its heads).")
    split = [type(m).__name__ for m in model.modules() if hasattr(m, "_seqmesh_tp_rows")]
    if split:
        raise ValueError(f"{name} has {split[0]} layers split over tp={mesh.tp} ranks, whose prefill and decode under "
                         "tensor parallelism seqmesh does not run yet (the split layer keeps no state for the decode); "
                         "generate it with tp=1 (--ulysses and --ring; its state passing is exact there).")
    if any(is_compressed(m) for m in model.modules()):
        raise ValueError(f"{name} has DeepSeek-V4's compressed attention layers, whose decode seqmesh does not run yet "
                         "(each step would add to the compressor's open window and, when it closes, a new entry on "
                         "the rank that holds the window); seqmesh trains it (seqmesh train, verify).")
    if any(is_qsa(m) for m in model.modules()):
        raise ValueError(f"{name} has Qwen4-Exp's QSA layers, whose decode seqmesh does not run yet (each step's query "
                         "would score the blocks of every rank's indexer keys); seqmesh trains it (seqmesh train, "
                         "verify).")
    if counting_embeddings(model) is not None:
        raise ValueError(f"{name} is the decoder of an encoder-decoder family (BART, Marian, Pegasus, MusicGen, ...), "
                         "whose attention layers keep their own cache, which seqmesh's sharded cache does not replace "
                         "yet; seqmesh trains it (seqmesh.hf.parallelize).")
    kinds = {getattr(m, REPLACED_ATTR, None) for m in model.modules()} - {None, *DECODED_MIXERS, OWN_ATTENTION}
    if kinds:
        what = ", ".join(sorted(kinds))
        raise ValueError(f"{name} has {what} layers, whose decode seqmesh does not run yet (their state would have to "
                         "stay where the prefill made it); generate with an attention-only model (Llama, Qwen, "
                         "Mistral, Gemma, gpt-oss, DeepSeek-V3's MLA, DeepSeek Sparse Attention, MiniMax-M3's "
                         "block-sparse layers; BLOOM, MPT, Falcon, GPT-Neo), one with Gated DeltaNet layers "
                         "(Qwen3.5), RecurrentGemma, or one with Mamba (Jamba, Zamba, Mamba) or "
                         "Mamba2 layers (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1, Mamba2), LFM2's short "
                         "convolutions, MiniMax-01's lightning attention, Kimi Linear's KDA or ZAYA's CCA.")


def _check_windows(model: nn.Module, tokens: int) -> None:
    """Doge past ``keep_window_size`` keys (its dynamic mask keeps each query's keys of largest bias, which seqmesh
    does not compute), and a family past its table of positions (:mod:`seqmesh.rules.positions`: GPT-2's, OPT's,
    ...), for the ``tokens`` a generation runs: refused before any work, on every rank."""
    from ..hf.own_attention import family_key

    text = model.config.get_text_config().to_dict()
    if problem := position_problem(tokens, position_rows(text), text.get("model_type")):
        raise ValueError(f"{type(model).__name__}: the prompt and the new tokens run {tokens} tokens: {problem}.")
    for m in model.modules():
        if family_key(m) == "DogeAttention" and (problem := doge_window_problem(tokens, m.keep_window_size)):
            raise ValueError(f"{type(model).__name__}: the prompt and the new tokens run {tokens} tokens: {problem}.")


def check_extension(model: nn.Module, mesh: SPMesh, cache: ShardedKVCache | None, input_ids: torch.Tensor) -> None:
    """Raise, naming what to change, where ``input_ids`` cannot be prefilled onto ``cache`` (:mod:`.extend`; None: the
    cache a prompt's first chunk will leave)."""
    from ..hf.indexed_attention import is_indexed
    from ..hf.indexed_layouts import is_block_sparse
    from ..hf.layers import OWN_ATTENTION
    from ..hf.mixer_kind import REPLACED_ATTR

    name = type(model).__name__
    if any(getattr(m, REPLACED_ATTR, None) == "Doge cross-domain experts" for m in model.modules()):
        raise ValueError(f"{name} has Doge's cross-domain experts, which route each token of a call by two tokens of "
                         "that call (transformers' (2, N, K) view of its router logits), so a row prefilled onto a "
                         "kept cache, in turns or chunks, routes otherwise than the same row at once: give the whole "
                         "row without the cache (and without prefill_chunk), at once.")
    kinds = {getattr(m, REPLACED_ATTR, None) for m in model.modules()} - {None, OWN_ATTENTION, *EXTENDED_MIXERS}
    sparse = [m for m in model.modules() if is_indexed(m) or is_block_sparse(m)]
    if kinds or sparse:
        what = ", ".join(sorted(kinds)) if kinds else "sparse attention (DeepSeek Sparse Attention, MiniMax-M3)"
        raise ValueError(f"{name} has {what} layers, and prefill onto a kept cache (a cache passed back, or "
                         "prefill_chunk) runs attention and the recurrent layers whose state it keeps (a new key joins "
                         "a rank's share, a recurrent layer runs the new tokens whole from its kept state); this "
                         "layer's state, or a sparse layer's selection, would have to be carried through the new "
                         "tokens, which seqmesh does not yet: give the whole row without the cache, at once.")
    if cache is None:
        return
    if cache.mesh.sp_size != mesh.sp_size or cache.mesh.sp_rank != mesh.sp_rank:
        raise ValueError(f"the cache was kept on a sequence group of {cache.mesh.sp_size} ranks and this call runs on "
                         f"{mesh.sp_size}: pass the cache back on the mesh that made it.")
    if input_ids.dim() == 2 and input_ids.shape[1] <= cache.length:
        raise ValueError(f"the cache holds {cache.length} tokens of each row and input_ids has {input_ids.shape[1]}: "
                         "give the whole row (the kept tokens, then at least one new one), as transformers' "
                         "past_key_values takes it.")
    rows = {t.shape[0] for t in cache.keys.values()}
    if input_ids.dim() == 2 and rows and rows != {input_ids.shape[0]}:
        raise ValueError(f"the cache holds {rows.pop()} rows and input_ids has {input_ids.shape[0]}: continue the same "
                         "batch.")


def split_heads(model: nn.Module, mesh: SPMesh) -> nn.Module:
    """Split the attention heads and the MLP of ``model`` (parallelized on ``mesh``) over ``mesh.tp`` ranks, as
    training's tensor parallelism does (:func:`seqmesh.tensor_parallel.apply_tensor_parallel`: q/k/v column-wise,
    o and down row-wise, the embedding and head over the vocabulary), for generation: each rank then runs and caches
    its heads only, ``1 / tp`` of the weights and of the KV cache; a decode step's token is a sequence of one, which
    the tensor-parallel regions shard unevenly (one rank holds it). What tensor parallelism does not split (mixtures
    of experts, other recurrent mixers) is refused by name. Returns ``model``."""
    from ..tensor_parallel import apply_tensor_parallel

    return apply_tensor_parallel(model, mesh)


def shard_weights(model: nn.Module, mesh: SPMesh) -> nn.Module:
    """Shard the weights of ``model`` (parallelized on ``mesh``) over its sequence group with FSDP2, as training does
    (:func:`seqmesh.model.fsdp.apply_fsdp`): each decoder layer a unit gathered for its forward and freed after it, an
    untied embedding its own, the final norm and LM head at the root (kept gathered once used). A model larger than
    one GPU then generates: the prefill's gathers hide behind its layers' compute, and each decode step gathers every
    layer again (``seqmesh plan --inference --shard-weights`` counts both). Returns ``model``."""
    from ..model.fsdp import apply_fsdp

    return apply_fsdp(model, mesh)


@torch.no_grad()
def generate(model: nn.Module, mesh: SPMesh, input_ids: torch.Tensor, max_new_tokens: int, *, layout: str = "zigzag",
             sampling: Sampling = Sampling(), keep_logits: bool = False, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, cache: ShardedKVCache | None = None,
             schedule: str = "auto", prefill_chunk: int | None = None) -> Generated:
    """``max_new_tokens`` tokens after each row of ``input_ids`` (B, S) (the same prompt on every rank; the rows of
    one length), by ``model`` parallelized on ``mesh`` (:func:`seqmesh.hf.parallelize`): the prefill sharded by
    ``layout``, then decode over the sharded cache. Greedy by default (``sampling``: :class:`Sampling`).
    ``eos_token_id`` (one id or several): as transformers' ``generate``, a row that drew one gets ``pad_token_id``
    (default: the first end id) from then on, and generation stops once every row has (fewer than
    ``max_new_tokens`` columns then); None runs ``max_new_tokens`` steps. ``keep_logits``: return each new token's
    logits (B x K x vocabulary values). ``cache``: a cache an earlier call left (its ``Generated.cache``) holding the
    first ``cache.length`` tokens of every row of ``input_ids``, as transformers' ``past_key_values``: only the tokens
    after them run, prefilled onto it by ``schedule`` (:mod:`.extend`: ``"pass_kv"``, ``"pass_q"``, or ``"auto"``,
    the one that moves fewer bytes), and the cache grows in place. ``prefill_chunk``: prefill at most this many tokens
    a call, each chunk onto the cache the ones before it left (a long prompt's activations bounded by a chunk's)."""
    check_generate(model, mesh)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}: give (batch, "
                         "length) int64 token ids, at least one per row.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be a positive number of tokens (or None: the prompt "
                         "at once).")
    if cache is not None or (prefill_chunk is not None and input_ids.shape[1] > prefill_chunk):
        check_extension(model, mesh, cache, input_ids)
    _check_windows(model, input_ids.shape[1] + max_new_tokens - 1)
    device = next(model.parameters()).device
    started = _now(device)
    b, s = input_ids.shape
    ids = input_ids.to(device)
    kept = 0 if cache is None else cache.length
    ran: set[str] = set()
    if cache is None:  # the prompt's prefill (its first prefill_chunk tokens)
        kept = s if prefill_chunk is None else min(s, prefill_chunk)
        cache = ShardedKVCache(mesh)
        cache.start(sequence_positions(kept, mesh, layout=layout), kept)  # each local token's index in the row
        logits, _ = _prompt_logits(model, mesh, ids[:, :kept], 0, layout, lambda info: Prefill.of(info, cache))
    while kept < s:  # the tokens after the kept ones, onto the cache (seqmesh.inference.extend), chunk by chunk
        stop = s if prefill_chunk is None else min(s, kept + prefill_chunk)
        before = cache.kept()
        try:
            logits, entry = _prompt_logits(model, mesh, ids[:, kept:stop], kept, layout,
                                           lambda info, at=kept: Extension.of(info, cache, at, schedule))
        except BaseException:  # the cache a caller passed stays as it was
            cache.restore(before)
            raise
        ran |= entry.chosen
        kept = stop
    prefilled = _now(device)
    generator = torch.Generator(device=logits.device).manual_seed(sampling.seed)
    ends = None if eos_token_id is None else torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=logits.device)
    pad = pad_token_id if pad_token_id is not None else (None if ends is None else int(ends[0]))
    finished = torch.zeros(b, dtype=torch.bool, device=logits.device)
    new, kept_logits = [], []
    for t in range(max_new_tokens):
        token = _draw(logits, sampling, generator)  # (B,)
        if ends is not None:
            token = token.masked_fill(finished, pad)
            finished |= torch.isin(token, ends)
        new.append(token)
        if keep_logits:
            kept_logits.append(logits)
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        position = s + t
        owner = cache.next_owner()
        cache.advance(owner, position)
        step = DecodeStep(seq_len=position + 1, cu_seqlens=None, layout=layout, max_position=position,
                          positions="caller", cache=cache, position=position, owner=owner)
        out = model(input_ids=token[:, None], position_ids=torch.full((b, 1), position, device=device), seqmesh=step,
                    logits_to_keep=1)
        logits = out.logits[:, -1].to(torch.promote_types(out.logits.dtype, torch.float32))
    return Generated(torch.stack(new, dim=1), cache, torch.stack(kept_logits, dim=1) if keep_logits else None,
                     prefilled - started, _now(device) - prefilled, tuple(sorted(ran)))


def _prompt_logits(model: nn.Module, mesh: SPMesh, ids: torch.Tensor, offset: int, layout: str,
                   make_entry) -> tuple[torch.Tensor, SequenceInfo]:
    """The model on ``ids`` (B, n), the tokens at ``offset`` onward, sharded by ``layout`` with the entry ``entry``
    ``make_entry`` makes of their :class:`SequenceInfo` (a prefill's, or an extension's): the last token's logits
    (B, V), computed on the rank that holds it only (``logits_to_keep``: one row of the vocabulary) and summed over
    the group; and the entry."""
    b, n = ids.shape
    positions = torch.arange(offset, offset + n, device=ids.device).expand(b, n)
    local = shard_batch({"input_ids": ids, "position_ids": positions}, mesh, layout=layout)
    holder = sequence_positions(n, mesh, layout=layout).eq(n - 1)  # the last token: on one rank
    index = int(holder.nonzero()[0]) if bool(holder.any()) else 0
    entry = make_entry(local["seqmesh"])
    with warnings.catch_warnings():  # under tensor parallelism transformers indexes the sequence-sharded final states
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")  # by this one-element
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], seqmesh=entry,  # tensor
                    logits_to_keep=torch.tensor([index], device=ids.device))
    logits = out.logits[:, -1].to(torch.promote_types(out.logits.dtype, torch.float32))  # (B, V)
    logits = logits.contiguous() if bool(holder.any()) else torch.zeros_like(logits)
    dist.all_reduce(logits, group=mesh.sp_group)  # one rank holds the last token: the sum is its logits, exactly
    return logits, entry


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, V)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens ahead of each
        ordered = ordered.masked_fill(before >= sampling.top_p, 0.0)  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
