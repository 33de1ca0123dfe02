"""The family census (issue 30): every causal-LM family of the installed transformers, and a few common
variants, through seqmesh.hf on every rank, against the same model on one process.

Each family is built tiny from its own config class (census_configs.py), in float64, with every weight perturbed
by seeded noise (so no zero-initialised branch hides a wrong mixer), and runs 128 random tokens on Ulysses 2 and
ring 2, without and with packed documents (the reference runs each document alone). Each case is classified:
``exact`` (logits within a multiple of the reference's own rounding), ``refused`` (seqmesh raised a ValueError
naming the reason), ``wrong`` (ran, but farther than that), ``crash`` (any other exception, or a refusal whose
reason is false); ``unbuildable`` families (their tiny model or its single-process reference cannot be made)
are counted apart, with the reason. All families run in one spawned group, one after another, each built once
per rank; the single-process references, most of a family's time, are shared out: each rank computes those of
one family of every group of as many families as ranks, and hands them to the others.
"""

from __future__ import annotations

import copy
import os
import signal
import time
import traceback

import torch

from census_configs import TINY, build, census_config
from family_cases import reference_dtype

SEQ_LEN = 128
CUTS = (0, 1, 9, 10, 30, SEQ_LEN)  # packed documents: one-token ones, a short one, and one past 64 positions
MESHES = {"U2": (2, 1), "R2": (1, 2)}  # name: (ulysses, ring)

ROUNDING_MULTIPLE = 4  # as test_hf_families: a case is exact within this many times the reference's own rounding
FLOAT64_FLOOR = 1e-10  # the least tolerance, for families float64 throughout (DESIGN.md: fp64 ~1e-10)
FAMILY_LIMIT_S = 60  # a family whose single-process part (build and references) takes longer is unbuildable
# words in the names of config fields that hold the id of a token standing for an image, video or audio item
MEDIA_WORDS = ("image", "video", "audio", "vision", "boi", "eoi", "boa", "eoa")


def census_batch(config, packed: bool) -> dict:
    """SEQ_LEN seeded random ids below the text vocabulary (ids that stand for an image, video or audio item
    replaced, the batch being text), with ``position_ids`` restarting at CUTS when ``packed``. Special text
    tokens (padding among them: RoBERTa numbers positions around it) stay in."""
    text = config.get_text_config(decoder=True)
    vocab = min(text.vocab_size, TINY["vocab_size"])
    media = {v for c in (config, text) for k, v in vars(c).items()
             if isinstance(v, int) and not isinstance(v, bool) and any(m in k for m in MEDIA_WORDS)}
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (1, SEQ_LEN), generator=g)  # (1, S)
    safe = min(set(range(vocab)) - media)
    for m in media:
        ids[ids == m] = safe
    if not packed:
        return {"input_ids": ids}
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CUTS[:-1], CUTS[1:])])[None]  # (1, S)
    return {"input_ids": ids, "position_ids": positions}


# Variants whose model decides something from the whole row it is given (the largest position: longrope, dynamic
# NTK; each token's index in the row: Llama 4's temperature), as transformers does on a packed batch in one call:
# their packed reference is that one call, which seqmesh reproduces (seqmesh.hf.positions), not the documents apart
WHOLE_ROW = ("phi3+longrope", "llama+dynamic", "llama4_text+unchunked",
             "deepseek_v32", "glm_moe_dsa")  # DSA: the indexer's top-k over the row (ties fall as over the row)


def reference_logits(model, batch: dict, whole_row: bool = False) -> torch.Tensor:
    """``(1, S, V)`` float64 logits of the whole sequence on one process, without position_ids (the model
    numbers positions itself); packed documents one model call each, with their own position_ids (the inputs the
    batch gives: a family that numbers positions itself, RoBERTa's, takes them as given); ``whole_row``: the packed
    batch in one call (see WHOLE_ROW)."""
    ids = batch["input_ids"]
    if whole_row and "position_ids" in batch:
        return single_call_logits(model, batch)
    with torch.no_grad():
        if "position_ids" not in batch:
            return _logits(model(input_ids=ids, use_cache=False))
        positions = batch["position_ids"]
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        return torch.cat([_logits(model(input_ids=ids[:, a:b], position_ids=positions[:, a:b], use_cache=False))
                          for a, b in zip(starts[:-1], starts[1:])], dim=1)


def single_call_logits(model, batch: dict) -> torch.Tensor:
    """The packed batch in one model call with its ``position_ids``, as a training loop packing documents would
    call the model on one process: for comparison only (a family whose rotary scaling follows the largest position,
    or whose masks ignore position_ids, gives each document something else than run alone)."""
    with torch.no_grad():
        return _logits(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False))


