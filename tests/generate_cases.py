"""Generation on spawned ranks against transformers' ``generate`` on one process (float64)."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.overrides import TorchFunctionMode

from dist_cases import get_mesh
from family_cases import build, family_config, reference_dtype
from seqmesh.hf import parallelize, unparallelize
from seqmesh.inference import generate, shard_weights, split_heads


# families whose reference, transformers' own generate, fails on an older release, and the release they are held to
# from: at 5.15 (the floor) Doge's decoder layer takes its experts' (states, router logits) as one tensor, and Zamba2's
# shared blocks with adapters mismatch their shapes
_REFERENCE_FROM = {"doge-moe": (5, 24), "zamba2": (5, 24)}


def family_here(family: str) -> bool:
    """Whether the installed transformers has ``family`` (Kimi Linear is newer than transformers 5.15, the floor) and
    its own generate runs it (:data:`_REFERENCE_FROM`)."""
    import transformers

    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if release < _REFERENCE_FROM.get(family, (0, 0)):
        return False
    try:
        return family_config(family) is not None
    except (AttributeError, KeyError):  # a config class, or a model type, the installed transformers lacks
        return False


@contextlib.contextmanager
def _mutated(mutation: str | None):
    """A deliberate fault for the test that the comparison sees it: ``"plain_mean"`` merges the shares' partial
    outputs without their log-sum-exp; ``"every_rank_keeps"`` has every rank keep each new token's key and value;
    ``"state_not_carried"``: Gated DeltaNet's, the RG-LRU's, Mamba's and Mamba2's decode start from a zero state
    instead of the prefill's (a short conv, which keeps no state, and ZAYA's CCA from a zero conv tail);
    ``"local_selection"``: a sparse-attention decode step takes each rank's own top k keys for the row's;
    ``"local_blocks"``: a block-sparse step scores each block by the rank's own keys only."""
    from seqmesh.hf import cca, kda, lightning, linear_attention, mamba, mamba2, rg_lru, short_conv
    from seqmesh.inference import block_sparse_decode, cache, decode, indexed_decode

    saved = (decode.merge_partials, cache.ShardedKVCache.next_owner, linear_attention.decode_gated_delta,
             rg_lru.rg_lru_step, mamba.mamba_step, mamba2.ssd_step, short_conv.short_conv_step, lightning.lightning_step,
             kda.kda_step, cca.cca_step, indexed_decode.global_top, block_sparse_decode.block_scores)
    if mutation == "plain_mean":
        def plain_mean(out, lse, mesh, sinks=None):
            import torch.distributed as dist

            gathered = [torch.empty_like(out) for _ in range(mesh.sp_size)]
            dist.all_gather(gathered, out.contiguous(), group=mesh.sp_group)
            return torch.stack(gathered).mean(dim=0)
        decode.merge_partials = plain_mean
    elif mutation == "every_rank_keeps":
        cache.ShardedKVCache.next_owner = lambda self: self.mesh.sp_rank
    elif mutation == "state_not_carried":
        step, lru_step = saved[2], saved[3]
        linear_attention.decode_gated_delta = lambda packed, params, heads, state, tail: step(
            packed, params, heads, torch.zeros_like(state), tail)
        rg_lru.rg_lru_step = lambda module, hidden, positions, state, tail: lru_step(
            module, hidden, positions, torch.zeros_like(state), tail)
        mamba.mamba_step = lambda module, x_in, state, tail: saved[4](module, x_in, torch.zeros_like(state), tail)
        mamba2.ssd_step = lambda xbc, dt, params, heads, state, tail: saved[5](xbc, dt, params, heads,
                                                                              torch.zeros_like(state), tail)
        short_conv.short_conv_step = lambda module, hidden, tail: saved[6](module, hidden, torch.zeros_like(tail))
        lightning.lightning_step = lambda q, k, v, slope, state: saved[7](q, k, v, slope, torch.zeros_like(state))
        kda.kda_step = lambda qkv, g, beta, w, bias, heads, state, tail, **kw: saved[8](
            qkv, g, beta, w, bias, heads, torch.zeros_like(state), tail, **kw)
        cca.cca_step = lambda module, hidden, delayed, tail: saved[9](module, hidden, delayed, torch.zeros_like(tail))
    elif mutation == "local_blocks":
        def own_keys_only(scores, positions, block_size, blocks, mesh):
            best = scores.new_full((*scores.shape[:2], blocks), float("-inf"))
            where = (positions.to(scores.device) // block_size).expand(*scores.shape[:2], -1)
            return best.scatter_reduce(-1, where, scores, reduce="amax", include_self=True)
        block_sparse_decode.block_scores = own_keys_only
    elif mutation == "local_selection":
        indexed_decode.global_top = lambda scores, positions, k, total, mesh: positions.to(scores.device)[
            scores.topk(min(k, scores.shape[-1]), dim=-1).indices]
    try:
        yield
    finally:
        (decode.merge_partials, cache.ShardedKVCache.next_owner, linear_attention.decode_gated_delta,
         rg_lru.rg_lru_step, mamba.mamba_step, mamba2.ssd_step, short_conv.short_conv_step,
         lightning.lightning_step, kda.kda_step, cca.cca_step, indexed_decode.global_top,
         block_sparse_decode.block_scores) = saved


class SelectionMargin(TorchFunctionMode):
    """The least relative gap, over every float32 ``topk`` of ``k`` a model's sparse selection calls, between the k-th
    score of a row and the next one below it (exact ties left out: torch's own topk breaks those, the same code on
    every machine at the pinned torch, whatever its BLAS). A gap of a few float32 units would let another machine's
    rounding pick another key; the sparse tests' data keeps it far above that."""

    def __init__(self, k: int | None, ties: bool = False) -> None:
        super().__init__()  # ties: count exact ties too (a selection seqmesh makes over a differently shaped row)
        self.k, self.ties, self.least = k, ties, float("inf")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        k = args[1] if len(args) > 1 else kwargs.get("k")
        if func is torch.Tensor.topk and k == self.k and args[0].dtype == torch.float32 and args[0].shape[-1] > k:
            pair = args[0].sort(dim=-1, descending=True).values[..., k - 1:k + 1]
            pair = pair[torch.isfinite(pair).all(-1)]
            gap = (pair[:, 0] - pair[:, 1]) / pair[:, 0].abs().clamp(min=1e-30)
            counted = gap if self.ties else gap[gap > 0]
            if counted.numel():
                self.least = min(self.least, float(counted.min()))
        return out


def generated_parity(family: str, ulysses: int, ring: int, prompt_len: int, new_tokens: int,
                     mutation: str | None = None, end_at: int | None = None, sharded: bool = False,
                     prefill_chunk: int | None = None, tp: int = 1) -> dict:
    """The parallelized float64 model's greedy tokens and logits for a batch of two prompts beside transformers'
    ``generate(do_sample=False)`` of the same model on one process; the scale: the same model in float32 against
    float64 on the whole generated sequence; each rank's cache share. ``sharded``: the weights sharded over the
    ranks (``seqmesh.inference.shard_weights``); ``prefill_chunk``: the prompt prefilled that many tokens a call, each
    chunk onto the cache the ones before it left; ``tp``: the heads and MLP split over that many ranks besides
    (``seqmesh.inference.split_heads``)."""
    mesh = get_mesh(ulysses, ring, tp=tp)
    config = family_config(family)
    reference = build(config)
    reference.generation_config.eos_token_id = None  # seqmesh generates max_new_tokens whatever it draws
    ids = torch.randint(3, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    with reference_dtype(family):  # XGLM's float64 reference needs float64 as the default dtype (family_cases)
        with SelectionMargin(getattr(config, "index_topk", None)) as margin:
            theirs = reference.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                        output_logits=True, return_dict_in_generate=True)
        end = None
        if end_at is not None:  # the token row 0 draws at step end_at ends a sequence: row 0 stops there, the other pads
            end = int(theirs.sequences[0, prompt_len + end_at])
            reference.generation_config.eos_token_id = end
            theirs = reference.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                        output_logits=True, return_dict_in_generate=True)
        their_tokens = theirs.sequences[:, prompt_len:]
        whole = theirs.sequences[:, :-1]  # every position whose next token was drawn
        with torch.no_grad():
            exact = reference(whole).logits[:, prompt_len - 1:]
            rounded = copy.deepcopy(reference).float()(whole).logits[:, prompt_len - 1:].double()
    model = parallelize(build(config), mesh)
    if tp > 1:
        split_heads(model, mesh)
    if sharded:
        shard_weights(model, mesh)
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    with _mutated(mutation):
        done = generate(model, mesh, ids, new_tokens, keep_logits=True, eos_token_id=end, pad_token_id=0,
                        prefill_chunk=prefill_chunk)
    unparallelize(model)
    return {"tokens_equal": bool(torch.equal(done.tokens, their_tokens)), "tokens": done.tokens.tolist(),
            "their_tokens": their_tokens.tolist(),
            "logits": float((done.logits - exact).abs().max()), "rounding": float((rounded - exact).abs().max()),
            "their_logits": float((torch.stack(theirs.logits, 1) - exact).abs().max()),
            "against_theirs": float((done.logits - torch.stack(theirs.logits, 1)).abs().max()),
            "selection_margin": margin.least, "schedules": done.schedules,
            "held_fraction": held / sum(p.numel() for p in reference.parameters()), "counts": done.cache.counts, "share_bytes": done.cache.nbytes(), "share_tokens": done.cache.positions.numel(),
            "layers": len(done.cache.keys),
            "expected_share_bytes": _share_bytes(config, done.cache.positions.numel()) // tp,
            "state_elements": [sum(t.numel() for t in kept) for kept in zip(*done.cache.states.values())] or [0, 0],
            "expected_state_elements": _planned_state_elements(config)}


