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


def _key_page_views(keys: torch.Tensor, scales: torch.Tensor, block_size: int, page_offset: int = 64):
    """(row bytes, keys view, scales view): flat key / scale pools copied into one key page per block row
    (keys section [bs, *key row] then scales section [bs, *scale row] at a 4-byte multiple, after
    `page_offset` bytes of other pages filled with 0xFF), as `block_layout` places them."""
    nb = keys.shape[0] // block_size
    kb = block_size * keys[0].numel() * keys.element_size()
    s_off = -(-(page_offset + kb) // 4) * 4
    row = s_off + block_size * scales[0].numel() * scales.element_size() + 8
    buf = torch.full((nb, row), 0xFF, dtype=torch.uint8)

    def view(pool, off):
        es = pool.element_size()
        per_tok = pool[0].numel()
        v = buf.view(-1).view(pool.dtype).as_strided((nb, block_size, *pool.shape[1:]),
                                                     (row // es, per_tok, *([1] if pool.dim() > 1 else [])), off // es)
        v.copy_(pool.view(nb, block_size, *pool.shape[1:]))
        return v
    return buf, view(keys, page_offset), view(scales, s_off)


def test_indexer_op_reads_fp8_and_mxfp4_keys_from_block_views_of_packed_rows():
    """indexer_topk's reference with keys + key scales as block views of one byte row per block gives the
    flat pools' selection; cache_write of new keys through the views lands in the rows."""
    from ir import formats
    from ir.ops import OPS

    lengths = [(13, 13), (7, 2), (10, 1)]
    tbl, n_blocks = scattered_table([c for c, _ in lengths], 4, seed=5)
    a = _setup(6, lengths, None, n_blocks * 4, dtype=torch.float32, paging=(tbl, 4))
    q8, qs = formats.quantize_fp8_pow2(a["q"])
    op, write = OPS["indexer_topk"], OPS["cache_write"]
    for fmt, quant in (("fp8", formats.quantize_fp8_pow2), ("mxfp4", formats.quantize_mxfp4)):
        keys, scales = quant(a["keys"])
        buf, kv, sv = _key_page_views(keys, scales, 4)
        attrs = {"block_size": 4, "topk": 5, "key_format": fmt}
        meta = [a["token_pos"], a["token_req"], tbl]
        want = op.reference(op.bind([q8, qs, a["w"], keys, scales, *meta]), attrs)
        got = op.reference(op.bind([q8, qs, a["w"], kv, sv, *meta]), attrs)
        assert torch.equal(got, want) and bool((want >= 0).any()), fmt
        new_k, new_s = quant(torch.randn(3, DI, generator=torch.Generator().manual_seed(1)))
        at = [torch.tensor([0, 1, 2]), torch.tensor([12, 6, 9]), tbl]
        for pool, views, vals in ((keys, kv, new_k), (scales, sv, new_s)):
            flat = pool.clone()
            write.reference(write.bind([flat, vals, *at]), {"block_size": 4})
            assert write.reference(write.bind([views, vals, *at]), {"block_size": 4}) is views
            assert torch.equal(views.reshape(flat.shape).view(torch.uint8), flat.view(torch.uint8)), fmt
        assert int((buf[:, :64] == 0xFF).sum()) == buf.shape[0] * 64, "a write reached another page"
