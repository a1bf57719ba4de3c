"""Indexer scorer + exact top-k kernels (codegen/triton/indexer_topk.py) vs `ir/ref/indexer.py` and a
float64 formula (CPU: Triton interpreter, fp32, tiny shapes). Selections are compared exactly with the
reference (random data has no near-ties) and, independently, against float64 scores: every selected
score >= the topk-th best - tol, every unselected <= it + tol, ascending, -1 padded. The parallel
pre-selection (FILTER) and threshold (SELECT) configs are tested in test_indexer_select_kernels.py, which
imports this file's batch builders and checks."""

from __future__ import annotations

import pytest
import torch

from codegen.triton.indexer_topk import TEMPLATES, default_kt, default_kt_pairs, heuristic, indexer_topk
from ir import formats
from ir.ops import OPS
from ir.ref import indexer as ref

try:
    from tests.helpers import assert_close_rel, contiguous_table, paged_row, scattered_table
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel, contiguous_table, paged_row, scattered_table

HI, DI, K = 4, 32, 16
SMALL = dict(BLOCK_N=16, KT=4, SPLITS=2, num_warps=4, num_stages=1, MERGE_TILE=64)  # overflow-prone
WIDE = dict(BLOCK_N=64, KT=8, SPLITS=1, num_warps=4, num_stages=1, MERGE_TILE=128)
# group top-2 candidates (CAND 1: 4 groups of 8 per tile), several programs per row
PAIRS = dict(BLOCK_N=32, KT=8, SPLITS=2, num_warps=4, num_stages=1, MERGE_TILE=64, CAND=1)
# every key a candidate (KT = BLOCK_N: no witness, no rescore), one tile per program, resident merge
ALL_KEYS = dict(BLOCK_N=16, KT=16, SPLITS=16, num_warps=4, num_stages=1, MERGE_TILE=256)


def _batch(seed, lengths, key_format="fp8", keys=None, q=None):
    """lengths: [(context, new tokens)] per request. Random keys: paged pool, blocks of 8 rows in random
    order with spare blocks. Given `keys` (rows laid out per request with gaps: request r's position p at
    row bases[r] + p): block size 1, the contiguous layout as a special case of paging."""
    g = torch.Generator().manual_seed(seed)
    tp, tr, bases, n = [], [], [], 3
    for r, (ctx, new) in enumerate(lengths):
        tp += list(range(ctx - new, ctx))
        tr += [r] * new
        bases.append(n)
        n += ctx + 5
    if keys is None:
        bs = 8
        tbl, n_blocks = scattered_table([c for c, _ in lengths], bs, seed)
        n = n_blocks * bs
    else:
        bs, tbl = 1, contiguous_table(bases, max(c for c, _ in lengths))
    T = len(tp)
    q = torch.randn(T, HI, DI, generator=g) if q is None else q
    keys = torch.randn(n, DI, generator=g) if keys is None else keys
    w = torch.randn(T, HI, generator=g) * (HI * DI) ** -0.5
    q8, qs = formats.quantize_fp8_pow2(q)
    b = dict(q8=q8, qs=qs, w=w, tp=torch.tensor(tp), tr=torch.tensor(tr), tbl=tbl, bs=bs,
             qd=formats.dequantize_fp8(q8, qs), fmt=key_format)
    if key_format == "fp8":
        b["k"], b["ks"] = formats.quantize_fp8_pow2(keys)
        b["kd"] = formats.dequantize_fp8(b["k"], b["ks"])
    else:
        b["k"], b["ks"] = formats.quantize_mxfp4(keys)
        b["kd"] = formats.dequantize_mxfp4(b["k"], b["ks"])
    return b


def _run(b, topk=K, config=None, output="positions", stats=None):
    return indexer_topk(b["q8"], b["qs"], b["w"], b["k"], b["ks"], b["tp"], b["tr"], b["tbl"], b["bs"], topk,
                        key_format=b["fmt"], output=output, config=config, stats=stats)


def _scores64(b):
    out = []
    for i in range(b["q8"].shape[0]):
        r, p = int(b["tr"][i]), int(b["tp"][i])
        kk = b["kd"][[paged_row(b["tbl"], b["bs"], r, s) for s in range(p + 1)]].double()
        out.append(b["w"][i].double() @ torch.relu(b["qd"][i].double() @ kk.T))
    return out


