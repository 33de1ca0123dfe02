"""Kimi Delta Attention cases: an independent token-by-token reference, and the layer by state passing run on
every rank of a spawned group (see conftest.Pools)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqmesh
from dist_cases import get_mesh
from seqmesh.comm.stats import comm_stats
from seqmesh.linear_attention import kda_state_passing
from seqmesh.linear_attention.kda_all_to_all import all_to_all_kda
from seqmesh.linear_attention.kda_state_passing import KdaHeads, state_passing_kda


def token_loop_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   starts: tuple[int, ...], initial: torch.Tensor | None = None, reset: bool = True):
    """The KDA recurrence one token at a time, as written (decay, delta write, read): q, k (B, S, H, Dk),
    v (B, S, H, Dv), g (B, S, H, Dk), beta (B, S, H); the state restarts (from ``initial[:, i]`` or zero) at
    each of ``starts`` (``reset=False``: it runs through them, a mutation) -> (out, final state of each segment)."""
    b, s, h, dk = q.shape
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / dk**0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    state, outs, finals, segment = None, [], [], -1
    for t in range(s):
        if t in starts:
            if state is not None:
                finals.append(state)
            segment += 1
            if reset or state is None:
                state = q.new_zeros(b, h, dk, v.shape[-1]) if initial is None else initial[:, segment]
        state = state * g[:, t].exp()[..., None]
        error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * error)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1), torch.stack(finals + [state], 1)


def conv_per_document(x: torch.Tensor, weight: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    """silu of the depthwise causal conv, each document alone: x (B, S, C), weight (C, K)."""
    bounds = list(starts) + [x.shape[1]]
    pieces = [F.conv1d(x[:, a:e].transpose(1, 2), weight[:, None], padding=weight.shape[-1] - 1,
                       groups=x.shape[-1])[..., : e - a].transpose(1, 2) for a, e in zip(bounds[:-1], bounds[1:])]
    return F.silu(torch.cat(pieces, 1))


@dataclass(frozen=True)
class KdaCase:
    seq_len: int
    layout: str = "zigzag"
    documents: tuple[int, ...] | None = None
    heads: int = 2
    key_dim: int = 5
    value_dim: int = 3
    kernel: int = 4
    batch: int = 2
    design: str = "state_passing"  # or "all_to_all"

    @property
    def name(self) -> str:
        return (f"S{self.seq_len}-{self.layout}-{'docs' if self.documents else 'nodocs'}-k{self.kernel}-h{self.heads}-"
                f"{self.design}")


def kda_inputs(case: KdaCase):
    """float64 leaves: qkv before the conv (B, S, C), the conv weight (C, K), the log decay g (B, S, H, Dk) with
    long memory on some channels (down to -0.02 a token), beta (B, S, H); and an output gradient."""
    gen = torch.Generator().manual_seed(11)
    heads = KdaHeads(case.heads, case.key_dim, case.value_dim)
    b, s, h, dt = case.batch, case.seq_len, case.heads, torch.float64
    qkv = torch.randn(b, s, heads.conv_dim, generator=gen, dtype=dt)
    weight = torch.randn(heads.conv_dim, case.kernel, generator=gen, dtype=dt) * 0.5
    g = -torch.rand(b, s, h, case.key_dim, generator=gen, dtype=dt).pow(3) * 2 - 0.02
    beta = torch.rand(b, s, h, generator=gen, dtype=dt)
    dout = torch.randn(b, s, h, case.value_dim, generator=gen, dtype=dt)
    return heads, [qkv, weight, g, beta], dout


def whole_sequence_kda(heads: KdaHeads, qkv, weight, g, beta, starts: tuple[int, ...], reset: bool = True):
    """The reference of the layer on one process: conv per document, then the token loop."""
    mixed = conv_per_document(qkv, weight, starts)
    b, s, _ = mixed.shape
    h, dk, dv = heads.heads, heads.key_dim, heads.value_dim
    q, k, v = mixed.split([h * dk, h * dk, h * dv], dim=-1)
    return token_loop_kda(q.reshape(b, s, h, dk), k.reshape(b, s, h, dk), v.reshape(b, s, h, dv), g, beta, starts,
                          reset=reset)[0]


def kda_layer_cases(ulysses: int, ring: int, cases: list[KdaCase], mutation: str | None = None) -> list[dict]:
    """``state_passing_kda`` or ``all_to_all_kda`` (``case.design``) on the mesh against :func:`whole_sequence_kda`:
    max abs error of the output and of every input's gradient, and the collectives' bytes. ``mutation="no_pass"``:
    the runs' states are not passed between ranks (each run starts from zero), which the test must see."""
    mesh = get_mesh(ulysses, ring)
    min_chunk = 1  # cut even short documents
    results = []
    for case in cases:
        heads, leaves, dout = kda_inputs(case)
        for t in leaves:
            t.requires_grad_(True)
        starts = tuple((case.documents or (0, case.seq_len))[:-1])
        want = whole_sequence_kda(heads, *leaves, starts)
        want_grads = torch.autograd.grad((want * dout).sum(), leaves)

        def shard(t):
            return seqmesh.shard_sequence(t, mesh, layout=case.layout, cu_seqlens=case.documents, min_chunk=min_chunk)

        qkv, weight, g, beta = leaves
        passing = kda_state_passing.pass_states
        if mutation == "no_pass":
            kda_state_passing.pass_states = lambda out, *args, **kwargs: out
        try:
            with comm_stats() as stats:
                design = all_to_all_kda if case.design == "all_to_all" else state_passing_kda
                out = design(shard(qkv), shard(g), shard(beta), weight, None, heads, mesh, layout=case.layout,
                                        seq_len=case.seq_len, cu_seqlens=case.documents, min_chunk=min_chunk)
                grads = torch.autograd.grad((out * shard(dout)).sum(), leaves)
        finally:
            kda_state_passing.pass_states = passing
        got = seqmesh.gather_sequence(out.detach(), mesh, layout=case.layout, length=case.seq_len,
                                      cu_seqlens=case.documents, min_chunk=min_chunk)
        errors = {"out": float((got - want.detach()).abs().max())}
        for name, g_sp, g_ref in zip(("qkv", "conv_weight", "g", "beta"), grads, want_grads):
            if name == "conv_weight":  # each rank holds its tokens' part of a parameter's gradient
                g_sp = g_sp.clone()
                dist.all_reduce(g_sp, group=mesh.sp_group)
            errors[name] = float((g_sp - g_ref).abs().max() / g_ref.abs().max())
        results.append({"case": case.name, "errors": errors, "scale": float(want.abs().max()),
                        "gather_bytes": stats.sent("all_gather", "forward"),
                        "a2a_bytes": {ph: stats.sent("all_to_all", ph) for ph in ("forward", "backward")},
                        "a2a_calls": (stats.count("all_to_all", "forward"), stats.count("all_to_all", "backward")),
                        "gather_calls": (stats.count("all_gather", "forward"), stats.count("reduce_scatter"))})
    return results


