"""H200 decode benchmark of sparse MLA and the indexer at the rank preset's shapes (issues 4 and 7), one JSON
document on stdout and in $OUT/attention_decode.json (rewritten after every measurement: a killed run keeps
what it measured).

    python benches/bench_attention_decode.py [--budget-s 130] [--sections idx_b32,long]   # 130: a 170-s call
    BENCH_SMOKE=1 python benches/bench_attention_decode.py     # CPU interpreter, tiny shapes: every path once

Sections, in this order (bf16 activations, FP8 caches, paged pools of 64-row blocks in random order):
  hbm      copy (read + write) and streaming-read bandwidth; the larger is the floor's bandwidth
  idx_b32  indexer, 32 tokens, context 128K
  idx_b1   indexer (rows out), 1 token, context 8192, 32 x 128 heads, top-2048, 48 input sets rotated
  mla_b64  sparse MLA, 64 tokens, top-2048 of 8K contexts
  mla_b1   sparse MLA, 1 token, 12 heads, top-2048 rows of an 8K context (the runtime's form="latent" call:
           selection as pool rows), 16 input sets rotated so rows come from HBM, not L2
  long     one token at 32K / 128K / 1M: indexer + sparse MLA vs dense MLA, measured time and byte ratios
Each section times the previous path (the previous heuristic's config; for MLA also its einsum + fp32 +
cast launcher) and the new kernels over a sweep of configs, all as CUDA-graph replays of the whole launcher
(device time, as the runtime's graphs run them), and checks the new default's results: MLA o~ / lse vs
float64, the indexer's selection vs the IR reference (exact, ties to the lower position). Ratios: bytes the
call must read / time vs the measured bandwidth, and previous / new. The indexer launcher is also captured
without `max_context` (graph safety: what the tuner does).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benches._report import graph_ms  # noqa: E402
sys.path.insert(0, HERE)
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import bench_attention as ba  # noqa: E402  (inputs, paging, indexer check; reads BENCH_SMOKE itself)

DEV = ba.DEV
BS = ba.BLOCK_SIZE
SCALE = ba.SCALE
T0 = time.time()
DOC = {"bench": "attention_decode", "command": " ".join([sys.executable] + sys.argv), "machine": {},
       "hbm": {}, "measurements": [], "checks": [], "errors": [], "skipped": []}


def _left(budget):
    return budget - (time.time() - T0)


def _save():
    text = json.dumps(DOC, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "attention_decode.json"), "w").write(text)
    return text


def gtime(fns, reps=7):
    """Median ms per call of fns (called in turn: rotated input sets) as one CUDA-graph replay (host clock in
    smoke mode)."""
    if SMOKE:
        t = time.time()
        for f in fns:
            f()
        return (time.time() - t) * 1e3 / len(fns)
    for f in fns:
        f()
    return graph_ms(fns, reps)


def measure(name, fns, nbytes, budget, **extra):
    if _left(budget) < 8:
        DOC["skipped"].append(name)
        return None
    try:
        t = time.time()
        ms = gtime(fns)
        m = {"name": name, "median_us": ms * 1e3, "bytes": nbytes, "wall_s": time.time() - t, **extra}
        bw = DOC["hbm"].get("floor_TBps")
        if bw:
            m["floor_us"] = nbytes / (bw * 1e12) * 1e6
            m["frac_of_measured_bw"] = m["floor_us"] / m["median_us"]
        DOC["measurements"].append(m)
        print(f"{name:58s} {m['median_us']:9.2f} us  {m.get('frac_of_measured_bw', 0) * 100:5.1f}% BW  "
              f"{extra.get('config', '')}", file=sys.stderr, flush=True)
        return m
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"{name}: {e!r}\n{traceback.format_exc()[-1200:]}")
        return None
    finally:
        _save()


def _summarize(tag, prev, new, best):
    """The summary row of a case: previous path, new default and best variant (µs), and the speedup."""
    DOC.setdefault("summary", {})[tag] = {"previous_us": prev["median_us"], "new_default_us": new and new["median_us"],
                                          "best_us": best["median_us"], "best_config": best["config"],
                                          "best_frac_bw": best.get("frac_of_measured_bw"),
                                          "speedup_best": prev["median_us"] / best["median_us"]}


def check(name, fn):
    try:
        DOC["checks"].append({"name": name, **fn()})
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"check {name}: {e!r}\n{traceback.format_exc()[-1200:]}")
    _save()


# --------------------------------------------------------------------------------------------- hbm
def sec_hbm():
    n = (1 << 20) if SMOKE else (2 << 30)
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    copy = 2 * n / (gtime([lambda: y.copy_(x)]) * 1e-3) / 1e12
    xf = x.view(torch.float32)
    read = n / (gtime([lambda: xf.sum()]) * 1e-3) / 1e12
    DOC["hbm"] = {"copy_TBps": copy, "read_TBps": read, "floor_TBps": max(copy, read)}
    del x, y


# --------------------------------------------------------------------------------------------- mla
MLA_PREV = dict(ORIENT=0, BLOCK_H=16, BLOCK_N=64, CHUNK=512, num_warps=4, num_stages=1, SUB=4, PREFETCH=1)
MLA_PREV_RECORD = dict(ORIENT=0, BLOCK_H=16, BLOCK_N=32, CHUNK=4096, num_warps=8, num_stages=1, SUB=4, PREFETCH=1)


def _mla_set(T, ctx, K, seed):
    d = ba._mla_inputs(T, 12, K, ctx, "fp8", seed=seed)
    d["rows"] = ba._all_rows(d["tbl"], ctx).gather(1, d["sels"][0])   # what the fused indexer hands attention
    return d


def _mla_new(d, cfg):
    from codegen.triton.mla_sparse import mla_sparse_decode
    return lambda: mla_sparse_decode(d["qn"], d["qp"], d["pool"], d["kvb"], d["pos"], d["req"], d["tbl"], BS, SCALE,
                                     d["rows"], latent_format="fp8", latent_scale=d["ls"], selection_rows=True,
                                     latent_out=True, return_lse=True, config=cfg)


def _mla_prev(d, cfg):
    """The previous launcher: q~ by einsum, attention in fp32, o~ cast to bf16 afterwards."""
    from codegen.triton.mla_sparse import sparse_latent_attention, split_kv_b
    W_UK = split_kv_b(d["kvb"], 12, 128)[0]

    def run():
        q_abs = torch.einsum("thn,hnk->thk", d["qn"], W_UK.to(d["qn"].dtype))
        o, lse = sparse_latent_attention(q_abs, d["qp"], d["pool"], d["pos"], None, SCALE, d["rows"],
                                         latent_format="fp8", latent_scale=d["ls"], config=cfg, block_size=BS)
        return o.to(d["qn"].dtype), lse
    return run


def _mla_check(d, cfg):
    from codegen.triton.mla_prefill import dequantize_latent
    o, lse = _mla_new(d, cfg)()
    deq = dequantize_latent(d["pool"], "fp8", 512, d["ls"], 1.0)
    c = deq[d["rows"]].double()
    W = d["kvb"].double().view(12, 256, 512)
    qa = torch.einsum("thn,hnk->thk", d["qn"].double(), W[:, :128])
    z = SCALE * (torch.einsum("thk,tlk->thl", qa, c[..., :512]) + torch.einsum("thr,tlr->thl", d["qp"].double(), c[..., 512:]))
    lse64 = torch.logsumexp(z, -1)
    o64 = torch.einsum("thl,tlk->thk", torch.softmax(z, -1), c[..., :512])
    e_o = float((o.double() - o64).norm() / o64.norm())
    e_l = float((lse.double() - lse64).norm() / lse64.norm())
    fin = bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all())
    return {"ok": fin and e_o < 2e-2 and e_l < 2e-3, "config": cfg, "rel_err_o": e_o, "rel_err_lse": e_l,
            "o_dtype": str(o.dtype)}


def _mla_variants(T):
    """The heuristic's config first, then the runner-up configs of the session-5/6 sweeps (ORIENT 1)."""
    from codegen.triton.mla_sparse import heuristic
    base = heuristic({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "sparse": 1, "T": T, "bi": 0}, "cpu" if SMOKE else "h200")
    if SMOKE:
        return base, [base]
    alt = [dict(base, BLOCK_N=32, num_warps=4, num_stages=1, CHUNK=32)] if T == 1 else \
        [dict(base, CHUNK=512), dict(base, CHUNK=128)]
    return base, [base] + alt


