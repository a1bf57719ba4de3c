"""Helpers of benches/bench_attention_decode.py and bench_mla_b64.py: graph replay vs eager (the PDL-contract check),
the registers / spills of every compiled indexer and MLA kernel, the indexer configs compared, and the sparse MLA
decode's inputs, launcher and float64 check."""

from __future__ import annotations

import os

import torch

from codegen.triton import _pdl

SMOKE = os.environ.get("BENCH_SMOKE") == "1"


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def graph_vs_eager(fn, replays=50):
    """Eager result vs the result of `replays` replays of one captured call (PDL on: a contract break races)."""
    if SMOKE:
        return {"ok": _same(fn(), fn()), "replays": 1}
    want = fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = fn()
    bad = 0
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
        bad += not _same(got, want)
    return {"ok": bad == 0, "replays": replays, "mismatched_replays": bad, "pdl": _pdl.launch_kwargs().get("PDL", False)}


def kernel_inventory():
    """Registers / spills / shared memory of every compiled indexer and MLA kernel (one entry per
    specialisation: its constexprs tell the variants apart)."""
    from codegen.triton import (_indexer_tiles, _mla_rows, _mla_tiles, _topk_fused, _topk_parallel, _topk_select,
                                mla_sparse)
    fns = [mla_sparse._mla_heads_kernel, _mla_rows._mla_sparse_kernel, _mla_tiles._combine_kernel,
           _topk_fused._place_select_kernel,
           _indexer_tiles._score_kernel, _indexer_tiles._rescore_kernel, _topk_select._merge_kernel,
           _topk_parallel._filter_kernel, _topk_parallel._select_kernel, _topk_parallel._place_kernel,
           _topk_fused._score_select_kernel]
    out = []
    for fn in fns:
        for caches in getattr(fn, "device_caches", {}).values():
            for k in list(caches[0].values()):
                try:
                    k._init_handles()
                    names = fn.arg_names
                    cx = {names[i[0]]: str(v) for i, v in getattr(k.src, "constants", {}).items()
                          if isinstance(i, tuple) and len(i) == 1 and names[i[0]].isupper()}
                    out.append({"kernel": fn.__name__, "n_regs": k.n_regs, "n_spills": k.n_spills,
                                "shared": k.metadata.shared, "num_warps": k.metadata.num_warps,
                                "num_stages": k.metadata.num_stages, "constexprs": cx})
                except Exception as e:  # noqa: BLE001
                    out.append({"kernel": fn.__name__, "error": repr(e)})
    return out


S10_SELECT2 = dict(BLOCK_N=128, KT=128, SPLITS=64, num_warps=8, num_stages=1, CAND=0, DOT=3, MERGE_TILE=2048,
                   SELECT=2, SELECT_TILE=4096, SELECT_WB=256, SELECT_PARTS=64, SELECT_WARPS=4)


