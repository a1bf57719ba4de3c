"""H200 decode benchmark of the DSA indexer select and sparse MLA at the rank preset's and issue 4's shapes, one
JSON document on stdout and in $OUT/attention_decode.json (rewritten after every measurement: a killed run keeps
what it measured).

    python benches/bench_attention_decode.py [--budget-s 120] [--sections idx_b1,idx_b1_32k,idx_b32,mla_b64,mla_b1,chain]
    BENCH_SMOKE=1 python benches/bench_attention_decode.py     # CPU interpreter, tiny shapes: every path once

Sections (bf16 activations, FP8 caches, paged pools of 64-row blocks in random order, 32 x 128 index heads,
top-2048, 12 MLA heads; every timing is a CUDA-graph replay of the whole launcher, inputs rotated where they fit
so caches come from HBM, not L2):
  hbm         copy (read + write) and streaming-read bandwidth; the larger is the floor's bandwidth
  idx_b1      indexer (rows out), 1 token, context 8192 (the rank step)     previous path vs new, variants
  idx_b1_32k  the same at context 32768
  idx_b8      8 tokens at context 8192 (the rank preset at batch 8)
  idx_b32     32 tokens at context 128K (issue 4)
  idx_b8_128k 8 tokens at context 128K (the materialised-scores default between batch 1 and 32)
  idx_b1_64k  1 token at context 64K, idx_b1_1m at 1M (the materialised-scores path at batch 1)
  mla_b64     sparse MLA, 64 tokens, top-2048 rows of 8K contexts (issue 4)
  mla_b1      sparse MLA, 1 token (the rank step)
  chain       indexer select then sparse MLA, one graph (two families back to back: the PDL gain at a boundary)
  chain_idx   two indexer selects back to back, one graph (SELECT 2 vs the previous path, PDL on / off)
Every new default is also timed with PDL off (`_pdl.set_enabled(False)` before capture) and checked: the indexer's
selection vs the IR reference (exact, ties to the lower position), MLA o~ / lse vs float64, and graph replay vs
eager bitwise over 50 replays with PDL on (a kernel breaking the PDL contract races). Ratios: bytes the call must
read / time vs the measured bandwidth (`frac_of_measured_bw`), and previous / new (`summary`; MLA also the best
opt-in F16 variant vs the default, checked the same way; the indexer also its best SELECT 2 variant). Breakdowns:
the best SELECT 2 config's score pass alone (its SCORE_ONLY specialisation, no memset), the long-context default's
score pass alone (`stop_after="score"`: the rest is candidate filter, merge and rescore; with SCORES 1 the rest is
select and placement, and the previous path's score pass is timed too; every SCORES variant selects the default's
rows, `scores_kernels` its score kernel's registers), MLA's best without the
query absorption, and at batch 64 MLA's default and best with every token reading token 0's rows (L2 resident: the
kernel's cost without HBM) and with contiguous 64-row blocks (`_mla_diagnostics`). `kernels`: registers, spills,
shared memory of every compiled indexer / MLA specialisation (`_attention_checks.kernel_inventory`);
`zeroed_workspace_after_all`: SELECT 2 and BUCKET 3 + ZERO left their counts at zero. SCORES 1 with a bucket
select: its launches timed as prefixes (`_select_breakdown`) and the boundary bucket's keys per row.
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
from codegen.triton import _pdl  # noqa: E402
from _attention_checks import graph_vs_eager, kernel_inventory, mla_variants as _mla_variants  # noqa: E402
from _attention_checks import idx_previous_config as _idx_prev, idx_variants as _idx_variants  # noqa: E402
from _attention_checks import mla_previous_config as _mla_prev  # noqa: E402
from _attention_checks import mla_call as _mla_call, mla_check as _mla_check, mla_set as _mla_set  # noqa: E402

BS, SCALE = ba.BLOCK_SIZE, ba.SCALE
T0 = time.time()
DOC = {"bench": "attention_decode", "command": " ".join([sys.executable] + sys.argv), "machine": {},
       "hbm": {}, "measurements": [], "checks": [], "errors": [], "skipped": [], "summary": {}}
BUDGET = float(sys.argv[sys.argv.index("--budget-s") + 1]) if "--budget-s" in sys.argv else 120.0


def _save():
    text = json.dumps(DOC, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "attention_decode.json"), "w").write(text)
    return text


def gtime(fns, reps=7):
    """Median ms per call of fns (called in turn) as one CUDA-graph replay (host clock in smoke mode)."""
    if SMOKE:
        t = time.time()
        for f in fns:
            f()
        return (time.time() - t) * 1e3 / len(fns)
    return graph_ms(fns, reps)


def _prime(fns):
    """One eager call on the stream graphs are captured on, so the zeroed workspaces (SELECT 2's histograms and
    counters: one set per stream) exist before capture and no graph carries their zero fill (before session 11 the
    first graph captured with a SELECT 2 config, often the one timed first, replayed a 520 KB fill)."""
    if SMOKE:
        return
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph(torch.cuda.CUDAGraph())   # creates the default capture stream
    cs = torch.cuda.graph.default_capture_stream
    cs.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cs):
        fns[0]()
    torch.cuda.current_stream().wait_stream(cs)
    torch.cuda.synchronize()


def measure(name, fns, nbytes, pdl=True, **extra):
    """Time fns (graph replay) with PDL on or off; records bytes / time vs the measured bandwidth."""
    if BUDGET - (time.time() - T0) < 6:
        DOC["skipped"].append(name)
        return None
    before = _pdl.set_enabled(pdl)
    try:
        _prime(fns)
        ms = gtime(fns)
        m = {"name": name, "median_us": ms * 1e3, "bytes": nbytes, "pdl": pdl and _pdl.launch_kwargs().get("PDL", False),
             **extra}
        bw = DOC["hbm"].get("floor_TBps")
        if bw:
            m["floor_us"] = nbytes / (bw * 1e12) * 1e6
            m["frac_of_measured_bw"] = m["floor_us"] / m["median_us"]
        DOC["measurements"].append(m)
        print(f"{name:44s} {m['median_us']:9.2f} us {m.get('frac_of_measured_bw', 0) * 100:5.1f}% BW  "
              f"{extra.get('config', '')}", file=sys.stderr, flush=True)
        return m
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"{name}: {e!r}\n{traceback.format_exc()[-1200:]}")
        return None
    finally:
        _pdl.set_enabled(before)
        _save()


def check(name, fn):
    if BUDGET - (time.time() - T0) < 4:
        DOC["skipped"].append(f"check {name}")
        return
    try:
        DOC["checks"].append({"name": name, **fn()})
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"check {name}: {e!r}\n{traceback.format_exc()[-1200:]}")
    _save()


def _summarize(tag, prev, new, ms):
    best = min((m for m in ms if m), key=lambda m: m["median_us"], default=None)
    if prev and best:
        DOC["summary"][tag] = {"previous_us": prev["median_us"], "new_default_us": new and new["median_us"],
                               "new_default_pdl_off_us": None, "best_us": best["median_us"],
                               "best_config": best.get("config"), "best_frac_bw": best.get("frac_of_measured_bw"),
                               "speedup_new_default": new and prev["median_us"] / new["median_us"],
                               "speedup_best": prev["median_us"] / best["median_us"]}
    return best


def sec_hbm():
    n = (1 << 20) if SMOKE else (2 << 30)
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ba.DEV)
    y = torch.empty_like(x)
    copy = 2 * n / (gtime([lambda: y.copy_(x)]) * 1e-3) / 1e12
    read = n / (gtime([lambda: x.view(torch.float32).sum()]) * 1e-3) / 1e12
    DOC["hbm"] = {"copy_TBps": copy, "read_TBps": read, "floor_TBps": max(copy, read)}


# ------------------------------------------------------------------------------------------ indexer
def _idx_shapes(tag):
    T, L = {"idx_b1": (1, 8192), "idx_b1_32k": (1, 32768), "idx_b8": (8, 8192), "idx_b32": (32, 128 * 1024),
            "idx_b8_128k": (8, 128 * 1024), "idx_b1_64k": (1, 65536), "idx_b1_1m": (1, 1 << 20)}[tag]
    return (min(T, 2), 1024 if T == 1 else 2048, 64) if SMOKE else (T, L, 2048)


def _long_previous(T, L):
    """The long-context path before SCORES 1 (sessions 8-12): per-tile group top-2 candidates, FILTER 1, merges,
    rescore."""
    from codegen.triton.indexer_topk import default_kt_pairs
    nt = -(-L // 128)
    return dict(BLOCK_N=128, KT=default_kt_pairs(128, 2048, L), SPLITS=max(1, min(max(1, nt // 4), round(8 * 132 / T))),
                num_warps=4, num_stages=1, CAND=1, DOT=3, MERGE_TILE=2048, FILTER=1, FILTER_PARTS=16)


def _scores_variants(tag, base):
    """SCORES 1 (materialised scores, `_indexer_scores`) around the heuristic's config (smoke: SCORES / BUCKET / TMA
    configs built from the CPU heuristic's). Session 13 (benches/results/h200-2026-11-30-s13/
    attention_decode_indexer_scores.json), batch 32 at 128K, all with SELECT_RES 8192 on 8 warps unless named: that
    config 361.0 us, SELECT_RES 2048 on 4 warps 342.4 (the new default), SPLITS 66 357.4, 32 select parts 364.5,
    8-warp scoring 394.7, BLOCK_N 64 367.0, BLOCK_N 256 on 8 warps 458.1, num_stages 2 365.6, the first digit
    counted in a pass of its own 405.7 (removed); the previous path 445.0. Second call (attention_decode_indexer_
    bucket.json): BUCKET 1 with 16 parts, SELECT_RES 4096 on 8 warps 312.0 vs 346.6 for the SELECT 1 default (the
    select alone 68.3 vs 88.4); 32 parts 307.8 (the new default), 64 parts 308.9, SELECT_RES 2048 on 4 warps 310.7,
    8192 335.6, MERGE_TILE 4096 322.6, SPLITS 66 310.9; score-kernel prefetch 347.9, prefetch under 168 registers
    322.2, TMA key tiles did not compile (see `_indexer_scores`). Session 14 (h200-2026-11-30-s14/
    attention_decode_indexer_tma.json): that default 305.0; TMA key tiles (`_scores_tma_kernel`) at 3 stages and
    SPLITS 20 242.7 (the new default; score pass 172.0 vs 247.5), 4 stages 249.7, 5 stages 254.4, SPLITS 33 / 40 (4
    stages) 252.5 / 250.6, an 80-register cap at SPLITS 24 267.1; the gather tiles under a 128-register cap 262.7
    (SPLITS 16: 266.6); BUCKET 2 (the bucket's next digit counted by the parts) 304.7 / 305.3, with TMA 259.9:
    removed (`_topk_bucket`). Session 15 (h200-2026-11-30-s15/attention_decode_indexer_select.json): BUCKET 3
    (`_topk_bucket_place`) with / without ZERO, parts, streamed bucket, MERGE_TILE, and the gathered tiles at the TMA
    programs: batch 32 237.1 (default) vs 253.5-303.0 (BUCKET 3), gathered 319.8; batch 1 (idx_b1_64k / idx_b1_1m)
    BUCKET 3 + ZERO the new default there (64K 29.0 vs 38.3, 1M 237.1 vs 329.7); figures in `indexer_topk.heuristic`.
    Round 2 (h200-2026-11-30-s15/attention_decode_indexer_place.json), batch 32: BUCKET 1 244.0 us vs SURV 241.7,
    SURV + ZERO 245.3, + MERGE_TILE 1024 219.3 (16 / 64 parts 217.0 / 221.3: 16 the new default; SELECT_RES 2048 on 4
    warps 240.2; placement tiles of 1024 survivors 222.7, removed); figures in `_topk_bucket`. Session 16
    (h200-2026-11-30-s16/attention_decode_indexer_slots_call{1,2}.json): SURV as `_topk_slots` (no atomics, the bucket
    in per-part slots) 214.8 / 209.2 vs 221.8 / 220.2 at batch 32, 94.7 / 91.6 vs 105.1 / 103.4 at batch 8
    (idx_b8_128k); its slots, warps, tiles, parts and a second histogram in `_topk_slots`. Round 2 (h200-2026-11-30-
    s16/attention_decode_indexer_scores_r2.json): the score kernel's table entries carried one box ahead (TMA_CARRY 1)
    77.5 vs 88.9 at batch 8 (the new default there), 221.5 vs 222.4 at batch 32 (score pass alone 199.9 vs 171.8: not
    adopted); its programs and stages, TMA_J 32, and the histogram atomics' cost (a score pass without them) in
    `_indexer_scores`."""
    if SMOKE and tag == "idx_b32":
        s = dict(base, KT=base["BLOCK_N"], SCORES=1, SELECT=1, SELECT_PARTS=4, SELECT_RES=64, SPLITS=4)
        return [s, dict(s, SELECT_RES=16), dict(s, BUCKET=1), dict(s, BUCKET=1, SELECT_RES=16),
                dict(s, BUCKET=1, TMA=3), dict(s, BUCKET=1, SURV=1, ZERO=1)]
    if SMOKE and tag.startswith("idx_b1_"):
        s = dict(base, KT=base["BLOCK_N"], SCORES=1, SELECT=1, BUCKET=1, SELECT_PARTS=4, SELECT_RES=64, SPLITS=4)
        return [s, dict(s, BUCKET=3, ZERO=1)]
    if SMOKE or not base.get("SCORES"):
        return []
    if not base.get("BUCKET"):
        return [dict(base, SPLITS=2 * base["SPLITS"]), dict(base, SELECT_RES=8192, MERGE_WARPS=8)]
    b3 = dict(base, BUCKET=3, SELECT_RES=2048, MERGE_WARPS=4)   # session 15: the two-launch select
    z = dict(b3, ZERO=1)
    lean = dict(z, SELECT_RES=16, MERGE_TILE=1024)   # the bucket always streamed: 96 registers, not 168
    if tag in ("idx_b32", "idx_b8_128k"):   # session 16, round 2: the score kernel's block-table entries
        return [dict(base, TMA_PRIV=1), dict(base, TMA_CARRY=1 - base.get("TMA_CARRY", 0), TMA_PRIV=1),
                dict(base, TMA_CARRY=1 - base.get("TMA_CARRY", 0))]
    wide = 64 if base.get("SPLITS", 0) < 512 else 256   # batch 1: more select parts per row
    return [dict(base, TMA=0), dict(base, SPLITS=base["SPLITS"] // 2), dict(base, SPLITS=2 * base["SPLITS"]),
            dict(base, SELECT_PARTS=wide), z, dict(z, SELECT_PARTS=wide), dict(lean, SELECT_PARTS=wide)]


def _select2_variants(base):
    """SELECT 2 (one row at <= 8K, `_topk_fused`). Session 16 (h200-2026-11-30-s16/attention_decode_indexer_slots_
    call{1,2}.json): the placement parts' own keys requested with the threshold 13.09 / 13.13 us vs 13.51 / 13.66, and
    counting in one step of 8192 keys on 8 warps 12.71 / 12.82 (the new default; 32 / 128 parts 12.84 / 12.98)."""
    if base.get("SELECT") != 2:
        return []
    return [dict(base, SELECT_TILE=4096, SELECT_WARPS=4), dict(base, SELECT_PARTS=32)]


def _scores_previous(base, T, L):
    """The SCORES 1 default before BUCKET 3 for one row and before SURV at batch 32 (session 15: BUCKET 1, 32 parts,
    MERGE_TILE 2048); before TMA key tiles (session 13's second change: gather tiles, 8 x 132 / T programs a row,
    BUCKET 1); before BUCKET 1 (base without TMA), SELECT 1's parts + last arriver."""
    if base.get("BUCKET") == 3 or base.get("SURV"):   # (SURV: batch 32's default before round 2)
        return dict({k: v for k, v in base.items() if k not in ("ZERO", "SURV")}, BUCKET=1, SELECT_PARTS=32,
                    SELECT_RES=4096, MERGE_WARPS=8, MERGE_TILE=2048)
    if base.get("TMA"):
        return dict({k: v for k, v in base.items() if k != "TMA"},
                    SPLITS=max(1, min(max(1, -(-L // 128) // 4), round(8 * 132 / T))))
    return dict({k: v for k, v in base.items() if k != "BUCKET"}, SELECT_PARTS=16, SELECT_RES=2048, MERGE_WARPS=4)


def _select_only(d, K, cfg, stop=None):
    """The launcher over scores stored by one score pass (`indexer_topk`'s scores_in hook): memset, select, place
    (`stop`: "memset", "bucket" or "threshold": that prefix of the select's launches only)."""
    from codegen.triton.indexer_topk import indexer_topk
    st = {}
    ba._indexer_call(d, K, cfg, output="rows", stats=st, stop_after="score")()
    keep = st["scores"]
    return lambda: indexer_topk(d["q8"], d["qs"], d["w"], d["keys"], d["ks"], d["pos"], d["req"], d["tbl"], BS, K,
                                key_format=d["fmt"], output="rows", config=cfg, max_context=d["L"], scores_in=keep,
                                stop_after=stop)


def _select_breakdown(tag, sets, K, nbytes, named):
    """Each launch of the select over stored scores, timed as prefixes (memset; + bucket parts; + threshold; the
    whole select): differences are the launches' costs in the graph. Also the boundary bucket's keys per row."""
    for name, cfg in named:
        stops = ("memset", "bucket") + (("threshold",) if cfg.get("BUCKET") == 1 else ()) + \
            ((None,) if cfg.get("SURV") else ())   # (SURV: the whole select too)
        for stop in stops:
            measure(f"{tag}_{name}_select_prefix_{stop or 'all'}", [_select_only(d, K, cfg, stop) for d in sets],
                    nbytes, config=cfg)
        st = {}
        ba._indexer_call(sets[0], K, cfg, output="rows", stats=st)()
        DOC.setdefault("bucket_keys_per_row", {})[f"{tag}_{name}"] = st.get("filter_kept", 0) / sets[0]["pos"].numel()


def _scores_checks(tag, sets, K, ms, first, checked):
    """Every timed SCORES variant selects exactly what the first SCORES config (checked vs the IR reference)
    selects; registers / spills of the score kernel's specialisations."""
    if not checked:
        check(f"{tag}_scores_vs_ir_reference", lambda: ba._indexer_check(sets[0], K, first))
    want = ba._indexer_call(sets[0], K, first, output="rows")()
    for m in ms:
        if m and m.get("config", {}).get("SCORES"):
            got = ba._indexer_call(sets[0], K, m["config"], output="rows")()
            m["same_rows_as_default"] = bool(torch.equal(got, want))
            DOC["checks"].append({"name": f"{m['name']}_same_rows_as_default", "ok": m["same_rows_as_default"]})
    from codegen.triton._indexer_scores import _scores_kernel, _scores_tma_kernel
    from codegen.triton._topk_bucket import _bucket_kernel, _threshold_kernel
    from codegen.triton._topk_bucket_place import _bucket_place_kernel
    from codegen.triton._topk_parallel import _place_kernel
    from codegen.triton._topk_slots import _slot_parts_kernel, _slot_place_kernel, _slot_threshold_kernel
    DOC.setdefault("scores_kernels", [])
    for fn in ((_scores_kernel, _scores_tma_kernel, _bucket_kernel, _threshold_kernel, _bucket_place_kernel,
                _place_kernel, _slot_parts_kernel, _slot_threshold_kernel, _slot_place_kernel) if not SMOKE else ()):
        for caches in getattr(fn, "device_caches", {}).values():
            for k in list(caches[0].values()):
                k._init_handles()
                DOC["scores_kernels"].append({"kernel": fn.__name__, "n_regs": k.n_regs, "n_spills": k.n_spills,
                                              "num_warps": k.metadata.num_warps, "shared": k.metadata.shared})


def sec_idx(tag, warm=None):
    T, L, K = _idx_shapes(tag)
    n_sets = 1 if (SMOKE or T > 1 or warm) else (48 if L <= 8192 else 12)
    sets = [ba._indexer_inputs(T, L, seed=200 + i) for i in range(n_sets)]
    nbytes = ba._indexer_bytes(sets[0], K)
    base, variants = _idx_variants(T, L, K)
    if base.get("SCORES"):   # SELECT 2 (short contexts) does not apply to the materialised scores
        variants = [c for c in variants if c.get("SELECT") != 2]
    variants = variants + [c for c in _scores_variants(tag, base) + _select2_variants(base) if c not in variants]
    prev_cfg = _idx_prev(T, L) if not SMOKE else dict(base, SELECT=0, SCORES=0)
    if prev_cfg.get("BUCKET"):   # the SCORES 1 default before TMA key tiles (session 14)
        prev_cfg = _scores_previous(prev_cfg, T, L)
    elif prev_cfg.get("SCORES"):   # the heuristic's long-context default changed in session 13
        prev_cfg = _long_previous(T, L)

    def calls(cfg, **kw):
        return [ba._indexer_call(d, K, cfg, output="rows", **kw) for d in sets]
    if warm:
        k, n = warm
        for i, cfg in enumerate([prev_cfg] + variants):
            for pdl in ((True, False) if i <= 1 else (True,)):
                if (2 * i + pdl) % n == k:
                    _pdl.set_enabled(pdl)
                    try:
                        calls(cfg)[0]()
                    except Exception:  # noqa: BLE001
                        pass
        return
    prev = measure(f"{tag}_previous", calls(prev_cfg), nbytes, config=prev_cfg)
    new = prev if base == prev_cfg else measure(f"{tag}_new_default", calls(base), nbytes, config=base)
    off = measure(f"{tag}_new_default_pdl_off", calls(base), nbytes, pdl=False, config=base)
    check(f"{tag}_new_default_vs_ir_reference", lambda: ba._indexer_check(sets[0], K, base))
    if base.get("SCORES") and prev_cfg != base:   # the previous path's score pass too
        measure(f"{tag}_previous_score_pass_only", [ba._indexer_call(d, K, prev_cfg, stop_after="score") for d in sets],
                nbytes, config=prev_cfg)
    if base.get("SELECT") != 2:   # score pass vs the rest (candidates merge / select) of the default path
        measure(f"{tag}_new_default_score_pass_only", [ba._indexer_call(d, K, base, stop_after="score") for d in sets],
                nbytes, config=base)
    pairs = [(n_, c) for n_, c in (("previous", prev_cfg), ("new_default", base)) if c.get("SCORES")]
    if SMOKE and tag == "idx_b32":
        pairs = [(f"smoke{i}", c) for i, c in enumerate(_scores_variants(tag, base)[::2])]
    for name, cfg in pairs:   # the select alone (memset + select + placement) over stored scores, old and new
        measure(f"{tag}_{name}_select_only", [_select_only(d, K, cfg) for d in sets], nbytes, config=cfg)
    if base.get("BUCKET") and not SMOKE:   # per-launch breakdown (prefixes) of the default and BUCKET 3
        _select_breakdown(tag, sets, K, nbytes, [("new_default", base)] +
                          [(f"bucket3_res{c['SELECT_RES']}", c) for c in variants if c.get("BUCKET") == 3 and
                           c.get("SELECT_PARTS") == base.get("SELECT_PARTS") and not c.get("ZERO")] +
                          [(f"slots_res{c['SELECT_RES']}_w{c['MERGE_WARPS']}", c) for c in variants
                           if c.get("SURV") and c.get("SELECT_RES") != base.get("SELECT_RES")])
    check(f"{tag}_new_default_graph_vs_eager", lambda: graph_vs_eager(calls(base)[0]))
    ms = [new]
    for i, cfg in enumerate(variants[1:]):
        m = measure(f"{tag}_variant{i}", calls(cfg), nbytes, config=cfg)
        ms.append(m)
        if base.get("SCORES") and (cfg.get("SPLITS"), cfg.get("TMA"), cfg.get("num_stages"), cfg.get("TMA_CARRY"),
                                   cfg.get("TMA_J"), cfg.get("TMA_PRIV")) != \
                (base.get("SPLITS"), base.get("TMA"), base.get("num_stages"), base.get("TMA_CARRY"), base.get("TMA_J"),
                 base.get("TMA_PRIV")):   # a score pass of its own
            measure(f"{tag}_variant{i}_score_pass_only",
                    [ba._indexer_call(d, K, cfg, stop_after="score") for d in sets], nbytes, config=cfg)
    best = _summarize(tag, prev, new, [prev] + ms)
    if best is not None and base.get("SCORES") and best.get("config") not in (base, prev_cfg):
        check(f"{tag}_best_graph_vs_eager", lambda: graph_vs_eager(calls(best["config"])[0]))
    scores = [c for c in variants if c.get("SCORES")]
    if scores:
        _scores_checks(tag, sets, K, [m for m in ms if m], scores[0], scores[0] == base)
    if tag in DOC["summary"] and off:
        DOC["summary"][tag]["new_default_pdl_off_us"] = off["median_us"]
    for i, cfg in enumerate(variants[1:]):   # TMA key tiles (session 14): graph replay == eager for each
        if ms[i + 1] and cfg.get("TMA") and ms[i + 1] is not best:
            check(f"{tag}_variant{i}_graph_vs_eager", lambda: graph_vs_eager(calls(cfg)[0]))
    for i, cfg in enumerate(variants[1:]):   # exactness of every variant that was timed
        if ms[i + 1] and (T == 1 or ms[i + 1] is best or cfg.get("SELECT") == 2):
            check(f"{tag}_variant{i}_vs_ir_reference", lambda: ba._indexer_check(sets[0], K, cfg))
            st = {}
            ba._indexer_call(sets[0], K, cfg, output="rows", stats=st)()
            ms[i + 1]["stats"] = st
    two = [m for m in ms if m and m.get("config", {}).get("SELECT") == 2]
    best2 = min(two, key=lambda m: m["median_us"], default=None)
    if best2 is not None and tag in DOC["summary"]:
        DOC["summary"][tag].update(best_select2_us=best2["median_us"], best_select2_config=best2["config"])
    best = best2 if best2 is not None else best
    if best is not None and best.get("config", {}).get("SELECT") == 2:   # SELECT 2's breakdown and graph check
        check(f"{tag}_best_graph_vs_eager", lambda: graph_vs_eager(calls(best["config"])[0]))
        measure(f"{tag}_best_score_pass_only", [ba._indexer_call(d, K, best["config"], stop_after="score")
                                                 for d in sets], nbytes, config=best["config"])
        measure(f"{tag}_best_pdl_off", calls(best["config"]), nbytes, pdl=False, config=best["config"])
    del sets
    if not SMOKE:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- mla
MLA_PREV = dict(ORIENT=0, BLOCK_H=16, BLOCK_N=64, CHUNK=512, num_warps=4, num_stages=1, SUB=4, PREFETCH=1)


def _mla_diagnostics(tag, d, cfgs, nbytes):
    """Where the time goes at batch 64: the same launches with every token reading token 0's rows (1.2 MB, L2
    resident: what the kernel costs without HBM) and with each token's first K positions (whole 64-row blocks,
    36 KB contiguous: DRAM locality) instead of a random selection."""
    T = d["rows"].shape[0]
    l2 = dict(d, rows=d["rows"][:1].expand(T, -1).contiguous())
    seq = dict(d, rows=ba._all_rows(d["tbl"], d["ctx"])[:, :d["rows"].shape[1]].contiguous())
    for name, cfg in cfgs:
        measure(f"{tag}_diag_{name}_l2_resident_rows", [_mla_call(l2, cfg)], nbytes, config=cfg)
        measure(f"{tag}_diag_{name}_contiguous_rows", [_mla_call(seq, cfg)], nbytes, config=cfg)


def sec_mla(tag, warm=None):
    T = int(tag.split("_b")[1])
    ctx, K = (256, 64) if SMOKE else (8192, 2048)
    T = min(T, 2) if SMOKE else T
    sets = [_mla_set(T, ctx, K, seed=100 + i) for i in range(1 if (SMOKE or T > 1 or warm) else 16)]
    nbytes = T * K * (576 + 8) + 12 * 128 * 512 * 2 + T * 12 * (192 * 2 + 512 * 2 + 4)
    base, variants = _mla_variants(T)
    if warm:
        k, n = warm
        for i, cfg in enumerate([_mla_prev(T) if not SMOKE else MLA_PREV] + variants):
            for pdl in ((True, False) if i <= 1 else (True,)):
                if (2 * i + pdl) % n == k:
                    _pdl.set_enabled(pdl)
                    try:
                        _mla_call(sets[0], cfg)()
                    except Exception:  # noqa: BLE001
                        pass
        return
    prev_cfg = MLA_PREV if SMOKE else _mla_prev(T)
    prev = measure(f"{tag}_previous", [_mla_call(d, prev_cfg) for d in sets], nbytes, config=prev_cfg)
    new = prev if prev_cfg == base else measure(f"{tag}_new_default", [_mla_call(d, base) for d in sets], nbytes,
                                                 config=base)
    off = measure(f"{tag}_new_default_pdl_off", [_mla_call(d, base) for d in sets], nbytes, pdl=False, config=base)
    check(f"{tag}_new_default_vs_float64", lambda: _mla_check(sets[0], base))
    check(f"{tag}_new_default_graph_vs_eager", lambda: graph_vs_eager(_mla_call(sets[0], base)))
    ms = [new] + [measure(f"{tag}_variant{i}", [_mla_call(d, cfg) for d in sets], nbytes, config=cfg)
                  for i, cfg in enumerate(variants[1:]) if cfg != prev_cfg]
    best = _summarize(tag, prev, new, ms)
    for i, m in enumerate(ms[1:]):   # every timed variant with a new option: vs float64
        if m and (m["config"].get("LSUM") or m["config"].get("num_stages", 1) > 3):
            check(f"{tag}_variant{i}_vs_float64", lambda: _mla_check(sets[0], m["config"]))
    f16 = [m for m in ms if m and m.get("config", {}).get("F16")]
    best16 = min(f16, key=lambda m: m["median_us"], default=None)
    if new and best16 and tag in DOC["summary"]:   # F16 is opt-in until measured: the heuristic's default vs it
        DOC["summary"][tag].update(best_f16_us=best16["median_us"], best_f16_config=best16["config"],
                                   speedup_best_f16_vs_default=new["median_us"] / best16["median_us"])
        check(f"{tag}_best_f16_vs_float64", lambda: _mla_check(sets[0], best16["config"]))
        check(f"{tag}_best_f16_graph_vs_eager", lambda: graph_vs_eager(_mla_call(sets[0], best16["config"])))
    if tag in DOC["summary"] and off:
        DOC["summary"][tag]["new_default_pdl_off_us"] = off["median_us"]
    if best is not None and best is not new:
        check(f"{tag}_best_vs_float64", lambda: _mla_check(sets[0], best["config"]))
        off_b = measure(f"{tag}_best_pdl_off", [_mla_call(d, best["config"]) for d in sets], nbytes, pdl=False)
        DOC["summary"].get(tag, {})["best_pdl_off_us"] = off_b and off_b["median_us"]
    if T > 1 and new:
        _mla_diagnostics(tag, sets[0], [("default", base)], nbytes)
    if best is not None and not SMOKE:   # without the query absorption (and o~ kept in bf16): kernel + combine
        from codegen.triton.mla_sparse import sparse_latent_attention, split_kv_b
        d = sets[0]
        qa = torch.einsum("thn,hnk->thk", d["qn"], split_kv_b(d["kvb"], 12, 128)[0]).contiguous()
        measure(f"{tag}_best_latent_attention_only", [lambda: sparse_latent_attention(
            qa, d["qp"], d["pool"], d["pos"], None, SCALE, d["rows"], latent_format="fp8", latent_scale=d["ls"],
            config=best["config"], block_size=BS, out_dtype=torch.bfloat16)], nbytes, config=best["config"])
    del sets
    if not SMOKE:
        torch.cuda.empty_cache()


def sec_chain():
    """Indexer select (rows) at 8K then sparse MLA over 2048 rows, batch 1, in one graph: the defaults and (when they
    differ) session 10's configs, PDL on vs off (the second kernel family starts while the first drains). Session 11
    also ran the indexer's SELECT 3 (no last arriver: every placement part reading the threshold off two
    launch-parity histogram sets) here: 26.59 us vs SELECT 2's 25.51 (PDL off 30.69 vs 29.41; alone at batch 1 8K
    13.82-14.19 vs 13.37; benches/results/h200-2026-11-30-s11/attention_decode_final.json). Removed."""
    T, L, K = (1, 1024, 64) if SMOKE else (1, 8192, 2048)
    di = [ba._indexer_inputs(T, L, seed=500 + i) for i in range(1 if SMOKE else 16)]
    dm = [_mla_set(T, 256 if SMOKE else 8192, K, seed=600 + i) for i in range(len(di))]
    prev = (None, None) if SMOKE else (_idx_prev(T, L), _mla_prev(T))
    if not SMOKE and prev == (_idx_variants(T, L, K)[0], _mla_variants(T)[0]):
        prev = (None, None)   # session 10's configs are still the defaults: time them once

    def both(a, b, cfgs):
        f, g = ba._indexer_call(a, K, cfgs[0], output="rows"), _mla_call(b, cfgs[1])
        return lambda: (f(), g())
    nbytes = ba._indexer_bytes(di[0], K) + K * 584
    runs = (("", (None, None)),) + ((("_previous", prev),) if prev != (None, None) else ())
    for tag, cfgs in runs:
        calls = [both(a, b, cfgs) for a, b in zip(di, dm)]
        on = measure(f"chain_idx_mla_b1{tag}_pdl_on", calls, nbytes, config=dict(zip(("indexer", "mla"), cfgs)))
        off = measure(f"chain_idx_mla_b1{tag}_pdl_off", calls, nbytes, pdl=False)
        check(f"chain{tag}_graph_vs_eager", lambda: graph_vs_eager(lambda: tuple(x for r in calls[0]() for x in
                                                                               (r if isinstance(r, tuple) else (r,)))))
        if on and off:
            DOC["summary"][f"chain_b1{tag}"] = {"pdl_on_us": on["median_us"], "pdl_off_us": off["median_us"],
                                                "pdl_gain_us": off["median_us"] - on["median_us"]}


def sec_chain_idx():
    """Two indexer selects (two layers' inputs) back to back in one graph, batch 1 at 8K: SELECT 2 (two launches
    each) and the previous path (the default), PDL on vs off."""
    T, L, K = (1, 1024, 64) if SMOKE else (1, 8192, 2048)
    di = [ba._indexer_inputs(T, L, seed=700 + i) for i in range(2 if SMOKE else 32)]
    prev_cfg = None if SMOKE else _idx_prev(T, L)
    two = _idx_variants(T, L, K)[1][1]   # SELECT 2's first variant
    for tag, cfg in (("select2", two), ("previous_s8", prev_cfg)):
        calls = [(lambda a, b: (lambda: (ba._indexer_call(a, K, cfg, output="rows")(),
                                         ba._indexer_call(b, K, cfg, output="rows")())))(di[i], di[i + 1])
                 for i in range(0, len(di), 2)]
        nbytes = 2 * ba._indexer_bytes(di[0], K)
        on = measure(f"chain_idx2_{tag}_pdl_on", calls, nbytes, config=cfg)
        off = measure(f"chain_idx2_{tag}_pdl_off", calls, nbytes, pdl=False, config=cfg)
        check(f"chain_idx2_{tag}_graph_vs_eager", lambda: graph_vs_eager(calls[0]))
        if on and off:
            DOC["summary"][f"chain_idx2_{tag}"] = {"pdl_on_us": on["median_us"], "pdl_off_us": off["median_us"],
                                                   "pdl_gain_us": off["median_us"] - on["median_us"]}


def _zeroed_check():
    """SELECT 2 and BUCKET 3 + ZERO leave their histograms and counters at zero (the next launch relies on it)."""
    from codegen.triton import _topk_fused
    if not SMOKE:
        torch.cuda.synchronize()
    from codegen.triton import _gemv   # (BUCKET 3 + ZERO, TMA_PRIV's private histograms: the stream's counter set)
    bufs = list(_topk_fused._ZEROED.values()) + _topk_fused._RETIRED + list(_gemv._COUNTERS.values())
    return {"ok": all(int(b.abs().sum()) == 0 for b in bufs), "buffers": len(bufs)}


SECTIONS = ("mla_b64", "idx_b32", "mla_b1", "idx_b1", "idx_b1_32k", "idx_b8", "idx_b8_128k", "idx_b1_64k", "idx_b1_1m",
            "chain",
            "chain_idx")
WARM_N = 4          # compile processes per section
WARM_CAP_S = 50     # measuring starts by then (anything not compiled yet compiles on first use)


def _run(tag, warm=None):
    if tag in ("chain", "chain_idx"):
        return (sec_chain() if tag == "chain" else sec_chain_idx()) if not warm else None
    return (sec_mla if tag.startswith("mla") else sec_idx)(tag, warm)


def main():
    only = sys.argv[sys.argv.index("--sections") + 1].split(",") if "--sections" in sys.argv else list(SECTIONS)
    if "--warm" in sys.argv:   # compile-only helper: one section's variants, a share of them
        tag, k, n = sys.argv[sys.argv.index("--warm") + 1].split(":")
        _run(tag, warm=(int(k), int(n)))
        return
    import triton
    DOC["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
                      "pdl_supported": _pdl.launch_kwargs().get("PDL", False)}
    warm = [] if SMOKE else [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", f"{t}:{k}:{WARM_N}"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                             for t in only if not t.startswith("chain") for k in range(WARM_N)]
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
    for tag in only:
        try:
            _run(tag)
        except Exception as e:  # noqa: BLE001
            DOC["errors"].append(f"{tag}: {e!r}\n{traceback.format_exc()[-1500:]}")
    check("zeroed_workspace_after_all", _zeroed_check)
    try:
        DOC["kernels"] = kernel_inventory()
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"kernel inventory: {e!r}")
    DOC["seconds"] = time.time() - T0
    print(_save())


if __name__ == "__main__":
    main()
