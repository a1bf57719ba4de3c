"""Sparse/dense absorbed MLA decode (codegen/triton/mla_sparse.py) and decompressed MLA prefill
(codegen/triton/mla_prefill.py) vs `ir/ref/mla.py` and float64 formulas (CPU: Triton interpreter, fp32,
tiny shapes): ragged batches, 1-8 query tokens per request, selections shorter than top-k (-1 padded),
chunked contexts merged by LSE, FP8 / NVFP4 latent pools vs the reference on the same quantised pool."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from codegen.triton import mla_prefill as prefill_mod
from codegen.triton._mla_heads import _pow2_scale
from codegen.triton import mla_sparse as sparse_mod
from codegen.triton.mla_prefill import dequantize_latent, mla_prefill, quantize_latent_fp8, quantize_latent_nvfp4
from codegen.triton._paging import paging_args
from codegen.triton.mla_sparse import mla_sparse_decode, sparse_latent_attention
from codegen.registry import templates_for
from ir.ops import OPS
from ir.ref import mla as ref

try:
    from tests.helpers import assert_close_rel, paged_row, scattered_table
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel, paged_row, scattered_table

H, DN, DR, DV, KV, TOPK = 3, 32, 16, 32, 64, 16
SCALE = (DN + DR) ** -0.5
ONE_PASS = dict(BLOCK_H=16, BLOCK_N=16, CHUNK=16, num_warps=4, num_stages=1, SUB=1,   # 16-row chunks + combine,
                PREFETCH=1)                                                           # rows a step ahead
TWO_PASS = dict(BLOCK_H=16, BLOCK_N=16, CHUNK=32, num_warps=4, num_stages=1, SUB=4)   # column blocks
HEADS = dict(ORIENT=1, BLOCK_H=16, BLOCK_N=16, CHUNK=32, num_warps=4, num_stages=1, PREFETCH=1)  # heads-major, split
HEADS_WHOLE = dict(HEADS, CHUNK=64, PREFETCH=0)   # one piece per token: the kernel writes o~ and lse itself
HEADS_AHEAD = dict(HEADS, PREFETCH=2, CHUNK=48)   # next step bytes in registers, rows two steps ahead (3 steps)
CONFIGS, IDS = [ONE_PASS, TWO_PASS, HEADS, HEADS_WHOLE, HEADS_AHEAD], ["one_pass", "two_pass", "heads", "heads_whole",
                                                                     "heads_ahead"]
PREFILL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def _batch(seed, lengths, with_selection=True):
    """lengths: [(context, new tokens)]; selections of min(TOPK, pos+1) random positions, some
    rows one short (extra -1 padding). The latent pool is paged: blocks of 8 rows in random order."""
    g = torch.Generator().manual_seed(seed)
    tp, tr = [], []
    for r, (ctx, new) in enumerate(lengths):
        tp += list(range(ctx - new, ctx))
        tr += [r] * new
    bs = 8
    tbl, n_blocks = scattered_table([c for c, _ in lengths], bs, seed)
    n = n_blocks * bs
    T = len(tp)
    b = dict(qn=torch.randn(T, H, DN, generator=g), qp=torch.randn(T, H, DR, generator=g),
             lat=torch.randn(n, KV + DR, generator=g), kvb=torch.randn(H * (DN + DV), KV, generator=g) * 0.2,
             tp=torch.tensor(tp), tr=torch.tensor(tr), tbl=tbl, bs=bs, sel=None)
    if with_selection:
        sel = torch.full((T, TOPK), -1, dtype=torch.int64)
        for i, p in enumerate(tp):
            k = max(1, min(TOPK, p + 1) - (i % 2))
            sel[i, :k] = torch.randperm(p + 1, generator=g)[:k].sort().values
        b["sel"] = sel
    return b


def _args(b, lat=None):
    return (b["qn"], b["qp"], b["lat"] if lat is None else lat, b["kvb"], b["tp"], b["tr"], b["tbl"], b["bs"], SCALE,
            b["sel"])


def _lse64(b, lat):
    """float64 log-sum-exp of the logits of every (token, head) over its context."""
    W = b["kvb"].double().view(H, DN + DV, KV)
    out = torch.empty(b["qn"].shape[0], H, dtype=torch.float64)
    for i in range(out.shape[0]):
        r, p = int(b["tr"][i]), int(b["tp"][i])
        pos = b["sel"][i][b["sel"][i] >= 0] if b["sel"] is not None else torch.arange(p + 1)
        c = lat[[paged_row(b["tbl"], b["bs"], r, int(s)) for s in pos]].double()
        k_nope = torch.einsum("lk,hnk->hln", c[:, :KV], W[:, :DN])
        z = SCALE * (torch.einsum("hn,hln->hl", b["qn"][i].double(), k_nope) + b["qp"][i].double() @ c[:, KV:].T)
        out[i] = torch.logsumexp(z, dim=1)
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_sparse_decode_and_lse(config):
    """1-8 tokens per request, contexts below and above TOPK, -1 padded selections."""
    b = _batch(0, [(40, 3), (9, 1), (25, 8), (12, 1)])
    want = ref.mla_attention(*_args(b), "absorbed")
    o, lse = mla_sparse_decode(*_args(b), return_lse=True, config=config)
    assert_close_rel(o, want, 1e-5, "o")
    assert_close_rel(lse, _lse64(b, b["lat"]), 1e-5, "lse")


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_dense_decode_over_the_causal_context(config):
    b = _batch(1, [(45, 2), (7, 1), (20, 1)], with_selection=False)
    want = ref.mla_attention(*_args(b), "absorbed")
    o, lse = mla_sparse_decode(*_args(b), return_lse=True, config=config)
    assert_close_rel(o, want, 1e-5, "o")
    assert_close_rel(lse, _lse64(b, b["lat"]), 1e-5, "lse")


def test_split_partials_in_token_slices_change_nothing(monkeypatch):
    """With split contexts the partials are held for PARTIAL_BYTES at a time: a step of many tokens runs in
    token slices (here 2 tokens each: a dense context of 40 is 3 chunks of 16), bitwise one launch's."""
    b = _batch(4, [(40, 5), (33, 4), (18, 2)], with_selection=False)
    whole = mla_sparse_decode(*_args(b), return_lse=True, config=ONE_PASS)
    monkeypatch.setattr(sparse_mod, "PARTIAL_BYTES", 2 * H * 3 * (KV + 1) * 4)  # 3 splits: 2 tokens a slice
    sliced = mla_sparse_decode(*_args(b), return_lse=True, config=ONE_PASS)
    for w, s in zip(whole, sliced):
        assert torch.equal(w, s)


