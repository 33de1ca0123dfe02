"""``prime_optimizer`` leaves AdamW's state as a real first step does, so the step measured after it holds the same
bytes: the rehearsal and the planner's measured peaks take their step that way instead of running a first one."""

from __future__ import annotations

import torch

from family_cases import build, family_config
from seqmesh.memory import MemoryTracker, prime_optimizer


def _tracked_step(model, optimizer, ids) -> dict:
    with MemoryTracker(model, optimizer) as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tracker.report().as_dict()


def test_the_state_and_the_next_steps_peak_are_a_real_first_steps():
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    reports, states = [], []
    for primed in (False, True):
        model = build(family_config("qwen3")).float()  # tied embeddings: one parameter, two uses
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if primed:
            prime_optimizer(model, optimizer)
        else:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        states.append({name: {k: (tuple(v.shape), v.dtype) for k, v in optimizer.state[p].items()}
                       for name, p in model.named_parameters()})
        reports.append(_tracked_step(model, optimizer, ids))
    assert states[0] == states[1] and all(states[0].values())
    assert reports[0] == reports[1], reports
