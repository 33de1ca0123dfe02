"""The census (issue 30): every causal-LM family of the installed transformers, and common variants, tiny,
float64, every weight perturbed, 128 tokens on Ulysses 2 and ring 2, plain and packed, logits against the same
model on one process (tests/census_cases.py). No family may be silently wrong or crash: each case is exact
(within a multiple of the reference's own rounding) or refused by seqmesh by name. A new transformers release
that adds or changes a family is caught here, at the newest versions (`make test`; for time, the floor subset,
tests/floor_subset.txt, checks only the main families there, in test_hf_families).

``pytest -s`` prints the counts, one line per family with its four cases, and every case that is not exact with
its error or message.
"""

from __future__ import annotations

import time
from collections import Counter

from census_cases import MESHES, census
from census_configs import census_names

# Families and variants that are wrong or crash today, each with its cause; the test reports them and tolerates
# them, and fails once one passes (so this list is emptied as fixes land, never left stale). Empty since issue 30
# fixed or refused by name every one the census found (offset positions, whole-row rotary scaling and temperature,
# encoder-decoder decoders, models without heads, layers that drop the seqmesh entry).
KNOWN_OPEN: dict[str, str] = {}
# Open only on transformers releases before the one named (the family's code changed within the supported range;
# the named release is the newest measured to pass, not necessarily the first). Empty, as KNOWN_OPEN.
KNOWN_OPEN_BEFORE: dict[str, tuple[str, str]] = {}

CLASSES = ("exact", "refused", "wrong", "crash", "unbuildable")
CASES = [(mesh, packed) for mesh in MESHES for packed in (False, True)]


def known_open() -> dict[str, str]:
    """KNOWN_OPEN, with the KNOWN_OPEN_BEFORE entries whose version is newer than the installed transformers."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__)
    return {**KNOWN_OPEN, **{n: why for n, (v, why) in KNOWN_OPEN_BEFORE.items() if installed < Version(v)}}


def _case_name(row: dict) -> str:
    return "-" if row["packed"] is None else f"{row['mesh']} {'packed' if row['packed'] else 'plain'}"


def _detail(row: dict) -> str:
    if row["class"] in ("exact", "wrong"):
        return f"error {row['error']:.2e} (tolerance {row['tolerance']:.1e})"
    where = f"at {row['stage']}: " if "stage" in row else ""
    return where + row["message"]


def _report(rows: list[dict], seconds: float) -> str:
    """The counts; one line per family with the class of each of its cases; then every case that is not exact;
    then the packed cases where one model call over the packed batch (with its position_ids) differs from the
    documents run one at a time, which the census takes as the reference."""
    counts = Counter(r["class"] for r in rows)
    lines = [f"census of {len({r['name'] for r in rows})} families and variants, {len(rows)} cases, {seconds:.0f} s: "
             + ", ".join(f"{counts[c]} {c}" for c in CLASSES)]
    by_name: dict[str, list[dict]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    lines.append("family".ljust(30) + "".join(f"{m} {'packed' if p else 'plain'}".ljust(12) for m, p in CASES))
    for name, cases in by_name.items():
        lines.append(name.ljust(30) + "".join(r["class"].ljust(12) for r in cases))
    lines.append("not exact:")
    for r in rows:
        if r["class"] != "exact":
            known = " [KNOWN_OPEN]" if r["name"] in known_open() and r["class"] in ("wrong", "crash") else ""
            lines.append(f"  {r['name']:30s} {_case_name(r):10s} {r['class']:11s} {_detail(r)}{known}")
    lines.append("packed, where the packed batch in one model call (with its position_ids) is not the documents one "
                 "call each (the reference): their difference; seqmesh's from that one call on each mesh")
    for name, cases in by_name.items():
        packed = [r for r in cases if r["packed"] and r.get("reference_vs_single_call") is not None]
        if packed and packed[0]["reference_vs_single_call"] > packed[0]["tolerance"]:
            lines.append(f"  {name:30s} {packed[0]['reference_vs_single_call']:.2e}; seqmesh "
                         + ", ".join(f"{r['mesh']} {r['vs_single_call']:.2e} ({r['class']})" for r in packed))
    return "\n".join(lines)


def test_no_family_is_silently_wrong_or_crashes(pools):
    """Every case of every family and variant is exact or refused by seqmesh by name (or the family cannot be
    built tiny at all, which is reported); wrong and crashing ones fail the test unless known_open() lists them,
    and a listed family that now runs without one fails it too. Both ranks classify every case alike."""
    names = census_names()
    start = time.monotonic()
    per_rank = pools.run(2, census, names, timeout=900.0)
    seconds = time.monotonic() - start
    rows = per_rank[0]
    print("\n" + _report(rows, seconds))
    disagree = [(a["name"], _case_name(a), a["class"], b["class"])
                for a, b in zip(per_rank[0], per_rank[1]) if a["class"] != b["class"]]
    assert not disagree, f"the ranks classify these cases differently: {disagree}"
    known = known_open()
    failing = {r["name"] for r in rows if r["class"] in ("wrong", "crash")}
    ran = {r["name"] for r in rows if r["class"] in ("exact", "refused")}
    new = sorted(failing - set(known))
    fixed = sorted(n for n in known if n in ran and n not in failing)  # an unbuildable family proves nothing
    assert not new, (f"silently wrong or crashing (not in KNOWN_OPEN): {new}; run with -s for the table:\n"
                     + "\n".join(f"{r['name']} {_case_name(r)} {r['class']}: {_detail(r)}"
                                 for r in rows if r["name"] in new and r["class"] in ("wrong", "crash")))
    assert not fixed, f"KNOWN_OPEN lists families that now pass; remove them: {fixed}"
