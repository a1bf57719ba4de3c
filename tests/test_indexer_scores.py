"""The indexer's materialised-scores path (SCORES 1: `codegen/triton/_indexer_scores.py`, then SELECT 1 over the
int32 score rows, `_topk_parallel` with SRC32, BUCKET 1, `_topk_bucket` (SURV: `_topk_slots`), or
BUCKET 3, `_topk_bucket_place`; TMA: FP8 key tiles through a tensor descriptor, `_scores_tma_kernel`) vs
`ir/ref/indexer.py` (exact, ties to the lower position) and a float64 formula (CPU: Triton interpreter, fp32). Batch
builders and checks come from test_indexer_kernels.py. CI cost: the select paths on tied scores run over one stored
score pass (`scores_in`), each path once at the smallest sizes that reach it."""

from __future__ import annotations

import pytest
import torch

try:
    from tests.helpers import paged_row
    from tests.test_indexer_kernels import DI, HI, _batch, _check, _reference, _run
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import paged_row
    from test_indexer_kernels import DI, HI, _batch, _check, _reference, _run

from codegen.triton.indexer_topk import TEMPLATES, heuristic

# a last arriver holding its survivors in registers (SELECT_RES 256) or streaming them (16: more survivors than
# that); one part per row
SCORES = dict(BLOCK_N=64, KT=64, SPLITS=4, num_warps=4, num_stages=1, MERGE_TILE=256, CAND=0, DOT=0, SCORES=1,
              SELECT=1, SELECT_PARTS=4, SELECT_RES=256)
# BUCKET 1 (`_topk_bucket`): the boundary bucket in registers (SELECT_RES 256) or streamed (16), one part per row
BUCKET = dict(SCORES, BUCKET=1)
# TMA 3: key tiles through a tensor descriptor (boxes of one block, 8 rows here), 3 stages, block-table entries
# TMA_J at a time (2: several vectors per program); GATHER_SPLITS: the gathered tiles' programs where no descriptor fits
TMA = dict(BUCKET, TMA=3, TMA_J=2, SPLITS=3, GATHER_SPLITS=2)
# BUCKET 3: the placement parts finish the threshold over the bucket in registers / streamed (ZERO: no memset)
BUCKET3 = dict(BUCKET, BUCKET=3)
# BUCKET 1 with SURV (`_topk_slots`: the parts keep their survivors and the bucket in slots of their own, 64 a part
# here) and ZERO (no memset)
SURV = dict(BUCKET, SURV=1, ZERO=1)
STREAMED = dict(SELECT_RES=16, SELECT_PARTS=8, MERGE_TILE=64)
VARIANTS = [SCORES, dict(SCORES, **STREAMED), BUCKET, dict(BUCKET, **STREAMED),
            dict(BUCKET, BLOCK_N=32, KT=32, SPLITS=3, SELECT_PARTS=1), TMA, BUCKET3, dict(BUCKET3, ZERO=1, **STREAMED),
            SURV]
IDS = ["resident", "streamed", "bucket_resident", "bucket_streamed", "bucket_bn32_one_part", "tma", "bucket3_resident",
       "bucket3_streamed_zero", "bucket_surv_zero"]
SELECTS = [c for c in VARIANTS if c["BLOCK_N"] == 64 and not c.get("TMA")]   # every select path, BLOCK_N 64


def _rows_of(b, sel):
    return [[paged_row(b["tbl"], b["bs"], int(r), s) if s >= 0 else -1 for s in row.tolist()]
            for r, row in zip(b["tr"], sel)]


@pytest.mark.parametrize("cfg", VARIANTS, ids=IDS)
def test_decode_ragged_contexts(cfg):
    """One token per request, contexts below, at and just above topk and far above (several tiles and parts, a
    partial last tile): exactly the reference's selection, as positions and (one config per select kernel, ZERO's
    second call over the counts its first left at zero) as pool rows."""
    from codegen.triton import _gemv
    topk = 48
    b = _batch(40 + len(str(cfg)), [(9, 1), (48, 1), (49, 1), (300, 1), (1000, 1), (1777, 1)])
    want = _reference(b, topk)
    got = _run(b, topk, config=cfg)
    _check(got, b, topk)
    assert torch.equal(got, want)
    if cfg in (SCORES, BUCKET) or cfg.get("ZERO"):
        assert _run(b, topk, config=cfg, output="rows").tolist() == _rows_of(b, want)
    if cfg.get("ZERO"):
        assert _gemv._COUNTERS and all(int(buf.abs().sum()) == 0 for buf in _gemv._COUNTERS.values())