def sec_mla(T, budget, warm=None):
    ctx, K = (256, 64) if SMOKE else (8192, 2048)
    T = min(T, 2) if SMOKE else T
    n_sets = 1 if (SMOKE or T > 1 or warm) else 16
    sets = [_mla_set(T, ctx, K, seed=100 + i) for i in range(n_sets)]
    nbytes = T * K * (576 + 8) + 12 * 128 * 512 * 2 + T * 12 * (192 * 2 + 512 * 2 + 4)
    base, variants = _mla_variants(T)
    tag = f"mla_b{T}"
    if warm:
        k, n = warm
        for cfg in (variants + [MLA_PREV, MLA_PREV_RECORD])[k::n]:
            try:
                (_mla_prev if cfg.get("ORIENT") == 0 else _mla_new)(sets[0], cfg)()
            except Exception:  # noqa: BLE001
                pass
        return
    prev = measure(f"{tag}_previous_path", [_mla_prev(d, MLA_PREV) for d in sets], nbytes, budget, config=MLA_PREV)
    measure(f"{tag}_previous_record_config", [_mla_prev(d, MLA_PREV_RECORD) for d in sets], nbytes, budget,
            config=MLA_PREV_RECORD)
    new = measure(f"{tag}_new_default", [_mla_new(d, base) for d in sets], nbytes, budget, config=base)
    check(f"{tag}_new_default_vs_float64", lambda: _mla_check(sets[0], base))
    best = new
    for i, cfg in enumerate(variants[1:]):
        m = measure(f"{tag}_sweep{i}", [_mla_new(d, cfg) for d in sets], nbytes, budget, config=cfg)
        if m and (best is None or m["median_us"] < best["median_us"]):
            best = m
    if best is not None:
        check(f"{tag}_best_vs_float64", lambda: _mla_check(sets[0], best["config"]))
        if prev:
            _summarize(tag, prev, new, best)
    del sets
    if not SMOKE:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ indexer
