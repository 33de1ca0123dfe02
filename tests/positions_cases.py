"""Families whose positions depend on the whole sequence, through seqmesh.hf on every rank, against the unmodified
transformers model on the whole sequence (logits, loss and every parameter's gradient).

Tiny float64 models of the families' own configs, each set so its whole-sequence quantity matters within the
45-token test sequence: Phi-3's longrope (``original_max_position_embeddings`` 32: long factors for the whole
sequence, short ones for its longest document), Llama's dynamic NTK (``max_position_embeddings`` 32), Llama 4's
no-RoPE temperature (``floor_scale`` 8), RoBERTa as a causal LM (positions from ``padding_idx + 1``, with
padding tokens among the ids) and the decoders of encoder-decoder families, which take no position_ids and number
each call's tokens from 0 (BART's learned table, Marian's sinusoidal one, BigBird-Pegasus's decoder whose
self-attention is causal only through its mask). ``mutation`` undoes one fix on purpose: the test must then see an error.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh, refusals_said
from family_cases import SMALL, _worst_grad, build, reference_rounding
from seqmesh.hf import parallelize, positions, unparallelize
from seqmesh.model.fsdp import sync_gradients
from seqmesh.model.lm import SequenceParallelLM

SEQ_LEN = 45
GRAD_FLOOR = 1e-3  # RoBERTa's key biases have gradients that are zero but for rounding (family_cases._worst_grad)
CUTS = [0, 1, 9, 10, 30, SEQ_LEN]  # packed documents: the longest (20 tokens) below every threshold, the row above


def position_config(family: str):
    import transformers as tf

    heads = dict(SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    if family == "phi3-longrope":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 2.0, 4.0, 8.0]}
        return tf.Phi3Config(**heads, max_position_embeddings=128, original_max_position_embeddings=32,
                             rope_parameters=rope, pad_token_id=0)  # Phi3Config's own field overrides rope_parameters
    if family == "llama-dynamic":
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        return tf.LlamaConfig(**heads, max_position_embeddings=32, rope_parameters=rope)
    if family == "llama4-temperature":  # layer 0 rotary, layer 1 no-RoPE with the temperature
        return tf.Llama4TextConfig(**heads, intermediate_size_mlp=64, attention_chunk_size=None, floor_scale=8,
                                   attn_scale=0.5, no_rope_layers=[1, 0], num_local_experts=2, moe_layers=[0],
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama4-chunked":  # layer 0 rotary and chunked (chunks of 8: across shards and documents)
        return tf.Llama4TextConfig(**heads, intermediate_size_mlp=64, attention_chunk_size=8, floor_scale=8,
                                   attn_scale=0.5, no_rope_layers=[1, 0], num_local_experts=2, moe_layers=[0],
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "roberta":
        return tf.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                vocab_size=64, is_decoder=True, attention_probs_dropout_prob=0.0,
                                hidden_dropout_prob=0.0, max_position_embeddings=SEQ_LEN + 4, pad_token_id=1)
    decoder = dict(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                   encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=SEQ_LEN,
                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, is_encoder_decoder=False,
                   pad_token_id=1)
    if family == "bart":  # a learned table two rows past the position (BART's offset)
        return tf.BartConfig(**decoder)
    if family == "marian":  # a frozen sinusoidal table
        return tf.MarianConfig(**decoder, decoder_start_token_id=1)
    if family == "bigbird-pegasus":  # a decoder whose self-attention says is_causal=False; its mask makes it causal
        return tf.BigBirdPegasusConfig(**decoder, attention_type="original_full")
    if family in ("trocr", "trocr-sinusoidal"):  # its attention of its own too (seqmesh.hf.own_attention)
        return tf.TrOCRConfig(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                              decoder_ffn_dim=64, max_position_embeddings=SEQ_LEN, dropout=0.0, attention_dropout=0.0,
                              activation_dropout=0.0, pad_token_id=1,
                              use_learned_position_embeddings=family == "trocr")
    raise ValueError(f"unknown family {family!r}")


def unrunnable(family: str) -> str | None:
    """Why the installed transformers cannot run ``family``'s model on one process (Llama 4 without chunks before
    5.2x), or None: such a family has no reference to test against."""
    try:
        model = build(position_config(family))
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    except Exception as err:  # noqa: BLE001 - reported by the test as its reason to leave the family out
        return f"{type(err).__name__}: {err}"
    return None


def _batch(vocab: int, documents: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (1, SEQ_LEN), generator=g)
    ids[0, [3, 17, 40]] = 1  # RoBERTa's padding token: its positions skip them
    if not documents:
        return {"input_ids": ids}
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(b - a) for a, b in zip(CUTS[:-1], CUTS[1:])])[None]}


def _whole_row(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and loss of the whole batch in one call, as transformers computes it (its mask keeps packed documents
    apart from their position_ids; a family's rotary scaling and temperature see the whole row)."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, position_ids=batch.get("position_ids"), use_cache=False).logits
    targets = ids[0, 1:].clone()
    if "position_ids" in batch:
        targets[batch["position_ids"][0, 1:] == 0] = -100
    loss = F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum") / (targets != -100).sum()
    return logits, loss


def _documents_alone(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_whole_row`, each packed document in a call of its own with its position_ids (RoBERTa's mask does
    not keep packed documents apart; nothing else of it depends on the row)."""
    if "position_ids" not in batch:
        return _whole_row(model, batch)
    parts = [_whole_row(model, {"input_ids": batch["input_ids"][:, a:b], "position_ids": batch["position_ids"][:, a:b]})
             for a, b in zip(CUTS[:-1], CUTS[1:])]
    logits = torch.cat([p[0] for p in parts], dim=1)
    counts = [b - a - 1 for a, b in zip(CUTS[:-1], CUTS[1:])]
    loss = sum(p[1] * n for p, n in zip(parts, counts) if n) / sum(counts)
    return logits, loss


