"""What the trainer reads: a user's config.json taken as written, packed local text (every token,
held-out documents, determinism), configuration checks, and checkpoints that never lose ``latest``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from seqmesh.training.config import TrainConfig

# A Llama config that differs from the defaults in everything a shape-only rebuild would drop.
USER_LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=97, rms_norm_eps=1e-2, attention_bias=True,
                  mlp_bias=True, hidden_act="gelu", max_position_embeddings=64, attention_dropout=0.25,
                  rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})


def _write_config(folder, config: dict, name: str = "config.json") -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("as_folder", [False, True], ids=["json-file", "folder"])
def test_user_config_is_built_as_written(tmp_path, as_folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqmesh.model.lm import build_model
    from seqmesh.model.presets import model_shape

    path = _write_config(tmp_path / "user", USER_LLAMA, "config.json" if as_folder else "my-model.json")
    model = build_model(str(tmp_path / "user") if as_folder else path).eval()
    kw = {k: v for k, v in USER_LLAMA.items() if k != "model_type"}
    reference = LlamaForCausalLM(LlamaConfig(**kw)).eval()  # transformers' own reading of the same settings
    model.load_state_dict(reference.state_dict())  # strict: the same parameters, biases included
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=0)
    c = model.config
    assert (c.rms_norm_eps, c.attention_bias, c.mlp_bias, c.hidden_act) == (1e-2, True, True, "gelu")
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["factor"] == 4.0
    assert c.attention_dropout == 0.0  # the one setting seqmesh overrides: exact attention has no dropout
    assert model_shape(path).vocab == 97 and model_shape(path).heads == 4  # the planner still reads it


def test_user_sliding_window_is_left_as_written(tmp_path):
    from seqmesh.model.lm import build_model

    mistral = dict(model_type="mistral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64, sliding_window=16)
    model = build_model(_write_config(tmp_path, mistral))
    assert model.config.sliding_window == 16  # seqmesh.hf refuses it on longer sequences instead


class _NumberTokenizer:
    """Whitespace-separated integers as token ids; ``len`` counts two added tokens past vocab_size."""

    vocab_size = 10_000

    def __len__(self) -> int:
        return self.vocab_size + 2

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def _corpus(tmp_path, lengths: list[int]) -> str:
    """Document d holds tokens 100*d + 1, 100*d + 2, ... so every token names its document and place."""
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for d, n in enumerate(lengths):
            f.write(json.dumps({"text": " ".join(str(100 * d + i + 1) for i in range(n))}) + "\n")
    return str(path)


def _pieces(ids: list[int], positions: list[int]) -> list[list[int]]:
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
    assert starts[0] == 0 and all(positions[a:b] == list(range(b - a)) for a, b in zip(starts[:-1], starts[1:]))
    return [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]


def test_packed_text_trains_on_every_token_of_long_documents(tmp_path):
    from seqmesh.training.datasets import PackedText

    seq_len = 16
    lengths = [40, 3, 21, 7, 5]  # documents 0 and 2 are longer than a row; the last (4) is held out
    data = PackedText([_corpus(tmp_path, lengths)], seq_len, _NumberTokenizer())
    assert data.vocab == 10_002
    train_tokens = sum(lengths[:4])  # 71 tokens: an epoch is 71 / 16 rows
    seen: list[int] = []
    for step in range(-(-2 * train_tokens // seq_len)):  # two epochs and a bit
        batch = data.batch(step, 0)
        ids, positions = batch["input_ids"][0].tolist(), batch["position_ids"][0].tolist()
        assert len(ids) == seq_len and batch["labels"][0].tolist() == ids
        for piece in _pieces(ids, positions):  # each piece: consecutive tokens of one document, positions from 0
            assert len(piece) <= seq_len and piece == list(range(piece[0], piece[0] + len(piece)))
            assert piece[-1] // 100 == piece[0] // 100
        seen.extend(ids)
    every = sorted(100 * d + i + 1 for d, n in enumerate(lengths[:4]) for i in range(n))
    assert sorted(seen[:train_tokens]) == every  # the first epoch: each training token exactly once
    assert sorted(seen[train_tokens : 2 * train_tokens]) == every  # and again, reshuffled, in the second
    assert seen[:train_tokens] != seen[train_tokens : 2 * train_tokens]
    assert not any(t // 100 == 4 for t in seen)  # the held-out document is never trained on


def test_packed_text_holds_out_documents_and_is_deterministic(tmp_path):
    from seqmesh.training.datasets import PackedText

    lengths = [5 + d % 7 for d in range(45)]  # documents 19 and 39 are held out (every 20th)
    path = _corpus(tmp_path, lengths)
    data = PackedText([path], 12, _NumberTokenizer(), seed=3)
    again = PackedText([path], 12, _NumberTokenizer(), seed=3)
    for dp_rank in (0, 1):
        held = data.eval_batch(dp_rank, 1, 2)["input_ids"].flatten().tolist()
        assert {t // 100 for t in held} <= {19, 39}, held
    trained = {t // 100 for step in range(60) for t in data.batch(step, step % 2, 1, 2)["input_ids"].flatten().tolist()}
    assert not trained & {19, 39} and len(trained) > 30
    for step in (7, 2, 7):  # a resumed run sees the same batches, whatever was drawn before
        for key in ("input_ids", "position_ids"):
            assert torch.equal(data.batch(step, 1, 1, 2)[key], again.batch(step, 1, 1, 2)[key])
    assert not torch.equal(data.batch(0, 0, 1, 2)["input_ids"], data.batch(0, 1, 1, 2)["input_ids"])


def test_two_documents_hold_one_out(tmp_path):
    from seqmesh.training.datasets import PackedText

    data = PackedText([_corpus(tmp_path, [6, 9])], 8, _NumberTokenizer())
    assert {t // 100 for t in data.eval_batch(0)["input_ids"].flatten().tolist()} == {1}
    assert {t // 100 for t in data.batch(0, 0)["input_ids"].flatten().tolist()} == {0}


def test_data_checks_read_the_vocabulary_without_a_model(tmp_path):
    from seqmesh.training.datasets import ByteTokenizer
    from seqmesh.training.run_data import make_dataset

    text = tmp_path / "a.txt"
    text.write_text("first document\n\nsecond one\n\nthird, ÿ", encoding="utf-8")
    data = make_dataset(TrainConfig(model="llama-tiny", data=[str(text)], seq_len=32))
    assert data.vocab == 256 and data.batch(0, 0)["input_ids"].max() < 256  # bytes fit the tiny presets
    assert ByteTokenizer().encode("aÿ") == [0x61, 0xC3, 0xBF]  # UTF-8 bytes as they are
    small = _write_config(tmp_path / "small", {**USER_LLAMA, "vocab_size": 100})
    with pytest.raises(ValueError, match="the tokenizer has 256 tokens but the model's vocabulary has 100"):
        make_dataset(TrainConfig(model=small, data=[str(text)], seq_len=32))
    with pytest.raises(ValueError, match="the copy task uses 603 tokens .* vocabulary has 256; lower --symbols to 253"):
        make_dataset(TrainConfig(model="qwen3-tiny", symbols=600, seq_len=32))
    os.makedirs(tmp_path / "no-tokenizer")
    with pytest.raises(ValueError, match="no tokenizer could be loaded from .*no-tokenizer"):
        make_dataset(TrainConfig(data=[str(text)], tokenizer=str(tmp_path / "no-tokenizer"), seq_len=32))


@pytest.mark.parametrize("change,message", [
    (dict(dp_replicate=0), "dp_replicate must be at least 1"),
    (dict(copy_period=0), r"copy_period must be in \[1, 62\] \(a token after the first block must be left to "
                          r"score at seq_len=64\), got 0"),
    (dict(copy_period=63), r"copy_period must be in \[1, 62\]"),  # nothing left to score: loss 0
    (dict(eval_every=-1), "eval_every must be >= 0"),
    (dict(symbols=0), "symbols must be at least 1"),
])
def test_config_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(seq_len=64, **change)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves and loads here
def test_checkpoint_latest_always_names_a_complete_checkpoint(tmp_path, monkeypatch):
    import seqmesh.training.checkpoint as ckpt

    folder = str(tmp_path / "checkpoints")
    checked = []

    def check_latest() -> None:
        if os.path.isfile(os.path.join(folder, ckpt.LATEST)):
            path = ckpt.latest_checkpoint(folder)  # raises if it names an incomplete folder
            checked.append(path)

    def watched(fn):
        def call(*args, **kwargs):
            check_latest()
            out = fn(*args, **kwargs)
            check_latest()
            return out
        return call

    monkeypatch.setattr(ckpt.shutil, "rmtree", watched(shutil.rmtree))
    monkeypatch.setattr(ckpt.os, "replace", watched(os.replace))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    ckpt.save_checkpoint(folder, 2, model, optimizer)
    with torch.no_grad():
        model.weight.fill_(7.0)
    ckpt.save_checkpoint(folder, 2, model, optimizer)  # the same step again (a run restarted in the same folder)
    assert checked and ckpt.latest_checkpoint(folder).endswith("step_0000002")
    assert sorted(os.listdir(folder)) == ["latest", "step_0000002"]
    fresh = torch.nn.Linear(3, 2)
    ckpt.load_checkpoint(ckpt.latest_checkpoint(folder), fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(fresh.weight, torch.full((2, 3), 7.0))
    # cut between renaming the old folder aside and moving the new one in: resume reads the old one
    os.replace(os.path.join(folder, "step_0000002"), os.path.join(folder, "step_0000002.old"))
    assert ckpt.latest_checkpoint(folder).endswith("step_0000002.old")


def test_fsdp_models_are_initialised_shard_by_shard(pools, tmp_path):
    """With FSDP, build() makes the model on the meta device and initialises only each rank's shards:
    shards are independent draws (not one block repeated), at transformers' scale (initializer_range
    0.02), norms at one, RoPE frequencies as an eagerly built model has them, the padding row zero
    (transformers' own zeroing misses a sharded weight), a tied head still tied; under HSDP both
    replicas of a shard are identical."""
    import json

    from train_job_cases import meta_initialised_weights

    padded = tmp_path / "config.json"  # pad row 37 lies in the second of four 64-row shards
    padded.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 256, "pad_token_id": 37}))
    for world, model, ulysses, ring, replicate, tied in (
            (4, "llama-tiny", 2, 2, 1, False), (2, "llama-tiny", 2, 1, 1, False), (4, "qwen3-tiny", 1, 2, 2, True),
            (4, str(padded), 2, 2, 1, False)):
        results = pools.run(world, meta_initialised_weights, model, ulysses, ring, replicate)
        for r in results:  # the same seed gives the one-process model whatever the world size and mesh
            assert r["equals_one_process"], (world, model, ulysses, ring, replicate)
            assert r["inv_freq_matches"], (model, r)
            assert r["pad_row_norm"] in (None, 0.0), (model, r)
            assert abs(r["std"] - 0.02) < 0.002, (model, r)
            assert len(set(r["blocks"])) == len(r["blocks"]), (model, r["blocks"])  # no repeated shard
            assert r["tied"] is tied and r["norm_ones"], (model, r)
        if model == str(padded):
            assert all(r["pad_row_norm"] == 0.0 for r in results), results
        by_shard: dict[int, set[float]] = {}
        for r in results:
            by_shard.setdefault(r["shard_rank"], set()).add(r["local_sum"])
        assert all(len(sums) == 1 for sums in by_shard.values()), by_shard  # replicas agree
