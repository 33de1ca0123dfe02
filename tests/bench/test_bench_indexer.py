"""``seqmesh bench indexer`` at toy size: the picks' agreement it reports is the one plain Python sets give for the
same picks, the layers attend on, and a row too short to leave any key out is refused."""

from __future__ import annotations

import json

import pytest
import torch

from seqmesh.bench.indexer import IndexerBench, _agreement, bench_indexer
from seqmesh.tools.cli import main


def test_agreement_is_what_sets_of_the_picks_give():
    """Shares of picks kept, of queries kept whole, and the worst query's, over the queries that see more than k
    keys, against Python sets of the same random picks (some queries' picks identical, some not)."""
    g = torch.Generator().manual_seed(0)
    length, top = 40, 5
    a = torch.stack([torch.randperm(length, generator=g)[:top] for _ in range(2 * length)]).view(2, length, top)
    b = a.clone()
    changed = torch.rand(2, length, top, generator=g) < 0.1
    b[changed] = torch.randint(0, length, (int(changed.sum()),), generator=g)
    b = torch.stack([torch.stack([row if len(set(row.tolist())) == top else a[i, j] for j, row in enumerate(rows)])
                     for i, rows in enumerate(b)])  # a query's picks stay distinct, as top-k's are
    got = _agreement(a, b, length, top)
    kept = [len(set(x.tolist()) & set(y.tolist())) / top
            for x, y in zip(a[:, top:].reshape(-1, top), b[:, top:].reshape(-1, top))]
    assert got["queries"] == len(kept) == 2 * (length - top)
    assert got["same_picks"] == pytest.approx(sum(kept) / len(kept))
    assert got["same_queries"] == pytest.approx(sum(k == 1 for k in kept) / len(kept))
    assert got["worst"] == pytest.approx(min(kept)) and min(kept) < 1 == max(kept)


def test_each_indexed_layer_gets_a_row():
    rows = bench_indexer(IndexerBench(width=128, seq_len=96, layers=2, dsa_topk=16))
    assert [r["layer"] for r in rows] == [0, 1], rows
    for r in rows:
        assert r["queries"] == 96 - 16 and 0 < r["worst"] <= r["same_picks"] <= 1, r
        assert r["float32_s"] > 0 and r["bfloat16_s"] > 0, r


def test_the_cli_prints_json_and_refuses_a_row_without_a_choice(capsys):
    assert main(["bench", "indexer", "--width", "128", "--seq-len", "40", "--layers", "1", "--dsa-topk", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"]["seq_len"] == 40 and len(out["rows"]) == 1, out
    with pytest.raises(SystemExit, match="seq_len=16 is not above dsa_topk=16"):
        main(["bench", "indexer", "--width", "128", "--seq-len", "16", "--dsa-topk", "16"])