def _check(sel, b, topk=K, tol=1e-5):
    assert sel.dtype == torch.int64 and sel.shape == (b["q8"].shape[0], topk)
    for i, s in enumerate(_scores64(b)):
        ctx, n = s.numel(), min(topk, s.numel())
        row = sel[i]
        assert bool((row[n:] == -1).all()), f"token {i}: padding {row[n:].tolist()}"
        chosen = row[:n]
        assert bool((chosen[1:] > chosen[:-1]).all()), f"token {i}: not strictly ascending {chosen.tolist()}"
        assert 0 <= int(chosen[0]) and int(chosen[-1]) < ctx, f"token {i}: non-causal {chosen.tolist()}"
        if n == ctx:
            continue
        kth = torch.sort(s, descending=True).values[n - 1]
        eps = tol * float(s.abs().max())
        mask = torch.zeros(ctx, dtype=torch.bool)
        mask[chosen] = True
        assert bool((s[mask] >= kth - eps).all()), f"token {i}: a selected score is below the top-{n}"
        assert bool((s[~mask] <= kth + eps).all()), f"token {i}: an unselected score beats the top-{n}"


def _reference(b, topk=K):
    sel, _ = ref.indexer_topk(b["qd"], b["w"], b["kd"], b["tp"], b["tr"], b["tbl"], b["bs"], topk)
    return sel


def test_decode_contexts_below_and_above_topk():
    """One token per request; contexts < topk (select all), == topk, just above, far above."""
    b = _batch(0, [(5, 1), (16, 1), (17, 1), (40, 1), (150, 1)])
    want = _reference(b)
    for cfg in (SMALL, WIDE, PAIRS, ALL_KEYS, dict(ALL_KEYS, MERGE_TILE=64), None):   # 64: candidates streamed
        got = _run(b, config=cfg)
        _check(got, b)
        assert torch.equal(got, want), f"config {cfg}"


def test_prefill_and_verify_ragged_causal():
    """A prompt with a cached prefix, a fresh prompt, and an 8-token verification step."""
    b = _batch(1, [(40, 22), (30, 30), (70, 8)])
    got = _run(b, config=WIDE)
    _check(got, b)
    assert torch.equal(got, _reference(b))


