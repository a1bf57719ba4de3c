"""benches/_gather_ceiling.py, the measuring stick of bench_mla_b64.py --gather (the bandwidth a sparse MLA row gather
reaches on its own): its kernel reads exactly the selected rows' bytes (an xor of their int32 words per program equals
numpy's over the same rows, and a row moved by one changes it) for several pieces / rows a step; bad shapes refused."""

import pytest
import torch

from benches._gather_ceiling import gather_xor, reference_xor


def _inputs(seed, T=3, N=1024, K=128, W=576):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (N, W), dtype=torch.uint8, generator=g)
    rows = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return pool, rows


@pytest.mark.parametrize("pieces,R", [(1, 32), (2, 32), (4, 32), (2, 64)])
def test_gather_xor_reads_the_selected_rows(pieces, R):
    pool, rows = _inputs(pieces * 10 + R)
    want = reference_xor(pool, rows, pieces)
    assert torch.equal(gather_xor(pool, rows, pieces=pieces, R=R)(), want)
    moved = rows.clone()
    moved[1, 7] = (moved[1, 7] + 1) % pool.shape[0]
    got = gather_xor(pool, moved, pieces=pieces, R=R)()
    assert not torch.equal(got, want) and torch.equal(got, reference_xor(pool, moved, pieces))


def test_gather_xor_refuses_bad_shapes():
    pool, rows = _inputs(1)
    with pytest.raises(ValueError, match="K 128 / pieces 3"):
        gather_xor(pool, rows, pieces=3)
    with pytest.raises(ValueError, match="row width 560"):
        gather_xor(torch.zeros(64, 560, dtype=torch.uint8), rows[:, :32] % 64, pieces=1, R=32)
