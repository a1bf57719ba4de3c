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


# session 9: SELECT 2 (`_topk_fused`): every program scores and counts its keys in three histograms (top 11 bits, top
# 16, the 21-bit prefix folded), the last to arrive at the row's counter reads the threshold off them (scanning the
# keys only when the boundary bucket is not taken whole), a second launch places the selection in parallel
FUSED = dict(ALL_KEYS, SELECT=2, SPLITS=4, SELECT_TILE=64, SELECT_SCAN=64, SELECT_WB=16, SELECT_PARTS=4)


def _zeroed_after():
    from codegen.triton import _topk_fused
    return all(int(b.abs().sum()) == 0 for b in list(_topk_fused._ZEROED.values()) + _topk_fused._RETIRED)


@pytest.mark.parametrize("cfg", [FUSED, dict(FUSED, SELECT_PARTS=1, SPLITS=1)], ids=["parts", "one_program"])
def test_select2_contexts_below_and_above_topk(cfg):
    """Contexts below, at and above top-k and a ragged prefill: exactly the reference's positions and pool rows;
    the histograms and counters are zero again after every launch pair (the next launch relies on it)."""
    b = _batch(50, [(5, 1), (16, 1), (17, 1), (90, 3), (150, 1)])
    got = _run(b, config=cfg)
    _check(got, b)
    assert torch.equal(got, _reference(b))
    assert _zeroed_after()
    rows = _run(b, config=cfg, output="rows")
    assert rows.tolist() == [[paged_row(b["tbl"], b["bs"], int(r), s) if s >= 0 else -1 for s in row.tolist()]
                             for r, row in zip(b["tr"], got)]
    assert _zeroed_after()


@pytest.mark.parametrize("cfg", [FUSED, dict(FUSED, SELECT_WB=16, SELECT_TILE=16, SELECT_SCAN=16)],
                         ids=["work_row", "streamed"])
def test_select2_exact_ties_and_huge_boundary_bucket(cfg):
    """Six distinct keys: scores tie in large groups, the boundary bucket is never taken whole by the histograms and
    overflows the 16-key work row (8-bit passes over every key); ties go to the lower position, exactly."""
    g = torch.Generator().manual_seed(51)
    distinct = torch.randint(-4, 5, (6, DI), generator=g).float()
    tied = _batch(52, [(90, 2), (200, 1)], keys=distinct[torch.randint(0, 6, (3 + 200 + 5 + 95,), generator=g)],
                  q=torch.randint(-4, 5, (3, HI, DI), generator=g).float())
    got = _run(tied, config=cfg)
    _check(got, tied, tol=0.0)
    assert torch.equal(got, _reference(tied))
    assert _zeroed_after()


@pytest.mark.parametrize("twin", [False, True], ids=["21_bit_histogram", "folded_bucket_scanned"])
def test_select2_boundary_below_16_bits_and_a_folded_bucket(twin):
    """Scores built exactly (q = e0 + e1 in every head, w = 1): 15 keys score 4, one B = 1 + 2^-9, twenty A = 1,
    the rest below 1/2. The 16th largest (B) shares its top 16 key bits with every A, so the 21-bit histogram decides.
    With a twin of B scaled by 2^-16 (same mantissa: its 21-bit prefix folds onto B's bin) the folded counts
    disagree with the 16-bit bucket's and the last program scans the keys instead. Both: positions 0..14 and 20."""
    ctx, topk = 60, 16
    g = torch.Generator().manual_seed(55)
    keys = torch.zeros(3 + ctx + 5, DI)
    keys[3:3 + ctx, 0] = torch.rand(ctx, generator=g) * 0.5
    keys[3:3 + 15, 0] = 4.0
    keys[3 + 20, 0], keys[3 + 20, 1] = 1.0, 2.0 ** -9
    keys[3 + 30:3 + 50, 0] = 1.0
    if twin:
        keys[3 + 55, 0], keys[3 + 55, 1] = 2.0 ** -16, 2.0 ** -25
    q = torch.zeros(1, HI, DI)
    q[..., :2] = 1.0
    b = _batch(56, [(ctx, 1)], keys=keys, q=q)
    b["w"] = torch.ones(1, HI)
    want = list(range(15)) + [20]
    # the scanned bucket (B + 20 A): its largest by one masked maximum over the row in registers (SELECT_SCAN 64 >= the
    # row); gathered into a 32-key work row (a row scanned in two steps); 8-bit passes over every key (WB 16)
    for cfg in (dict(FUSED, SELECT_SCAN=64), dict(FUSED, SELECT_WB=32, SELECT_SCAN=32), dict(FUSED, SELECT_SCAN=32)):
        got = _run(b, topk=topk, config=cfg)
        assert got[0].tolist() == want, (cfg, got[0].tolist())
        assert torch.equal(got, _reference(b, topk=topk))
    assert _zeroed_after()