def test_overflow_path_clustered_winners():
    """All strong keys in two adjacent tiles: tiles overflow their KT candidates and are rescored."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, HI, DI, generator=g)
    keys = torch.randn(3 + 120 + 5, DI, generator=g) * 0.1
    keys[3 + 48: 3 + 80] = q[0].mean(0) * 3 + torch.randn(32, DI, generator=g) * 0.1
    b = _batch(2, [(120, 3)], keys=keys, q=q)
    for cfg in (SMALL, PAIRS, dict(SMALL, MERGE_TILE=16)):   # the last: candidates streamed, not resident
        stats = {}
        got = _run(b, config=cfg, stats=stats)
        assert stats["overflowed_rows"] > 0, (cfg, stats)
        _check(got, b)
        assert torch.equal(got, _reference(b))


@pytest.mark.parametrize("factor", [1, 8], ids=["all_keys_radix", "work_row"])
def test_second_merge_paths(monkeypatch, factor):
    """Overflowed rows are re-selected from the first merge's threshold survivors in a work row (room for
    8 pow2(topk) keys: always fits here) or, when the survivors do not fit (room for pow2(topk) only), by
    radix passes over every candidate and rescored key: both exact."""
    from codegen.triton import indexer_topk as mod
    g = torch.Generator().manual_seed(21)
    q = torch.randn(3, HI, DI, generator=g)
    keys = torch.randn(3 + 200 + 5, DI, generator=g) * 0.1
    keys[3 + 64: 3 + 96] = q[0].mean(0) * 3 + torch.randn(32, DI, generator=g) * 0.1
    b = _batch(22, [(200, 3)], keys=keys, q=q)
    monkeypatch.setattr(mod, "WORK_ROW_FACTOR", factor)
    for cfg in (SMALL, PAIRS, dict(SMALL, FILTER=1, FILTER_PARTS=4)):   # the last: over the pre-selected keys
        stats = {}
        got = _run(b, config=cfg, stats=stats)
        assert stats["overflowed_rows"] > 0, (cfg, stats)
        _check(got, b)
        assert torch.equal(got, _reference(b))


def test_ties_go_to_the_lower_position():
    """Integer-valued fp8 data with many duplicate key rows: scores tie exactly (fp32 and float64),
    and the selection must take the lowest positions of a tied group straddling the boundary."""
    g = torch.Generator().manual_seed(3)
    distinct = torch.randint(-4, 5, (6, DI), generator=g).float()
    keys = distinct[torch.randint(0, 6, (3 + 90 + 5,), generator=g)]
    q = torch.randint(-4, 5, (2, HI, DI), generator=g).float()
    b = _batch(3, [(90, 2)], keys=keys, q=q)
    for cfg in (SMALL, WIDE):
        got = _run(b, config=cfg)
        _check(got, b, tol=0.0)
        for i, s in enumerate(_scores64(b)):
            order = sorted(range(s.numel()), key=lambda j: (-float(s[j]), j))[:K]
            assert got[i].tolist() == sorted(order), f"token {i}, config {cfg}"
        assert torch.equal(got, _reference(b))


def test_mxfp4_keys():
    b = _batch(4, [(9, 1), (60, 3), (140, 1)], key_format="mxfp4")
    for cfg in (SMALL, PAIRS):
        got = _run(b, config=cfg)
        _check(got, b)
        assert torch.equal(got, _reference(b))


def test_physical_rows_output():
    b = _batch(5, [(12, 1), (50, 2)])
    pos = _run(b, config=WIDE)
    rows = _run(b, config=WIDE, output="rows")
    want = [[paged_row(b["tbl"], b["bs"], int(r), s) if s >= 0 else -1 for s in row.tolist()]
            for r, row in zip(b["tr"], pos)]
    assert rows.tolist() == want


def test_template_matches_ir_op_reference():
    """The template's launch is a drop-in for the IR op's reference on the same bound operands."""
    b = _batch(6, [(33, 2), (8, 1)])
    op = OPS["indexer_topk"]
    a = op.bind([b["q8"], b["qs"], b["w"], b["k"], b["ks"], b["tp"], b["tr"], b["tbl"]])
    attrs = op.full_attrs({"topk": K, "block_size": b["bs"]})
    t = TEMPLATES[0]
    key = t.key_dims(a, attrs)
    got = t.launch(a, attrs, t.heuristic(key, "cpu"))
    want = op.reference(a, attrs)
    assert torch.equal(got, want)
    # scores of the chosen positions agree with the reference scores (not a tie artefact)
    _, want_scores = ref.indexer_topk(b["qd"], b["w"], b["kd"], b["tp"], b["tr"], b["tbl"], b["bs"], K)
    s64 = _scores64(b)
    got_scores = torch.stack([torch.where(got[i] >= 0, s64[i][got[i].clamp(min=0)].float(), float("-inf"))
                              for i in range(got.shape[0])])
    fin = torch.isfinite(want_scores)
    assert torch.equal(fin, torch.isfinite(got_scores))
    assert_close_rel(got_scores[fin], want_scores[fin], 1e-5, "selected scores")


def test_mxfp4_key_format_through_the_ir_op():
    """indexer_topk {key_format="mxfp4"}: the IR reference dequantises the MXFP4 keys; the template
    (positions) and the fused template (rows) match it; the verifier rejects mismatched key tensors."""
    from types import SimpleNamespace

    from ir.core import TensorType
    from ir.dtypes import f8e4m3, f32, i32, i64, u8
    from ir.ref import mla as ref_mla
    b = _batch(11, [(50, 2), (7, 1)], key_format="mxfp4")
    op = OPS["indexer_topk"]
    ops = [b["q8"], b["qs"], b["w"], b["k"], b["ks"], b["tp"], b["tr"], b["tbl"]]
    attrs = op.full_attrs({"topk": K, "block_size": b["bs"], "key_format": "mxfp4"})
    want = op.reference(op.bind(ops), attrs)
    assert torch.equal(want, _reference(b))
    for t in TEMPLATES:
        a = SimpleNamespace(operands=ops) if "fused.indexer_select" in t.ops else op.bind(ops)
        got = t.launch(a, dict(attrs, emits="rows"), t.heuristic(t.key_dims(a, attrs), "cpu"))
        exp = want if t.ops == ("indexer_topk",) else ref_mla.selection_positions_to_rows(want, b["tr"], b["tbl"], b["bs"])
        assert torch.equal(got, exp), t.family
    types = [TensorType(f8e4m3, ("T", HI, DI)), TensorType(f32, ("T", HI)), TensorType(f32, ("T", HI)),
             TensorType(u8, ("N", DI // 2)), TensorType(u8, ("N", DI // 32)), TensorType(i64, ("T",)),
             TensorType(i64, ("T",)), TensorType(i32, ("R", "MB"))]
    assert op.infer(op.bind(types), attrs)[0].shape[1] == K
    bad = types[:4] + [TensorType(u8, ("N", DI // 16))] + types[5:]
    with pytest.raises(Exception, match="indexer: mxfp4 keys"):
        op.infer(op.bind(bad), attrs)


def test_fused_indexer_select_template_emits_rows():
    """fused.indexer_select (passes/fused_indexer_select.py) binds `a.operands`; it must emit pool rows."""
    from types import SimpleNamespace

    from ir.ref import mla as ref_mla
    b = _batch(7, [(40, 2), (6, 1)])
    a = SimpleNamespace(operands=[b["q8"], b["qs"], b["w"], b["k"], b["ks"], b["tp"], b["tr"], b["tbl"]])
    t = next(t for t in TEMPLATES if "fused.indexer_select" in t.ops)
    attrs = {"topk": K, "block_size": b["bs"], "emits": "rows"}
    assert t.supports(a, attrs, "cpu") is None
    got = t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), "cpu"))
    assert torch.equal(got, ref_mla.selection_positions_to_rows(_reference(b), b["tr"], b["tbl"], b["bs"]))


def test_launcher_reads_no_device_data_on_the_host(monkeypatch):
    """Without `max_context` the context bound is the block table's width (a shape), so the launcher never
    reads device data on the host and can be captured in a CUDA graph (the tuner captures it); the selection
    still equals the reference's when the table is wider than every context."""
    b = _batch(14, [(40, 1), (150, 1), (9, 1)])
    b["tbl"] = torch.cat([b["tbl"], torch.full((b["tbl"].shape[0], 7), -1, dtype=b["tbl"].dtype)], 1)
    want = _reference(b)

    def refuse(*a, **k):
        raise AssertionError("host read of device data in the launcher")
    for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = [_run(b, config=cfg) for cfg in (ALL_KEYS, SMALL, dict(PAIRS, FILTER=1, FILTER_PARTS=2, PREFETCH=1))]
    monkeypatch.undo()
    for g in got:
        assert torch.equal(g, want)