def test_prefill_rows_and_mxfp4_keys():
    """Several tokens of one request (each row its own causal context) and MXFP4 keys (TMA configs: the gathered
    tiles); TMA with one vector of block-table entries per program."""
    for fmt in ("fp8", "mxfp4"):
        b = _batch(50, [(400, 5), (130, 2)], key_format=fmt)
        for cfg in (SCORES, dict(TMA, TMA_J=128, SPLITS=2)):
            got = _run(b, 32, config=cfg)
            _check(got, b, 32)
            assert torch.equal(got, _reference(b, 32)), (fmt, cfg)


def test_tma_carried_table_entries_and_private_histograms():
    """TMA_CARRY 1 (each box's block-table entry a scalar carried one box ahead) and TMA_PRIV 1 (each score program
    counts into its own histogram, added to the row's once): programs with many boxes, with none (a context of 5 boxes
    over 8 programs) and rows at or below topk, at 3 and 4 stages: the reference's selection, and the private
    histograms all zero again after the launches."""
    from codegen.triton import _gemv, _indexer_scores

    b = _batch(61, [(300, 1), (33, 1), (20, 1)])
    want = _reference(b, 32)
    for cfg in (dict(TMA, TMA_CARRY=1, SPLITS=8), dict(TMA, TMA_CARRY=1, TMA=4), dict(TMA, TMA_PRIV=1, SPLITS=8),
                dict(TMA, TMA_CARRY=1, TMA_PRIV=1, SPLITS=8)):
        got = _run(b, 32, config=cfg)
        _check(got, b, 32)
        assert torch.equal(got, want), cfg
    assert _gemv._COUNTERS and all(int(buf.abs().sum()) == 0 for buf in _gemv._COUNTERS.values())
    assert not hasattr(_indexer_scores, "_PRIVATE")   # the private histograms come from the counter sets


def _args(b, topk):
    return (b["q8"], b["qs"], b["w"], b["k"], b["ks"], b["tp"], b["tr"], b["tbl"], b["bs"], topk)


def _every_select(b, topk):
    """Each select path (`SELECTS`) over one stored score pass (the `scores_in` hook)."""
    from codegen.triton.indexer_topk import indexer_topk
    st = {}
    indexer_topk(*_args(b, topk), config=SCORES, stop_after="score", stats=st)
    return [indexer_topk(*_args(b, topk), config=cfg, scores_in=st["scores"]) for cfg in SELECTS]


def test_ties_go_to_the_lower_position():
    """Integer-valued data from six distinct key rows: scores tie exactly in fp32 and float64, and the tied group
    straddling the boundary (the boundary bucket: in registers or streamed) is taken from its lowest positions, by
    every select path."""
    g = torch.Generator().manual_seed(51)
    distinct = torch.randint(-4, 5, (6, DI), generator=g).float()
    keys = distinct[torch.randint(0, 6, (3 + 300 + 5,), generator=g)]
    b = _batch(52, [(300, 3)], keys=keys, q=torch.randint(-4, 5, (3, HI, DI), generator=g).float())
    want = _reference(b, 40)
    got = _run(b, 40, config=BUCKET)
    _check(got, b, 40, tol=0.0)
    assert torch.equal(got, want)
    for cfg, got in zip(SELECTS, _every_select(b, 40)):
        assert torch.equal(got, want), cfg


def test_every_score_equal_selects_the_first_positions():
    """One key row everywhere: every score ties, the first-digit bucket holds the whole row (every position a
    survivor), and the selection is the first topk positions."""
    g = torch.Generator().manual_seed(53)
    keys = torch.randn(1, DI, generator=g).expand(3 + 305 + 155, DI).clone()
    b = _batch(54, [(300, 1), (150, 1)], keys=keys)
    want = torch.arange(32).expand(2, 32)
    assert torch.equal(_reference(b, 32), want)
    for cfg, got in zip(SELECTS, _every_select(b, 32)):
        assert torch.equal(got, want), cfg