@pytest.mark.parametrize("topk,pick,scan", [(16, 16, 128), (48, 16, 128), (16, 4, 128), (16, 16, 64), (16, 0, 128)],
                         ids=["max_passes", "min_passes", "too_many_passes", "row_over_tiles", "pick_off"])
def test_select2_tied_boundary_bucket(topk, pick, scan):
    """A boundary bucket of 40 exactly tied keys (identical index rows: one score, the key's low bits the position)
    below 10 keys: the selection is the 10 and the tied keys at the lowest positions. The last program takes the
    threshold from the row held in registers (SELECT_SCAN 128 >= the row) by 6 masked maxima (top-16: 6 of the 40) or
    3 minima (top-48: 38 of 40), or gathers the bucket into the work row for 8-bit steps: more passes than SELECT_PICK
    allows, a row scanned in two steps, or SELECT_PICK 0. All exact."""
    ctx = 100
    g = torch.Generator().manual_seed(58)
    keys = torch.zeros(3 + ctx + 5, DI)
    keys[3:3 + ctx, 0] = torch.rand(ctx, generator=g) * 0.5
    top = torch.cat([torch.tensor([ctx - 1]), torch.randperm(ctx - 1, generator=g)[:49]])  # a top key last: an
    keys[3 + top[:10], 0] = 4.0   # extra tied key selected would push it out of the position-ordered top-k
    keys[3 + top[10:], 0] = 1.0
    q = torch.zeros(1, HI, DI)
    q[..., 0] = 1.0
    b = _batch(59, [(ctx, 1)], keys=keys, q=q)
    b["w"] = torch.ones(1, HI)
    want = sorted(top[:10].tolist() + sorted(top[10:].tolist())[:topk - 10])
    got = _run(b, topk=topk, config=dict(FUSED, SELECT_WB=64, SELECT_PICK=pick, SELECT_SCAN=scan))
    assert got[0].tolist() == want
    assert torch.equal(got, _reference(b, topk=topk))
    assert _zeroed_after()


def test_select2_pick_passes_and_scan_step_are_checked():
    b = _batch(54, [(40, 1)])
    with pytest.raises(ValueError, match="SELECT_PICK in 0..64"):
        _run(b, config=dict(FUSED, SELECT_PICK=65))
    with pytest.raises(ValueError, match="SELECT_SCAN must be powers of two"):
        _run(b, config=dict(FUSED, SELECT_SCAN=100))


def test_select2_mxfp4_keys_and_float64_scores():
    """MXFP4 keys; the float64 formula (`_check`: every selected score >= the topk-th, every other <=) and the IR
    reference agree with SELECT 2."""
    b = _batch(53, [(9, 1), (60, 3), (140, 1)], key_format="mxfp4")
    got = _run(b, config=FUSED)
    _check(got, b)
    assert torch.equal(got, _reference(b))


def test_select2_needs_every_key_a_candidate():
    b = _batch(54, [(40, 1)])
    with pytest.raises(ValueError, match="KT == BLOCK_N"):
        _run(b, config=dict(FUSED, KT=8))


def test_select2_on_the_gpu_and_in_graph_replays():
    """GPU only (tensor-core dots, PDL, the counter protocol across real concurrent programs): SELECT 2 at a few
    thousand keys selects exactly the reference's positions, and 20 replays of one captured call equal eager
    (a race in the arrival / zeroing protocol or the PDL contract would show as a mismatch)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: the interpreter runs programs one after another")
    from codegen.triton.indexer_topk import heuristic
    b = _batch(57, [(3000, 1), (2200, 2), (700, 1)])
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) and k not in ("qd", "kd") else v) for k, v in b.items()}
    cfg = dict(heuristic({"T": 4, "L": 3000, "K": 64, "HI": HI, "DI": DI}, "h200"), SELECT=2, KT=128, BLOCK_N=128,
               num_warps=8, SELECT_PARTS=16)
    want = _run(dev, topk=64, config=cfg)
    assert torch.equal(want.cpu(), _reference(b, topk=64))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = _run(dev, topk=64, config=cfg)
    for _ in range(20):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert _zeroed_after()