def test_selection_as_physical_rows():
    b = _batch(2, [(30, 2), (11, 1)])
    rows = torch.tensor([[paged_row(b["tbl"], b["bs"], int(r), s) if s >= 0 else -1 for s in row.tolist()]
                         for r, row in zip(b["tr"], b["sel"])])
    want = mla_sparse_decode(*_args(b), config=ONE_PASS)
    got = mla_sparse_decode(*_args(b)[:-1], rows, selection_rows=True, config=ONE_PASS)
    assert_close_rel(got, want, 1e-6, "rows vs positions")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_quantised_latent_pools(fmt, config):
    """Dequantised in-kernel; compared with the reference run on the same quantised pool."""
    b = _batch(3, [(35, 2), (18, 1)])
    if fmt == "fp8":
        pool, ls = quantize_latent_fp8(b["lat"])
        ps = 1.0
    else:
        pool, ls, ps = quantize_latent_nvfp4(b["lat"], KV)
        assert pool.shape[1] == KV // 2 + KV // 16 + DR
    deq = dequantize_latent(pool, fmt, KV, ls, ps)
    assert 0 < float((deq - b["lat"]).norm() / b["lat"].norm()) < 0.15   # really quantised, not garbage
    want = ref.mla_attention(*_args(b, deq), "absorbed")
    o, lse = mla_sparse_decode(*_args(b, pool), latent_format=fmt, latent_scale=ls, pe_scale=ps,
                               return_lse=True, config=config)
    assert_close_rel(o, want, 2e-2, f"{fmt} o")
    assert_close_rel(lse, _lse64(b, deq), 2e-2, f"{fmt} lse")


def test_absorbed_queries_kernel_vs_float64():
    """q~ = W_UK^T q_nope per head from strided views (q_nope a slice of q, W_UK a slice of kv_b), 1 and 37
    tokens (token blocks of 16, the last partial)."""
    g = torch.Generator().manual_seed(20)
    for T in (1, 37):
        q = torch.randn(T, H, DN + DR, generator=g)
        kvb = torch.randn(H * (DN + DV), KV, generator=g)
        W_UK, _ = sparse_mod.split_kv_b(kvb, H, DN)
        got = sparse_mod.absorb_queries(q[:, :, :DN], W_UK, torch.float32)
        want = torch.einsum("thn,hnk->thk", q[:, :, :DN].double(), W_UK.double())
        assert_close_rel(got, want, 1e-5, f"q~ T={T}")


