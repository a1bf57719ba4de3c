"""Pool-reading / pool-writing kernels on block views of a packed pool (DESIGN §5 T1): the MLA prefill
kernel (codegen/triton/mla_prefill.py) and the fused indexer front's key write (indexer_front.py) take a
pool either flat [N, *row] or as a block view [NB, bs, *row] whose block stride exceeds bs * row (a
page of a wider byte row, other pages around it). Results must equal the flat-pool run exactly, agree
with the reference, and a write must land only in its page. Interpreter, fp32, tiny shapes."""

from __future__ import annotations

import torch

from codegen.triton import mla_prefill as mp
from codegen.triton import indexer_front as fr
from ir import formats
from ir.ref import mla as ref

from k31c.model.build import BuildOptions, build_module
from k31c.model.presets import get_preset
from passes import fused_indexer_front, packed_projection
from passes.base import PassContext

try:
    from tests.helpers import assert_close_rel, scattered_table
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel, scattered_table

H, DN, DR, DV, KV = 2, 16, 16, 16, 32
BS = 8
PREFILL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def _page(pool: torch.Tensor, block_size: int, before: int = 48, after: int = 16):
    """(row buffer u8 [NB, row bytes], block view of `pool`'s dtype [NB, bs, *row]): `pool`'s rows copied
    into one page per byte row, `before` bytes into it, other bytes 0xAB."""
    nb = pool.shape[0] // block_size
    per_tok = pool[0].numel()
    es = pool.element_size()
    row = before + block_size * per_tok * es + after
    buf = torch.full((nb, row), 0xAB, dtype=torch.uint8)
    view = buf.view(-1).view(pool.dtype).as_strided((nb, block_size, *pool.shape[1:]),
                                                    (row // es, per_tok, *([1] if pool.dim() > 1 else [])),
                                                    before // es)
    view.copy_(pool.view(nb, block_size, *pool.shape[1:]))
    return buf, view


def _prefill_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [(13, 13), (9, 3)]
    tbl, nblk = scattered_table([c for c, _ in lengths], BS, seed)
    tp = [p for c, n in lengths for p in range(c - n, c)]
    tr = [r for r, (c, n) in enumerate(lengths) for _ in range(n)]
    T = len(tp)
    return dict(qn=torch.randn(T, H, DN, generator=g), qp=torch.randn(T, H, DR, generator=g),
                lat=torch.randn(nblk * BS, KV + DR, generator=g), kvb=torch.randn(H * (DN + DV), KV, generator=g) * 0.3,
                tp=torch.tensor(tp), tr=torch.tensor(tr), tbl=tbl)


def test_mla_prefill_reads_block_views_of_packed_rows():
    b = _prefill_case()
    scale = (DN + DR) ** -0.5
    args = lambda lat: (b["qn"], b["qp"], lat, b["kvb"], b["tp"], b["tr"], b["tbl"], BS, scale)  # noqa: E731
    want = ref.mla_attention(*args(b["lat"]), None, "decompressed")
    for fmt, pool in (("fp32", b["lat"]),
                      ("fp8", formats.encode_fp8_e4m3(b["lat"])),
                      ("nvfp4", formats.quantize_latent_nvfp4(b["lat"], KV))):
        flat = mp.mla_prefill(*args(pool), latent_format=fmt, config=PREFILL)
        _, view = _page(pool, BS)
        got = mp.mla_prefill(*args(view), latent_format=fmt, config=PREFILL)
        assert torch.equal(got, flat), f"{fmt}: a block view reads other rows than the flat pool"
        assert_close_rel(got, want, {"fp32": 1e-5, "fp8": 0.1, "nvfp4": 0.3}[fmt], f"mla_prefill {fmt} block view")


def _front_case(T: int, N: int, seed: int):
    """The k31-tiny verify function's fused.indexer_front node (flat pools, block size 16) and random
    operands: two requests, 3 + 2 tokens at positions 4..6 and 0..1, in blocks 0 and 2 of an N-row pool."""
    m = build_module(get_preset("k31-tiny"), BuildOptions(block_size=16, pool_view="flat"))
    ctx = PassContext()
    packed_projection.run(m, ctx)
    assert fused_indexer_front.run(m, ctx) > 0
    node = next(n for n in m.function("verify").nodes if n.op == "fused.indexer_front")
    g = torch.Generator().manual_seed(seed)
    dims = {"B": T, "N": N}
    ops = []
    for v in node.inputs[:-3]:
        shape = [dims[str(d)] if not d.is_number else int(d) for d in v.type.shape]
        x = torch.randn(*shape, generator=g)
        ops.append((x * 8).to(torch.float8_e4m3fn) if v.type.dtype.name == "f8e4m3" else x)
    ops += [torch.tensor([0, 0, 0, 1, 1]), torch.tensor([4, 5, 6, 0, 1]),
            torch.tensor([[0, -1], [2, -1]], dtype=torch.int32)]
    return node, ops


def test_indexer_front_writes_keys_and_scales_into_block_views():
    T, N = 5, 48
    node, ops = _front_case(T, N, 9)
    flat = [x.clone() if x is not None else None for x in ops]
    want = fr.indexer_front(flat, dict(node.attrs), fr._front_heuristic({}, "cpu"))
    bs = node.attrs["block_size"]
    kbuf, kview = _page(ops[6].clone(), bs)
    sbuf, sview = _page(ops[7].clone(), bs, before=20, after=4)
    mine = list(ops)
    mine[6], mine[7] = kview, sview
    got = fr.indexer_front(mine, dict(node.attrs), fr._front_heuristic({}, "cpu"))
    assert got[3] is kview and got[4] is sview, "pools must be updated in place and returned"
    for a, b_ in zip(got[:3], want[:3]):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b_.view(torch.uint8) if b_.dtype == torch.float8_e4m3fn else b_)
    assert torch.equal(kview.reshape(N, -1).view(torch.uint8), want[3].view(torch.uint8)), "keys in the page"
    assert torch.equal(sview.reshape(N), want[4]), "key scales in the page"
    assert not torch.equal(want[3].view(torch.uint8), ops[6].view(torch.uint8)), "nothing was written"
    for buf, before, after in ((kbuf, 48, 16), (sbuf, 20, 4)):
        assert bool((buf[:, :before] == 0xAB).all() and (buf[:, buf.shape[1] - after:] == 0xAB).all()), \
            "the key write reached another page of the row"


def test_pool_strides_reject_a_view_that_is_not_a_block_view():
    from codegen.triton._paging import pool_strides

    _, view = _page(torch.zeros(32, 8), 8)
    assert pool_strides(view, 8) == (view.stride(0), 8)
    assert pool_strides(torch.zeros(32, 8), 8) == (64, 8)
    try:
        pool_strides(view, 4, what="latent pool")
    except ValueError as e:
        assert "latent pool" in str(e) and "4 rows per block" in str(e)
    else:
        raise AssertionError("a block view with 8 rows per block accepted for block size 4")
