import math

import pytest
import torch

from ir.ref import mla

try:
    from tests.helpers import assert_close_rel, contiguous_table, paged_row, scattered_table
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel, contiguous_table, paged_row, scattered_table

H, DN, DR, DV, KV = 3, 16, 8, 12, 24


def _setup(seed, lengths, bases, n_pool, dtype=torch.float64, paging=None):
    """Ragged batch: request r has its last lengths[r] positions in this step (context
    of len ctx_len[r] already cached), pool rows at base offsets `bases` (block size 1), or through
    `paging` = (block_table, block_size) when given."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n_pool, KV + DR, generator=g, dtype=torch.float64)
    kv_b_w = torch.randn(H * (DN + DV), KV, generator=g, dtype=torch.float64) / math.sqrt(KV)
    token_pos, token_req = [], []
    for r, (ctx_len, new) in enumerate(lengths):
        for p in range(ctx_len - new, ctx_len):
            token_pos.append(p)
            token_req.append(r)
    B = len(token_pos)
    q_nope = torch.randn(B, H, DN, generator=g, dtype=torch.float64)
    q_pe = torch.randn(B, H, DR, generator=g, dtype=torch.float64)
    return dict(
        q_nope=q_nope.to(dtype), q_pe=q_pe.to(dtype), latent=latent.to(dtype),
        kv_b_w=kv_b_w.to(dtype), token_pos=torch.tensor(token_pos),
        token_req=torch.tensor(token_req),
        **(dict(block_table=paging[0], block_size=paging[1]) if paging else
           dict(block_table=contiguous_table(bases, max(c for c, _ in lengths)), block_size=1)))


def _formula64(a, scale, positions_per_token):
    """Per-token, per-head float64 formula with explicitly decompressed k_nope / v."""
    latent = a["latent"].double()
    W = a["kv_b_w"].double().view(H, DN + DV, KV)
    B = a["q_nope"].shape[0]
    out = torch.empty(B, H, DV, dtype=torch.float64)
    for i in range(B):
        r = int(a["token_req"][i])
        rows = [paged_row(a["block_table"], a["block_size"], r, p) for p in positions_per_token[i]]
        for h in range(H):
            logits, vals = [], []
            for row in rows:
                c, kpe = latent[row, :KV], latent[row, KV:]
                k_nope = W[h, :DN] @ c
                v = W[h, DN:] @ c
                logits.append(scale * (float(a["q_nope"][i, h].double() @ k_nope)
                                       + float(a["q_pe"][i, h].double() @ kpe)))
                vals.append(v)
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            out[i, h] = sum(w / sum(e) * v for w, v in zip(e, vals))
    return out


def _call(a, scale, form, selection=None):
    return mla.mla_attention(a["q_nope"], a["q_pe"], a["latent"], a["kv_b_w"], a["token_pos"],
                             a["token_req"], a["block_table"], a["block_size"], scale, selection, form)


# (context length after this step, new tokens in this step) per request
LENGTHS = [(6, 6), (9, 1), (4, 3)]
BASES = [20, 3, 40]


def test_mla_dense_absorbed_equals_decompressed_and_formula():
    a = _setup(0, LENGTHS, BASES, 48)
    scale = (DN + DR) ** -0.5
    oa = _call(a, scale, "absorbed")
    od = _call(a, scale, "decompressed")
    assert oa.shape == (a["q_nope"].shape[0], H, DV) and oa.dtype == torch.float64
    assert_close_rel(oa, od, 1e-10, "absorbed vs decompressed")
    ref = _formula64(a, scale, [list(range(int(p) + 1)) for p in a["token_pos"]])
    assert_close_rel(oa, ref, 1e-10, "absorbed vs formula")
    assert_close_rel(od, ref, 1e-10, "decompressed vs formula")


def test_mla_fp32():
    a = _setup(1, LENGTHS, BASES, 48, dtype=torch.float32)
    scale = (DN + DR) ** -0.5
    ref = _formula64(a, scale, [list(range(int(p) + 1)) for p in a["token_pos"]])
    for form in ("absorbed", "decompressed"):
        o = _call(a, scale, form)
        assert o.dtype == torch.float32
        assert_close_rel(o, ref, 1e-5, form)


def test_mla_selection_subset():
    a = _setup(2, LENGTHS, BASES, 48)
    scale = 0.37
    g = torch.Generator().manual_seed(22)
    K = 4
    sel, lists = [], []
    for p in a["token_pos"].tolist():
        n = min(K, p + 1)
        chosen = torch.randperm(p + 1, generator=g)[:n].tolist()
        # random order and padding positions inside the row: order must not matter
        row = chosen + [-1] * (K - n)
        row = [row[j] for j in torch.randperm(K, generator=g).tolist()]
        sel.append(row)
        lists.append(chosen)
    sel = torch.tensor(sel, dtype=torch.int64)
    assert (sel == -1).any(), "test should exercise padding"
    ref = _formula64(a, scale, lists)
    oa = _call(a, scale, "absorbed", sel)
    od = _call(a, scale, "decompressed", sel)
    assert_close_rel(oa, od, 1e-10, "sel absorbed vs decompressed")
    assert_close_rel(oa, ref, 1e-10, "sel vs formula")
    # the selection really changes the result vs dense attention
    dense = _call(a, scale, "absorbed")
    assert (oa - dense).norm() > 1e-3 * dense.norm()


def test_mla_selection_full_equals_dense():
    a = _setup(3, [(5, 5)], [7], 16)
    K = 8
    sel = torch.full((5, K), -1, dtype=torch.int64)
    for i, p in enumerate(a["token_pos"].tolist()):
        sel[i, : p + 1] = torch.arange(p + 1)
    assert_close_rel(_call(a, 0.25, "absorbed", sel), _call(a, 0.25, "decompressed"), 1e-12)


def test_mla_errors():
    a = _setup(4, [(3, 2)], [0], 4)
    with pytest.raises(ValueError):
        _call(a, 0.25, "bogus")
    bad = torch.tensor([[0, 2], [2, -1]])      # token at position 1 selecting position 2
    with pytest.raises(ValueError):
        _call(a, 0.25, "absorbed", bad)
    with pytest.raises(ValueError):
        _call(a, 0.25, "absorbed", torch.tensor([[-1, -1], [0, 1]]))


@pytest.mark.parametrize("block_size", [2, 4])
def test_mla_paged_blocks_in_random_order(block_size):
    """Scattered blocks give the same attention as the contiguous layout holding the same tokens."""
    tbl, n_blocks = scattered_table([c for c, _ in LENGTHS], block_size, seed=block_size)
    a = _setup(5, LENGTHS, BASES, n_blocks * block_size, paging=(tbl, block_size))
    scale = (DN + DR) ** -0.5
    ref = _formula64(a, scale, [list(range(int(p) + 1)) for p in a["token_pos"]])
    for form in ("absorbed", "decompressed"):
        assert_close_rel(_call(a, scale, form), ref, 1e-10, f"paged {form}")
    # positions -> rows -> positions round trip through the block table
    sel = torch.stack([torch.where(torch.arange(4) <= p, torch.arange(4), -1) for p in a["token_pos"].tolist()])
    rows = mla.selection_positions_to_rows(sel, a["token_req"], tbl, block_size)
    want = [[paged_row(tbl, block_size, int(r), s) if s >= 0 else -1 for s in row.tolist()]
            for r, row in zip(a["token_req"], sel)]
    assert rows.tolist() == want
    assert torch.equal(mla.selection_rows_to_positions(rows, a["token_req"], tbl, block_size), sel)
    other = (int(a["token_req"][0]) + 1) % tbl.shape[0]           # a row owned by another request
    foreign = rows.clone()
    foreign[0, 0] = int(tbl[other, 0]) * block_size
    with pytest.raises(ValueError, match="does not own"):
        mla.selection_rows_to_positions(foreign, a["token_req"], tbl, block_size)


def _page_view(flat: torch.Tensor, block_size: int, before: int = 5, after: int = 3):
    """(row buffer, view): flat pool rows [N, W] copied into a block view [NB, bs, W] that is a page of
    wider NaN-filled block rows (the page starts `before` elements into its row), like a packed pool."""
    n, w = flat.shape
    nb = n // block_size
    buf = torch.full((nb, before + block_size * w + after), float("nan"), dtype=flat.dtype)
    view = buf[:, before:before + block_size * w].view(nb, block_size, w)
    view.copy_(flat.view(nb, block_size, w))
    assert view.stride(0) > block_size * w and view.data_ptr() != buf.data_ptr()
    return buf, view


@pytest.mark.parametrize("block_size", [2, 4])
def test_mla_reads_and_cache_write_writes_a_block_view_of_a_packed_row(block_size):
    """The latent pool given as a block view [NB, bs, W] (a page of wider rows, NaN around it) gives
    exactly the flat pool's attention; cache_write through the view lands in the row buffer."""
    from ir.ops import OPS

    tbl, n_blocks = scattered_table([c for c, _ in LENGTHS], block_size, seed=7 + block_size)
    a = _setup(9, LENGTHS, BASES, n_blocks * block_size, paging=(tbl, block_size))
    scale = (DN + DR) ** -0.5
    buf, view = _page_view(a["latent"], block_size)
    for form in ("absorbed", "decompressed", "latent"):
        want = _call(a, scale, form)
        got = _call(dict(a, latent=view), scale, form)
        assert torch.equal(got, want), f"{form}: a block view reads other values than the flat pool"
    op = OPS["cache_write"]
    g = torch.Generator().manual_seed(2)
    vals = torch.randn(len(a["token_pos"]), KV + DR, generator=g, dtype=torch.float64)
    flat = a["latent"].clone()
    for pool in (flat, view):
        out = op.reference(op.bind([pool, vals, a["token_req"], a["token_pos"], tbl]), {"block_size": block_size})
        assert out is pool
    assert torch.equal(view.reshape(-1, KV + DR), flat), "cache_write through a block view"
    assert int(torch.isnan(buf).sum()) == buf.numel() - view.numel(), "cache_write wrote outside its page"