def test_sparse_launcher_reads_no_device_data_on_the_host(monkeypatch):
    """With a selection (or max_context for a dense context) the launcher never reads device data on the host
    (CUDA-graph capture): absorption, attention and combine are launches only."""
    b = _batch(23, [(30, 2), (12, 1)])
    want = mla_sparse_decode(*_args(b), return_lse=True, config=HEADS)
    dense = _args(b)[:-1] + (None,)
    want_dense = mla_sparse_decode(*dense, return_lse=True, config=HEADS)

    def refuse(*a, **k):
        raise AssertionError("host read of device data in the launcher")
    for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = mla_sparse_decode(*_args(b), return_lse=True, config=HEADS)
    got_dense = mla_sparse_decode(*dense, return_lse=True, config=HEADS, max_context=64)
    monkeypatch.undo()
    for g_, w_ in zip(got + got_dense, want + want_dense):
        assert torch.equal(g_, w_)


def test_heuristic_splits_selected_rows_by_batch():
    """A selection over an FP8 pool: ORIENT 3 at every batch, the split of a token's rows following the selection size
    and the batch (about one program an SM, pieces of 64 to 1024 rows), never the context bound (FOLD 1 asked for
    more pieces than its merge takes is refused); a dense context at small batches: ORIENT 1; batch-invariant mode fixes the split per L; every
    GPU heuristic passes the constraints."""
    t = sparse_mod.TEMPLATES[0]

    def h(T, **kw):
        return sparse_mod.heuristic(dict({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "sparse": 1, "T": T, "bi": 0}, **kw),
                                    "h200")
    got = {T: (h(T)["ORIENT"], h(T)["CHUNK"], h(T)["num_stages"]) for T in (1, 8, 32, 64)}
    assert got == {1: (3, 64, 2), 8: (3, 128, 2), 32: (3, 512, 3), 64: (3, 1024, 3)}, got   # FOLD at 32 and 64
    assert h(1, sparse=0)["ORIENT"] == 1 and h(64, sparse=0)["ORIENT"] == 2 and h(1, fmt=2)["ORIENT"] == 0
    inv = [sparse_mod.heuristic({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "T": T, "bi": 1}, "h200") for T in (1, 64)]
    assert inv[0] == inv[1] and inv[0]["ORIENT"] == 1
    for key in ({"H": H_, "L": L, "KV": 512, "fmt": f, "T": T, "bi": bi} for T in (1, 8, 64) for bi in (0, 1)
                for f in (0, 1, 2) for H_ in (12, 64) for L in (256, 2048, 8192)):
        assert not t.constraints(sparse_mod.heuristic(key, "h200"), key, "h200"), key
    fold = dict(h(64), CHUNK=256, FOLD=1)   # 8 pieces: FOLD's one-program merge is for a few
    assert any("FOLD" in p for p in t.constraints(fold, {"H": 12, "L": 2048, "KV": 512, "fmt": 1, "T": 64}, "h200"))


def test_prefill_dense_decompressed():
    """Two prompts (one continuing a cached prefix), tokens out of order, several query blocks."""
    b = _batch(4, [(40, 25), (18, 18)], with_selection=False)
    perm = torch.randperm(b["tp"].numel(), generator=torch.Generator().manual_seed(0))
    for k in ("qn", "qp", "tp", "tr"):
        b[k] = b[k][perm]
    want = ref.mla_attention(*_args(b), "decompressed")
    o, lse = mla_prefill(*_args(b), return_lse=True, config=PREFILL)
    assert_close_rel(o, want, 1e-5, "o")
    assert_close_rel(lse, _lse64(b, b["lat"]), 1e-5, "lse")


def test_prefill_fp8_pool_and_sparse_prefill():
    b = _batch(5, [(30, 12)], with_selection=False)
    pool, ls = quantize_latent_fp8(b["lat"])
    want = ref.mla_attention(*_args(b, dequantize_latent(pool, "fp8", KV, ls)), "decompressed")
    got = mla_prefill(*_args(b, pool), latent_format="fp8", latent_scale=ls, config=PREFILL)
    assert_close_rel(got, want, 2e-2, "fp8 prefill")
    s = _batch(6, [(30, 12)])
    assert_close_rel(mla_prefill(*_args(s)), ref.mla_attention(*_args(s), "decompressed"), 1e-5, "sparse prefill")


