"""``seqmesh generate`` as issue 48's contract writes it: torchrun, a checkpoint folder, a JSON prompt file, --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from family_cases import build, family_config
from planner_cases import in_process


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny float64 Llama checkpoint folder, a batch of two prompts of 37 ids, and transformers' greedy tokens."""
    root = tmp_path_factory.mktemp("generate")
    model = build(family_config("llama"))
    model.save_pretrained(root / "model")
    prompt = torch.randint(3, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    (root / "prompt.json").write_text(json.dumps(prompt.tolist()))
    theirs = model.generate(prompt, max_new_tokens=5, do_sample=False)[:, 37:]  # its own end and pad ids
    return root, theirs.tolist()


@pytest.mark.parametrize("chunked", [[], ["--prefill-chunk", "16"]], ids=["at-once", "chunks"])
def test_torchrun_generates_the_tokens_transformers_does(folder, chunked):
    """As the contract writes it; and the prompt prefilled 16 tokens a call (16, 16, 5), each chunk onto the kept
    cache: the same tokens and shares (the last chunk's zigzag gives its tokens 2 and 3, the decode evens them)."""
    root, theirs = folder
    for attempt in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "seqmesh", "generate",
             "--model", str(root / "model"), "--prompt-ids", str(root / "prompt.json"), "--max-new-tokens", "5",
             "--ulysses", "2", "--dtype", "fp64", "--json", *chunked],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        # a rank aborted by the C++ runtime ("terminate called without an active exception", SIGABRT) under the full
        # suite's load, three times in seven full suites, after loading its weights; never alone (28
        # runs, 16 under a two-core load): run once more, so that the test fails on anything else and on a second
        # abort (docs/testing.md, the known aborts)
        if done.returncode == 0 or "terminate called without an active exception" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["tokens"] == theirs, (summary, theirs)
    assert summary["prompt_tokens"] == 74 and len(summary["cache_bytes_per_rank"]) == 2
    # 2 rows x 2 layers x 2 key heads x (8 + 8) values x 8 bytes a token; 37 + 4 tokens kept (the last one drawn is
    # never run), 21 on the rank that took the first new one, 20 on the other
    assert summary["cache_bytes_per_rank"] == [21 * 2 * 2 * 2 * 16 * 8, 20 * 2 * 2 * 2 * 16 * 8], summary
    assert bool(summary["schedules"]) == bool(chunked), summary


@pytest.mark.parametrize("prompt, args, said", [
    ("[[1, 2, 3], [4, 5]]", [], "a batch needs prompts of one length"),
    ("[1, 2, 64]", [], "holds token id 64, but"),
    ("[1, 2,", [], "is not JSON"),
    ("[]", [], "non-empty JSON list"),
    ("[1, 2, 3]", ["--temperature", "-1"], "temperature=-1.0 must be 0 (greedy) or positive"),
    ("[1, 2, 3]", ["--max-new-tokens", "0"], "generate at least 1 token"),
    ("[1, 2, 3]", ["--prefill-chunk", "0"], "--prefill-chunk 0: give a positive number"),
    ("[1, 2, 3]", ["--tp", "0"], "--tp 0: each degree is at least 1"),
], ids=["ragged", "id-past-vocab", "not-json", "empty", "temperature", "no-tokens", "no-chunk", "no-tp"])
def test_bad_input_is_refused_by_name_before_any_model(folder, tmp_path, prompt, args, said):
    root, _ = folder
    (tmp_path / "p.json").write_text(prompt)
    done = in_process(["generate", "--model", str(root / "model"), "--prompt-ids", str(tmp_path / "p.json"),
                       "--max-new-tokens", "3", *args])
    assert done.returncode == 2 and "seqmesh: error:" in done.stderr and said in done.stderr, done.stderr
