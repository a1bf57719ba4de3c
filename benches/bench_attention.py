"""H200 benchmark of the indexer scorer + exact top-k and sparse MLA decode (issue 4), one JSON document.

    python benches/bench_attention.py [--budget 250]   # also writes $OUT/attention.json when $OUT is set
    BENCH_SMOKE=1 python benches/bench_attention.py     # CPU interpreter, tiny shapes: exercises every path

Sections run in subprocesses (a crash loses one section); every kernel variant is compiled first by the
same sections run in parallel on batch-2 inputs of otherwise identical shapes.
  hbm      ceilings: device copy (read + write) and a streaming read (torch sum); the larger is the floor
  indexer  decode, context 128K, batch 32, 32 x 128 heads, top-2048, FP8 (and MXFP4) keys: full-shape check
           vs the IR reference, configs (+ the score kernel alone: what the top-k merge costs), torch eager peer
  mla      sparse absorbed decode, batch 64, 12 heads, top-2048 of FP8 latents (also NVFP4, bf16 pools):
           check vs the IR reference on the dequantised pool + float64 LSE, configs, torch eager peer
  step     decode step, batch 16, FP8 caches: indexer + sparse MLA vs dense MLA at 32K, 128K, 1M (the
           structural knobs of the best indexer / MLA configs measured above, context-dependent ones from
           the heuristics)
Every cache is paged: block_size 64 (BLOCK_SIZE), each request's blocks a random permutation of the pool's.
  prefill  decompressed MLA prefill, bf16 check + time;  peers: torch.compile of both reference formulas
Times: medians of do_bench_cudagraph (kernel time; bandwidth fractions) and do_bench (plain launches;
ratios against the peers, which launch plainly too).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEV = "cpu" if SMOKE else "cuda"
SECTIONS = ("hbm", "indexer", "mla", "step", "prefill", "peers")
WARM_PARTS = {"indexer": 3, "mla": 3, "step": 2, "prefill": 1}
WARM_CAP_S = 80   # the parallel compile phase ends by then (the rest compiles on first use)
SCALE = 192 ** -0.5
BLOCK_SIZE = 64


def _sync():
    if not SMOKE:
        torch.cuda.synchronize()


def _free():
    if not SMOKE:
        torch.cuda.empty_cache()


def _left():
    return float(os.environ.get("BENCH_DEADLINE", time.time() + 1e9)) - time.time()


def _time(fn, graph):
    if SMOKE:
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    import triton.testing as tt
    if graph:
        fn()
        _sync()
        return tt.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _rec(res, name, fn, bytes_=0.0, flops=0.0, peer=False, optional=False, graph=True, **extra):
    """Time fn (warm mode: run once to compile) and append a measurement; errors are recorded, never
    raised. Optional measurements are skipped when less than 25 s of the global budget is left."""
    if optional and _left() < 25 and not res["warm"]:
        res.setdefault("skipped", []).append(name)
        return None
    try:
        if res["warm"]:
            k, n = res["warm_part"]
            res["ctr"] = res.get("ctr", -1) + 1
            if res["ctr"] % n == k:
                fn()
                _sync()
            return None
        m = {"name": name, "bytes": bytes_, "flops": flops, **extra}
        m["median_ms"] = _time(fn, False)
        res["measurements"].append(m)
        if graph and not peer:   # host-planned calls (prefill) cannot be graph-captured
            try:
                m["median_ms_graph"] = _time(fn, True)
            except Exception as e:  # noqa: BLE001
                m["graph_error"] = repr(e)[:300]
        t = m.get("median_ms_graph", m["median_ms"])
        if bytes_ and res.get("read_TBps"):
            m["TBps"] = bytes_ / (t * 1e-3) / 1e12
            m["frac_of_measured_hbm"] = m["TBps"] / res["read_TBps"]
        if flops:
            m["TFLOPs"] = flops / (t * 1e-3) / 1e12
        return m
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"{name}: {e!r}\n{traceback.format_exc()[-1500:]}")
        return None


def _check(res, name, fn):
    if res["warm"]:
        return
    try:
        res["checks"].append({"name": name, **fn()})
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"check {name}: {e!r}\n{traceback.format_exc()[-1500:]}")


def _compiled(res, name, fn):
    """torch.compile peer when >= 45 s of the global budget are left (compile time recorded)."""
    if res["warm"] or SMOKE or _left() < 45:
        res.setdefault("skipped", []).append(f"torch.compile {name}")
        return None
    try:
        t0 = time.time()
        cf = torch.compile(fn)
        cf()
        _sync()
        res.setdefault("compile_s", {})[name] = time.time() - t0
        return cf
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"torch.compile {name}: {e!r}")
        return None


def _random_fp8(shape, g):
    k = torch.randint(0, 256, shape, device=DEV, dtype=torch.uint8, generator=g)
    return torch.where((k & 0x7F) == 0x7F, k ^ 1, k).view(torch.float8_e4m3fn)   # no NaN codes


# ------------------------------------------------------------------------------------------ hbm
def sec_hbm(res):
    n = (1 << 20) if SMOKE else (4 << 30)
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    res["copy_TBps"] = 2 * n / (_time(lambda: y.copy_(x), True) * 1e-3) / 1e12
    xf = x.view(torch.float32)
    res["read_TBps"] = n / (_time(lambda: xf.sum(), True) * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------ paging
def _table(T, L, g):
    """Block table int32 [T, L/BLOCK_SIZE]: the pool's T*L/BLOCK_SIZE blocks in random order."""
    nb = T * (-(-L // BLOCK_SIZE))
    return torch.randperm(nb, device=DEV, generator=g).to(torch.int32).view(T, -1)


def _all_rows(tbl, L):
    """Pool rows [T, L] of every position of every request (peers and checks gather through them)."""
    p = torch.arange(L, device=tbl.device)
    return tbl.long()[:, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE


# -------------------------------------------------------------------------------------- indexer
def _indexer_inputs(T, L, HI=32, DI=128, fmt="fp8", seed=0):
    from ir import formats
    g = torch.Generator(device=DEV).manual_seed(seed)
    q8, qs = formats.quantize_fp8_pow2(torch.randn(T, HI, DI, device=DEV, generator=g))
    N = T * L
    if fmt == "fp8":
        keys = _random_fp8((N, DI), g)
        ks = torch.exp2(torch.randint(-8, -4, (N,), device=DEV, generator=g).float())
    else:
        keys = torch.randint(0, 256, (N, DI // 2), device=DEV, dtype=torch.uint8, generator=g)
        ks = torch.randint(118, 126, (N, DI // 32), device=DEV, dtype=torch.uint8, generator=g)
    w = (torch.randn(T, HI, device=DEV, generator=g) * (HI * DI) ** -0.5).to(torch.bfloat16)
    return dict(q8=q8, qs=qs, w=w, keys=keys, ks=ks, pos=torch.full((T,), L - 1, device=DEV, dtype=torch.int64),
                req=torch.arange(T, device=DEV), tbl=_table(T, L, g), L=L, fmt=fmt)


def _indexer_call(d, K, config=None, output="positions", stats=None, stop_after=None):
    from codegen.triton.indexer_topk import indexer_topk
    return lambda: indexer_topk(d["q8"], d["qs"], d["w"], d["keys"], d["ks"], d["pos"], d["req"], d["tbl"],
                                BLOCK_SIZE, K, key_format=d["fmt"], output=output, config=config,
                                max_context=d["L"], stats=stats, stop_after=stop_after)


def _indexer_bytes(d, K):
    T, HI, DI = d["q8"].shape
    key_b = (DI + 4) if d["fmt"] == "fp8" else (DI // 2 + DI // 32)
    return T * d["L"] * key_b + T * HI * (DI + 6) + T * K * 8


def indexer_reference_args(d) -> tuple:
    """The IR reference's operands for an `_indexer_inputs` set: dequantised queries and keys (block views flattened:
    a copy for the reference only), weights, positions, requests, table, block size."""
    from ir import formats
    from ir.ops.attention import dequantize_index_keys
    qd = formats.dequantize_fp8(d["q8"], d["qs"])
    ks = d["ks"].reshape(-1) if d["fmt"] == "fp8" else d["ks"].reshape(-1, d["ks"].shape[-1])
    kd = dequantize_index_keys(d["keys"].reshape(-1, d["keys"].shape[-1]), ks, d["fmt"])
    return qd, d["w"].float(), kd, d["pos"], d["req"], d["tbl"], BLOCK_SIZE


def _indexer_check(d, K, cfg):
    from ir.ref import indexer as ref
    sel = _indexer_call(d, K, cfg)()
    args = indexer_reference_args(d)
    want, _ = ref.indexer_topk(*args, K)
    scores, _ = ref.indexer_scores_padded(*args)
    kth = scores.topk(K, dim=1).values[:, -1]
    eps = 1e-4 * scores.abs().amax(1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, sel.clamp(min=0), True)
    lo = scores.masked_fill(~chosen, float("inf")).amin(1)
    hi = scores.masked_fill(chosen, float("-inf")).amax(1)
    ok = bool(((lo >= kth - eps) & (hi <= kth + eps)).all()) and bool((sel[:, 1:] > sel[:, :-1]).all())
    return {"ok": ok, "config": cfg, "exact_match_rows": int((sel == want).all(1).sum()), "rows": int(sel.shape[0]),
            "same_positions_frac": float((sel == want).float().mean())}


def _indexer_eager(d, K):
    """The reference formula in torch: gather the paged keys, dequantise, score every position, top-k, sort."""
    rows = _all_rows(d["tbl"], d["L"])

    def eager():
        kd = d["keys"][rows].to(torch.bfloat16) * d["ks"][rows].unsqueeze(-1).to(torch.bfloat16)
        qd = d["q8"].to(torch.bfloat16) * d["qs"][..., None].to(torch.bfloat16)
        s = torch.einsum("thd,tld->thl", qd, kd).relu_()
        sc = torch.einsum("th,thl->tl", d["w"].float(), s.float())
        return torch.sort(torch.topk(sc, K, dim=1).indices, dim=1).values
    return eager


def _indexer_shape(res):
    return (2, 1024, 64) if SMOKE else ((2 if res["warm"] else 32), 128 * 1024, 2048)


def _indexer_configs(base, fmt):
    """Swept configs: the heuristic (lean streaming score pass, bf16 dot, the pipeliner's async copies),
    its FP8 tensor-core dots (DOT 1: each 32-deep step added exactly; DOT 2: no promotion), and candidate
    (CAND 1: group top-2; KT 16: no overflow expected) / occupancy / tile-size / pipeline-depth variants."""
    from codegen.triton.indexer_topk import default_kt
    if fmt != "fp8":
        return [base, dict(base, KT=32, CAND=1), dict(base, SPLITS=2 * base["SPLITS"])]
    d0 = dict(base, DOT=0)
    return [base, d0, dict(base, KT=8), dict(base, KT=32, CAND=1), dict(base, KT=64, CAND=1),
            dict(base, SPLITS=2 * base["SPLITS"]), dict(base, MERGE_TILE=4096),
            dict(base, BLOCK_N=64, KT=default_kt(64, 2048, 1 << 17), SPLITS=2 * base["SPLITS"]),
            dict(base, BLOCK_N=256, KT=default_kt(256, 2048, 1 << 17), num_warps=8, SPLITS=max(1, base["SPLITS"] // 2))]


def _block_view(pool, fill=0):
    """The same rows as a block view [NB, BLOCK_SIZE, ...] cut from a larger byte buffer: each block is a page
    of a packed row (96 foreign bytes after it), as the packed block pool (issue 7) hands kernels."""
    nb = pool.shape[0] // BLOCK_SIZE
    row = pool[0].numel() * pool.element_size()
    buf = torch.full((nb, BLOCK_SIZE * row + 96), fill, dtype=torch.uint8, device=pool.device)
    v = buf[:, :BLOCK_SIZE * row].view(pool.dtype).view(nb, BLOCK_SIZE, *pool.shape[1:])
    v.copy_(pool.view(nb, BLOCK_SIZE, *pool.shape[1:]))
    return v


def sec_indexer(res):
    from codegen.triton.indexer_topk import heuristic
    T, L, K = _indexer_shape(res)
    for fmt in ("fp8", "mxfp4"):
        d = _indexer_inputs(T, L, fmt=fmt)
        base_cfg = heuristic({"T": 32, "L": L, "K": K}, "h200")
        configs = _indexer_configs(base_cfg, fmt)
        for i, cfg in enumerate(configs):
            m = _rec(res, f"indexer_decode_{fmt}_cfg{i}", _indexer_call(d, K, cfg), _indexer_bytes(d, K),
                     2 * T * 32 * L * 128, optional=i > 0 or fmt != "fp8", config=cfg, T=T, L=L, topk=K)
            if m is not None:
                stats = {}
                _indexer_call(d, K, cfg, stats=stats)()
                m["overflow"] = stats
        if fmt == "fp8":   # pools as block views cut from a packed byte buffer (read in place)
            dv = dict(d, keys=_block_view(d["keys"]), ks=_block_view(d["ks"]))
            _rec(res, "indexer_decode_fp8_block_view_cfg0", _indexer_call(dv, K, configs[0]), _indexer_bytes(d, K),
                 2 * T * 32 * L * 128, config=configs[0], T=T, L=L, topk=K)
            _check(res, "indexer_decode_fp8_block_view_cfg0_vs_ir_reference", lambda: _indexer_check(dv, K, configs[0]))
            dot2 = dict(configs[0], DOT=2)   # FP8 dots without exact promotion: fast, but outside the tolerance
            _rec(res, "indexer_decode_fp8_dot2_unpromoted", _indexer_call(d, K, dot2), _indexer_bytes(d, K), config=dot2)
            _check(res, "indexer_decode_fp8_dot2_unpromoted_vs_ir_reference", lambda: _indexer_check(d, K, dot2))
            del dv
        for i in ((0, 2, 3) if fmt == "fp8" else (0, 1)):   # the score kernel alone: the rest is the candidates' merge
            _rec(res, f"indexer_decode_{fmt}_score_only_cfg{i}", _indexer_call(d, K, configs[i], stop_after="score"),
                 _indexer_bytes(d, K), optional=True, config=configs[i])
        for i, cfg in enumerate(configs[:3]):
            _check(res, f"indexer_decode_{fmt}_cfg{i}_vs_ir_reference", lambda: _indexer_check(d, K, cfg))
        if fmt == "fp8":
            _rec(res, "indexer_decode_fp8_peer_torch_eager", _indexer_eager(d, K), _indexer_bytes(d, K), peer=True)
        del d
        _free()


# ------------------------------------------------------------------------------------------ mla
def _mla_inputs(T, H, K, ctx, fmt="fp8", seed=1, raw=False):
    """raw: random e4m3 codes straight into the pool (long contexts: no fp32 copy of the pool)."""
    from codegen.triton._paging import paging_args
    from codegen.triton.mla_prefill import quantize_latent_fp8, quantize_latent_nvfp4
    g = torch.Generator(device=DEV).manual_seed(seed)
    dn, dr, dv, kv = 128, 64, 128, 512
    ls, ps = 1.0, 1.0
    if raw:
        pool, ls = _random_fp8((T * ctx, kv + dr), g), 2.0 ** -6
    else:
        lat = torch.randn(T * ctx, kv + dr, device=DEV, generator=g)
        if fmt == "fp8":
            pool, ls = quantize_latent_fp8(lat)
        elif fmt == "nvfp4":
            pool, ls, ps = quantize_latent_nvfp4(lat, kv)
        else:
            pool = lat.to(torch.bfloat16)
        del lat
    sels = [torch.rand(T, ctx, device=DEV, generator=g).topk(K, dim=1).indices.sort(dim=1).values if K else None
            for _ in range(3)]   # rotated so that repeated runs do not re-read rows from L2
    tbl, req = _table(T, ctx, g), torch.arange(T, device=DEV)
    return dict(qn=torch.randn(T, H, dn, device=DEV, generator=g).to(torch.bfloat16),
                qp=torch.randn(T, H, dr, device=DEV, generator=g).to(torch.bfloat16),
                kvb=(torch.randn(H * (dn + dv), kv, device=DEV, generator=g) * kv ** -0.5).to(torch.bfloat16),
                pool=pool, ls=ls, ps=ps, sels=sels, fmt=fmt, ctx=ctx, K=K, H=H, tbl=tbl, req=req,
                paging=paging_args(tbl, req, BLOCK_SIZE, DEV),
                pos=torch.full((T,), ctx - 1, device=DEV, dtype=torch.int64))


def _q_abs(d):
    from codegen.triton.mla_sparse import split_kv_b
    return torch.einsum("thn,hnk->thk", d["qn"], split_kv_b(d["kvb"], d["H"], 128)[0])


def _latent_call(d, config=None, dense=False, rows=None, rows_fn=None):
    """The kernel part: q~ = W_UK^T q_nope precomputed, attention over latent rows only. The selection
    is d's positions (rotated, mapped through the block table in-kernel), pool `rows`, or `rows_fn()`
    (the indexer emitting rows, for a whole decode step); dense: the whole causal context."""
    from codegen.triton.mla_sparse import sparse_latent_attention
    q_abs, it = _q_abs(d), [0]
    by_rows = rows is not None or rows_fn is not None

    def run():
        it[0] = (it[0] + 1) % 3
        s = None if dense else rows_fn() if rows_fn else (rows if rows is not None else d["sels"][it[0]])
        return sparse_latent_attention(q_abs, d["qp"], d["pool"], d["pos"], None if by_rows else d["paging"], SCALE, s,
                                       latent_format=d["fmt"], latent_scale=d["ls"], pe_scale=d["ps"], config=config,
                                       max_context=d["ctx"])
    return run


def _mla_bytes(T, H, rows, row_bytes, idx_bytes=8):
    return T * rows * (row_bytes + idx_bytes) + T * H * (576 * 2 + 512 * 4 + 4)


def _mla_check(d, cfg):
    from codegen.triton.mla_prefill import dequantize_latent
    from codegen.triton.mla_sparse import mla_sparse_decode
    from ir.ref import mla as ref
    sel, H = d["sels"][0], d["H"]
    meta = (d["pos"], d["req"], d["tbl"], BLOCK_SIZE, SCALE, sel)
    o, lse = mla_sparse_decode(d["qn"], d["qp"], d["pool"], d["kvb"], *meta, latent_format=d["fmt"],
                               latent_scale=d["ls"], pe_scale=d["ps"], return_lse=True, config=cfg)
    deq = dequantize_latent(d["pool"].reshape(-1, d["pool"].shape[-1]), d["fmt"], 512, d["ls"], d["ps"])
    want = ref.mla_attention(d["qn"].float(), d["qp"].float(), deq, d["kvb"].float(), *meta, "absorbed")
    W = d["kvb"].double().view(H, 256, 512)
    c = deq[_all_rows(d["tbl"], d["ctx"]).gather(1, sel)].double()
    z = SCALE * (torch.einsum("thk,tlk->thl", torch.einsum("thn,hnk->thk", d["qn"].double(), W[:, :128]), c[..., :512])
                 + torch.einsum("thr,tlr->thl", d["qp"].double(), c[..., 512:]))
    lse64 = torch.logsumexp(z, dim=-1)
    e_o = float((o.float() - want).norm() / want.norm())
    e_l = float((lse.double() - lse64).norm() / lse64.norm())
    return {"ok": e_o < 2e-2 and e_l < 2e-2 and bool(torch.isfinite(o).all()), "config": cfg, "rel_err_o": e_o,
            "rel_err_lse": e_l}


def _mla_eager(d):
    """The reference formula in torch: gather + dequantise the selected rows, softmax, value sum."""
    q_abs = _q_abs(d)
    rows = _all_rows(d["tbl"], d["ctx"]).gather(1, d["sels"][0])

    def eager():
        c = d["pool"].view(torch.uint8)[rows].view(torch.float8_e4m3fn).to(torch.bfloat16) * d["ls"]
        z = (torch.einsum("thk,tlk->thl", q_abs, c[..., :512]) +
             torch.einsum("thr,tlr->thl", d["qp"], c[..., 512:])).float() * SCALE
        lse = torch.logsumexp(z, -1)
        return torch.einsum("thl,tlk->thk", torch.exp(z - lse[..., None]).to(torch.bfloat16), c[..., :512]), lse
    return eager


def _mla_shape(res):
    T, H, K, ctx = (2 if res["warm"] else 64), 12, 2048, 16384
    return (2, H, 64, 256) if SMOKE else (T, H, K, ctx)


def _mla_configs(base, fmt):
    """The heuristic (heads-major ORIENT 1), 8 warps, the previous rows-major default (ORIENT 0, SUB 4), and
    no row prefetch with a deeper pipeline."""
    if fmt != "fp8":
        return [base, dict(base, BLOCK_N=64 if base["BLOCK_N"] == 32 else 32)]
    return [base, dict(base, num_warps=8), dict(base, ORIENT=0, BLOCK_N=64, SUB=4, num_stages=1, PREFETCH=1),
            dict(base, SUB=1, BLOCK_N=32, num_stages=3, PREFETCH=0)]


def sec_mla(res):
    from codegen.triton.mla_sparse import heuristic
    T, H, K, ctx = _mla_shape(res)
    for fmt in ("fp8", "nvfp4", "bf16"):
        d = _mla_inputs(T, H, K, ctx, fmt)
        base_cfg = heuristic({"H": H, "L": K, "fmt": {"bf16": 0, "fp8": 1, "nvfp4": 2}[fmt]}, "h200")
        configs = _mla_configs(base_cfg, fmt)
        flops = 2 * T * H * K * (576 + 512)
        nbytes = _mla_bytes(T, H, K, d["pool"].shape[1] * d["pool"].element_size())
        for i, cfg in enumerate(configs):
            _rec(res, f"mla_sparse_decode_{fmt}_cfg{i}", _latent_call(d, cfg), nbytes, flops, config=cfg,
                 optional=i > 0 or fmt != "fp8", T=T, H=H, topk=K)
        if fmt == "fp8":   # the model's path: the fused indexer hands attention pool rows (no block-table read)
            rows = _all_rows(d["tbl"], ctx).gather(1, d["sels"][0])
            _rec(res, "mla_sparse_decode_fp8_rows_input", _latent_call(d, configs[0], rows=rows), nbytes, flops,
                 config=configs[0], T=T, H=H, topk=K)
            dv = dict(d, pool=_block_view(d["pool"]))   # a block view cut from a packed byte buffer
            _rec(res, "mla_sparse_decode_fp8_block_view_cfg0", _latent_call(dv, configs[0]), nbytes, flops,
                 config=configs[0], T=T, H=H, topk=K)
            _check(res, "mla_sparse_decode_fp8_block_view_cfg0_vs_ir_reference", lambda: _mla_check(dv, configs[0]))
            del dv
        for i, cfg in enumerate(configs[:2] if fmt == "fp8" else configs[:1]):
            _check(res, f"mla_sparse_decode_{fmt}_cfg{i}_vs_ir_reference", lambda: _mla_check(d, cfg))
        if fmt == "fp8":
            _rec(res, "mla_sparse_decode_fp8_peer_torch_eager", _mla_eager(d), nbytes, flops, peer=True)
        del d
        _free()


# ----------------------------------------------------------------------------------------- step
def _best_structure(path, family, keys):
    """The structural knobs (keys) of the fastest measured config of `family` in an earlier section."""
    try:
        ms = json.load(open(path)).get("measurements", [])
        cand = [m for m in ms if m["name"].startswith(family) and "score_only" not in m["name"] and m.get("config")]
        best = min(cand, key=lambda m: m.get("median_ms_graph", m["median_ms"]))
        return {k: best["config"][k] for k in keys if k in best["config"]}
    except Exception:  # noqa: BLE001  (no earlier section: heuristics alone)
        return {}


def sec_step(res):
    """Per decode step, one token per request: indexer + sparse MLA vs dense MLA, FP8 caches."""
    from codegen.triton.indexer_topk import default_kt, default_kt_pairs
    from codegen.triton.indexer_topk import heuristic as ih
    from codegen.triton.mla_sparse import heuristic as mh
    B, H, K = (2 if res["warm"] else 16), 12, 2048
    lengths = (32 * 1024, 128 * 1024, 1024 * 1024)
    if SMOKE:
        B, K, lengths = 2, 64, (512, 1024)
    here = os.path.dirname(res["path"])
    ib = _best_structure(os.path.join(here, "indexer.json"), "indexer_decode_fp8_cfg",
                         ("BLOCK_N", "CAND", "DOT", "MERGE_TILE", "num_warps", "num_stages"))
    mb = _best_structure(os.path.join(here, "mla.json"), "mla_sparse_decode_fp8_cfg",
                         ("ORIENT", "BLOCK_N", "SUB", "PREFETCH", "num_warps", "num_stages"))
    res["structure"] = {"indexer": ib, "mla": mb}
    for L in lengths:
        di = _indexer_inputs(B, L, seed=2)
        dm = _mla_inputs(B, H, 0, L, "fp8", seed=3, raw=True)
        dm["tbl"], dm["paging"] = di["tbl"], _paging_of(di["tbl"], B)   # one block table for both pools
        icfg = dict(ih({"T": B, "L": L, "K": K}, "h200"), **ib)
        icfg["KT"] = (default_kt_pairs if icfg.get("CAND") else default_kt)(icfg["BLOCK_N"], K, L)
        rows = _indexer_call(di, K, icfg, output="rows")
        sparse_cfg = dict(mh({"H": H, "L": K, "fmt": 1}, "h200"), **mb)
        dense_cfg = dict(mh({"H": H, "L": L, "fmt": 1}, "h200"), **mb)
        sparse_mla = _latent_call(dm, sparse_cfg, rows=rows())
        step = _latent_call(dm, sparse_cfg, rows_fn=rows)
        dense = _latent_call(dm, dense_cfg, dense=True)
        b_idx = _indexer_bytes(di, K)
        b_sp, b_dn = _mla_bytes(B, H, K, 576), _mla_bytes(B, H, L, 576, 0)
        mi = _rec(res, f"step_indexer_L{L}", rows, b_idx, config=icfg, B=B, L=L)
        ms = _rec(res, f"step_sparse_mla_L{L}", sparse_mla, b_sp, config=sparse_cfg, B=B, L=L)
        mt = _rec(res, f"step_indexer_plus_sparse_mla_L{L}", step, b_idx + b_sp, B=B, L=L)
        md = _rec(res, f"step_dense_mla_L{L}", dense, b_dn, config=dense_cfg, B=B, L=L)
        if mt and md:
            res.setdefault("step", []).append({
                "L": L, "B": B, "bytes_sparse": b_idx + b_sp, "bytes_dense": b_dn, "bytes_ratio": (b_idx + b_sp) / b_dn,
                "time_ratio_graph": mt["median_ms_graph"] / md["median_ms_graph"],
                "time_ratio_plain": mt["median_ms"] / md["median_ms"],
                "indexer_ms": mi and mi["median_ms_graph"], "sparse_mla_ms": ms and ms["median_ms_graph"],
                "dense_ms": md["median_ms_graph"]})
        del di, dm
        _free()


def _paging_of(tbl, B):
    from codegen.triton._paging import paging_args
    return paging_args(tbl, torch.arange(B, device=DEV), BLOCK_SIZE, DEV)


# -------------------------------------------------------------------------------------- prefill
def sec_prefill(res):
    from codegen.triton.mla_prefill import mla_prefill
    from ir.ref import mla as ref
    g = torch.Generator(device=DEV).manual_seed(4)
    P, H, dn, dr, dv, kv = (16 if SMOKE else 64 if res["warm"] else 1024), 16, 128, 64, 128, 512
    tp = torch.cat([torch.arange(P), torch.arange(P)]).to(DEV)
    tr = torch.cat([torch.zeros(P), torch.ones(P)]).long().to(DEV)
    tbl = _table(2, P, g)
    qn = torch.randn(2 * P, H, dn, device=DEV, generator=g).to(torch.bfloat16)
    qp = torch.randn(2 * P, H, dr, device=DEV, generator=g).to(torch.bfloat16)
    lat = torch.randn(tbl.numel() * BLOCK_SIZE, kv + dr, device=DEV, generator=g).to(torch.bfloat16)
    kvb = (torch.randn(H * (dn + dv), kv, device=DEV, generator=g) * kv ** -0.5).to(torch.bfloat16)
    call = lambda: mla_prefill(qn, qp, lat, kvb, tp, tr, tbl, BLOCK_SIZE, SCALE)  # noqa: E731
    _rec(res, "mla_prefill_dense_bf16", call, flops=2 * 2 * (P * P / 2) * H * (dn + dr + dv), optional=True,
         graph=False, T=2 * P, H=H)

    def check():
        want = ref.mla_attention(qn.float(), qp.float(), lat.float(), kvb.float(), tp, tr, tbl, BLOCK_SIZE, SCALE, None,
                                 "decompressed")
        e = float((call().float() - want).norm() / want.norm())
        return {"ok": e < 1e-2, "rel_err": e}
    _check(res, "mla_prefill_dense_bf16_vs_ir_reference", check)


# ---------------------------------------------------------------------------------------- peers
def sec_peers(res):
    """torch.compile of the two reference formulas, last, while the budget lasts."""
    T, L, K = _indexer_shape(res)
    d = _indexer_inputs(T, L)
    cf = _compiled(res, "indexer", _indexer_eager(d, K))
    if cf is not None:
        _rec(res, "indexer_decode_fp8_peer_torch_compile", cf, _indexer_bytes(d, K), peer=True)
    del d, cf
    T, H, K, ctx = _mla_shape(res)
    d = _mla_inputs(T, H, K, ctx, "fp8")
    cf = _compiled(res, "mla", _mla_eager(d))
    if cf is not None:
        _rec(res, "mla_sparse_decode_fp8_peer_torch_compile", cf, _mla_bytes(T, H, K, 576), 2 * T * H * K * 1088,
             peer=True)


# --------------------------------------------------------------------------------------- driver
def run_section(name, warm, path, part=(0, 1)):
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"section": name, "warm": warm, "warm_part": part, "measurements": [], "checks": [], "errors": [],
           "path": path}
    t0 = time.time()
    hbm = os.path.join(os.path.dirname(path), "hbm.json")
    if name != "hbm" and os.path.exists(hbm):
        h = json.load(open(hbm))
        res["read_TBps"] = max(h.get("read_TBps") or 0, h.get("copy_TBps") or 0) or None  # the larger ceiling
    try:
        globals()["sec_" + name](res)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"section {name}: {e!r}\n{traceback.format_exc()[-2000:]}")
    res["seconds"] = time.time() - t0
    json.dump(res, open(path, "w"), default=str)


def _summary(doc):
    ms = {m["name"]: m for sec in doc["sections"].values() for m in sec.get("measurements", [])}
    for fam in ("indexer_decode_fp8_cfg", "mla_sparse_decode_fp8_cfg", "indexer_decode_mxfp4_cfg",
                "mla_sparse_decode_nvfp4_cfg", "mla_sparse_decode_bf16_cfg"):
        cand = [m for n, m in ms.items() if n.startswith(fam) and "frac_of_measured_hbm" in m]
        if cand:
            best = max(cand, key=lambda m: m["frac_of_measured_hbm"])
            doc.setdefault("best", {})[fam[:-4]] = {k: best.get(k) for k in (
                "name", "config", "median_ms_graph", "median_ms", "TBps", "frac_of_measured_hbm")}
    doc["vs_peers"] = {}
    for fam in ("indexer_decode_fp8", "mla_sparse_decode_fp8"):
        mine = doc.get("best", {}).get(fam)
        for peer in ("peer_torch_eager", "peer_torch_compile"):
            p = ms.get(f"{fam}_{peer}")
            if mine and p:   # peers launch plainly: compare plain-launch medians
                doc["vs_peers"][f"{fam}: {peer} / {mine['name']}"] = p["median_ms"] / mine["median_ms"]
    lines = ["=== name | ms (graph) | ms (plain) | fraction of measured HBM BW ==="]
    lines += [f"{m['name']:<44} {m.get('median_ms_graph', float('nan')):9.4f} {m['median_ms']:9.4f} "
              f"{m.get('frac_of_measured_hbm', float('nan')):6.3f}" for m in ms.values()]
    for s, sec in doc["sections"].items():
        lines += [f"check {c}" for c in sec.get("checks", [])]
        lines += [f"ERROR {s}: {e[:400]}" for e in sec.get("errors", []) + sec.get("warm_errors", [])]
        lines += [f"skipped {s}: {sec['skipped']}"] if sec.get("skipped") else []
    lines += [f"step {st}" for st in doc["sections"].get("step", {}).get("step", [])]
    lines += [f"best {doc.get('best')}", f"hbm {doc['hbm']}", f"vs_peers {doc['vs_peers']}",
              f"seconds {doc['seconds']:.1f}"]
    return "\n".join(lines)


def main():
    import triton
    t0 = time.time()
    budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 250.0
    tmp = tempfile.mkdtemp()
    doc = {"machine": {"gpu": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "host": platform.node(),
                       "python": platform.python_version()},
           "torch": torch.__version__, "triton": triton.__version__, "command": " ".join([sys.executable] + sys.argv),
           "sections": {}}
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_DEADLINE=str(t0 + budget))
    me = os.path.abspath(__file__)
    warm = [subprocess.Popen([sys.executable, me, "--section", s, "--warm", f"{k}/{n}", "--out", f"{tmp}/{s}.warm{k}.json"],
                             env=env) for s, n in WARM_PARTS.items() for k in range(n) if not SMOKE]
    for p in warm:
        try:
            p.wait(timeout=max(1.0, t0 + WARM_CAP_S - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    doc["warm_compile_s"] = time.time() - t0
    for s in SECTIONS:
        path = f"{tmp}/{s}.json"
        try:
            subprocess.run([sys.executable, me, "--section", s, "--out", path], env=env, check=False,
                           timeout=max(5.0, t0 + budget + 20 - time.time()))
            doc["sections"][s] = json.load(open(path))
        except Exception as e:  # noqa: BLE001
            doc["sections"][s] = {"errors": [repr(e)]}
        for k in range(WARM_PARTS.get(s, 0)):
            if os.path.exists(f"{tmp}/{s}.warm{k}.json"):
                doc["sections"][s].setdefault("warm_errors", []).extend(json.load(open(f"{tmp}/{s}.warm{k}.json"))["errors"])
        if os.environ.get("OUT"):   # partial document after every section (a killed run still reports)
            open(os.path.join(os.environ["OUT"], "attention.partial.json"), "w").write(json.dumps(doc, default=str))
    hbm = doc["sections"].get("hbm", {})
    doc["hbm"] = {"copy_TBps": hbm.get("copy_TBps"), "read_TBps": hbm.get("read_TBps")}
    doc["seconds"] = time.time() - t0
    summary = _summary(doc)
    text = json.dumps(doc, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "attention.json"), "w").write(text)
    print(summary)


if __name__ == "__main__":
    if "--section" in sys.argv:
        part = tuple(map(int, sys.argv[sys.argv.index("--warm") + 1].split("/"))) if "--warm" in sys.argv else (0, 1)
        run_section(sys.argv[sys.argv.index("--section") + 1], "--warm" in sys.argv, sys.argv[sys.argv.index("--out") + 1],
                    part)
    else:
        main()