def _idx_prev(L, T):
    """The session-5 heuristic (committed before session 6): DOT 0 (bf16 dots), no prefetch, no pre-selection."""
    from codegen.triton.indexer_topk import default_kt_pairs
    nt = -(-L // 128)
    if L <= 8 * 2048:
        return dict(BLOCK_N=128, KT=128, SPLITS=max(1, min(nt, round(8 * 132 / T))), num_warps=4, num_stages=3,
                    CAND=0, DOT=0, MERGE_TILE=2048)
    return dict(BLOCK_N=128, KT=default_kt_pairs(128, 2048, L), SPLITS=max(1, min(max(1, nt // 4), round(8 * 132 / T))),
                num_warps=4, num_stages=4, CAND=1, DOT=0, MERGE_TILE=2048)


def _idx_variants(T, L, K):
    """The heuristic's config first, then the session-6 variants, most informative first (a budget cut keeps
    them): FILTER 1 (parallel 22-bit pre-selection: the serial merges run over its survivors), PREFETCH 1
    (next tile in flight), DOT 3 (fp16 dots, e4m3 exact: one cvt per two codes) at num_stages 1 (fewer
    registers), fewer candidates (KT 16), more programs."""
    from codegen.triton.indexer_topk import default_kt_pairs, heuristic
    base = heuristic({"T": T, "L": L, "K": K, "HI": 32, "DI": 128}, "cpu" if SMOKE else "h200")
    if SMOKE:
        return base, [base, dict(base, DOT=3, PREFETCH=1, FILTER=1, FILTER_PARTS=4, MERGE_WARPS=4)]
    f = dict(base, DOT=3, num_stages=1)
    if T == 1:
        nt = L // 128
        out = [dict(f, FILTER=1, FILTER_PARTS=8), dict(f, FILTER=1, FILTER_PARTS=16), dict(f, FILTER=1, FILTER_PARTS=32),
               dict(f, FILTER=1, FILTER_PARTS=16, MERGE_TILE=4096), f, dict(f, BLOCK_N=64, KT=64, SPLITS=2 * nt)]
    else:
        sp, kp = base["SPLITS"], default_kt_pairs(64, K, L)
        out = [dict(f, PREFETCH=1, FILTER=1), dict(f, FILTER=1), dict(f, PREFETCH=1), f,
               dict(f, PREFETCH=1, FILTER=1, KT=16), dict(f, PREFETCH=1, FILTER=1, SPLITS=2 * sp),
               dict(f, PREFETCH=1, FILTER=1, FILTER_PARTS=64), dict(f, PREFETCH=1, FILTER=1, BLOCK_N=64, KT=kp, SPLITS=2 * sp),
               dict(base, num_stages=1, PREFETCH=1, FILTER=1)]
    return base, [base] + [c for c in out if c != base]


def sec_idx(T, budget, warm=None):
    T_, L, K = (min(T, 2), 1024, 64) if SMOKE else (T, 8192 if T == 1 else 128 * 1024, 2048)
    n_sets = 1 if (SMOKE or T > 1 or warm) else 48
    sets = [ba._indexer_inputs(T_, L, seed=200 + i) for i in range(n_sets)]
    nbytes = ba._indexer_bytes(sets[0], K)
    base, variants = _idx_variants(T_, L, K)
    prev_cfg = _idx_prev(L, T_) if not SMOKE else base
    tag = f"idx_b{T}"

    def call(d, cfg, **kw):
        return ba._indexer_call(d, K, cfg, output="rows", **kw)
    if warm:
        k, n = warm
        for cfg in (variants + [prev_cfg])[k::n]:
            try:
                call(sets[0], cfg)()
            except Exception:  # noqa: BLE001
                pass
        return
    prev = measure(f"{tag}_previous_heuristic", [call(d, prev_cfg) for d in sets], nbytes, budget, config=prev_cfg)
    new = measure(f"{tag}_new_default", [call(d, base) for d in sets], nbytes, budget, config=base)
    check(f"{tag}_new_default_vs_ir_reference", lambda: ba._indexer_check(sets[0], K, base))
    best = new
    for i, cfg in enumerate(variants[1:]):
        m = measure(f"{tag}_sweep{i}", [call(d, cfg) for d in sets], nbytes, budget, config=cfg)
        if m:
            st = {}
            call(sets[0], cfg, stats=st)()
            m["overflow"] = st
            if best is None or m["median_us"] < best["median_us"]:
                best = m
    if best is not None and best is not new:
        check(f"{tag}_best_vs_ir_reference", lambda: ba._indexer_check(sets[0], K, best["config"]))
    for i, cfg in enumerate(variants[1:]):   # every variant's selection (exactness first)
        if T == 1 or SMOKE or cfg.get("FILTER") or i < 3:
            check(f"{tag}_sweep{i}_vs_ir_reference", lambda: ba._indexer_check(sets[0], K, cfg))
    if best is not None:
        measure(f"{tag}_best_score_pass_only", [call(d, best["config"], stop_after="score") for d in sets], nbytes, budget,
                config=best["config"])
    if T == 1:   # graph safety: the launcher without max_context (the tuner's call) is captured
        from codegen.triton.indexer_topk import indexer_topk
        d = sets[0]
        m = measure(f"{tag}_new_default_no_max_context", [lambda: indexer_topk(
            d["q8"], d["qs"], d["w"], d["keys"], d["ks"], d["pos"], d["req"], d["tbl"], BS, K, output="rows",
            config=base)], nbytes, budget, config=base)
        DOC.setdefault("summary", {})["indexer_graph_capture_without_max_context"] = m is not None
    if prev and best:
        _summarize(tag, prev, new, best)
    del sets
    if not SMOKE:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- long context
def sec_long(budget):
    """One decode token at context L = 32K, 128K, 1M: the K3.1 Pro step (indexer emitting rows + sparse MLA
    over the top-2048 rows) vs K3's dense MLA over all L rows, default configs, measured times and the byte
    ratio (DESIGN T2 claims ~23% of dense bytes at long context)."""
    from codegen.triton.indexer_topk import indexer_topk
    from codegen.triton.mla_sparse import mla_sparse_decode
    K = 64 if SMOKE else 2048
    for L in ((512,) if SMOKE else (32768, 131072, 1 << 20)):
        if _left(budget) < 15:
            DOC["skipped"].append(f"long_L{L}")
            continue
        n_sets = 1 if SMOKE or L > 131072 else (4 if L <= 32768 else 2)   # rotated past L2 where they fit
        di = [ba._indexer_inputs(1, L, seed=300 + i) for i in range(n_sets)]
        dm = [ba._mla_inputs(1, 12, K, L, "fp8", seed=400 + i, raw=True) for i in range(n_sets)]
        for d in dm:
            d["rows"] = ba._all_rows(d["tbl"], L).gather(1, d["sels"][0])

        def idx(d):
            return lambda: indexer_topk(d["q8"], d["qs"], d["w"], d["keys"], d["ks"], d["pos"], d["req"], d["tbl"], BS, K,
                                        output="rows", max_context=L)

        def mla(d, sparse):
            return lambda: mla_sparse_decode(d["qn"], d["qp"], d["pool"], d["kvb"], d["pos"], d["req"], d["tbl"], BS,
                                             SCALE, d["rows"] if sparse else None, latent_format="fp8",
                                             latent_scale=d["ls"], selection_rows=sparse, latent_out=True,
                                             max_context=None if sparse else L)
        b_idx, b_sp, b_dn = ba._indexer_bytes(di[0], K), K * 584, L * 584
        mi = measure(f"long_L{L}_indexer_rows", [idx(d) for d in di], b_idx, budget)
        ms = measure(f"long_L{L}_sparse_mla_top{K}", [mla(d, True) for d in dm], b_sp, budget)
        md = measure(f"long_L{L}_dense_mla", [mla(d, False) for d in dm], b_dn, budget)
        if mi and ms and md:
            DOC.setdefault("summary", {})[f"long_L{L}"] = {
                "indexer_us": mi["median_us"], "sparse_mla_us": ms["median_us"], "dense_mla_us": md["median_us"],
                "time_ratio_sparse_step_vs_dense": (mi["median_us"] + ms["median_us"]) / md["median_us"],
                "byte_ratio_sparse_step_vs_dense": (b_idx + b_sp) / b_dn}
        del di, dm
        if not SMOKE:
            torch.cuda.empty_cache()


SECTIONS = (("idx", 32), ("idx", 1), ("mla", 64), ("mla", 1))
WARM_N = 3          # compile processes per section
WARM_CAP_S = 55     # measuring starts by then (anything not compiled yet compiles on first use)


def main():
    budget = float(sys.argv[sys.argv.index("--budget-s") + 1]) if "--budget-s" in sys.argv else 130.0
    if "--warm" in sys.argv:   # compile-only helper: one section's variants on small inputs
        kind, T, k, n = sys.argv[sys.argv.index("--warm") + 1].split(":")
        (sec_mla if kind == "mla" else sec_idx)(int(T), budget, warm=(int(k), int(n)))
        return
    import triton
    DOC["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"}
    # compile every variant first in parallel processes (Triton's disk cache), then measure on a quiet GPU
    warm = [] if SMOKE else [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", f"{kind}:{T}:{k}:{WARM_N}"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                             for kind, T in SECTIONS for k in range(WARM_N)
                             if "--sections" not in sys.argv or f"{kind}_b{T}" in sys.argv[sys.argv.index("--sections") + 1]]
    for p in warm:
        try:
            p.wait(timeout=max(1.0, T0 + WARM_CAP_S - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    DOC["warm_s"] = time.time() - T0
    try:
        sec_hbm()
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"hbm: {e!r}")
    only = sys.argv[sys.argv.index("--sections") + 1].split(",") if "--sections" in sys.argv else None
    for kind, T in SECTIONS:
        if only is not None and f"{kind}_b{T}" not in only:
            continue
        try:
            (sec_mla if kind == "mla" else sec_idx)(T, budget)
        except Exception as e:  # noqa: BLE001
            DOC["errors"].append(f"{kind} T={T}: {e!r}\n{traceback.format_exc()[-1500:]}")
    try:
        if only is None or "long" in only:
            sec_long(budget)
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"long: {e!r}\n{traceback.format_exc()[-1500:]}")
    DOC["seconds"] = time.time() - T0
    print(_save())


if __name__ == "__main__":
    main()
