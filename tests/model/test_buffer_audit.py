"""Audit: no (S, S)-sized buffer and no full-vocabulary logits in a seqmesh training step.

A dispatch mode records every operator output of two AdamW steps of the ``seqmesh train`` build
(FSDP2, chunked loss) with at least S_local^2 elements or a dimension of the vocabulary's size. The
shapes are chosen so S^2 dwarfs everything else: the tiny presets' shapes (hidden 64, MLP 128, 4 heads of
16), 2,048 tokens on 2 ranks (S_local = 1,024: the (S, S) threshold is 1,048,576 elements, and the test
checks that every other tensor is at most an eighth of it), a loss tile of 100 tokens, and a vocabulary of
320 tokens, a size no sequence piece, head count or width of these runs has.
The positive controls run the same recorder on plain transformers, where it finds the buffers
seqmesh avoids.
"""

from __future__ import annotations

import pytest
import torch

from baseline_cases import LargeBuffers, audit_seqmesh_step

SEQ_LEN, LOSS_CHUNK = 2048, 100
LAST_TILE = SEQ_LEN // 2 % LOSS_CHUNK  # the local shard's last, shorter loss tile: 24 tokens


def allowed_vocab_buffers(vocab: int, hidden: int) -> dict[tuple[int, ...], str]:
    """Every vocabulary-sized shape a step may create, and what it is (logical shapes: under FSDP2 each
    rank holds 1/world of the weights and their optimizer state)."""
    return {
        (vocab, hidden): "the embedding and LM-head weights (FSDP2's gathered copy), their gradients (the loss's "
                         "d_weight accumulator, embedding_dense_backward), AdamW's two moments and its update "
                         "temporaries",
        (hidden, vocab): "the LM head's weight transposed (a view) in the loss's matmuls",
        (LOSS_CHUNK, vocab): "one loss tile's logits in forward, and the same tile's d_logits in backward",
        (vocab, LOSS_CHUNK): "one tile's d_logits transposed (a view) for d_weight",
        (LAST_TILE, vocab): "the last, shorter loss tile's logits and d_logits",
        (vocab, LAST_TILE): "its d_logits transposed",
    }


CASES = {  # ulysses, ring, TrainConfig options, packed document lengths, the layout shard_batch takes
    "ulysses": (2, 1, {}, None, "zigzag"),
    "ring-checkpointed-tiled": (1, 2, {"checkpointing": True, "tiled_mlp": True}, None, "zigzag"),
    "ring-packed-documents": (1, 2, {}, (1536, 512), "per_document"),  # one kernel call per document
    "ulysses-sliding-window": (2, 1, {"model": "mistral-window-tiny"}, None, "zigzag"),  # banded calls
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_square_buffer_and_only_tile_sized_logits(pools, case):
    ulysses, ring, options, documents, layout = CASES[case]
    for rank in pools.run(2, audit_seqmesh_step, SEQ_LEN, ulysses, ring, LOSS_CHUNK, options, documents):
        assert rank["local_len"] == SEQ_LEN // 2 and rank["layout"] == layout
        assert rank["squares"] == {}  # attention (cpu_flash op, ring merge, Ulysses all-to-all) and loss: none
        # measured: 131,072 (the MLP's (S, 128), Ulysses' (8, 1, S, 16) all-to-all buffer), 65,536 (ring, tiled)
        assert rank["largest_other"][1] <= rank["local_len"] ** 2 // 8  # so an (S, S) buffer would stand out
        allowed = allowed_vocab_buffers(rank["vocab"], rank["hidden"])
        found = {shape for _, shape in rank["vocab_sized"]}
        assert found == set(allowed), found ^ set(allowed)  # exactly the named ones, each of them made
        full_logits = [key for key in rank["vocab_sized"] if rank["vocab"] in key[1] and
                       torch.Size(key[1]).numel() > LOSS_CHUNK * rank["vocab"]]
        assert full_logits == []


def test_the_recorder_finds_what_plain_transformers_allocates():
    """Positive controls: eager attention makes (B, H, S, S) scores; transformers' loss makes the whole
    (B, S, V) logits."""
    from seqmesh.model.lm import build_model

    length = 512
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    for attention in ("eager", "sdpa"):
        model = build_model("llama-tiny", seed=0)
        model.config._attn_implementation = attention
        recorder = LargeBuffers(length * length, model.config.vocab_size)
        with recorder:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        shapes = {shape for _, shape in recorder.squares}
        heads = model.config.num_attention_heads
        assert ((1, heads, length, length) in shapes) == (attention == "eager"), shapes
        assert (1, length, model.config.vocab_size) in {shape for _, shape in recorder.vocab_sized}
