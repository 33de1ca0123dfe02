"""The main job on spawned ranks: runs, resumes, verifies."""

from __future__ import annotations

import torch

from seqmesh.training.config import TrainConfig
from seqmesh.training.train import train
from seqmesh.training.verify import verify


def run_train(cfg: TrainConfig) -> dict:
    return train(cfg)


def run_verify(cfg: TrainConfig, rtol: float | None) -> dict:
    return verify(cfg, rtol=rtol)


def entry_error(entry: str, cfg: TrainConfig) -> str:
    """The configuration error of ``train(cfg)`` or ``verify(cfg)``; building a mesh or a model before
    raising it is a failure."""
    import seqmesh.training.train as job
    import seqmesh.training.verify as check

    def too_early(*args, **kwargs):
        raise AssertionError("a mesh or a model was built before the configuration was checked")

    original = job.init_mesh, job.build_model, check.build_model
    job.init_mesh = job.build_model = check.build_model = too_early
    try:
        {"train": train, "verify": verify}[entry](cfg)
    except ValueError as err:
        return str(err)
    finally:
        job.init_mesh, job.build_model, check.build_model = original
    return "no error"


def run_verify_with_a_bug(cfg: TrainConfig) -> dict:
    """verify() with a real pipeline bug on the sequence-parallel side: labels shifted one token too
    far (the classic off-by-one of shifting after slicing)."""
    import torch

    import seqmesh.inputs as data  # seqmesh.shard_batch hands a text batch to this name

    original = data.shard_text_batch

    def broken(batch, mesh, **kwargs):
        labels = batch.get("labels", batch["input_ids"])
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        return original({**batch, "labels": shifted}, mesh, **kwargs)

    data.shard_text_batch = broken
    try:
        return verify(cfg)
    finally:
        data.shard_text_batch = original


def meta_initialised_weights(model: str, ulysses: int, ring: int, dp_replicate: int) -> dict:
    """build() with FSDP allocates only shards (meta device first): what the initialised weights look like."""
    from seqmesh.training.config import TrainConfig
    from seqmesh.training.train import build

    mesh, module, _ = build(TrainConfig(model=model, seq_len=64, ulysses=ulysses, ring=ring, dp=1,
                                        dp_replicate=dp_replicate))
    lm = module.lm
    q_proj = lm.model.layers[0].self_attn.q_proj.weight
    whole = q_proj.full_tensor().detach()
    fsdp_mesh = mesh.fsdp_mesh
    from seqmesh.model.lm import build_model

    embedding = lm.get_input_embeddings()
    pad = embedding.padding_idx
    eager = build_model(model)  # the whole model on one process: buffers, and every weight, must agree
    shards = dict(lm.named_parameters())
    return {
        "equals_one_process": all(torch.equal(shards[name].full_tensor(), p) for name, p in eager.named_parameters()),
        "pad_row_norm": None if pad is None else float(embedding.weight.full_tensor()[pad].norm()),
        "inv_freq_matches": bool(torch.equal(lm.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)),
        "std": float(whole.std()),
        "blocks": [float(b.sum()) for b in whole.chunk(fsdp_mesh.size(fsdp_mesh.ndim - 1))],
        "local_sum": float(q_proj.to_local().detach().sum()),
        "shard_rank": fsdp_mesh.get_local_rank(fsdp_mesh.ndim - 1),
        "tied": lm.lm_head.weight is lm.model.embed_tokens.weight,
        "norm_ones": bool((lm.model.norm.weight.full_tensor() == 1).all()),
    }


def sharded_init_against_one_process(model: str, ring: int) -> dict:
    """build() with FSDP over a ring (the model made on the meta device, only shards allocated) against the same
    config built whole on one process: which parameters differ, and each Mamba mixer's dt bias through softplus
    (its init writes its children's weights: dt_proj, conv1d, out_proj)."""
    import torch.nn.functional as F

    from seqmesh.model.lm import build_model
    from seqmesh.training.train import build

    _, module, _ = build(TrainConfig(model=model, seq_len=64, ulysses=1, ring=ring, dp=1, fsdp=True))
    shards = dict(module.lm.named_parameters())
    eager = build_model(model)
    steps = [F.softplus(p.full_tensor()) for name, p in shards.items() if name.endswith("dt_proj.bias")]
    return {"differ": [name for name, p in eager.named_parameters() if not torch.equal(shards[name].full_tensor(), p)],
            "dt_min": min(float(s.min()) for s in steps), "dt_max": max(float(s.max()) for s in steps)}


def compiled_layers(cfg: TrainConfig) -> list[bool]:
    """Whether each decoder layer of the job's model is compiled (``nn.Module.compile``) after ``build``."""
    from seqmesh.model.lm import decoder_layers
    from seqmesh.training.train import build

    _, module, _ = build(cfg)
    return [getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(module.lm)]


def run_train_counting_breaks(cfg: TrainConfig) -> dict:
    """``train(cfg)``, and the graph breaks dynamo met on the way (its counters, cleared first)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    summary = train(cfg)
    return {"summary": summary, "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"], "reasons": [r[:200] for r in counters["graph_break"]]}


def _job_settings(tmp_path, config, ring: int, options: dict) -> dict:
    """``config`` (a transformers config) written as a config.json, and the jobs' settings: a ring of ``ring`` ranks,
    77 tokens of the copy task, ``options`` (TrainConfig's) besides."""
    path = tmp_path / config.model_type / "config.json"
    path.parent.mkdir()
    path.write_text(config.to_json_string())
    return dict(model=str(path), seq_len=77, ulysses=1, ring=ring, dp=1, lr=1e-2, warmup=1, log_every=1, eval_every=0,
                symbols=16, **options)


def _train_losses(pools, tmp_path, base: dict, steps: int) -> list[float]:
    import json

    pools.run(base["ring"], run_train, TrainConfig(**base, steps=steps, out=str(tmp_path / "train")))
    with open(tmp_path / "train" / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def train_from_config(pools, tmp_path, config, *, ring: int = 2, steps: int = 6, **options) -> list[float]:
    """``seqmesh train`` (``steps``) from ``config`` written as a config.json (:func:`_job_settings`): the losses."""
    return _train_losses(pools, tmp_path, _job_settings(tmp_path, config, ring, options), steps)


def verify_then_train(pools, tmp_path, config, *, ring: int = 2, steps: int = 6, **options) -> tuple[dict, list[float]]:
    """``seqmesh verify`` (one step), then ``seqmesh train`` (``steps``) from ``config`` written as a config.json
    (:func:`_job_settings`): verify's answer on rank 0 and the training losses."""
    base = _job_settings(tmp_path, config, ring, options)
    good = pools.run(ring, run_verify, TrainConfig(**base, steps=1, out=str(tmp_path / "verify")), None)[0]
    return good, _train_losses(pools, tmp_path, base, steps)
