import torch

from ir.ref import indexer

try:
    from tests.helpers import assert_close_rel, contiguous_table, paged_row, scattered_table
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel, contiguous_table, paged_row, scattered_table

HI, DI = 4, 32


def _setup(seed, lengths, bases, n_pool, dtype=torch.float32, paging=None):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_pool, DI, generator=g, dtype=torch.float64)
    token_pos, token_req = [], []
    for r, (ctx_len, new) in enumerate(lengths):
        token_pos += list(range(ctx_len - new, ctx_len))
        token_req += [r] * new
    B = len(token_pos)
    q = torch.randn(B, HI, DI, generator=g, dtype=torch.float64)
    w = torch.randn(B, HI, generator=g, dtype=torch.float64) * (HI ** -0.5) * (DI ** -0.5)
    return dict(q=q.to(dtype), w=w.to(dtype), keys=keys.to(dtype),
                token_pos=torch.tensor(token_pos), token_req=torch.tensor(token_req),
                **(dict(block_table=paging[0], block_size=paging[1]) if paging else
                   dict(block_table=contiguous_table(bases, max(c for c, _ in lengths)), block_size=1)))


def _scores64(a):
    out = []
    for i in range(a["q"].shape[0]):
        r, p = int(a["token_req"][i]), int(a["token_pos"][i])
        row = []
        for s in range(p + 1):
            k = a["keys"][paged_row(a["block_table"], a["block_size"], r, s)].double()
            row.append(sum(float(a["w"][i, j]) * max(0.0, float(a["q"][i, j].double() @ k))
                           for j in range(HI)))
        out.append(torch.tensor(row, dtype=torch.float64))
    return out


def _ref_topk(scores64, topk):
    """Sorted float64 scores, ties to lower position (python sort on (-score, pos))."""
    sel = []
    for row in scores64:
        order = sorted(range(len(row)), key=lambda s: (-float(row[s]), s))[:topk]
        sel.append(sorted(order) + [-1] * (topk - len(order)))
    return torch.tensor(sel, dtype=torch.int64)


def _args(a):
    return a["q"], a["w"], a["keys"], a["token_pos"], a["token_req"], a["block_table"], a["block_size"]


LENGTHS = [(30, 30), (40, 2), (7, 7)]
BASES = [50, 0, 90]


def test_indexer_dense_scores_vs_formula():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        a = _setup(0, LENGTHS, BASES, 100, dtype)
        got = indexer.indexer_dense_scores(*_args(a))
        ref = _scores64(a)
        assert len(got) == len(ref)
        for i, (x, y) in enumerate(zip(got, ref)):
            assert x.dtype == dtype
            assert_close_rel(x, y, tol, f"token {i}")


def test_indexer_topk_vs_sorted_fp64():
    topk = 8
    a = _setup(1, LENGTHS, BASES, 100, torch.float64)
    sel, sc = indexer.indexer_topk(*_args(a), topk)
    ref64 = _scores64(a)
    assert sel.dtype == torch.int64 and sel.shape == (a["q"].shape[0], topk)
    assert torch.equal(sel, _ref_topk(ref64, topk))
    for i in range(sel.shape[0]):
        valid = sel[i] >= 0
        assert_close_rel(sc[i][valid], ref64[i][sel[i][valid]], 1e-12)
        assert torch.isneginf(sc[i][~valid]).all()
    # fp32: same selection up to swaps between scores equal within tolerance
    a32 = _setup(1, LENGTHS, BASES, 100, torch.float32)
    sel32, _ = indexer.indexer_topk(*_args(a32), topk)
    for i in range(sel.shape[0]):
        if not torch.equal(sel32[i], sel[i]):
            s64 = ref64[i]
            a_only = set(sel32[i].tolist()) - set(sel[i].tolist())
            b_only = set(sel[i].tolist()) - set(sel32[i].tolist())
            for x, y in zip(sorted(a_only), sorted(b_only)):
                assert abs(float(s64[x]) - float(s64[y])) < 1e-5 * float(s64.abs().max())


def test_indexer_topk_short_context_selects_all():
    topk = 16
    a = _setup(2, [(5, 5), (16, 1), (17, 1)], [0, 10, 40], 64)
    sel, sc = indexer.indexer_topk(*_args(a), topk)
    for i, p in enumerate(a["token_pos"].tolist()):
        n = min(topk, p + 1)
        if p + 1 <= topk:
            assert sel[i].tolist() == list(range(p + 1)) + [-1] * (topk - p - 1)
        assert (sel[i][:n] >= 0).all() and (sel[i][n:] == -1).all()
        assert torch.isfinite(sc[i][:n]).all() and torch.isneginf(sc[i][n:]).all()
        assert sel[i][:n].tolist() == sorted(sel[i][:n].tolist())
        assert len(set(sel[i][:n].tolist())) == n


def test_indexer_topk_ties_lower_position_wins():
    topk = 4
    a = _setup(3, [(12, 12)], [5], 20, torch.float64)
    keys = a["keys"]
    base = 5
    # duplicate keys: positions 2, 6, 9 share one key, 3 and 10 share another -> exact ties
    keys[base + 6] = keys[base + 2]
    keys[base + 9] = keys[base + 2]
    keys[base + 10] = keys[base + 3]
    sel, sc = indexer.indexer_topk(*_args(a), topk)
    ref64 = _scores64(a)
    assert torch.equal(sel, _ref_topk(ref64, topk))
    # force the tie to straddle the top-k boundary for the last token: make the duplicated
    # key the single best for every head, then only some copies fit.
    a["keys"][base + 2] = a["q"][-1].sum(0) * 10
    for p in (6, 9):
        a["keys"][base + p] = a["keys"][base + 2]
    a["w"][-1] = a["w"][-1].abs() + 0.1
    sel, _ = indexer.indexer_topk(*_args(a), 2)
    assert sel[-1].tolist() == [2, 6], sel[-1]
    sel, _ = indexer.indexer_topk(*_args(a), 3)
    assert sel[-1].tolist() == [2, 6, 9], sel[-1]
    # all-equal scores (identical keys): the lowest positions win
    a["keys"][:] = a["keys"][base + 2]
    sel, _ = indexer.indexer_topk(*_args(a), 3)
    assert sel[-1].tolist() == [0, 1, 2]
    assert sel[4].tolist() == [0, 1, 2]


def test_topk_over_scattered_blocks():
    lengths = [(13, 13), (7, 2), (10, 1)]
    tbl, n_blocks = scattered_table([c for c, _ in lengths], 4, seed=11)
    a = _setup(12, lengths, None, n_blocks * 4, dtype=torch.float64, paging=(tbl, 4))
    sel, _ = indexer.indexer_topk(*_args(a), 5)
    assert torch.equal(sel, _ref_topk(_scores64(a), 5))
