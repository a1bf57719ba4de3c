"""The indexer top-k's parallel configs (codegen/triton/_topk_parallel.py through indexer_topk.py): the
pre-selection before the merge (FILTER 1, `_filter_kernel`) and the parallel threshold + placement (SELECT 1,
`_select_kernel` / `_place_kernel`), vs `ir/ref/indexer.py` and a float64 formula (CPU: Triton interpreter).
Batch builders, configs and checks come from test_indexer_kernels.py (the serial merge's tests)."""

from __future__ import annotations

import pytest
import torch

try:
    from tests.helpers import paged_row
    from tests.test_indexer_kernels import ALL_KEYS, DI, HI, PAIRS, SMALL, _batch, _check, _reference, _run
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import paged_row
    from test_indexer_kernels import ALL_KEYS, DI, HI, PAIRS, SMALL, _batch, _check, _reference, _run


# session 6: parallel pre-selection (FILTER: the merges run over the survivors of a 22-bit radix
# pre-select), next tile in flight (PREFETCH), both with per-tile candidates (rescore: disjoint `ext`)
FILTERED = [dict(PAIRS, FILTER=1, FILTER_PARTS=2, PREFETCH=1), dict(ALL_KEYS, FILTER=1, FILTER_PARTS=8),
            dict(SMALL, FILTER=1, FILTER_PARTS=4, MERGE_TILE=16)]


@pytest.mark.parametrize("cfg", FILTERED[:2], ids=["pairs_prefetch", "all_keys"])
def test_filtered_merge_contexts_below_and_above_topk(cfg):
    """Contexts below, at and above top-k (decode) and a ragged prefill: the pre-selected merge gives
    exactly the reference's selection, positions and rows."""
    b = _batch(30, [(5, 1), (16, 1), (17, 1), (90, 3), (150, 1)])
    stats = {}
    got = _run(b, config=cfg, stats=stats)
    assert 0 < stats["filter_kept"] < stats["filter_candidates"], stats   # the pre-selection drops candidates
    _check(got, b)
    assert torch.equal(got, _reference(b))
    rows = _run(b, config=cfg, output="rows")
    assert rows.tolist() == [[paged_row(b["tbl"], b["bs"], int(r), s) if s >= 0 else -1 for s in row.tolist()]
                             for r, row in zip(b["tr"], got)]


@pytest.mark.parametrize("cfg", [FILTERED[2], dict(PAIRS, PREFETCH=1)], ids=["small_streamed", "prefetch"])
def test_filtered_merge_overflow_and_ties(cfg):
    """Clustered winners (tiles overflow and are rescored: their non-candidate keys join the survivors) and
    exact ties across the boundary (the lower positions win) through the pre-selection."""
    g = torch.Generator().manual_seed(31)
    q = torch.randn(3, HI, DI, generator=g)
    keys = torch.randn(3 + 200 + 5, DI, generator=g) * 0.1
    keys[3 + 64: 3 + 96] = q[0].mean(0) * 3 + torch.randn(32, DI, generator=g) * 0.1
    b = _batch(32, [(200, 3)], keys=keys, q=q)
    stats = {}
    got = _run(b, config=cfg, stats=stats)
    assert stats["overflowed_rows"] > 0, stats
    _check(got, b)
    assert torch.equal(got, _reference(b))
    distinct = torch.randint(-4, 5, (6, DI), generator=g).float()
    tied = _batch(33, [(90, 2)], keys=distinct[torch.randint(0, 6, (3 + 90 + 5,), generator=g)],
                  q=torch.randint(-4, 5, (2, HI, DI), generator=g).float())
    got = _run(tied, config=cfg)
    _check(got, tied, tol=0.0)
    assert torch.equal(got, _reference(tied))


def test_filtered_merge_mxfp4_keys():
    b = _batch(34, [(9, 1), (60, 3), (140, 1)], key_format="mxfp4")
    got = _run(b, config=FILTERED[0])
    _check(got, b)
    assert torch.equal(got, _reference(b))


# session 7: parallel threshold (SELECT: programs per part of the candidates append their survivors, the last
# to arrive radix-selects over them; placement in parallel), per-program first-digit histogram (HIST)
SELECTED = [dict(ALL_KEYS, SELECT=1, SELECT_PARTS=4, HIST=1), dict(PAIRS, SELECT=1, SELECT_PARTS=2, PREFETCH=1),
            dict(SMALL, SELECT=1, SELECT_PARTS=4, SELECT_RES=16, MERGE_TILE=16)]


@pytest.mark.parametrize("cfg", SELECTED, ids=["all_keys_hist", "pairs", "streamed_fallback"])
def test_parallel_select_contexts_ties_and_overflow(cfg):
    """Contexts below, at and above top-k, a ragged prefill, clustered winners (overflowed tiles: PHASE 2 over
    the survivors) and exact ties across the boundary (the lower positions win): exactly the reference,
    positions and rows; RES 16 sends the last arriver through its streamed (non-resident) passes."""
    b = _batch(40, [(5, 1), (16, 1), (17, 1), (90, 3), (150, 1)])
    stats = {}
    got = _run(b, config=cfg, stats=stats)
    assert 0 < stats["filter_kept"] < stats["filter_candidates"], stats   # survivors are a strict subset
    _check(got, b)
    assert torch.equal(got, _reference(b))
    g = torch.Generator().manual_seed(41)
    if cfg.get("SELECT_RES", 4096) < 4096:   # the streamed passes: the clustered case below only (CPU time)
        return _check_clustered_select(cfg, g)
    rows = _run(b, config=cfg, output="rows")
    assert rows.tolist() == [[paged_row(b["tbl"], b["bs"], int(r), s) if s >= 0 else -1 for s in row.tolist()]
                             for r, row in zip(b["tr"], got)]
    distinct = torch.randint(-4, 5, (6, DI), generator=g).float()
    tied = _batch(42, [(90, 2)], keys=distinct[torch.randint(0, 6, (3 + 90 + 5,), generator=g)],
                  q=torch.randint(-4, 5, (2, HI, DI), generator=g).float())
    got = _run(tied, config=cfg)
    _check(got, tied, tol=0.0)
    assert torch.equal(got, _reference(tied))
    if cfg["KT"] < cfg["BLOCK_N"]:
        _check_clustered_select(cfg, g)


def _check_clustered_select(cfg, g):
    """Winners clustered in a few tiles: they overflow, PHASE 2 re-selects over the survivors + rescored keys."""
    q = torch.randn(1, HI, DI, generator=g)
    keys = torch.randn(3 + 200 + 5, DI, generator=g) * 0.1
    keys[3 + 64: 3 + 96] = q[0].mean(0) * 3 + torch.randn(32, DI, generator=g) * 0.1
    clustered = _batch(43, [(200, 1)], keys=keys, q=q)
    stats = {}
    got = _run(clustered, config=cfg, stats=stats)
    assert stats["overflowed_rows"] > 0, stats
    _check(got, clustered)
    assert torch.equal(got, _reference(clustered))


def test_parallel_select_mxfp4_keys():
    b = _batch(44, [(9, 1), (60, 3), (140, 1)], key_format="mxfp4")
    got = _run(b, config=SELECTED[0])
    _check(got, b)
    assert torch.equal(got, _reference(b))