# the decoders of encoder-decoder families take no position_ids: their mask does not keep packed documents apart
REFERENCE = {"roberta": _documents_alone, "bart": _documents_alone, "marian": _documents_alone,
             "bigbird-pegasus": _documents_alone, "trocr": _documents_alone}


def _mutate(lm, local: dict, mutation: str | None) -> dict:
    """One fix undone on this rank's inputs or model."""
    info = local["seqmesh"]
    if mutation == "shard_largest_position":  # each shard decides the rotary scaling from its own positions
        local = {**local, "seqmesh": dataclasses.replace(info, max_position=int(local["position_ids"].max()))}
    elif mutation == "positions_from_zero":  # an offset family given seqmesh's positions from 0, unrefused
        local = {**local, "seqmesh": dataclasses.replace(info, positions="caller")}
    elif mutation == "shard_numbered_from_zero":  # the decoder's own numbering: each shard from position 0
        positions.counting_embeddings(lm)._forward_hooks.clear()
    elif mutation == "self_attention_not_causal":  # BigBird-Pegasus's flag taken as it is
        for module in lm.modules():
            if getattr(module, positions._CAUSAL, False):
                module.is_causal = False
    elif mutation == "local_temperature":  # transformers' own no-RoPE forward: the temperature of each shard's arange
        for module in lm.modules():
            if getattr(module, positions._ATTR, False) and hasattr(module, "floor_scale"):
                del module.forward
                delattr(module, positions._ATTR)
    return local


@functools.lru_cache(maxsize=None)
def position_reference(family: str, documents: bool) -> tuple:
    """``(model, batch, logits, loss, rounding)`` of the whole-row float64 reference (gradients in the model, read
    only), computed once per rank process: every mesh and layout of a family compares with the same one."""
    config = position_config(family)
    reference = build(config)
    batch = _batch(config.vocab_size, documents)
    whole = REFERENCE.get(family, _whole_row)
    ref_logits, ref_loss = whole(reference, batch)
    ref_loss.backward()
    rounding = reference_rounding(config, batch, ref_logits.detach(), ref_loss.detach(), reference, loss_fn=whole,
                                  relative_floor=GRAD_FLOOR)
    return reference, batch, ref_logits.detach(), ref_loss.detach(), rounding


def position_parity(family: str, ulysses: int, ring: int, layout: str = "zigzag", documents: bool = False,
                    mutation: str | None = None) -> dict:
    """Largest logit, loss and relative gradient errors against the whole-row reference, and the reference's own
    rounding of each (``family_cases.reference_rounding``)."""
    mesh = get_mesh(ulysses, ring)
    reference, batch, ref_logits, ref_loss, rounding = position_reference(family, documents)
    lm = parallelize(build(position_config(family)), mesh)
    model = None if mutation == "positions_from_zero" else lm  # without the model: positions from 0
    local = _mutate(lm, seqmesh.shard_batch(batch, mesh, model=model, layout=layout), mutation)
    with torch.no_grad():
        logits = lm(**{k: local[k] for k in ("input_ids", "position_ids", "seqmesh")}).logits
    whole = seqmesh.gather_sequence(logits, mesh, layout=layout, length=SEQ_LEN)
    sp = SequenceParallelLM(lm, mesh, chunk=16)  # RoBERTa's: its prediction head, then its projection
    loss = sp(**local)
    loss.backward()
    sync_gradients(sp, mesh)
    grad_err, worst_name = _worst_grad(lm, dict(reference.named_parameters()), GRAD_FLOOR)
    unparallelize(lm)
    return {"logits": float((whole - ref_logits).abs().max()), "loss": abs(loss.item() - ref_loss.detach().item()),
            "grad": grad_err, "worst": worst_name, "rounding": rounding}


def unsharded_refusal(family: str) -> str:
    """The refusal of an offset family called with a batch sharded without the model (positions from 0)."""
    mesh = get_mesh(1, dist.get_world_size())
    config = position_config(family)
    lm = parallelize(build(config), mesh)
    try:
        lm(**seqmesh.shard_batch(_batch(config.vocab_size, False), mesh))
    except ValueError as err:
        return str(err)
    finally:
        unparallelize(lm)
    return ""


def decoder_refusals(family: str = "bart") -> dict[str, str]:
    """The refusals of an encoder-decoder family's decoder: generation (its attention keeps its own cache), and
    TrOCR's sinusoidal table (it numbers around padding tokens, not by span)."""
    from seqmesh.inference.generate import check_generate

    mesh = get_mesh(1, dist.get_world_size())
    lm = parallelize(build(position_config(family)), mesh)
    said = refusals_said({"generate": lambda: check_generate(lm, mesh),
                          "sinusoidal": lambda: parallelize(build(position_config("trocr-sinusoidal")), mesh)})
    unparallelize(lm)
    return said
