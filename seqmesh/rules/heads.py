"""How Ulysses deals heads to ranks: the one rule the attention engine and the planner share.

Query heads go to Ulysses ranks in contiguous ranges, as evenly as possible (the first ``Hq % U``
ranks take one more). A rank needs exactly the kv heads its query heads read (query head h reads kv
head ``h // (Hq / Hkv)``), which is again a contiguous range. When the degree exceeds the kv heads,
neighbouring ranks need the same kv head: each source sends it to every rank that needs it and
nowhere else, so no rank receives a head it does not use. Torch-free: ``seqmesh plan`` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass


def even_split(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` contiguous groups, the first ``total % parts`` one larger."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class HeadDeal:
    """Which query and kv heads each of ``ulysses`` ranks works on."""

    q_heads: int
    kv_heads: int
    ulysses: int

    def __post_init__(self) -> None:
        if self.kv_heads < 1 or self.q_heads % self.kv_heads:
            raise ValueError(
                f"{self.q_heads} query heads cannot share {self.kv_heads} kv heads evenly; grouped-query "
                "attention needs the query heads to be a multiple of the kv heads."
            )
        if not 1 <= self.ulysses <= self.q_heads:
            divisors = [u for u in range(1, self.q_heads + 1) if self.q_heads % u == 0]
            raise ValueError(
                f"ulysses={self.ulysses} exceeds the {self.q_heads} query heads: each Ulysses rank needs at "
                f"least one head. Use ulysses <= {self.q_heads} (even splits: {divisors}) and put the rest "
                "of the sequence degree on the ring axis."
                if self.ulysses > self.q_heads else f"ulysses={self.ulysses}: the degree is at least 1."
            )

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q_heads // self.kv_heads

    def q_range(self, rank: int) -> tuple[int, int]:
        """``[first, end)`` of the query heads Ulysses rank ``rank`` works on."""
        sizes = even_split(self.q_heads, self.ulysses)
        start = sum(sizes[:rank])
        return start, start + sizes[rank]

    def kv_range(self, rank: int) -> tuple[int, int]:
        """``[first, end)`` of the kv heads those query heads read."""
        a, b = self.q_range(rank)
        return a // self.group, (b - 1) // self.group + 1

    def q_count(self, rank: int) -> int:
        a, b = self.q_range(rank)
        return b - a

    def kv_count(self, rank: int) -> int:
        a, b = self.kv_range(rank)
        return b - a

    def send_chunks(self) -> list[tuple[int, int, int]]:
        """Destination-major ``(tensor, first head, end head)`` for the packed (q, k, v) all-to-all."""
        chunks = []
        for u in range(self.ulysses):
            (qa, qb), (ka, kb) = self.q_range(u), self.kv_range(u)
            chunks += [(0, qa, qb), (1, ka, kb), (2, ka, kb)]
        return chunks

    def send_heads(self) -> list[int]:
        """Heads of the packed (q, k, v) send to each rank."""
        return [self.q_count(u) + 2 * self.kv_count(u) for u in range(self.ulysses)]

    def split_sends(self) -> tuple[tuple[list[tuple[int, int, int]], list[int]], tuple[list[tuple[int, int, int]], list[int]]]:
        """``((qk_chunks, qk_heads), (v_chunks, v_heads))``: the deal as two all-to-alls, q and k packed in
        one and v in the other, for heads whose value dim differs from the query's (MLA)."""
        ranks = range(self.ulysses)
        qk = ([c for c in self.send_chunks() if c[0] != 2], [self.q_count(u) + self.kv_count(u) for u in ranks])
        v = ([(0, ka, kb) for i, ka, kb in self.send_chunks() if i == 2], [self.kv_count(u) for u in ranks])
        return qk, v

    def query_sends(self) -> tuple[list[tuple[int, int, int]], list[int]]:
        """``(chunks, heads)`` of a query-shaped tensor's all-to-all (out, dout): each rank's query heads."""
        ranks = range(self.ulysses)
        return [(0, *self.q_range(u)) for u in ranks], [self.q_count(u) for u in ranks]

    @property
    def max_q(self) -> int:
        return max(self.q_count(u) for u in range(self.ulysses))

    @property
    def max_kv(self) -> int:
        return max(self.kv_count(u) for u in range(self.ulysses))

    @property
    def replicated(self) -> bool:
        """True when some kv head goes to more than one rank."""
        return sum(self.kv_count(u) for u in range(self.ulysses)) > self.kv_heads
