"""One Mamba (v1) mixer of transformers (Jamba's, Mamba's, Falcon-Mamba's), float64, run by seqmesh.hf.mamba on
this rank's shard against the mixer's own forward on each whole document (its float32 casts kept float64,
family_cases.KeepFloat64): outputs and every parameter's gradient. The mixer alone, so Mamba and Falcon-Mamba,
whose models seqmesh.hf.parallelize does not take (no attention heads; their backbone drops **kwargs), are
checked too."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqmesh
from dist_cases import get_mesh
from family_cases import KeepFloat64
from seqmesh.hf import mamba
from seqmesh.sequence.batch import real_tokens

HIDDEN, LENGTH, VOCAB = 16, 45, 50


def build_mixer(family: str) -> torch.nn.Module:
    import transformers as tf

    sizes = dict(hidden_size=HIDDEN, state_size=4, expand=2, conv_kernel=4, time_step_rank=4, vocab_size=VOCAB)
    torch.manual_seed(0)
    if family == "jamba":
        config = tf.JambaConfig(hidden_size=HIDDEN, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
        mixer = tf.models.jamba.modeling_jamba.JambaMambaMixer(config, 0)
    elif family == "mamba":
        mixer = tf.models.mamba.modeling_mamba.MambaMixer(tf.MambaConfig(**sizes), 0)
    else:
        # its own init reads norms built after it (transformers 5.24): the weights are set below instead
        mixer = tf.models.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer(tf.FalconMambaConfig(**sizes), 0,
                                                                              initialize_mixer_weights=False)
    with torch.no_grad():  # decays and time steps away from their init, so the scan carries state far
        mixer.A_log.copy_(torch.randn_like(mixer.A_log) * 0.5)
        mixer.D.copy_(torch.randn_like(mixer.D))
        mixer.dt_proj.bias.copy_(torch.randn_like(mixer.dt_proj.bias) - 2.0)
    return mixer.double()


def mixer_parity(family: str, ulysses: int, ring: int, layout: str, documents: bool) -> dict:
    """Largest output error and largest relative parameter-gradient error against the reference."""
    mesh = get_mesh(ulysses, ring)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)  # token -> hidden state
    probe = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)  # token -> the loss's weight on its output
    ids = torch.randint(0, VOCAB, (1, LENGTH), generator=g)
    cuts = [0, 1, 9, 10, 30, LENGTH] if documents else [0, LENGTH]
    batch = {"input_ids": ids}
    if documents:
        batch["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]

    reference = build_mixer(family)
    with KeepFloat64():
        want = torch.cat([reference(table[ids[:, a:b]]) for a, b in zip(cuts[:-1], cuts[1:])], dim=1)
    (want * probe[ids]).sum().backward()

    mixer = build_mixer(family)
    forward = mamba.KIND.make_forward(mixer, mesh, "auto")
    local = seqmesh.shard_batch(batch, mesh, layout=layout)
    with KeepFloat64():  # the mixer's norms upcast to float32 inside; here, as in the reference, they stay float64
        out = forward(mixer, table[local["input_ids"]], seqmesh=local["seqmesh"])  # (1, L, H)
    real = real_tokens(local["seqmesh"], mesh, tuple(local["input_ids"].shape))  # (1, L) bool: not the layout's padding
    real = torch.ones(local["input_ids"].shape, dtype=torch.bool) if real is None else real
    (out * probe[local["input_ids"]] * real[..., None]).sum().backward()
    worst, worst_name = 0.0, ""
    for (name, p), ref in zip(mixer.named_parameters(), reference.parameters()):
        if p.grad is None and ref.grad is None:  # Falcon-Mamba's unused norm weights
            continue
        if p.grad is None or ref.grad is None:
            return {"case": (family, ulysses, ring, layout, documents), "out": float("inf"), "scale": 1.0,
                    "grad": float("inf"), "missing": name}
        dist.all_reduce(p.grad, group=mesh.sp_group)  # each rank holds its tokens' share
        err = float((p.grad - ref.grad).abs().max() / ref.grad.abs().max())
        worst, worst_name = max((worst, worst_name), (err, name))
    whole = seqmesh.gather_sequence(out.detach(), mesh, layout=local["seqmesh"].layout, length=LENGTH)
    return {"case": (family, ulysses, ring, layout, documents), "out": float((whole - want).abs().max()),
            "scale": float(want.abs().max()), "grad": worst, "worst": worst_name}


def all_mixers(cases: list[tuple]) -> list[dict]:
    return [mixer_parity(*case) for case in cases]


def mamba_mixer_bytes(ring: int, seq_len: int) -> dict:
    """Pure Mamba's mixer (:func:`build_mixer`'s sizes) in float32 on this rank's tokens of one sequence, forward and
    backward, its collectives counted by ``comm_stats``: the bytes and calls of each kind by phase, and the output's
    distance from the mixer's own forward on the whole sequence (relative to its largest value)."""
    from seqmesh.comm.stats import comm_stats

    mesh = get_mesh(1, ring)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=g)
    hidden = torch.randn(1, seq_len, HIDDEN, generator=g)
    mixer = build_mixer("mamba").float()
    want = mixer(hidden)
    forward = mamba.KIND.make_forward(mixer, mesh, "auto")
    local = seqmesh.shard_batch({"input_ids": ids}, mesh)
    x = seqmesh.shard_sequence(hidden, mesh, layout=local["seqmesh"].layout).clone().requires_grad_(True)
    with comm_stats() as stats:
        out = forward(mixer, x, seqmesh=local["seqmesh"])
        out.pow(2).sum().backward()
    got = seqmesh.gather_sequence(out.detach(), mesh, layout=local["seqmesh"].layout, length=seq_len)
    sent = {(kind, ph): stats.sent(kind, ph) for kind in ("all_gather", "reduce_scatter", "all_to_all")
            for ph in ("forward", "backward")}
    calls = {(kind, ph): stats.count(kind, ph) for kind, ph in sent}
    return {"sent": sent, "calls": calls, "error": float((got - want.detach()).abs().max() / want.abs().max())}
