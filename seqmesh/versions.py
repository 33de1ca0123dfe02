"""The versions seqmesh is tested with, written once: the floors (pyproject.toml states the same ones),
the newest release checked, and the warning ``import seqmesh`` gives outside that range.

``make test`` runs the whole suite at the pinned versions of ``requirements/test.lock``; ``make
test-floor`` (CI runs both) runs a focused subset at the floors of ``requirements/floor.lock``. A floor
is the oldest release that passed that subset; the newest is the newest release that passed the whole
suite. Installed versions are read from package metadata, so nothing here imports torch.

``seqmesh versions`` prints the installed versions beside the tested range.
"""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Mapping

# package -> (oldest tested, newest tested)
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.9.1", "2.15.0"),
    "transformers": ("5.15.0", "5.24.0"),
    "accelerate": ("1.3.0", "1.15.0"),
}


class UntestedVersionWarning(UserWarning):
    """An installed torch, transformers or accelerate lies outside the range seqmesh is tested with."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``, ``"5.10.0rc1"``
    -> ``(5, 10, 0)``, ``"2.16.0.dev20261101"`` -> ``(2, 16, 0)``."""
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):  # "0rc1": the release ends here
            break
    return tuple(parts)


def installed_versions() -> dict[str, str]:
    """The installed version of each package in :data:`TESTED` (absent packages left out)."""
    found = {}
    for name in TESTED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def untested(installed: Mapping[str, str]) -> list[str]:
    """One sentence per installed package outside its tested range, naming both."""
    problems = []
    for name, version in installed.items():
        oldest, newest = TESTED[name]
        if release(version) < release(oldest):
            problems.append(f"{name} {version} is older than seqmesh's tested range {oldest} - {newest}: "
                            f"upgrade it (pip install '{name}>={oldest}')")
        elif release(version)[:2] > release(newest)[:2]:  # a later patch of the newest minor is fine
            problems.append(f"{name} {version} is newer than seqmesh's tested range {oldest} - {newest}: "
                            f"it may work; if anything fails, try {name}=={newest}")
    return problems


def require(name: str, what: str) -> None:
    """Refuse to run ``what`` with ``name`` older than its tested floor (a hard floor: below it something
    fails or trains differently; see pyproject.toml). Nothing happens when ``name`` is not installed."""
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return
    oldest = TESTED[name][0]
    if release(version) < release(oldest):
        raise ValueError(f"{what} needs {name} >= {oldest} (installed: {version}); "
                         f"upgrade it: pip install '{name}>={oldest}'.")


def warn_if_untested() -> None:
    """Warn once per process (``import seqmesh`` calls this) for every package outside its range."""
    for problem in untested(installed_versions()):
        warnings.warn(problem, UntestedVersionWarning, stacklevel=3)


def report() -> int:
    """Print the installed versions beside the tested range (``seqmesh versions``); 1 if any is outside."""
    installed = installed_versions()
    for name, (oldest, newest) in TESTED.items():
        print(f"{name:14s} installed {installed.get(name, '-'):18s} tested {oldest} - {newest}")
    problems = untested(installed)
    for problem in problems:
        print(f"seqmesh: warning: {problem}")
    return 1 if problems else 0