def idx_previous_config(T, L):
    """The session-10 heuristic (committed before this change): one row at <= 8K, SELECT 2 in two launches (score +
    threshold, then `_place_select_kernel`); other short contexts SELECT 1 (`_select_kernel` + `_place_kernel`, a
    memset before); long contexts unchanged."""
    from codegen.triton.indexer_topk import default_kt, heuristic
    nt = -(-L // 128)
    if default_kt(128, 2048, L) * 4 >= 128 and L <= 8192 and T <= 1:
        return dict(S10_SELECT2, SPLITS=max(1, min(nt, round(8 * 132 / T))))
    if default_kt(128, 2048, L) * 4 >= 128:
        return dict(BLOCK_N=128, KT=128, SPLITS=max(1, min(nt, round(8 * 132 / T))), num_warps=4, num_stages=1,
                    CAND=0, DOT=3, MERGE_TILE=2048, FILTER=int(nt * 128 > 4 * 2048), FILTER_PARTS=16,
                    SELECT=1, SELECT_PARTS=16, SELECT_RES=2048)
    return heuristic({"T": T, "L": L, "K": 2048, "HI": 32, "DI": 128}, "h200")


def idx_variants(T, L, K):
    """(heuristic's config, variants). Short contexts: the two-launch select (SELECT 2, `_topk_fused`: histogram
    threshold by the last program to arrive, parallel placement, no memset) with its warps / parts / pass width /
    BLOCK_N / programs; long contexts (batch 32 at 128K, unchanged path): the default only. Session 9's first
    one-launch SELECT 2 (the last program streaming every key) measured 22.4-27.8 us at 8K and 63-79 us at 32K (vs
    21.1 / 26.4): one program streaming 4096 keys costs ~4.5 us (~4000 SASS instructions per thread at 8 warps).
    Session 11 (benches/results/h200-2026-11-30-s11): SELECT_COOP, one launch whose score programs spin until the
    last arriver publishes the threshold, publish their tiles' selected counts, spin until all are in, and place
    their own tiles (exact, graph == eager over 50 replays), measured 13.62 us (4 warps 13.36, BLOCK_N 64 14.14, two
    tiles per program 14.34) vs the two-launch SELECT 2's 13.54: the placement launch is not where the time goes.
    Removed. SELECT 3 (every placement part deriving the threshold itself from two launch-parity histogram sets, no
    last arriver) measured 13.82 us (8 warps), 13.85 (4 warps), 14.19 (32 parts) vs SELECT 2's 13.37 (4 warps 13.82)
    at batch 1 8K, and 26.59 vs 25.51 us in the indexer + MLA chain (attention_decode_final.json). Removed."""
    from codegen.triton.indexer_topk import heuristic
    base = heuristic({"T": T, "L": L, "K": K, "HI": 32, "DI": 128}, "cpu" if SMOKE else "h200")
    if SMOKE:
        f = dict(base, KT=base["BLOCK_N"], SELECT=2, SPLITS=4, SELECT_TILE=256, SELECT_WB=64, SELECT_PARTS=4)
        return base, [base, f, dict(f, SELECT_TILE=64, SELECT_WB=16), dict(base, SELECT=1, SELECT_PARTS=4)]
    if base.get("SELECT") == 2:   # one row at <= 8K: SELECT 2's 4-warp scoring
        out = [dict(base, num_warps=4)]
    elif base["KT"] == base["BLOCK_N"]:
        two = dict(base, SELECT=2, num_warps=8, SELECT_TILE=4096, SELECT_WB=256, SELECT_PARTS=16, SELECT_WARPS=8)
        for k in ("FILTER", "FILTER_PARTS", "SELECT_RES"):
            two.pop(k, None)
        out = [two, dict(two, num_warps=4)] if T > 1 else [two]
    else:   # long contexts: the default only (session 10: PREFETCH 1 under a 168-register cap, 3 programs per SM,
        # 481-483 us vs 433; uncapped, session 8: 656)
        out = []
    seen, uniq = [], []
    for c in [base] + out:
        if c not in seen:
            seen.append(c)
            uniq.append(c)
    return base, uniq


def mla_variants(T):
    """(heuristic's config, variants): the default and session 10's config (`mla_previous_config`, the same unless the
    heuristic changed). Session 11 measured and removed COMBINE (the batch-1 pieces merging their partials themselves
    after a spin on an arrival counter, no `_combine_kernel` launch; exact, graph == eager): 12.87 us vs 11.62 at 64
    pieces, 14.99 at 32, 15.92 at 128; the indexer + MLA chain 28.4 vs 25.4 with SELECT_COOP. Session 10's text:
    the F16 path (fp16 dots, per-head power-of-two query scaling): the session-9 default (no LSUM), LSUM 1
    (softmax denominators per row lane, summed once after the loop: 7 barriers per step instead of 10, 671 SASS
    instructions per thread against 696, Triton 3.7 build) with 2-4 stages (4: gathered rows two steps ahead, 110.6 KB
    of shared memory, still 2 programs per SM) and CHUNK 256. Session 10 measured and
    removed (batch 64): an L1 prefetch of the piece's selection, rescaling only where a maximum moved, the query
    operand re-laid out from shared memory under a 168-register cap (3 programs per SM): 74.7-106 us vs 74.2."""
    from codegen.triton.mla_sparse import heuristic
    base = heuristic({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "sparse": 1, "T": T, "bi": 0}, "cpu" if SMOKE else "h200")
    if SMOKE:
        return base, [base, dict(base, F16=1), dict(base, F16=1, LSUM=1)]
    s10 = mla_previous_config(T)
    return base, [base] + [c for c in [s10] if c != base]


def mla_previous_config(T):
    """The session-10 heuristic's config for 12 heads, top-2048 FP8 rows (still the heuristic's after session 11)."""
    return dict(ORIENT=1, BLOCK_H=16, BLOCK_N=32, num_warps=4, PREFETCH=1, F16=1,
                **(dict(num_stages=3, CHUNK=512, LSUM=1) if T >= 32 else dict(num_stages=1, CHUNK=32)))


def mla_set(T, ctx, K, seed):
    """Sparse MLA decode inputs (bench_attention's: 12 heads, FP8 latents) with the selected rows the fused indexer
    hands attention."""
    import bench_attention as ba
    d = ba._mla_inputs(T, 12, K, ctx, "fp8", seed=seed)
    d["rows"] = ba._all_rows(d["tbl"], ctx).gather(1, d["sels"][0])
    return d


def mla_call(d, cfg, absorbed=False):
    """The whole sparse MLA decode launcher (absorption, attention, combine) on `mla_set`'s inputs; absorbed: as the
    runtime runs it, q~ = W_UK^T q_nope computed once beforehand (the IR's `mla_absorb` node, which the runtime
    overlaps with the indexer on its side stream) and the launcher given q~ (`nope_dim`)."""
    import bench_attention as ba
    from codegen.triton._mla_combine import absorb_queries, split_kv_b
    from codegen.triton.mla_sparse import mla_sparse_decode
    q, extra = d["qn"], {}
    if absorbed:
        q = absorb_queries(d["qn"], split_kv_b(d["kvb"], d["H"], d["qn"].shape[2])[0], d["qn"].dtype)
        extra = {"nope_dim": d["qn"].shape[2]}
    return lambda: mla_sparse_decode(q, d["qp"], d["pool"], d["kvb"], d["pos"], d["req"], d["tbl"],
                                     ba.BLOCK_SIZE, ba.SCALE, d["rows"], latent_format="fp8", latent_scale=d["ls"],
                                     selection_rows=True, latent_out=True, return_lse=True, config=cfg, **extra)


def mla_check(d, cfg):
    """o~ / lse vs float64 on the dequantised rows, every output finite."""
    import bench_attention as ba
    from codegen.triton.mla_prefill import dequantize_latent
    o, lse = mla_call(d, cfg)()
    c = dequantize_latent(d["pool"], "fp8", 512, d["ls"], 1.0)[d["rows"]].double()
    W = d["kvb"].double().view(12, 256, 512)
    qa = torch.einsum("thn,hnk->thk", d["qn"].double(), W[:, :128])
    z = ba.SCALE * (torch.einsum("thk,tlk->thl", qa, c[..., :512]) +
                    torch.einsum("thr,tlr->thl", d["qp"].double(), c[..., 512:]))
    lse64, o64 = torch.logsumexp(z, -1), torch.einsum("thl,tlk->thk", torch.softmax(z, -1), c[..., :512])
    e_o = float((o.double() - o64).norm() / o64.norm())
    e_l = float((lse.double() - lse64).norm() / lse64.norm())
    fin = bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all())
    return {"ok": fin and e_o < 2e-2 and e_l < 2e-3, "config": cfg, "rel_err_o": e_o, "rel_err_lse": e_l}