def _logits(out) -> torch.Tensor:
    """(1, S, V) logits of a model output; MusicGen's decoder gives (1 * codebooks, S, V) with one codebook."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.reshape(1, logits.shape[-2], logits.shape[-1]).double()


def _in_order(model: torch.nn.Module, batches: dict, whole_row: bool, out: dict) -> dict:
    """Each batch's ``reference_logits`` from one model, in the order given, into ``out`` as each is done (so a
    failure on a later batch keeps the earlier ones): dynamic NTK keeps the longest length it has seen, so each
    batch's reference has the history the parallelized model has when it runs that batch."""
    for key, batch in batches.items():
        out[key] = reference_logits(model, batch, whole_row)
    return out


def references(pristine: torch.nn.Module, batches: dict, whole_row: bool = False) -> dict:
    """The reference of each batch (``{packed: batch}``, plain first: the order the parallelized models run them),
    one model copy per precision running all of them: its logits (``reference_logits``), how far rounding alone moves
    them (as family_cases.reference_rounding, logits only: the same weights in float32 against float64, scaled to
    float64's unit roundoff where the float64 model has run no float32 operator so far, plus how far its own float32
    steps move it where it has), whether it has, and for a packed batch the single-call logits."""
    from family_cases import Float32Ops, KeepFloat64

    model, ref, seen, upcast = copy.deepcopy(pristine), {}, {}, False  # a copy: rotary state
    for key, batch in batches.items():
        with Float32Ops() as ops:
            ref[key] = reference_logits(model, batch, whole_row)
        seen[key] = upcast = upcast or ops.seen
    try:
        low = _in_order(copy.deepcopy(pristine).float(), batches, whole_row, {})
    except Exception:  # noqa: BLE001 - a model that keeps its float64 dtype in its config: built in float32
        low_model = build(pristine.config, dtype=torch.float32)
        low_model.load_state_dict(pristine.state_dict())
        low = _in_order(low_model, batches, whole_row, {})
    inside: dict = {}
    if upcast:
        try:
            with KeepFloat64():
                _in_order(copy.deepcopy(pristine), batches, whole_row, inside)
        except Exception:  # noqa: BLE001 - a family the float64 mode cannot run: its float32 rounding alone
            pass
    prepared = {}
    for key, batch in batches.items():
        scale = 1.0 if seen[key] else torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
        rounding = scale * float((low[key] - ref[key]).abs().max())
        if seen[key] and key in inside:
            rounding += float((inside[key] - ref[key]).abs().max())
        single = None
        if "position_ids" in batch:
            try:
                single = single_call_logits(copy.deepcopy(pristine), batch)
            except Exception:  # noqa: BLE001 - a model that takes no position_ids: nothing to compare with
                pass
        prepared[key] = {"batch": batch, "ref": ref[key], "rounding": rounding, "float32": seen[key], "single": single}
    return prepared


class _Timeout(Exception):
    """A family's single-process part ran past FAMILY_LIMIT_S."""


def _on_alarm(signum, frame):
    raise _Timeout(f"its model and references took over {FAMILY_LIMIT_S} s")


def _seqmesh_refusal(err: BaseException) -> bool:
    """Whether ``err`` is a ValueError that seqmesh itself raised (its own frame raised it) with a reason that
    holds: a call "without the 'seqmesh' entry" is not one, the census passes it (the model lost it)."""
    import seqmesh

    if not isinstance(err, ValueError) or "called without the 'seqmesh' entry" in str(err):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(os.path.dirname(seqmesh.__file__))


def _describe(err: BaseException) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1:] or [None]
    where = f" ({os.path.basename(frame[0].filename)}:{frame[0].lineno})" if frame[0] else ""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:400]}{where}"


def _failed(err: BaseException, stage: str) -> dict:
    return {"class": "refused" if _seqmesh_refusal(err) else "crash", "stage": stage, "message": _describe(err)}


def _parallelized(pristine: torch.nn.Module, mesh_name: str) -> torch.nn.Module | dict:
    """A copy of the model parallelized on the mesh, or the case's row if parallelize refuses it or fails (local
    checks only: no collective runs)."""
    from dist_cases import get_mesh
    from seqmesh.hf import parallelize

    try:
        return parallelize(copy.deepcopy(pristine), get_mesh(*MESHES[mesh_name]))
    except Exception as err:  # noqa: BLE001 - every failure is classified, none ends the census
        return _failed(err, "parallelize")