def test_rows_split_into_workspace_chunks(monkeypatch):
    """A workspace too small for every row: the rows run in chunks, same selection (BUCKET 3 / SURV + ZERO: the
    zeroed counts reused chunk after chunk)."""
    from codegen.triton import indexer_topk as mod
    b = _batch(55, [(500, 1), (260, 1), (90, 1), (700, 1)])
    want = _reference(b, 32)
    monkeypatch.setattr(mod, "WORKSPACE_BYTES", 30_000)
    for cfg in (SCORES, dict(TMA, BUCKET=3, ZERO=1), SURV):
        assert torch.equal(_run(b, 32, config=cfg), want), cfg


def test_select_alone_over_stored_scores():
    """The bench hooks: a score pass's stored rows (stop_after="score", stats) fed back through `scores_in` give
    the full launcher's selection (BUCKET 1 / 3: also its launches' prefixes run), for every select kernel."""
    from codegen.triton.indexer_topk import indexer_topk
    b = _batch(57, [(700, 1), (40, 1), (333, 1)])
    want = _reference(b, 32)
    args = _args(b, 32)
    for cfg in (SCORES, BUCKET, BUCKET3, SURV):
        st = {}
        indexer_topk(*args, config=cfg, stop_after="score", stats=st)
        assert torch.equal(indexer_topk(*args, config=cfg, scores_in=st["scores"]), want), cfg
        for stop in ("memset", "bucket", "threshold")[:2 if cfg is BUCKET3 else 3 if cfg is not SCORES else 0]:
            indexer_topk(*args, config=cfg, scores_in=st["scores"], stop_after=stop)
        sc, hist = st["scores"]   # every stored score equal (zero): the first positions, the score kernel skipped
        flat = torch.zeros_like(hist)
        flat[:, 1024] = b["tp"].to(torch.int32) + 1
        got = indexer_topk(*args, config=cfg, scores_in=(torch.zeros_like(sc), flat))
        assert torch.equal(got[[0, 2]], torch.arange(32).expand(2, 32)), cfg