def test_short_context_heuristic_takes_every_key():
    """Decode at 8K with top-2048 (the rank preset): every key is a candidate, one 128-key tile per program at
    batch 1; long-context prefill keeps per-tile candidates (group top-2; decode materialises its scores:
    test_indexer_scores.py)."""
    cfg = heuristic({"T": 1, "L": 8192, "K": 2048, "HI": 32, "DI": 128}, "h200")
    assert cfg["KT"] == cfg["BLOCK_N"] == 128 and cfg["SPLITS"] == 64
    long = heuristic({"T": 512, "L": 1 << 17, "K": 2048, "HI": 32, "DI": 128}, "h200")
    assert long["CAND"] == 1 and long["KT"] == default_kt_pairs(long["BLOCK_N"], 2048, 1 << 17) < long["BLOCK_N"]
    # session 7 measurements: the pre-selection once a row holds > 4 x 2048 candidates, fp16 dots at long contexts
    mid = heuristic({"T": 1, "L": 32768, "K": 2048, "HI": 32, "DI": 128}, "h200")
    assert cfg.get("FILTER", 0) == 0 and mid["KT"] == 128 and long["FILTER"] == 1 and long["DOT"] == 3
    assert mid.get("FILTER") == 1 or mid.get("SELECT") == 2   # SELECT 2 (two launches) needs no pre-selection


def test_heuristics_are_legal():
    for L in (100, 4096, 32768, 131072, 1 << 20):
        for target in ("cpu", "h200"):
            cfg = heuristic({"T": 32, "L": L, "K": 2048, "HI": 32, "DI": 128}, target)
            assert cfg["KT"] <= cfg["BLOCK_N"] and cfg["KT"] & (cfg["KT"] - 1) == 0 and cfg["SPLITS"] >= 1
            assert not TEMPLATES[0].constraints(cfg, {"DI": 128}, target)
    assert default_kt(128, 2048, 1 << 17) == 16 and default_kt(256, 2048, 1 << 17) == 16
    assert default_kt(128, 2048, 1 << 20) == 8


def _packed_block_view(pool: torch.Tensor, bs: int, lead: int, tail: int, seed: int) -> torch.Tensor:
    """`pool`'s rows as a block view [NB, bs, ...] cut from a larger byte buffer: each block is one page of
    a packed row (`lead` foreign bytes before it, `tail` after, all random), so the block stride exceeds
    bs rows and the view is not contiguous."""
    nb = pool.shape[0] // bs
    row = pool[0].numel() * pool.element_size()
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (nb, lead + bs * row + tail), dtype=torch.uint8, generator=g)
    v = buf[:, lead:lead + bs * row].view(pool.dtype).view(nb, bs, *pool.shape[1:])
    v.copy_(pool.reshape(nb, bs, *pool.shape[1:]))
    assert not v.is_contiguous() and v.stride(0) > bs * pool[0].numel()
    return v