def without_document_resets(lm) -> None:
    """A mutation of a parallelized model: its KDA layers run through document starts (their state and conv are
    not reset), the attention layers still see the documents."""
    for module in lm.modules():
        if getattr(module, "_seqmesh_mixer", None) == "Kimi Delta Attention":
            forward = module.forward

            def through(hidden_states, *args, _forward=forward, **kwargs):
                kwargs["seqmesh"] = dataclasses.replace(kwargs["seqmesh"], cu_seqlens=None)
                return _forward(hidden_states, *args, **kwargs)

            module.forward = through


def tiny_bailing_layer(seed: int = 0):
    """The KDA layer of a tiny Bailing hybrid (Ling/Ring linear), all float64: transformers keeps its conv, A_log
    and dt_bias in float32 (``_keep_in_fp32_modules_strict``), cast up here so its own forward runs in float64."""
    import transformers as tf

    from family_cases import build

    config = tf.BailingHybridConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
        intermediate_size=64, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, head_dim=8, short_conv_kernel_size=4, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], num_mtp_layers=0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return build(config, seed).model.layers[0].self_attn.double()


def bailing_layer_cases(ulysses: int, ring: int, cases: list[tuple[str, tuple[int, ...] | None, str]]) -> list[dict]:
    """Bailing hybrid's KDA layer through seqmesh's forward on the mesh (cases: layout, documents, design) against
    transformers' own forward of the layer on each document alone, both in float64 (KeepFloat64: transformers' KDA
    and gate cast to float32 themselves): relative errors of the output, the input's and every parameter's gradient."""
    from family_cases import KeepFloat64
    from seqmesh.hf import kda
    from seqmesh.sequence.batch import SequenceInfo

    mesh = get_mesh(ulysses, ring)
    results = []
    for layout, documents, design in cases:
        layer = tiny_bailing_layer()
        gen = torch.Generator().manual_seed(3)
        s = 24
        x = torch.randn(2, s, 32, generator=gen, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, s, 32, generator=gen, dtype=torch.float64)
        params = dict(layer.named_parameters())
        bounds = documents or (0, s)
        with KeepFloat64():
            want = torch.cat([layer(x[:, a:e]) for a, e in zip(bounds[:-1], bounds[1:])], 1)
        want_grads = torch.autograd.grad((want * dout).sum(), [x, *params.values()])

        def shard(t):
            return seqmesh.shard_sequence(t, mesh, layout=layout, cu_seqlens=documents)

        forward = kda._make_forward(layer, mesh, design)
        info = SequenceInfo(seq_len=s, cu_seqlens=documents, layout=layout)
        with KeepFloat64():
            out = forward(layer, shard(x), seqmesh=info)
        grads = list(torch.autograd.grad((out * shard(dout)).sum(), [x, *params.values()]))
        for g in grads[1:]:
            dist.all_reduce(g, group=mesh.sp_group)
        got = seqmesh.gather_sequence(out.detach(), mesh, layout=layout, length=s, cu_seqlens=documents)
        errors = {"out": float((got - want.detach()).abs().max() / want.abs().max())}
        for name, g, ref in zip(["input", *params], grads, want_grads):
            errors[name] = float((g - ref).abs().max() / ref.abs().max())
        results.append({"case": (layout, documents, design), "errors": errors})
    return results


def kda_refusals() -> dict:
    """What a parallelized Kimi Linear's KDA layer says when called without seqmesh's entry, with a cache, or with
    a padding mask; and whether parallelize installs and unparallelize removes its forward."""
    from transformers import DynamicCache

    from family_cases import build, family_config
    from seqmesh.hf import parallelize, unparallelize
    from seqmesh.sequence.batch import SequenceInfo

    model = parallelize(build(family_config("kimi_linear")), get_mesh(1, 1))
    layer = model.model.layers[0].self_attn
    out = {"installed": sum("forward" in vars(m) for m in model.modules())}
    x = torch.zeros(1, 6, model.config.hidden_size, dtype=torch.float64)
    info = SequenceInfo(seq_len=6, cu_seqlens=None, layout="zigzag")
    calls = {"no_entry": dict(), "cache": dict(cache=DynamicCache(config=model.config), seqmesh=info),
             "mask": dict(attention_mask=torch.ones(1, 6), seqmesh=info)}
    for what, kwargs in calls.items():
        try:
            layer(x, **kwargs)
            out[what] = "no error"
        except ValueError as err:
            out[what] = str(err)
    unparallelize(model)
    out["left"] = sum("forward" in vars(m) for m in model.modules())
    return out