def test_slotted_bucket_few_keys_histograms_and_full_slots():
    """SURV over crafted stored scores (the `scores_in` hook): every score of a row in one first-digit bucket, spread
    over its 21 low bits with repeats (ties to the lower position), so that the next 8-bit digit leaves a few keys at
    the boundary: resolved by max reductions (SLOT_FEW 8) or by more histograms (SLOT_FEW 0); and slots too small for
    the bucket (8-bit passes over the parts' survivors). Exactly the topk largest (score, -position) every way."""
    from codegen.triton.indexer_topk import indexer_topk
    b = _batch(59, [(700, 1), (40, 1), (1000, 1)])
    args = _args(b, 32)
    bn = SCORES["BLOCK_N"]
    shape = (3, -(-b["tbl"].shape[1] * b["bs"] // bn) * bn)   # the score rows' shape: [rows, NT * BLOCK_N]
    g = torch.Generator().manual_seed(60)
    low = torch.randint(0, 1 << 21, shape, generator=g, dtype=torch.int32)
    low[:, 1::5] = low[:, 0:shape[1] - 1:5]   # repeats: equal scores
    sc = (((777 ^ 1024) << 21) + low).to(torch.int32)   # first digit 777 everywhere
    ctx = b["tp"] + 1
    hist = torch.zeros(shape[0], 2048, dtype=torch.int32)
    hist[:, 777] = ctx.to(torch.int32)
    want = []
    for r in range(shape[0]):
        p = torch.arange(int(ctx[r]))
        key = (sc[r, :len(p)].to(torch.int64) << 32) | ((1 << 32) - 1 - p)
        want.append(p[key.topk(32).indices].sort().values)
    wide = dict(SURV, SELECT_RES=1024)   # 256 slots a part: every row's bucket in registers (SURV's 64: streamed)
    for cfg in (wide, dict(wide, SLOT_FEW=0), SURV):
        assert torch.equal(indexer_topk(*args, config=cfg, scores_in=(sc, hist)), torch.stack(want)), cfg


def test_heuristic_materialises_decode_scores_only():
    """GPU heuristic: decode at long contexts (T x L x 4 B within SCORES_WORKSPACE) takes SCORES 1; prefill at long
    contexts keeps per-tile candidates; short contexts keep their paths; batch-invariant keys choose by L only."""
    from codegen.triton.indexer_topk import SCORES_WORKSPACE
    key = {"L": 1 << 17, "K": 2048, "HI": 32, "DI": 128}
    dec = heuristic(dict(key, T=32), "h200")
    assert dec["SCORES"] == 1 and dec["KT"] == dec["BLOCK_N"] and dec.get("SELECT") == 1 and dec.get("BUCKET") == 1
    assert dec["TMA"] == 3 and dec["SPLITS"] == 20   # one wave of 5 TMA score programs per SM
    assert dec["GATHER_SPLITS"] == 33   # (no descriptor: 8 gathered-tile programs per SM)
    assert (dec["SURV"], dec["ZERO"], dec["SELECT_PARTS"], dec["MERGE_TILE"]) == (1, 1, 16, 1024)
    assert dec["SELECT_RES"] == 4096   # 256 bucket slots a part (`_topk_slots`)
    assert dec["TMA_CARRY"] == dec["TMA_PRIV"] == 1    # batch 32: carried entries, private histograms
    b8 = heuristic(dict(key, T=8), "h200")
    assert b8["TMA_CARRY"] == 1 and not b8.get("TMA_PRIV")
    for L, parts in ((1 << 16, 64), (1 << 17, 128), (1 << 20, 256), (1 << 22, 256)):   # one row: BUCKET 3
        one = heuristic(dict(key, T=1, L=L), "h200")
        assert (one["BUCKET"], one["ZERO"], one["SELECT_PARTS"], one["MERGE_TILE"]) == (3, 1, parts, 2048), L
        assert not one.get("SURV") and not one.get("TMA_CARRY")
        assert one["GATHER_SPLITS"] == min(L // 256, 1056) and not TEMPLATES[0].constraints(one, {"DI": 128}, "h200")
    big = SCORES_WORKSPACE // (4 * (1 << 17)) + 1
    pre = heuristic(dict(key, T=big), "h200")
    assert not pre.get("SCORES") and pre["CAND"] == 1
    assert heuristic(dict(key, T=big, bi=1), "h200")["SCORES"] == 1
    for T, L in ((1, 8192), (8, 8192), (1, 32768)):
        assert not heuristic(dict(key, T=T, L=L), "h200").get("SCORES")
    b1 = heuristic(dict(key, T=1, L=8192), "h200")   # SELECT 2, the placement counting in one step on 8 warps,
    assert (b1["SELECT"], b1["SELECT_TILE"], b1["SELECT_WARPS"], b1["SELECT_PARTS"]) == (2, 8192, 8, 64)
    assert b1["SELECT_SCAN"] == 8192   # the last program's scan over the row held in registers (`_topk_fused._pick`)
    for bad in (dict(SCORES, KT=16), dict(SCORES, SELECT=2)):
        assert TEMPLATES[0].constraints(bad, {"DI": DI}, "h200"), bad
        with pytest.raises(ValueError, match="SCORES 1"):
            _run(_batch(56, [(300, 1)]), 32, config=bad)
    assert not TEMPLATES[0].constraints(dec, {"DI": 128}, "h200")


def test_tma_key_tiles_taken_where_the_pool_allows(monkeypatch):
    """TMA reads the keys through a descriptor for flat pools and for block views whose block stride is a whole
    number of 16-byte-aligned rows, and falls back to the gathered tiles otherwise (a page starting off a 16-byte
    boundary, with GATHER_SPLITS programs per row): the same selection every way."""
    from codegen.triton import _indexer_scores as mod
    try:
        from tests.test_indexer_kernels import _packed_block_view
    except ImportError:
        from test_indexer_kernels import _packed_block_view
    launched, gathered = [], []

    class Spy:
        def __init__(self, real, log):
            self.real, self.log = real, log

        def __getitem__(self, grid):
            self.log.append(grid)
            return self.real[grid]
    monkeypatch.setattr(mod, "_scores_tma_kernel", Spy(mod._scores_tma_kernel, launched))
    monkeypatch.setattr(mod, "_scores_kernel", Spy(mod._scores_kernel, gathered))
    b = _batch(58, [(300, 1), (97, 1), (20, 1)])
    want = _reference(b, 32)
    views = [(b, 1), (dict(b, k=_packed_block_view(b["k"], b["bs"], 16, 48, 3)), 1),
             (dict(b, k=_packed_block_view(b["k"], b["bs"], 8, 40, 4)), 0)]
    for v, taken in views:
        launched.clear()
        gathered.clear()
        assert torch.equal(_run(v, 32, config=TMA), want)
        assert len(launched) == taken and gathered == ([] if taken else [(3, TMA["GATHER_SPLITS"])])