@pytest.mark.parametrize("key_format", ["fp8", "mxfp4"])
def test_block_view_pools_read_in_place(key_format):
    """Key and key-scale pools as block views [NB, bs, ...] (pages of a packed byte buffer, scattered block
    table): the same selection as the flat pools, positions and rows, without copying the views."""
    b = _batch(12, [(60, 2), (9, 1), (100, 1)], key_format=key_format)
    flat_pos, flat_rows = _run(b, config=SMALL), _run(b, config=WIDE, output="rows")
    v = dict(b, k=_packed_block_view(b["k"], b["bs"], 16, 48, 1), ks=_packed_block_view(b["ks"], b["bs"], 4, 12, 2))
    assert torch.equal(_run(v, config=SMALL), flat_pos)
    assert torch.equal(_run(v, config=WIDE, output="rows"), flat_rows)
    assert torch.equal(flat_pos, _reference(b))
    bad = dict(v, k=v["k"][:, : b["bs"] // 2])   # a block view must hold block_size rows per block
    with pytest.raises(ValueError, match="indexer keys"):
        _run(bad, config=SMALL)


@pytest.mark.parametrize("dot", [0, 1, 3])
def test_gpu_tensor_core_dots(dot):
    """GPU only (the interpreter scores in fp32): bf16 / fp16 dots (DOT 0 / 3, both exact for e4m3 codes)
    select exactly the reference's positions; FP8 dots with exact fp32 promotion per 32-deep step (DOT 1) select positions whose float64
    scores agree with the reference's top-k within 1e-4 of the largest score."""
    if not torch.cuda.is_available():
        pytest.skip("tensor-core dot variants run on a GPU only (the interpreter computes in fp32)")
    b = _batch(13, [(3000, 1), (2200, 2), (700, 1)])
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) and k not in ("qd", "kd") else v) for k, v in b.items()}
    cfg = dict(heuristic({"T": 4, "L": 3000, "K": 64, "HI": HI, "DI": DI}, "h200"), DOT=dot)
    got = _run(dev, topk=64, config=cfg).cpu()
    _check(got, b, topk=64, tol=1e-4 if dot == 1 else 1e-5)
    if dot != 1:
        assert torch.equal(got, _reference(b, topk=64))


def test_every_kernel_of_both_families_keeps_the_pdl_contract():
    """Source-level PDL contract (codegen/triton/_pdl.py) of every indexer / sparse MLA kernel: a `PDL` constexpr,
    one wait (`pdl_enter` or `pdl_wait`) at the top level of the body before any store or atomic, and only weight
    loads (the MLA absorb kernel's W_UK) before it; races themselves are checked on the GPU (the bench's graph
    replays vs eager)."""
    import inspect

    from codegen.triton import (_indexer_scores, _indexer_tiles, _mla_combine, _mla_heads, _mla_rows, _mla_tiles,
                                _topk_bucket, _topk_bucket_place, _topk_fused, _topk_parallel, _topk_select)
    kernels = {getattr(m, n) for m in (_indexer_scores, _indexer_tiles, _topk_select, _topk_parallel, _topk_fused,
                                       _topk_bucket, _topk_bucket_place, _mla_heads, _mla_rows, _mla_tiles,
                                       _mla_combine)
               for n in dir(m) if n.endswith("_kernel") and n.startswith("_")}
    assert len(kernels) >= 16, [k for k in kernels]
    for k in kernels:
        fn = getattr(k, "fn", k)
        src = inspect.getsource(fn)
        body = src[src.index('"""', src.index('"""') + 3) + 3:]   # after the docstring
        name = fn.__name__
        assert "PDL" in inspect.signature(fn).parameters, f"{name}: no PDL parameter"
        waits = [line.strip() for line in body.splitlines() if line.startswith("    pdl_") and "launch" not in line]
        assert waits in (["pdl_enter(PDL)"], ["pdl_wait(PDL)"]), f"{name}: one top-level wait, found {waits}"
        first_wait = body.index(waits[0])
        for op in ("tl.store(", "tl.atomic_add(", "_collect(", "_gather_ge("):
            assert op not in body[:first_wait], f"{name}: {op} before the PDL wait"
        before = [line.strip() for line in body[:first_wait].splitlines() if "tl.load(" in line]
        assert all(line.startswith("w = tl.load(w_ptr") for line in before), f"{name}: loads before the wait {before}"