def _run_case(model: torch.nn.Module, mesh_name: str, prepared: dict) -> dict:
    """One (mesh, batch) case of a parallelized model: run this rank's shard, gather the logits, compare."""
    import seqmesh
    from dist_cases import get_mesh

    mesh = get_mesh(*MESHES[mesh_name])
    try:
        local = seqmesh.shard_batch(prepared["batch"], mesh, model=model)  # the family's own positions, if any
        info = local["seqmesh"]
        with torch.no_grad():
            out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], seqmesh=info)
        logits = out.logits if hasattr(out, "logits") else out[0]
        logits = logits.reshape(1, logits.shape[-2], logits.shape[-1])  # (1, S/P, V)
        whole = seqmesh.gather_sequence(logits, mesh, layout=info.layout, length=SEQ_LEN, cu_seqlens=info.cu_seqlens)
    except Exception as err:  # noqa: BLE001 - every failure is classified, none ends the census
        return _failed(err, "forward")
    ref, rounding = prepared["ref"], prepared["rounding"]
    err = float((whole.double() - ref).abs().max())
    tol = max(ROUNDING_MULTIPLE * rounding, FLOAT64_FLOOR)
    row = {"class": "exact" if err <= tol else "wrong", "error": err, "tolerance": tol, "rounding": rounding,
           "float32_inside": prepared["float32"]}
    if prepared["single"] is not None:  # how far seqmesh and the per-document reference are from one packed call
        row["vs_single_call"] = float((whole.double() - prepared["single"]).abs().max())
        row["reference_vs_single_call"] = float((ref - prepared["single"]).abs().max())
    return row


def _single_process(name: str, own: bool) -> tuple[dict, str | None]:
    """This rank's single-process part of one family, under FAMILY_LIMIT_S: its model parallelized per mesh (a
    family refused at parallelize needs no reference) and, where ``own``, the references of a family some mesh runs.
    Returns ``({"models": ..., "prepared": ...}, None)`` or ``({}, why it cannot be built)``."""
    signal.alarm(FAMILY_LIMIT_S)
    try:
        pristine = build(census_config(name))
        models = {mesh_name: _parallelized(pristine, mesh_name) for mesh_name in MESHES}
        running = any(isinstance(m, torch.nn.Module) for m in models.values())
        batches = {packed: census_batch(pristine.config, packed) for packed in (False, True)}
        with reference_dtype(name):  # XGLM clamps its float64 scores with a default-dtype tensor (family_cases)
            prepared = references(pristine, batches, name in WHOLE_ROW) if own and running else None
        return {"models": models, "prepared": prepared}, None
    except Exception as err:  # noqa: BLE001 - _Timeout included: the family cannot be built or run on one process
        return {}, _describe(err)
    finally:
        signal.alarm(0)


def _group(names: list[str]) -> list[dict]:
    """Every case of the families ``names`` (one per rank at most) on this rank. Every rank builds and parallelizes
    each of them; rank i computes the references of ``names[i]`` only (the single-process references are most of a
    family's time) and the ranks exchange them, agreeing in the same round on which families could not be built, so
    a rank that gave up cannot leave another waiting in a collective."""
    import torch.distributed as dist

    rank = dist.get_rank()
    start = time.monotonic()
    mine = {name: _single_process(name, own=i == rank) for i, name in enumerate(names)}
    told: list = [None] * dist.get_world_size()
    dist.all_gather_object(told, {name: (part.get("prepared"), failure) for name, (part, failure) in mine.items()})
    rows = []
    for i, name in enumerate(names):
        why = mine[name][1] or next((said[name][1] for said in told if said[name][1] is not None), None)
        if why is not None:
            rows.append({"name": name, "mesh": "-", "packed": None, "class": "unbuildable", "message": why})
            continue
        prepared = told[i][name][0]  # rank i's references (None where every mesh refused the family)
        for mesh_name, model in mine[name][0]["models"].items():
            for packed in (False, True):
                row = _run_case(model, mesh_name, prepared[packed]) if isinstance(model, torch.nn.Module) else model
                rows.append({"name": name, "mesh": mesh_name, "packed": packed, **row})
    rows[-1]["seconds"] = time.monotonic() - start
    return rows


def census(names: list[str]) -> list[dict]:
    """Every case of every family in ``names`` on this rank, in order: one row per (family, mesh, plain/packed),
    or one ``unbuildable`` row for a family whose tiny model or single-process reference cannot be made; the last
    row of each group of families (one per rank, :func:`_group`) carries the group's seconds."""
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    world = dist.get_world_size()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for first in range(0, len(names), world):
            rows += _group(names[first:first + world])
    finally:
        signal.signal(signal.SIGALRM, previous)
    return rows