def test_templates_match_ir_op_reference():
    """Both templates are drop-ins for the IR op on bound operands; form decides which applies."""
    op = OPS["mla_attention"]
    for form, mod, b in (("absorbed", sparse_mod, _batch(7, [(26, 2), (10, 1)])),
                         ("latent", sparse_mod, _batch(10, [(22, 2), (30, 1)])),
                         ("decompressed", prefill_mod, _batch(8, [(26, 9)], with_selection=False))):
        ops = [b["qn"], b["qp"], b["lat"], b["kvb"], b["tp"], b["tr"], b["tbl"]] + \
            ([b["sel"]] if b["sel"] is not None else [])
        a = op.bind(ops)
        attrs = op.full_attrs({"scale": SCALE, "form": form, "block_size": b["bs"]})
        t = mod.TEMPLATES[0]
        got = t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), "cpu"))
        assert_close_rel(got, op.reference(a, attrs), 1e-5, t.family)


@pytest.mark.parametrize("form", ["absorbed", "latent"])
def test_absorb_template_then_q_absorbed_attention_equal_the_plain_attention(form):
    """mla_absorb's template (passes/query_absorption.py) vs its IR reference and float64, then mla_sparse reading
    that q~ (q_absorbed, nope_dim) against the IR reference and bitwise against the attention absorbing inside
    (the same absorption kernel and arguments)."""
    op, absorb = OPS["mla_attention"], OPS["mla_absorb"]
    b = _batch(11, [(26, 2), (13, 1)])
    ta = templates_for("mla_absorb")[0]
    aa = absorb.bind([b["qn"], b["kvb"]])
    q_abs = ta.launch(aa, {}, ta.heuristic(ta.key_dims(aa, {}), "cpu"))
    want = torch.einsum("thn,hnk->thk", b["qn"].double(), b["kvb"].double().view(H, DN + DV, KV)[:, :DN])
    assert_close_rel(q_abs, want, 1e-5, "mla_absorb vs float64")
    assert_close_rel(q_abs, absorb.reference(aa, {}), 1e-5, "mla_absorb vs its IR reference")
    other = ta.launch(aa, {}, {"BLOCK_T": 32, "BLOCK_K": 32, "num_warps": 2})   # a tuner's other tiling
    assert_close_rel(other, want, 1e-5, "mla_absorb, 32 x 32 tiles")
    assert ta.constraints({"BLOCK_T": 16, "BLOCK_K": 256, "num_warps": 4}, ta.key_dims(aa, {}), "cpu")
    rest = [b["qp"], b["lat"], b["kvb"], b["tp"], b["tr"], b["tbl"], b["sel"]]
    attrs = op.full_attrs({"scale": SCALE, "form": form, "block_size": b["bs"]})
    t = sparse_mod.TEMPLATES[0]
    plain = op.bind([b["qn"], *rest])
    cfg = t.heuristic(t.key_dims(plain, attrs), "cpu")
    want = t.launch(plain, attrs, cfg)
    absorbed = op.bind([q_abs, *rest])
    attrs_abs = op.full_attrs({**attrs, "q_absorbed": True, "nope_dim": DN})
    got = t.launch(absorbed, attrs_abs, cfg)
    assert torch.equal(got, want), "q_absorbed changed the attention's result"
    assert_close_rel(got, op.reference(absorbed, attrs_abs), 1e-5, f"q_absorbed {form} vs the IR reference")
    with pytest.raises(ValueError, match="absorbed query"):
        t.launch(plain, attrs_abs, cfg)


def test_templates_read_rows_when_selection_kind_is_rows():
    op = OPS["mla_attention"]
    b = _batch(9, [(28, 3), (9, 1)])
    rows = ref.selection_positions_to_rows(b["sel"], b["tr"], b["tbl"], b["bs"])
    a = op.bind([b["qn"], b["qp"], b["lat"], b["kvb"], b["tp"], b["tr"], b["tbl"], rows])
    for form, mod in (("absorbed", sparse_mod), ("decompressed", prefill_mod)):
        attrs = op.full_attrs({"scale": SCALE, "form": form, "selection_kind": "rows", "block_size": b["bs"]})
        t = mod.TEMPLATES[0]
        got = t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), "cpu"))
        assert_close_rel(got, op.reference(a, attrs), 1e-5, f"{t.family} rows")


