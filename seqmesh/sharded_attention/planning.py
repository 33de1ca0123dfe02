"""What one call of ``seqmesh.attention`` runs, decided before any rank sends: the checked call, the ring's
schedule and the kernel. Shared by the eager path (:mod:`.api`) and the compiled ops (:mod:`.compiled`), so
both plan a call the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..kernels import ChooseKernel, kernel_chooser
from ..mesh import SPMesh
from ..sequence.layout import LayoutKind
from .blocks import chunk_bounds, document_bounds
from .checks import CheckedCall, check_attention_inputs
from .schedule import RingSchedule, ring_schedule


def check_backend(schedule: RingSchedule, choose: ChooseKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise, on every rank alike, if the chosen kernel refuses any call of the pass. The schedule keeps
    its distinct calls (mask, query and key lengths: FA2's window check reads them), so a call of
    ``attention`` checks each once; the check itself runs every call, as the kernels' answers follow
    torch's backend switches (``torch.backends.cuda.enable_flash_sdp``)."""
    for mask, sq, sk in schedule.kernel_calls:
        rows = q[:, :1].expand(-1, sq, -1, -1)  # views: no memory
        keys = k[:, :1].expand(-1, sk, -1, -1)
        choose(rows, keys, mask, v)


def check_alibi(alibi: Sequence[float] | None, heads: int, causal: bool, window: int | None,
                image_blocks: Sequence[tuple[int, int]] | None) -> tuple[float, ...] | None:
    """ALiBi's slopes as a tuple of floats, one per query head, or a ValueError naming what to change."""
    if alibi is None:
        return None
    slopes = tuple(float(s) for s in (alibi.tolist() if isinstance(alibi, torch.Tensor) else alibi))
    if len(slopes) != heads or not all(math.isfinite(s) for s in slopes):
        raise ValueError(f"alibi: {len(slopes)} slopes for {heads} query heads (or one not finite); ALiBi needs one "
                         "finite slope per query head of q, in q's head order.")
    if not causal or window is not None or image_blocks:
        raise ValueError("alibi: seqmesh computes ALiBi for causal attention without a sliding window or image blocks "
                         f"(got causal={causal}, window={window}, image_blocks={'given' if image_blocks else None}).")
    return slopes


def plan_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *, causal: bool, layout: str | LayoutKind,
    cu_seqlens: torch.Tensor | Sequence[int] | None, seq_len: int | None, backend: str, validate: bool | None,
    window: int | None, sinks: torch.Tensor | None, image_blocks: Sequence[tuple[int, int]] | None = None,
    chunk: int | None = None, softcap: float | None = None, alibi: Sequence[float] | None = None,
) -> tuple[CheckedCall, RingSchedule, ChooseKernel]:
    """The checked call of ``seqmesh.attention`` (arguments as there; only q, k, v's shapes, dtype and device
    are read), its ring schedule and kernel chooser; a named kernel's refusal raises here on every rank."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk={chunk!r}: chunked attention needs a whole number of positions per chunk, at least 1.")
    if chunk is not None and image_blocks:
        raise ValueError("chunked attention (chunk) with image_blocks: an image may cross a chunk's edge, which "
                         "seqmesh does not plan; pass one of the two.")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap={softcap!r}: soft-capping needs a positive cap (scores become "
                         "softcap * tanh(s / softcap)); pass None for none.")
    slopes = check_alibi(alibi, q.shape[2], causal, window, image_blocks)
    call = check_attention_inputs(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens,
                                  seq_len=seq_len, validate=validate, window=window, sinks=sinks,
                                  image_blocks=image_blocks)
    lay = call.layout
    if window is not None and window >= lay.padded_len:
        window = None  # every key is inside it: plain causal attention
    blocks = call.image_blocks if causal else ()  # without causality a document's keys are all visible already
    bounds = document_bounds(lay.padded_len, call.real_len, call.cu_seqlens)
    if chunk is not None:  # the mask's documents only: the layout placed the tokens by the documents alone
        bounds = chunk_bounds(bounds, chunk)
    schedule = ring_schedule(lay, bounds, causal, window, blocks, None if softcap is None else float(softcap), slopes)
    choose = kernel_chooser(backend)
    if backend != "auto":  # a named kernel may refuse some blocks (documents): find out before any rank sends
        check_backend(schedule, choose, q, k, v)
    return call, schedule, choose
