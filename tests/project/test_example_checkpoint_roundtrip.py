"""examples/checkpoint_roundtrip.py runs at tiny size: checkpoint in, trained, transformers folder out."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_checkpoint_roundtrip_example_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "checkpoint_roundtrip.py"), "--out",
                           str(tmp_path), "--steps", "4", "--seq-len", "64"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"held-out loss with transformers: ([\d.]+) before, ([\d.]+) after", done.stdout)
    assert found, done.stdout[-2000:]
    before, after = map(float, found.groups())
    assert after < before  # the trained weights came back through from_pretrained
    assert os.path.isfile(tmp_path / "run" / "model" / "model.safetensors")