def test_supports_on_ir_types():
    from ir.core import TensorType
    from ir.dtypes import bf16, i32, i64

    op = OPS["mla_attention"]
    a = op.bind([TensorType(bf16, ("B", 96, 128)), TensorType(bf16, ("B", 96, 64)), TensorType(bf16, ("N", 576)),
                 TensorType(bf16, (96 * 256, 512)), TensorType(i64, ("B",)), TensorType(i64, ("B",)),
                 TensorType(i32, ("R", "MB"))])
    assert sparse_mod.TEMPLATES[0].supports(a, {"form": "absorbed"}, "h200") is None
    assert prefill_mod.TEMPLATES[0].supports(a, {"form": "decompressed"}, "h200") is None
    assert "absorbed" in prefill_mod.TEMPLATES[0].supports(a, {"form": "absorbed"}, "h200")


def _packed_block_view(pool: torch.Tensor, bs: int, lead: int, tail: int, seed: int) -> torch.Tensor:
    """`pool`'s rows as a block view [NB, bs, width] cut from a larger random byte buffer (one page of a
    packed block row per block: `lead` foreign bytes before it, `tail` after): block stride > bs rows."""
    nb, row = pool.shape[0] // bs, pool.shape[1] * pool.element_size()
    buf = torch.randint(0, 256, (nb, lead + bs * row + tail), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    v = buf[:, lead:lead + bs * row].view(pool.dtype).view(nb, bs, pool.shape[1])
    v.copy_(pool.view(nb, bs, pool.shape[1]))
    assert not v.is_contiguous() and v.stride(0) > bs * pool.shape[1]
    return v


@pytest.mark.parametrize("fmt", ["fp32", "fp8", "nvfp4"])
def test_block_view_latent_pool_read_in_place(fmt):
    """A latent pool handed over as a block view [NB, bs, width] (pages of a packed byte buffer, blocks in
    random order): selections by position and by row, and the dense causal context, all equal to the
    flat pool's results (the view is read through its strides, not copied)."""
    b = _batch(11, [(33, 2), (12, 1)])
    ls, ps = 1.0, 1.0
    if fmt == "fp8":
        pool, ls = quantize_latent_fp8(b["lat"])
    elif fmt == "nvfp4":
        pool, ls, ps = quantize_latent_nvfp4(b["lat"], KV)
    else:
        pool = b["lat"]
    view = _packed_block_view(pool, b["bs"], 32, 80, 12)
    kw = dict(latent_format=fmt, latent_scale=ls, pe_scale=ps, return_lse=True, config=ONE_PASS)
    rows = ref.selection_positions_to_rows(b["sel"], b["tr"], b["tbl"], b["bs"])
    for what, args, extra in (("positions", _args(b, pool), {}), ("rows", _args(b, pool)[:-1] + (rows,),
                                                                     {"selection_rows": True}),
                              ("dense", _args(b, pool)[:-1] + (None,), {})):
        want_o, want_lse = mla_sparse_decode(*args, **kw, **extra)
        vargs = args[:2] + (view,) + args[3:]
        o, lse = mla_sparse_decode(*vargs, **kw, **extra)
        assert_close_rel(o, want_o, 1e-6, f"{fmt} {what} o")
        assert_close_rel(lse, want_lse, 1e-6, f"{fmt} {what} lse")
    deq = dequantize_latent(pool, fmt, KV, ls, ps)
    assert_close_rel(mla_sparse_decode(*_args(b, view), **kw)[0], ref.mla_attention(*_args(b, deq), "absorbed"),
                     1e-5 if fmt == "fp32" else 2e-2, f"{fmt} vs reference")


F16_HEADS = dict(HEADS, F16=1)   # fp16 dots, queries scaled per head by powers of two (CPU: fp32 dots, same scaling)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_f16_heads_path_on_quantised_pools(fmt):
    """F16 1 (ORIENT 1, FP8 / NVFP4 pools) vs the reference on the same quantised pool, queries of magnitude
    ~1e5 (past fp16's range unless the per-head scaling works), o~ / lse vs float64; rejected for bf16 pools."""
    b = _batch(5, [(35, 2), (18, 1)])
    b["qn"] = b["qn"] * 1e5
    b["qp"] = b["qp"] * 1e5
    pool, ls, ps = (*quantize_latent_fp8(b["lat"]), 1.0) if fmt == "fp8" else quantize_latent_nvfp4(b["lat"], KV)
    deq = dequantize_latent(pool, fmt, KV, ls, ps)
    o, lse = mla_sparse_decode(*_args(b, pool), latent_format=fmt, latent_scale=ls, pe_scale=ps, return_lse=True,
                               config=F16_HEADS)
    assert_close_rel(o, ref.mla_attention(*_args(b, deq), "absorbed"), 2e-2, f"{fmt} F16 o")
    assert_close_rel(lse, _lse64(b, deq), 1e-4, f"{fmt} F16 lse")
    with pytest.raises(ValueError, match="F16"):
        mla_sparse_decode(*_args(b), config=F16_HEADS)


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_row_lane_denominators_match_reference(fmt):
    """LSUM 1 (softmax denominators kept per row lane, summed after the loop) over several steps per piece (CHUNK 48 =
    3 steps of 16 rows, pieces merged by LSE), in one piece, and in 40-row pieces (not a power of two: the last step
    half empty), with -1 padded selections: o~ vs the reference on the same pool, lse vs float64; fp8 with the F16
    path (scaled queries). ORIENT 0 rejects LSUM."""
    b = _batch(9, [(40, 2), (21, 1), (6, 1)])
    if fmt == "fp8":
        pool, ls = quantize_latent_fp8(b["lat"])
        kw = dict(latent_format="fp8", latent_scale=ls)
        deq = dequantize_latent(pool, "fp8", KV, ls, 1.0)
    else:
        pool, kw, deq = b["lat"], {}, b["lat"]
    for cfg in (dict(HEADS, LSUM=1, CHUNK=48), dict(HEADS_WHOLE, LSUM=1), dict(HEADS, LSUM=1, CHUNK=40)):
        cfg = dict(cfg, F16=1) if fmt == "fp8" else cfg
        o, lse = mla_sparse_decode(*_args(b, pool), **kw, return_lse=True, config=cfg)
        assert_close_rel(o, ref.mla_attention(*_args(b, deq), "absorbed"), 1e-5 if fmt == "fp32" else 2e-2,
                         f"{fmt} LSUM o {cfg}")
        assert_close_rel(lse, _lse64(b, deq), 1e-5 if fmt == "fp32" else 1e-4, f"{fmt} LSUM lse {cfg}")
    with pytest.raises(ValueError, match="LSUM"):
        mla_sparse_decode(*_args(b), config=dict(ONE_PASS, LSUM=1))


@triton.jit
def _pow2_scale_probe(a_ptr, up_ptr, down_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    up, down = _pow2_scale(tl.load(a_ptr + i))
    tl.store(up_ptr + i, up)
    tl.store(down_ptr + i, down)


def test_pow2_query_scale_is_exact_and_below_fp16_max():
    """`_pow2_scale`: amax * 2^n in [2^13, 2^14) for normal amax, 2^n * 2^-n = 1, n clamped for 0 / tiny / huge."""
    a = torch.tensor([0.0, 1e-30, 3e-5, 0.7, 1.0, 3.0, 65504.0, 1e6, 3e38, 1e-42, 2.5e-8, 12345.6, 8192.0, 16383.9,
                      5e-39, 1.5])
    up, down = torch.empty_like(a), torch.empty_like(a)
    _pow2_scale_probe[(1,)](a, up, down, N=16)
    assert torch.equal(up * down, torch.ones_like(a)), "2^n * 2^-n != 1"
    assert torch.equal(torch.exp2(torch.round(torch.log2(up))), up), "not a power of two"
    normal = (a >= 2.0 ** -100) & (a < 2.0 ** 120)
    scaled = a[normal] * up[normal]
    assert bool(((scaled >= 2.0 ** 13) & (scaled < 2.0 ** 14)).all()), scaled
    assert float(up[0]) == 2.0 ** 126 and float((a * up).max()) < 65504, "zero / huge amax"


_SM90_F16 = r'''
import os, re
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as tc
from codegen.aot.record import Recorder
from codegen.triton.mla_sparse import sparse_latent_attention
target = GPUTarget("cuda", 90, 32)
T, H, N = 2, 12, 256
pool = torch.zeros(N, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
rows = torch.arange(T * 64).view(T, 64) % N
cfg = dict(ORIENT=1, BLOCK_H=16, BLOCK_N=32, CHUNK=64, num_warps=4, num_stages=1, PREFETCH=1, F16=1)
for c in (cfg, dict(cfg, LSUM=1, num_stages=3)):
    with Recorder(target) as rec:
        sparse_latent_attention(torch.zeros(T, H, 512, dtype=torch.bfloat16), torch.zeros(T, H, 64, dtype=torch.bfloat16),
                                pool, torch.full((T,), 500), None, 0.1, rows, latent_format="fp8", config=c,
                                block_size=64, out_dtype=torch.bfloat16)
    for spec in rec.specs.values():
        fn, sig, cx, attrs, opts = spec.compile_args
        if fn.fn.__name__ == "_mla_heads_kernel":
            ptx = tc(ASTSource(fn, sig, cx, attrs), target=target, options=dict(vars(opts))).asm["ptx"]
            print(ptx.count("cvt.rn.f16x2.e4m3x2"), ptx.count("ld.shared.b8"), ptx.count("ldmatrix"),
                  len(re.findall(r"cp\.async\.wait_group\s+2", ptx)))
'''


def test_f16_heads_kernel_widens_rows_before_the_relayout_on_sm90():
    """The sm_90 build of the F16 path widens e4m3 rows in registers (`_e4m3_to_f16`) and feeds both dots through
    16-bit ldmatrix, with no byte-wise shared-memory loads (the bf16 path transposes the 8-bit tile byte by byte);
    so does the batch-64 default (LSUM 1, 3 stages), whose gathers are cp.async groups waited on a step ahead.
    Compiled in a subprocess (not interpreting) through the AOT recorder; ptxas is not needed for the PTX."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _SM90_F16], env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=repo),
                       capture_output=True, text=True, timeout=240, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    (cvt, bytewise, ldm, _), (cvt2, bytewise2, ldm2, wait2) = [map(int, line.split())
                                                                for line in p.stdout.splitlines()]
    assert cvt > 0 and ldm > 0 and bytewise == 0, p.stdout
    # the batch-64 default (LSUM, 3 stages): the same widening, gathers in cp.async groups one step ahead
    assert cvt2 > 0 and ldm2 > 0 and bytewise2 == 0 and wait2 > 0, p.stdout



ROWS_M = dict(ORIENT=2, BLOCK_H=16, BLOCK_N=16, CHUNK=32, num_warps=4, num_stages=1, PREFETCH=1, KB=32)  # 2 blocks
ROWS_M_CFGS = [ROWS_M, dict(ROWS_M, CHUNK=64, PREFETCH=0, KB=64), dict(ROWS_M, CHUNK=48, KB=16)]
ROWS_M_IDS = ["split_kb32", "whole_kb64", "three_steps_kb16"]


def _latent64(q_abs, q_pe, deq, rows):
    """float64 (o~, lse) of the absorbed attention over pool rows (a list per token), per token and head."""
    o = torch.zeros(q_abs.shape, dtype=torch.float64)
    lse = torch.empty(q_abs.shape[:2], dtype=torch.float64)
    for t, r in enumerate(rows):
        c = deq[r].double()
        z = SCALE * (q_abs[t].double() @ c[:, :KV].T + q_pe[t].double() @ c[:, KV:].T)
        lse[t] = torch.logsumexp(z, 1)
        o[t] = torch.softmax(z, 1) @ c[:, :KV]
    return o, lse


def _bf16_queries(T, seed):
    """q~, q_pe of bf16 precision (ORIENT 2 splits each value into two e4m3 parts: exact for those), heads of
    magnitudes 1e-3 .. 1e4 (the per-head power-of-two scaling)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.tensor([1e-3, 1.0, 1e4])[torch.arange(H) % 3].view(1, H, 1)
    return tuple((torch.randn(T, H, w, generator=g) * mag).to(torch.bfloat16).float() for w in (KV, DR))


@pytest.mark.parametrize("config", ROWS_M_CFGS, ids=ROWS_M_IDS)
def test_rows_m_orientation_vs_float64(config):
    """ORIENT 2 (rows as the dots' M, fp8 logits dots against queries split into two e4m3 parts, c_KV in KB-wide
    column blocks) on FP8 pools, queries of bf16 precision: o~ / lse vs float64 to fp32 rounding for -1 padded
    selections of positions (1-8 tokens per request, paged pool), the dense causal context, and selections of rows
    read from a block view of a packed pool, in pieces merged by LSE and in one piece."""
    b = _batch(13, [(40, 3), (9, 1), (25, 8), (12, 1)])
    pool, ls = quantize_latent_fp8(b["lat"])
    deq = dequantize_latent(pool, "fp8", KV, ls, 1.0)
    qa, qp = _bf16_queries(len(b["tp"]), 14)
    paging = paging_args(b["tbl"], b["tr"], b["bs"], "cpu")
    kw = dict(latent_format="fp8", latent_scale=ls, config=config)
    rows = ref.selection_positions_to_rows(b["sel"], b["tr"], b["tbl"], b["bs"])
    view = _packed_block_view(pool, b["bs"], 16, 48, 15)
    dense = [[paged_row(b["tbl"], b["bs"], int(r), s) for s in range(int(p) + 1)] for r, p in zip(b["tr"], b["tp"])]
    for what, got, want_rows in (
            ("positions", sparse_latent_attention(qa, qp, pool, b["tp"], paging, SCALE, b["sel"], **kw),
             [r[r >= 0] for r in rows]),
            ("dense", sparse_latent_attention(qa, qp, pool, b["tp"], paging, SCALE, None, max_context=64, **kw), dense),
            ("rows of a block view", sparse_latent_attention(qa, qp, view, b["tp"], None, SCALE, rows,
                                                             block_size=b["bs"], **kw), [r[r >= 0] for r in rows])):
        o64, lse64 = _latent64(qa, qp, deq, want_rows)
        assert_close_rel(got[0], o64, 1e-5, f"{what} o")
        assert_close_rel(got[1], lse64, 1e-5, f"{what} lse")


def test_rows_m_fp32_queries_and_pool_formats():
    """ORIENT 2 with fp32 queries (two e4m3 parts keep ~8 significant bits of each value): o~ / lse within the FP8
    paths' tolerances; float and NVFP4 pools are rejected."""
    b = _batch(16, [(35, 2), (18, 1)])
    pool, ls = quantize_latent_fp8(b["lat"])
    deq = dequantize_latent(pool, "fp8", KV, ls, 1.0)
    o, lse = mla_sparse_decode(*_args(b, pool), latent_format="fp8", latent_scale=ls, return_lse=True, config=ROWS_M)
    assert_close_rel(o, ref.mla_attention(*_args(b, deq), "absorbed"), 2e-2, "fp32 queries o")
    assert_close_rel(lse, _lse64(b, deq), 2e-3, "fp32 queries lse")
    with pytest.raises(ValueError, match="FP8 pools only"):
        mla_sparse_decode(*_args(b), config=ROWS_M)
    nv, ls4, ps4 = quantize_latent_nvfp4(b["lat"], KV)
    with pytest.raises(ValueError, match="FP8 pools only"):
        mla_sparse_decode(*_args(b, nv), latent_format="nvfp4", latent_scale=ls4, pe_scale=ps4, config=ROWS_M)


_SM90_ROWS_M = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as tc
from codegen.aot.record import Recorder
from codegen.triton.mla_sparse import sparse_latent_attention
target = GPUTarget("cuda", 90, 32)
T, H, N = 64, 12, 4096
cfg = dict(ORIENT=2, BLOCK_H=16, BLOCK_N=64, KB=128, num_warps=4, num_stages=3, PREFETCH=1, CHUNK=512)
pool = torch.zeros(N, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
rows = torch.arange(T * 2048).view(T, 2048) % N
with Recorder(target) as rec:
    q = torch.zeros(T, H, 576, dtype=torch.bfloat16)
    sparse_latent_attention(q[..., :512], q[..., 512:], pool, torch.full((T,), N), None, 0.1, rows, latent_format="fp8",
                            config=cfg, block_size=64, out_dtype=torch.bfloat16)
for spec in rec.specs.values():
    fn, sig, cx, attrs, opts = spec.compile_args
    if fn.fn.__name__ == "_mla_rowsm_kernel":
        ptx = tc(ASTSource(fn, sig, cx, attrs), target=target, options=dict(vars(opts))).asm["ptx"]
        print(*(ptx.count(w) for w in (".e4m3.e4m3", ".f16.f16", "cvt.rn.f16x2.e4m3x2", "cp.async.cg", "mma.sync")))
'''


def test_rows_m_kernel_uses_wgmma_on_sm90():
    """ORIENT 2 at session 13's batch-64 FP8 config (ORIENT 3's fallback now) built for sm_90a: fp8 wgmma for the
    logits (e4m3 x e4m3, A the gathered bytes), fp16 wgmma for the values, rows widened by `_e4m3_to_f16`, gathers
    as cp.async (pipelined), no mma.sync. Compiled in a subprocess (not interpreting) through the AOT recorder."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=repo)
    p = subprocess.run([sys.executable, "-c", _SM90_ROWS_M], env=env, capture_output=True, text=True, timeout=240,
                       cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    e4m3, f16, cvt, cpasync, mma_sync = map(int, p.stdout.split())
    assert e4m3 > 0 and f16 > 0 and cvt > 0 and cpasync > 0 and mma_sync == 0, p.stdout
