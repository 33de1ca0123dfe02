"""The tested range is written once (seqmesh/versions.py) and agrees with pyproject.toml and the lock."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from seqmesh.versions import TESTED, UntestedVersionWarning, installed_versions, release, require, untested

ROOT = Path(__file__).resolve().parents[2]


def test_release_parses_local_pre_and_dev_versions():
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("5.10.0rc1") == (5, 10, 0)
    assert release("2.16.0.dev20261101") == (2, 16, 0)
    assert release("1.1") == (1, 1)


def test_outside_the_range_names_installed_and_tested_versions():
    oldest, newest = TESTED["torch"]
    assert untested({"torch": oldest}) == [] and untested({"torch": newest}) == []
    major, minor = release(newest)[:2]
    assert untested({"torch": f"{major}.{minor}.9"}) == []  # a later patch of the newest minor
    (older,) = untested({"torch": "2.6.0"})
    assert "2.6.0" in older and oldest in older and "older" in older
    (newer,) = untested({"torch": f"{major}.{minor + 1}.0"})
    assert f"{major}.{minor + 1}.0" in newer and newest in newer and "newer" in newer


def test_import_warns_once_outside_the_range(tmp_path):
    """A fake distribution of torch 2.6.0 first on the path: ``import seqmesh`` warns, naming it."""
    info = tmp_path / "torch-2.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.6.0\n")
    done = subprocess.run([sys.executable, "-c", "import seqmesh"], capture_output=True, text=True,
                          env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": ""}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("UntestedVersionWarning") == 1 and "torch 2.6.0" in done.stderr, done.stderr


def test_below_the_floor_the_hf_entry_points_refuse(monkeypatch):
    import seqmesh.versions as versions

    monkeypatch.setattr(versions.metadata, "version", lambda name: "5.14.1")
    with pytest.raises(ValueError, match=r"seqmesh.hf needs transformers >= 5\.15\.0 \(installed: 5\.14\.1\)"):
        require("transformers", "seqmesh.hf")
    monkeypatch.setattr(versions.metadata, "version", lambda name: TESTED[name][0])
    require("transformers", "seqmesh.hf")  # the floor itself runs


def test_this_environment_is_inside_the_range():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntestedVersionWarning)
        assert untested(installed_versions()) == []


def test_pyproject_floors_are_the_tested_floors():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    floors = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", req.split(";")[0].strip())
        if match and match.group(1) in TESTED:
            floors.setdefault(match.group(1), set()).add(match.group(2))
    assert floors == {name: {oldest} for name, (oldest, _) in TESTED.items()}


def test_floor_lock_pins_the_floors_and_test_lock_lies_in_the_range():
    def pins(path):
        found = {}
        for line in (ROOT / path).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                name, version = line.split("==")
                found[name.strip().lower()] = version.strip()
        return found

    floor = pins("requirements/floor.lock")
    for name, (oldest, _) in TESTED.items():
        assert release(floor[name]) == release(oldest), (name, floor[name], oldest)
    locked = pins("requirements/test.lock")
    assert untested({name: locked[name] for name in TESTED if name in locked}) == []
