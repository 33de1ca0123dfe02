"""The LM-head census: for every causal-LM family of the installed transformers (tiny, float64, perturbed weights:
tests/census_configs.py), SequenceParallelLM's loss on one process is the cross-entropy of the model's own logits,
or the model is refused by name when wrapped (seqmesh.model.head). A family whose forward changes its logits in a
way the chunked loss would miss cannot pass silently."""

from __future__ import annotations

import signal

import torch
import torch.nn.functional as F

from census_configs import build, census_config, census_names
from seqmesh.hf.positions import own_positions
from seqmesh.model.lm import SequenceParallelLM

SEQ_LEN = 24
FAMILY_LIMIT_S = 30
ROUNDING_MULTIPLE = 4  # as the census: a multiple of the reference's own measured rounding  # one family's build and two forwards; past it the family is reported, not failed


def _own_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of the model's own logits, float64 (its forward: scales, caps, biases)."""
    out = model(input_ids=ids, use_cache=False)
    logits = (out.logits if hasattr(out, "logits") else out[0]).reshape(-1, SEQ_LEN, out.logits.shape[-1])[0]
    return F.cross_entropy(logits[:-1].double(), ids[0, 1:])


def _outcome(name: str, mutation: str | None = None) -> tuple[str, str]:
    def alarm(signum, frame):
        raise TimeoutError(f"over {FAMILY_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(FAMILY_LIMIT_S)
    try:
        model = build(census_config(name))
        vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 8
        ids = torch.randint(3, min(vocab, 60), (1, SEQ_LEN), generator=torch.Generator().manual_seed(2))
        want = _own_loss(model, ids)
        rounding = _rounding(model, ids, want)
    except Exception as err:  # noqa: BLE001 - not buildable or not runnable on one process: nothing to compare
        return "unbuildable", f"{type(err).__name__}: {err}"[:160]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    try:
        sp = SequenceParallelLM(model, None, chunk=7)
    except ValueError as err:
        return "refused", str(err)[:160]
    if mutation == "prediction_head_skipped":  # the decoder's output straight into the projection
        sp.logit_transform = None
    if mutation == "softcap_skipped":  # the logits uncapped
        sp.logit_softcap = None
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    own = own_positions(model, ids)  # RoBERTa's kin number their positions themselves (shard_batch(model=) gives them)
    try:
        got = sp(ids, torch.arange(SEQ_LEN)[None] if own is None else own, targets)
    except Exception as err:  # noqa: BLE001 - a wrapped model whose loss fails to run: a crash
        return "crash", f"{type(err).__name__}: {err}"[:160]
    # a missed scale, cap or bias moves the loss by 1e-3 or more on these perturbed models
    error = abs(float(got.detach()) - float(want.detach()))
    tolerance = max(ROUNDING_MULTIPLE * rounding, 64 * torch.finfo(torch.float64).eps * float(want))
    return ("exact" if error <= tolerance else "wrong"), f"{error:.2e} (tolerance {tolerance:.1e})"


def _rounding(model, ids: torch.Tensor, want: torch.Tensor) -> float:
    """How far rounding alone moves the reference loss (as family_cases.reference_rounding): the same weights in
    float32 against float64, scaled to float64's unit roundoff unless the float64 model computes in float32 itself
    (Mamba's and the MLA families' float32 steps), plus how far those steps move it from the same code in float64."""
    import copy

    from family_cases import Float32Ops, KeepFloat64

    with Float32Ops() as ops, torch.no_grad():
        _own_loss(model, ids)
    with torch.no_grad():
        low = _own_loss(copy.deepcopy(model).float(), ids)
    scale = 1.0 if ops.seen else torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    rounding = scale * abs(float(low) - float(want))
    if ops.seen:  # the reference's own float32 steps: how far they move it from the same code all in float64
        try:
            with KeepFloat64(), torch.no_grad():
                rounding += abs(float(_own_loss(model, ids)) - float(want))
        except Exception:  # noqa: BLE001 - a family the float64 mode cannot run: its float32 rounding alone
            pass
    if any(p.dtype == torch.float32 for p in model.parameters()):  # kept in float32 (HY-V4's LM head): the same
        wide = copy.deepcopy(model)                                  # model with every weight in float64
        for p in wide.parameters():
            p.data = p.data.double()
        try:
            with torch.no_grad():
                rounding += abs(float(_own_loss(wide, ids)) - float(want))
        except Exception:  # noqa: BLE001 - code that insists on its float32 weights: their rounding is unmeasured
            pass
    return rounding


def _share(world: int) -> dict[str, tuple[str, str]]:
    """This rank's share of the families (every ``world``-th), each with its outcome: the census on one process per
    core, the families being independent."""
    import torch.distributed as dist

    return {name: _outcome(name) for name in census_names()[dist.get_rank()::world]}


def test_every_familys_loss_is_its_own_or_refused(pools):
    rows = {name: row for share in pools.run(2, _share, 2, timeout=900.0) for name, row in share.items()}
    assert len(rows) == len(census_names())
    bad = {n: r for n, r in rows.items() if r[0] in ("wrong", "crash")}
    counts = {c: sum(r[0] == c for r in rows.values()) for c in ("exact", "refused", "wrong", "crash", "unbuildable")}
    print(f"LM-head census: {counts}")
    for name, (kind, detail) in rows.items():
        if kind != "exact":
            print(f"  {name:30s} {kind:11s} {detail}")
    assert not bad, bad


def test_a_prediction_head_left_out_is_seen():
    """BERT's and RoBERTa's heads (a per-token transform, then the projection, inside one module) with the transform
    skipped: the loss leaves the tolerance."""
    for name in ("bert", "roberta"):
        kind, detail = _outcome(name, mutation="prediction_head_skipped")
        assert kind == "wrong", (name, kind, detail)


def test_a_soft_cap_by_a_family_function_left_out_is_seen():
    """xLSTM caps its logits by its own function (``soft_cap(logits, output_logit_soft_cap)``), which the loss reads
    as a final soft-cap: exact with it (the census above), and the cap left out leaves the tolerance."""
    kind, detail = _outcome("xlstm")
    assert kind == "exact", detail
    kind, detail = _outcome("xlstm", mutation="softcap_skipped")
    assert kind == "wrong", detail


def test_a_padded_vocabulary_cut_by_the_forward_is_cut_by_the_loss():
    """Inkling keeps the first ``unpadded_vocab_size`` of its head's logits (``logits[..., :n]``): the loss uses those
    rows of the head, equal to the cross-entropy of the model's own logits; with every row it is not."""
    model = build(census_config("inkling_text"))
    model.config.unpadded_vocab_size = model.get_output_embeddings().weight.shape[0] - 8
    ids = torch.randint(3, 60, (1, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    want = _own_loss(model, ids)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    sp = SequenceParallelLM(model, None, chunk=7)
    assert sp.logit_vocab == model.config.unpadded_vocab_size
    got = sp(ids, torch.arange(SEQ_LEN)[None], targets)
    tolerance = ROUNDING_MULTIPLE * _rounding(model, ids, want) + 64 * torch.finfo(torch.float64).eps
    assert abs(float(got.detach()) - float(want)) <= tolerance, (float(got), float(want))
    sp.logit_vocab = None
    assert abs(float(sp(ids, torch.arange(SEQ_LEN)[None], targets).detach()) - float(want)) > 100 * tolerance
