"""Point-to-point exchange around a ring: send ``shift`` ranks ahead, receive from as far behind.

This is the only communication ring attention does. The schedule (what travels at which step) lives
in ``seqmesh.sharded_attention.ring``; here is only the mechanics, asynchronous so the caller can compute
while a block is in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .stats import record


class Pending:
    """A send/receive pair in flight; :meth:`wait` returns the received tensor."""

    def __init__(self, works: list[dist.Work], sent: torch.Tensor, received: torch.Tensor):
        self._works = works
        self._sent = sent  # kept alive until the send has completed
        self._received = received

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works = []
        self._sent = None
        return self._received


class RingExchange:
    """Moves tensors around ``group``: rank r sends to ``r + shift`` and receives from ``r - shift``
    (mod the group size); ``shift=1`` rotates one step.

    ``tag`` keeps two exchanges that are in flight at the same time (K/V blocks and their
    gradients) apart on transports that match messages by tag.
    """

    def __init__(self, group: dist.ProcessGroup, phase: str, tag: int = 0):
        self.group = group
        self.phase = phase
        self.tag = tag
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def start(self, tensor: torch.Tensor, shift: int = 1) -> Pending:
        """Post ``tensor`` to rank ``r + shift`` and a receive of the same shape from ``r - shift``."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        to, source = (self.rank + shift) % self.size, (self.rank - shift) % self.size
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=to, tag=self.tag),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=source, tag=self.tag),
        ]
        works = dist.batch_isend_irecv(ops)
        nbytes = tensor.numel() * tensor.element_size()
        record("p2p", self.phase, nbytes, nbytes)
        return Pending(works, tensor, received)