def _planned_state_elements(config) -> tuple[int, int] | None:
    """The planner's recurrent state and conv-tail elements for this batch of two rows (``seqmesh plan --inference``
    reads the model from its config.json, as here); None for a model without attention heads (Mamba)."""
    import tempfile

    from seqmesh.model.presets import model_shape
    from seqmesh.planner.inference import recurrent_state_elements

    if getattr(config, "num_attention_heads", None) is None:  # Mamba: the planner reads no model without heads
        return None
    with tempfile.TemporaryDirectory() as folder:
        config.to_json_file(f"{folder}/config.json")
        shape = model_shape(folder)
        return None if shape.unplanned else recurrent_state_elements(shape, batch=2)


def _share_bytes(config, tokens: int) -> int:
    """``seqmesh.inference.cache_bytes`` for ``tokens`` of this batch of two float64 rows: MLA keeps a key of
    ``qk_nope + qk_rope`` and a value of ``v_head_dim`` for every head, the others ``head_dim`` for each key head."""
    from seqmesh.inference import cache_bytes

    if getattr(config, "num_attention_heads", None) is None:  # Mamba: no attention layer keeps anything
        return 0
    kinds = (getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
             or ["full_attention"] * config.num_hidden_layers)
    indexed = kinds.count("indexed_attention")  # DeepSeek Sparse Attention: MLA's latent cache, the indexer's key
    sparse = 0
    if indexed:
        from seqmesh.rules.kv_cache import indexed_cache_bytes

        shared = list(getattr(config, "indexer_types", None) or ["full"] * len(kinds))
        own = sum(k == "indexed_attention" and s != "shared" for k, s in zip(kinds, shared))
        sparse = indexed_cache_bytes(tokens, indexed, own, config.kv_lora_rank + config.qk_rope_head_dim,
                                     config.index_head_dim, 8, batch=2)
    if getattr(config, "kv_lora_rank", None):
        dims = (config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    else:  # the older families (BLOOM, MPT, GPT-Neo: every head; Falcon: one, or num_kv_heads in its new layout)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if config.model_type == "falcon":
            kv = config.num_kv_heads if config.new_decoder_architecture else (1 if config.multi_query else heads)
        else:
            kv = getattr(config, "num_key_value_heads", None) or heads
        fold = 1 if config.model_type == "doge" else 0  # Doge's key bias, one more channel (the values padded)
        dims = (kv, head_dim + fold, head_dim + fold)
    # RecurrentGemma's layers_block_type (before transformers 5.2x: "recurrent" / "attention"; layer_types after)
    # recurrent layers keep none; Zamba's hybrid layers run its shared attention block, each with a cache of its own
    layers = sum(kind in ("full_attention", "sliding_attention", "hybrid", "hybrid_sliding", "attention",
                          "minimax_m3_sparse", "chunked_attention") for kind in kinds)  # ZAYA's hybrid layers: attention, its CCA projection
    blocked = kinds.count("minimax_m3_sparse") * cache_bytes(tokens, 1, 1, config.index_head_dim, 0, 8, batch=2) \
        if "minimax_m3_sparse" in kinds else 0  # MiniMax-M3's sparse layers keep their indexer's key too
    return cache_bytes(tokens, layers, *dims, 8, batch=2) + sparse + blocked


def generated_cases(cases: list[tuple], **kwargs) -> list[dict]:
    return [{"case": c, **generated_parity(*c, **kwargs)} for c in cases]


def sampled_tokens(ulysses: int, ring: int, settings: list[tuple[float, float, int]], prompt_len: int = 45,
                   new_tokens: int = 12) -> list[list[list[int]]]:
    """The tokens ``generate`` draws on this rank for each ``(temperature, top_p, seed)`` (a float64 Llama)."""
    from seqmesh.inference import Sampling

    mesh = get_mesh(ulysses, ring)
    config = family_config("llama")
    model = parallelize(build(config), mesh)
    ids = torch.randint(3, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(2))
    drawn = [generate(model, mesh, ids, new_tokens, sampling=Sampling(*s)).tokens.tolist() for s in settings]
    unparallelize(model)
    return drawn


@contextlib.contextmanager
def _extension_mutated(mutation: str | None):
    """A deliberate fault in prefill onto a kept cache: ``"plain_sum"`` merges partial results without their
    log-sum-exp (their outputs summed); ``"offset_dropped"``: the new tokens' queries at their indices among the new
    tokens, not in the row; ``"state_not_carried"``: the recurrent layers run the new tokens from a zero state and
    tail, not the kept ones."""
    from seqmesh.inference import cache, extend

    saved = (extend.merge_into, cache.Extension.of, cache.RecurrentStates.get)
    if mutation == "plain_sum":
        def plain_sum(acc_out, acc_lse, out, lse):
            acc_out.add_(out.to(acc_out.dtype))
            acc_lse.copy_(torch.logaddexp(acc_lse, lse.to(acc_lse.dtype)))
        extend.merge_into = plain_sum
    elif mutation == "offset_dropped":
        def from_zero(info, kept, offset, schedule):
            entry = saved[1](info, kept, offset, schedule)
            moved = entry.query_positions - offset
            object.__setattr__(entry, "query_positions", moved.masked_fill(entry.query_positions < 0, -1))
            return entry
        cache.Extension.of = from_zero
    elif mutation == "state_not_carried":
        def zero(self, module):
            state, tail = saved[2](self, module)
            return (torch.zeros_like(state), torch.zeros_like(tail)) if self.extension is not None else (state, tail)
        cache.RecurrentStates.get = zero
    try:
        yield
    finally:
        extend.merge_into, cache.Extension.of, cache.RecurrentStates.get = saved


def extended_parity(family: str, ulysses: int, ring: int, schedule: str, mutation: str | None = None,
                    prompt_len: int = 101, first: int = 4, turn: int = 37, new_tokens: int = 5, tp: int = 1) -> dict:
    """A second turn prefilled onto the cache the first left: seqmesh generates ``first`` tokens after a prompt, a
    turn of ``turn`` more tokens follows, and ``generate(..., cache=)`` runs only the tokens the cache lacks (by
    ``schedule``), then ``new_tokens`` more; against transformers' ``generate(do_sample=False)`` on the whole row on
    one process, float64, with the float32 rounding of the same model as the scale; ``tp``: the heads split over that
    many ranks besides."""
    mesh = get_mesh(ulysses, ring, tp=tp)
    config = family_config(family)
    reference = build(config)
    reference.generation_config.eos_token_id = None
    ids = torch.randint(3, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    more = torch.randint(3, config.vocab_size, (2, turn), generator=torch.Generator().manual_seed(2))
    model = parallelize(build(config), mesh)
    if tp > 1:
        split_heads(model, mesh)
    done = generate(model, mesh, ids, first)
    row = torch.cat([ids, done.tokens, more], dim=1)
    kept_before = done.cache.length
    with _extension_mutated(mutation):
        again = generate(model, mesh, row, new_tokens, keep_logits=True, cache=done.cache, schedule=schedule)
    same_cache = again.cache is done.cache
    unparallelize(model)
    with reference_dtype(family):
        theirs = reference.generate(row, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        whole = theirs[:, :-1]
        with torch.no_grad():
            exact = reference(whole).logits[:, row.shape[1] - 1:]
            rounded = copy.deepcopy(reference).float()(whole).logits[:, row.shape[1] - 1:].double()
    return {"tokens_equal": bool(torch.equal(again.tokens, theirs[:, row.shape[1]:])),
            "logits": float((again.logits - exact).abs().max()), "rounding": float((rounded - exact).abs().max()),
            "kept_before": kept_before, "same_cache": same_cache, "schedules": again.schedules, "counts": again.cache.counts, "row": row.shape[1],
            "share_bytes": again.cache.nbytes(),
            "expected_share_bytes": _share_bytes(config, again.cache.positions.numel()) // tp,
            "positions_unique": bool(again.cache.positions.unique().numel() == again.cache.positions.numel())}


def extended_cases(cases: list[tuple], **kwargs) -> list[dict]:
    return [{"case": c, **extended_parity(*c, **kwargs)} for c in cases]


def kept_after_a_failure(ulysses: int, ring: int) -> dict:
    """A second turn whose prefill fails in its second attention layer (a fault put there): the cache passed back is
    as the first turn left it (counts, positions, every layer's keys), so the turn can run again, then right."""
    from seqmesh.inference import extend

    mesh = get_mesh(ulysses, ring)
    config = family_config("llama")
    model = parallelize(build(config), mesh)
    ids = torch.randint(3, config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(1))
    done = generate(model, mesh, ids, 3)
    before = (list(done.cache.counts), done.cache.positions.clone(), {k: v.clone() for k, v in done.cache.keys.items()})
    row = torch.cat([ids, done.tokens, ids[:, :9]], dim=1)
    calls, real = [], extend.attend_chunk

    def failing(module, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a fault in the second layer")
        return real(module, *args, **kwargs)

    extend.attend_chunk = failing
    try:
        generate(model, mesh, row, 2, cache=done.cache)
        failed = False
    except RuntimeError:
        failed = True
    finally:
        extend.attend_chunk = real
    kept = (done.cache.counts == before[0] and torch.equal(done.cache.positions, before[1])
            and all(torch.equal(done.cache.keys[k], v) for k, v in before[2].items()))
    again = generate(model, mesh, row, 2, cache=done.cache)
    reference = build(config)
    reference.generation_config.eos_token_id = None
    theirs = reference.generate(row, max_new_tokens=2, do_sample=False, pad_token_id=0)[:, row.shape[1]:]
    unparallelize(model)
    return {"failed": failed, "kept": kept, "right_after": bool(torch.equal(again.tokens, theirs))}


def generation_refusals(ulysses: int, ring: int) -> list[str]:
    """What generate refuses before any work: a Doge whose prompt and new tokens pass keep_window_size, a model
    parallelized with async Ulysses."""
    mesh = get_mesh(ulysses, ring)
    said = []
    doge = build(family_config("doge"))
    ids = torch.randint(3, 64, (2, doge.config.keep_window_size - 4), generator=torch.Generator().manual_seed(1))
    async_model = parallelize(build(family_config("llama")), mesh, async_ulysses=True)
    for attempt in (lambda: generate(parallelize(doge, mesh), mesh, ids, 6), lambda: generate(async_model, mesh, ids, 2)):
        try:
            attempt()
            said.append("")
        except ValueError as err:
            said.append(str(err))
    unparallelize(doge)
    unparallelize(async_model)
    return said


def extension_refusals(ulysses: int, ring: int) -> list[str]:
    """The errors of prefill onto a kept cache given what it cannot run: DeepSeek-V3.2 (its sparse layers) chunked, a
    row no
    longer than the cache, another batch size, an unknown schedule, a chunk of 0 tokens; and of tensor parallelism
    (on ``ulysses x ring`` ranks of tp 1: a model left whole on tp 2, a Gated DeltaNet model split)."""
    mesh = get_mesh(ulysses, ring)
    said = []
    ids = torch.randint(3, 64, (2, 41), generator=torch.Generator().manual_seed(1))
    sparse = build(family_config("deepseek-v3.2"))
    attempts = [lambda: generate(parallelize(sparse, mesh), mesh, ids, 2, prefill_chunk=16)]
    model = parallelize(build(family_config("llama")), mesh)
    done = generate(model, mesh, ids, 2)
    attempts += [lambda: generate(model, mesh, ids, 2, cache=done.cache),
                 lambda: generate(model, mesh, torch.cat([ids, ids], dim=1)[:1], 2, cache=done.cache),
                 lambda: generate(model, mesh, ids, 2, schedule="pass_everything"),
                 lambda: generate(model, mesh, ids, 2, prefill_chunk=0)]
    split = get_mesh(1, 1, tp=ulysses * ring)
    whole = parallelize(build(family_config("llama")), split)
    hybrid_split = split_heads(parallelize(build(family_config("qwen3_5")), split), split)
    attempts += [lambda: generate(whole, split, ids, 2), lambda: generate(hybrid_split, split, ids, 2)]
    for attempt in attempts:
        try:
            attempt()
            said.append("")
        except ValueError as err:
            said.append(str(err))
    for m in (sparse, model, whole, hybrid_split):
        unparallelize(m)
    return said
