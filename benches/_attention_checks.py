"""Helpers of benches/bench_attention_decode.py: graph replay vs eager (the PDL-contract check), the
registers / spills of every compiled indexer and MLA kernel, and the indexer configs it compares."""

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


def idx_previous_config(T, L):
    """The session-8 heuristic (committed before this change): short contexts score, then select in parallel
    (SELECT 1: `_select_kernel` + `_place_kernel`, a memset before); long contexts unchanged."""
    from codegen.triton.indexer_topk import default_kt, heuristic
    nt = -(-L // 128)
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
    21.1 / 26.4): one program streaming 4096 keys costs ~4.5 us (~4000 SASS instructions per thread at 8 warps)."""
    from codegen.triton.indexer_topk import heuristic
    base = heuristic({"T": T, "L": L, "K": K, "HI": 32, "DI": 128}, "cpu" if SMOKE else "h200")
    if SMOKE:
        f = dict(base, KT=base["BLOCK_N"], SELECT=2, SPLITS=4, SELECT_TILE=256, SELECT_WB=64, SELECT_PARTS=4)
        return base, [base, f, dict(f, SELECT_TILE=64, SELECT_WB=16), dict(base, SELECT=1, SELECT_PARTS=4)]
    if base["KT"] == base["BLOCK_N"]:
        two = dict(base, SELECT=2, num_warps=8, SELECT_TILE=4096, SELECT_WB=256, SELECT_PARTS=16, SELECT_WARPS=8)
        for k in ("FILTER", "FILTER_PARTS", "SELECT_RES"):
            two.pop(k, None)
        out = [two, dict(two, num_warps=4), dict(two, SELECT_PARTS=32), dict(two, SELECT_PARTS=64, SELECT_WARPS=4),
               dict(two, SELECT_WARPS=4, SELECT_TILE=2048),
               dict(two, BLOCK_N=64, KT=64, SPLITS=2 * two["SPLITS"]) if L <= 8192 else
               dict(two, SPLITS=max(1, two["SPLITS"] // 2))]
        out = out[:2] if T > 1 else out
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
    """(heuristic's config, variants) of the F16 path (fp16 dots, per-head power-of-two query scaling): the session-9
    default (no LSUM), LSUM 1 (softmax denominators per row lane, summed once after the loop: 7 barriers per step
    instead of 10, 671 SASS instructions per thread against 696, Triton 3.7 build) with 2-4 stages (4: gathered rows
    two steps ahead, 110.6 KB of shared memory, still 2 programs per SM) and CHUNK 256. Session 10 measured and
    removed (batch 64): an L1 prefetch of the piece's selection, rescaling only where a maximum moved, the query
    operand re-laid out from shared memory under a 168-register cap (3 programs per SM): 74.7-106 us vs 74.2."""
    from codegen.triton.mla_sparse import heuristic
    base = heuristic({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "sparse": 1, "T": T, "bi": 0}, "cpu" if SMOKE else "h200")
    if SMOKE:
        return base, [base, dict(base, F16=1), dict(base, F16=1, LSUM=1)]
    s9 = dict(ORIENT=1, BLOCK_H=16, BLOCK_N=32, num_warps=4, PREFETCH=1, F16=1,
              **(dict(num_stages=3, CHUNK=512) if T >= 32 else dict(num_stages=1, CHUNK=32)))
    if T == 1:
        alt = [s9, dict(s9, LSUM=1), dict(s9, LSUM=1, num_stages=2), dict(s9, LSUM=1, CHUNK=64, num_stages=2)]
    else:
        alt = [s9, dict(s9, LSUM=1), dict(s9, num_stages=4), dict(s9, LSUM=1, num_stages=4),
               dict(s9, LSUM=1, num_stages=4, CHUNK=256), dict(s9, LSUM=1, num_stages=2)]
    return base, [base] + [c for c in alt if c != base]
