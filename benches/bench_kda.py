"""KDA kernels on one GPU (issue 4): bf16 correctness at full shapes and timings vs fla-core 0.6.0.

One JSON document (stdout and $OUT/kda.json, rewritten after every record). Warm-up subprocesses (`--warm
decode:i:n | prefill:i:n | fla:i:n`, benches/_kda_bench_inputs.py with the inputs and fla wrappers) fill the compile
cache in parallel; every timing waits for them to end:
  check  bf16 vs fp32 references: every fused decode candidate vs the unfused ops (B=64 / B=1 at H=32, B=1 H=12:
         the rank preset; B=64 x 8 tokens with states kept); prefill kernel-2 tiles and kernel-1 variants at B=1
         T=8192 vs ir.ref; the Gluon decode (GLUON) on a ragged step (requests of 0-3 tokens) vs the unfused ops,
         vs the Triton kernel and vs itself given the gate input f in float64
  time   copy bandwidth (the byte floors) and launch gap; decode per launch in ONE CUDA graph of launches on
         distinct (L2-cold) pools, PDL on (new candidates, then the previous ones), the previous heuristic and the
         best with PDL off; fla fused_recurrent_kda (f given; + the f GEMM), floor B*H*D*D*4*2 bytes; a PDL race
         check per case (graph replays of a chain reading the previous launch's output and the state written two
         launches back equal PDL-off eager launches, bitwise); prefill B=4 x 8192: kernel-1 variants and kernel-2
         tiles apart, whole prefill (heuristic, previous, best tiles, best kernel 1 with the best tiles; per-kernel
         split by torch.profiler, fla's too) vs fla chunk_kda; then B=1 x 8192 and 1 x 32768 while time is left
A candidate whose warm-up met a CUDA error (a dead context: in session 10 one kernel-1 variant's illegal address ended
every later case) is skipped, and new kernel-1 variants run here only once a warm-up ran them cleanly. The decode's
ceiling: the B=64 grid's state read + write alone (`_state_rmw_kernel`, per block width / staging / warps / streaming
stores; session 11: 70.8-72.8 us with BV 64-128 unstaged, 73.8 with BV 32 x 4 stages, 91.6 BV 16 x 5 stages, 80.9 BV 32
unstaged; session 13: 69.65 with .cs stores vs 70.83; `_kda_bench_variants.COPY_VARIANTS`). Each decode check records
its kernel's registers / spills (`resources`).
Run: `python benches/bench_kda.py` on a CUDA machine; cases that would start after KDA_BENCH_DEADLINE_S (140) are
skipped; KDA_BENCH_SECTIONS=decode: the decode sections alone (no prefill checks, timings or warm-ups);
KDA_BENCH_SWEEP=1 adds earlier sessions' (slower) variants; KDA_BENCH_FLA_PREFILL=0 leaves fla's prefill out;
KDA_BENCH_TINY=1: toy shapes in the interpreter (a dry run on a CPU).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch
# _kda_bench_inputs before triton: it picks the interpreter on a CPU
from _kda_bench_inputs import (ACT, B_DEC, DEV, FLA, FLA_PREFILL, H, T_PRE, TINY, D, attempt,  # noqa: I001
                               compiled_keys, decode_operands, decode_run, f_given, fla_decode, fla_prefill,
                               kernel_split_ms, low, n_chain, ours_prefill, poison_key, poisoned, prefill_bytes,
                               prefill_inputs, rel, resources, wait_all, warm_up)
from _kda_bench_variants import (_INTRA_KEYS, COPY_VARIANTS, DECODE_CASES, PREV_PREFILL,  # noqa: I001
                                 decode_candidates, decode_jobs, state_configs)
from _report import BenchReport, copy_bandwidth_GBps, graph_ms, median_ms  # benches/ (the script's folder)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from codegen.triton import _kda_decode_gluon as _glu, _pdl  # noqa: E402
from codegen.triton._kda_common import device_chunk_table  # noqa: E402
from codegen.triton._kda_intra64 import _kda_intra64_kernel  # noqa: E402
from codegen.triton._kda_state import _kda_state_kernel  # noqa: E402
from codegen.triton.kda_prefill import heuristic as prefill_heuristic, run_intra, run_state  # noqa: E402
from ir.ref import kda as ref  # noqa: E402
from tests.kda_decode_case import unfused_decode as unfused  # noqa: E402  (the fp32 op sequence the kernel fuses)

REPORT = BenchReport("kda")
DOC, save, section = REPORT.doc, REPORT.save, REPORT.section
ms = lambda fn, rep=100: median_ms(fn, DEV, rep)  # noqa: E731
STATE: dict = {}  # results of the check phase the time phase uses
DEADLINE = float(os.environ.get("KDA_BENCH_DEADLINE_S", "140"))  # later cases are skipped
PREFILL = os.environ.get("KDA_BENCH_SECTIONS", "decode,prefill") != "decode"  # KDA_BENCH_SECTIONS=decode: no prefill
def late(what) -> bool:  # past the deadline: note the skipped case
    over = time.time() - REPORT.t0 > DEADLINE
    DOC["notes"] += [f"{what} skipped: past KDA_BENCH_DEADLINE_S={DEADLINE:.0f}"] if over else []
    return over


def record(name, **kw):
    DOC["measurements"].append({"name": name, **kw}), save()
    print(f"   {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()),
          flush=True)


def chain_us(fns, pdl=True):
    """µs per launch in ONE CUDA graph of fns (each on its own inputs: L2-cold), as a captured step runs them;
    PDL on or off for the launches captured (our kernels only)."""
    before = _pdl.set_enabled(pdl)
    try:
        return ms(fns[0]) * 1e3 if DEV == "cpu" else graph_ms(fns, reps=20) * 1e3
    finally:
        _pdl.set_enabled(before)


@triton.jit
def _empty_kernel(x):
    tl.store(x + tl.program_id(0), 1.0)


@triton.jit
def _state_rmw_kernel(st, D: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, CS: tl.constexpr):
    """The decode's state traffic alone: each program reads its [D, D] fp32 state in [D, BV] blocks and writes
    it back (x 0.5, in place); STAGES > 0 through Triton's pipelined loop (cp.async into shared memory); CS:
    streaming stores (.cs)."""
    base = st + tl.program_id(0).to(tl.int64) * D * D
    dd = tl.arange(0, D)
    for vb in tl.range(0, D // BV, num_stages=STAGES if STAGES > 0 else None):
        x = tl.load(base + vb * BV + (dd[:, None] * D + tl.arange(0, BV)[None, :]), eviction_policy="evict_first")
        tl.store(base + (dd[:, None] * D + vb * BV + tl.arange(0, BV)[None, :]), x * 0.5,
                 cache_modifier=".cs" if CS else "")


# ------------------------------------------------------------------------------------------ checks
@section
def check_decode():
    from codegen.triton import kda_decode as dec_mod
    STATE["decode"] = []
    for B, heads, qlen, new, prev in DECODE_CASES:
        ops = decode_operands([qlen] * B, heads)
        want = [x.clone() for x in ops]
        y_ref, states_ref = unfused(want, D ** -0.5, -5.0, 1e-5)
        cands, heur, i_prev = decode_candidates(B, heads, qlen, new, prev)
        ok = []
        for i, cfg in enumerate(cands):
            if poison_key("decode", B, heads, qlen, cfg) in poisoned():  # it would kill this process's context
                record(f"decode_check_B{B}_H{heads}_q{qlen}", config=cfg, error="CUDA error in its warm-up: skipped")
                continue
            try:
                seen = compiled_keys(dec_mod._kda_decode_kernel)
                out = decode_run(low(ops), cfg, keep=qlen > 1)()
                errs = dict(rel_err_out=rel(out[0].float(), y_ref), rel_err_state=rel(out[2][1:], want[12][1:]),
                            rel_err_conv=rel(out[1][1:], want[6][1:]),
                            resources=resources(seen, decode=dec_mod._kda_decode_kernel))
                attempt(errs, "resources_gluon", lambda: resources(decode=_glu._kda_decode_gluon_kernel))
                errs.update(rel_err_kept_states=rel(out[3], states_ref)) if qlen > 1 else None
                good = all(e < 1e-2 for e in errs.values() if isinstance(e, float))
                record(f"decode_check_B{B}_H{heads}_q{qlen}", **errs, tol=1e-2, ok=good, config=cfg,
                       role="new" if i < i_prev else ("previous" if i < len(cands) - 1 or cfg != heur else
                                                      "heuristic"), heuristic=cfg == heur)
                ok += [(i, cfg)] if good else []
            except Exception as e:  # noqa: BLE001
                record(f"decode_check_B{B}_H{heads}_q{qlen}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
        STATE["decode"].append((B, heads, qlen, ok, heur, i_prev))
    DOC["kernel_resources_decode"] = resources(decode=dec_mod._kda_decode_kernel)


@section
def check_gluon_ragged():
    """The Gluon kernel (each GLUON value) on a ragged step: requests of 0-3 tokens (later tokens, empty requests,
    the generic conv-tail path) vs the unfused ops, and its B=64 one-token output vs the Triton default's (bf16);
    both vs the same kernel given the gate input f in float64 (the in-kernel gate's and the GEMM's fp32 rounding)."""
    for B, heads, lengths in ((8, H, [1, 0, 3, 1, 2, 0, 1, 1]), (B_DEC, H, [1] * B_DEC)):
        ops = decode_operands(lengths, heads, seed=3)
        want = [x.clone() for x in ops]
        y_ref, _ = unfused(want, D ** -0.5, -5.0, 1e-5)
        base = decode_run(low(ops), {**decode_candidates(B, heads, 1, [], [])[1], "GLUON": 0})()
        for cfg in (c for c in DECODE_CASES[0][3] if c.get("GLUON")):
            res = dict(B=B, lengths=lengths if B < 64 else "1 each", config=cfg)
            try:
                out = decode_run(low(ops), cfg)()
                res.update(rel_err_out=rel(out[0].float(), y_ref), rel_err_state=rel(out[2][1:], want[12][1:]),
                           rel_err_conv=rel(out[1][1:], want[6][1:]),
                           rel_vs_triton_out=rel(out[0].float(), base[0].float()),
                           rel_vs_triton_state=rel(out[2][1:], base[2][1:]),
                           empty_rows_kept=all(torch.equal(out[2][1 + r], ops[12][1 + r]) and
                                               torch.equal(out[1][1 + r], ops[6][1 + r])
                                               for r in range(B) if lengths[r] == 0))
                exact = low(ops)  # the same kernel given f = f_a f_b^T computed in float64 (rounded to fp32)
                exact[7], exact[8] = (exact[7].double() @ exact[8].double().T).float(), None
                ref64 = decode_run(exact, {**cfg, "GATE_MM": 0})()
                res.update(rel_vs_f64_gate_out=rel(out[0].float(), ref64[0].float()),
                           rel_vs_f64_gate_state=rel(out[2][1:], ref64[2][1:]))
                res["ok"] = all(v < 1e-2 for k, v in res.items() if k.startswith("rel_err")) and res["empty_rows_kept"]
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            record(f"gluon_check_B{B}_H{heads}", **res)


@section
def check_prefill():
    from codegen.triton import kda_prefill as pre
    x = prefill_inputs([T_PRE])
    want = x["pool"].clone()
    o_ref = ref.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], want, x["slots"], x["cu"], D ** -0.5)
    STATE["state"], STATE["intra"] = [], []
    for kind, cfg in state_configs():
        key = poison_key("prefill", cfg)  # new kernel-1 variants run here only after a warm-up ran them cleanly
        if key in poisoned() or (kind == "intra" and DEV == "cuda" and key not in poisoned(".ok")):
            record(f"prefill_check_{kind}", config=cfg, error="CUDA error in its warm-up, or not warmed up: skipped")
            continue
        mine = x["pool"].clone()
        try:
            o = ours_prefill(x, mine, cfg)()
            errs = dict(rel_err_o=rel(o.float(), o_ref), rel_err_state=rel(mine[1:], want[1:]))
            good = all(e < 1e-2 for e in errs.values())
            STATE[kind] += [cfg] if good else []
            record(f"prefill_check_{kind}", T=T_PRE, **errs, tol=1e-2, ok=good, config=cfg)
        except Exception as e:  # noqa: BLE001
            record(f"prefill_check_{kind}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
    DOC["kernel_resources_prefill"] = resources(intra=pre._kda_intra_kernel, intra64=_kda_intra64_kernel,
                                                state=_kda_state_kernel)


@section
def ceiling():
    DOC["ceilings"]["copy_GBps"] = copy_bandwidth_GBps(DEV) if DEV == "cuda" else 1.0
    record("copy_bandwidth", GBps=DOC["ceilings"]["copy_GBps"])
    buf = torch.zeros(64, device=DEV)
    DOC["ceilings"]["empty_launch_us"] = chain_us([lambda: _empty_kernel[(1,)](buf)] * 48)
    record("empty_kernel_chain", us_per_launch=DOC["ceilings"]["empty_launch_us"])


@section
def state_copy_ceiling(B=None, heads=H):
    """The same grid as the B=64 decode (one program per (request, head)) doing only its state read + write: the
    ceiling of this grid, per block width / staging / warps, µs per launch in a graph of distinct (L2-cold) pools."""
    B = B or B_DEC
    floor_us = B * heads * D * D * 4 * 2 / DOC["ceilings"].get("copy_GBps", 1) / 1e3
    pools = [torch.randn(B * heads, D, D, device=DEV) for _ in range(n_chain(B, heads))]
    for bv, stages, warps, cs in COPY_VARIANTS:
        if late(f"state copy ceiling BV {bv}"):
            return
        res = dict(B=B, H=heads, BV=bv, STAGES=stages, WARPS=warps, CS=cs, byte_floor_us=floor_us)
        attempt(res, "us", lambda: chain_us([lambda p=p: _state_rmw_kernel[(B * heads,)](  # noqa: B023
            p, D=D, BV=min(bv, D), STAGES=stages, CS=cs, num_warps=warps)  # noqa: B023
            for p in pools], pdl=False))
        res["x_floor"] = res["us"] / floor_us if "us" in res else None
        record(f"state_copy_B{B}_H{heads}", **res)
        if "us" in res:  # the fastest: the ceiling time_decode compares the fused kernel with
            ceil = STATE.setdefault("copy_us", {})
            ceil[(B, heads)] = min(ceil.get((B, heads), float("inf")), res["us"])


# ------------------------------------------------------------------------------------------ timings
@section
def time_decode(qlens):
    for B, heads, qlen, ok, heur, i_prev in STATE.get("decode", []):
        if qlen not in qlens or late(f"decode B={B} H={heads} q={qlen}"):
            continue
        ops = decode_operands([qlen] * B, heads)
        n = n_chain(B, heads)
        sets = [low(ops) for _ in range(n)]  # distinct pools and weights per launch
        floor_us = B * heads * D * D * 4 * 2 / DOC["ceilings"].get("copy_GBps", 1) / 1e3
        times = []
        for i, cfg in ok:
            try:
                t = chain_us([decode_run(s, cfg, keep=qlen > 1) for s in sets])
            except Exception as e:  # noqa: BLE001
                record(f"decode_time_B{B}_H{heads}_q{qlen}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            times.append((t, i, cfg))
            record(f"decode_time_B{B}_H{heads}_q{qlen}", us=t, x_floor=t / floor_us, chain=n, config=cfg, pdl=True,
                   heuristic=cfg == heur, index=i)
        if not times:
            continue
        best = min(times, key=lambda p: p[0])
        res = dict(B=B, H=heads, q_len=qlen, best_us=best[0], best_config=best[2], byte_floor_us=floor_us,
                   x_floor=best[0] / floor_us, launch_gap_us=DOC["ceilings"].get("empty_launch_us"),
                   previous_us=next((t for t, i, _ in times if i == i_prev), None),
                   heuristic_us=next((t for t, _, c in times if c == heur), None))
        ceil = STATE.get("copy_us", {}).get((B, heads))  # the same grid moving only the state (state_copy_ceiling)
        res.update(copy_ceiling_us=ceil, x_copy_ceiling=best[0] / ceil) if ceil else None
        for t, i, cfg in {i: (t, i, c) for t, i, c in [p for p in times if p[1] == i_prev] + [best]}.values():
            attempt(res, f"pdl_off_us_{i}", lambda: chain_us([decode_run(s, cfg, keep=qlen > 1)  # noqa: B023
                                                              for s in sets], pdl=False))
        if qlen == 1:  # like for like with fla: f given, not timed
            f_cfg = {**best[2], "GATE_MM": 0}
            attempt(res, "ours_f_given_us", lambda: chain_us([decode_run(f_given(s), f_cfg) for s in sets]))  # noqa: B023
        if FLA and qlen == 1:
            attempt(res, "fla_us", lambda: chain_us([fla_decode(ops, heads) for _ in range(n)]))  # noqa: B023
            attempt(res, "fla_plus_gate_gemm_us",
                    lambda: chain_us([fla_decode(ops, heads, True) for _ in range(n)]))  # noqa: B023
            res["speedup_vs_fla"] = res.get("fla_us", 0) / best[0]
            res["speedup_vs_fla_plus_gemm"] = res.get("fla_plus_gate_gemm_us", 0) / best[0]
            res["speedup_vs_fla_f_given"] = res.get("fla_us", 0) / res.get("ours_f_given_us", float("inf"))
        record(f"decode_B{B}_H{heads}_q{qlen}", **res)
        # the race check runs the fastest Gluon candidate of each gate mode (its state and f_b loads precede the PDL
        # wait), else the fastest EARLY one
        early = [[p for p in times if p[2].get("GLUON") and (p[2]["GLUON"] >= 2) == inner]
                 for inner in (True, False)]
        early = [g for g in early if g] or [[p for p in times if p[2].get("EARLY")]]
        STATE.setdefault("best_decode", {})[(B, heads, qlen)] = \
            [min(g, key=lambda p: p[0])[2] for g in early if g] or [best[2]]


@section
def pdl_race_check(reps=20):
    """A chain of 6 launches alternating two op sets A, B: launch i reads launch i-1's output as its q (loaded
    after the wait) and the state launch i-2 wrote (loaded before the wait with EARLY or GLUON). Graph replays with
    PDL must equal the same launches run eagerly with PDL off, bitwise, replay after replay; also its µs per launch
    with PDL on / off (the chain's gain)."""
    for (B, heads, qlen), cfg in ((k, c) for k, cs in STATE.get("best_decode", {}).items() for c in cs):
        if qlen != 1 or late(f"pdl race check B={B} H={heads}"):
            continue
        base = [low(decode_operands([1] * B, heads, seed=s)) for s in (5, 6)]
        pools = lambda sets: [x.clone() if torch.is_tensor(x) else x for x in sets]  # noqa: E731

        def chain(sets, first_q):
            q, outs = first_q, []
            for i in range(6):
                ops = list(sets[i % 2])
                ops[0] = q
                q = decode_run(ops, cfg)()[0]
                outs.append(q)
            return outs

        res = dict(B=B, H=heads, config=cfg, replays=reps)
        eager = [pools(s) for s in base]
        before = _pdl.set_enabled(False)
        want = [torch.cat(chain(eager, base[0][0])) for _ in range(reps)]
        _pdl.set_enabled(True)
        mine = [pools(s) for s in base]
        if DEV == "cuda":  # one warm-up run, the capture, the pools restored to where the eager run started
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                chain(mine, base[0][0])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = chain(mine, base[0][0])
            for m, b in zip(mine, base):
                m[6].copy_(b[6]), m[12].copy_(b[12])
            replay = lambda: (graph.replay(), torch.cat(outs))[1]  # noqa: E731
        else:  # the interpreter: no graphs, no PDL (a dry run of the logic)
            replay = lambda: torch.cat(chain(mine, base[0][0]))  # noqa: E731
        got = [replay().clone() for _ in range(reps)]
        _pdl.set_enabled(before)
        res.update(replays_differing=sum(not torch.equal(a, b) for a, b in zip(got, want)),
                   max_abs_diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)),
                   states_equal=all(torch.equal(mine[j][12], eager[j][12]) for j in range(2)))
        res["ok"] = res["replays_differing"] == 0 and res["states_equal"]
        attempt(res, "chain_us_pdl_on", lambda: chain_us([lambda: chain(mine, base[0][0])]) / 6)  # noqa: B023
        attempt(res, "chain_us_pdl_off", lambda: chain_us([lambda: chain(mine, base[0][0])], pdl=False) / 6)  # noqa: B023
        record(f"pdl_race_check_B{B}_H{heads}", **res)


def time_prefill_case(lengths, variants=False):
    """Whole prefill (heuristic, previous config, fla) at `lengths`; kernel-2 tiles apart (variants); the
    heuristic's config is what kda_prefill picks at this batch."""
    x, T, R = prefill_inputs(lengths, seed=2), sum(lengths), len(lengths)
    starts, lens, req_chunks = device_chunk_table(x["cu"], T)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    heur = prefill_heuristic({"D": D, "Dv": D, "H": H, "R": R, "T": T}, DEV)
    res = dict(B=R, T_each=lengths[0], bytes=prefill_bytes(T, R), heuristic_config=heur)
    ws, pool, best = run_intra(*args, heur), x["pool"].clone(), (float("inf"), heur)
    intra = [(ms(lambda: run_intra(*args, heur), rep=50), heur)]
    res["intra_ms"] = intra[0][0]
    for cfg in STATE.get("intra", []) if variants else []:  # kernel 1 alone (the variant's own workspace)
        key = "intra_ms_" + "_".join(f"{k}{cfg.get(k, 0)}" for k in _INTRA_KEYS)
        attempt(res, key, lambda: ms(lambda: run_intra(*args, cfg), rep=50))  # noqa: B023
        intra += [(res[key], cfg)] if key in res else []
    for cfg in (STATE.get("state") or [PREV_PREFILL]) if variants else []:
        tiles = {k: cfg[k] for k in ("BV", "WARPS", "STAGES")}
        try:
            t = ms(lambda: run_state(ws, pool, x["slots"], starts, lens, req_chunks, cfg, ACT,  # noqa: B023
                                     n_tokens=T), rep=50)
            record(f"prefill_state_B{R}_T{lengths[0]}", median_ms=t, **tiles,
                   heuristic=tiles == {k: heur[k] for k in tiles})
            best = min(best, (t, {**heur, **tiles}), key=lambda p: p[0])
        except Exception as e:  # noqa: BLE001
            record(f"prefill_state_B{R}_T{lengths[0]}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
    res["heuristic_ms"] = ms(ours_prefill(x, x["pool"].clone(), heur))
    if variants:
        res["previous_ms"] = ms(ours_prefill(x, x["pool"].clone(), PREV_PREFILL))
        res["best_state_tiles"] = {k: best[1][k] for k in ("BV", "WARPS", "STAGES")}
        res["best_state_tiles_ms"] = ms(ours_prefill(x, x["pool"].clone(), best[1]))  # kernel 1 as the heuristic's
        k1 = min(intra, key=lambda p: p[0])[1]  # the fastest kernel 1 with the fastest kernel-2 tiles
        res["best_config"] = STATE["best_intra"] = {**best[1], **{k: k1.get(k, 0) for k in _INTRA_KEYS}}
        attempt(res, "best_ms", lambda: ms(ours_prefill(x, x["pool"].clone(), res["best_config"])))
    elif "best_intra" in STATE:  # the best kernel 1 at B=4 with this batch's kernel-2 tiles
        cfg = {**heur, **{k: STATE["best_intra"][k] for k in _INTRA_KEYS}}
        attempt(res, "best_intra_ms", lambda: ms(ours_prefill(x, x["pool"].clone(), cfg)))
    res["x_byte_floor"] = res["heuristic_ms"] / (res["bytes"] / DOC["ceilings"].get("copy_GBps", 1) / 1e6)
    record(f"prefill_B{R}_T{lengths[0]}", **res)
    STATE.setdefault("prefill", {})[tuple(lengths)] = res


@section
def time_fla_prefill(*cases):
    """fla chunk_kda at the cases timed above (its autotune runs here, on a quiet GPU, every config timed by
    do_bench(warmup=5 ms, rep=20 ms): the warm-ups only compiled them); speed-ups of ours over it."""
    from triton.runtime.autotuner import Autotuner
    from triton.testing import do_bench
    Autotuner.do_bench = property(lambda self: lambda fn, **kw: do_bench(fn, warmup=5, rep=20, **kw))
    for lengths in cases:
        mine = STATE.get("prefill", {}).get(tuple(lengths))
        if not FLA_PREFILL or mine is None or late(f"fla prefill {len(lengths)} x {lengths[0]}"):
            continue
        x, res, t = prefill_inputs(lengths, seed=2), {}, time.time()
        attempt(res, "first_call_s", lambda: (fla_prefill(x, lengths)(), torch.cuda.synchronize(),  # noqa: B023
                                              time.time() - t)[-1])  # autotune included
        attempt(res, "fla_ms", lambda: ms(fla_prefill(x, lengths)))  # noqa: B023
        for k in ("heuristic_ms", "previous_ms", "best_state_tiles_ms", "best_ms", "best_intra_ms"):
            res[f"speedup_vs_fla_{k[:-3]}"] = res.get("fla_ms", 0) / mine[k] if k in mine else None
        record(f"fla_prefill_B{len(lengths)}_T{lengths[0]}", **res, ours_heuristic_ms=mine["heuristic_ms"])


@section
def time_prefill(*cases):
    for lengths, variants in cases:  # (request lengths, time the kernel-2 tiles apart)
        if not late(f"prefill {len(lengths)} x {lengths[0]}"):
            time_prefill_case(lengths, variants)


# ------------------------------------------------------------------------------------------ main
@section
def kernel_splits(lengths):
    """Where the prefill time goes: ms per kernel (torch.profiler) of ours (heuristic, best) and fla's chunk_kda at
    `lengths`; last, so that the profiler cannot perturb a timing."""
    mine = STATE.get("prefill", {}).get(tuple(lengths))
    if mine is None or DEV != "cuda" or late(f"kernel splits {len(lengths)} x {lengths[0]}"):
        return
    x, res = prefill_inputs(lengths, seed=2), {}
    for name, cfg in (("heuristic", mine["heuristic_config"]), ("best", mine.get("best_config"))):
        if cfg:
            attempt(res, f"ours_{name}", lambda: kernel_split_ms(ours_prefill(x, x["pool"].clone(), cfg)))  # noqa: B023
    attempt(res, "fla", lambda: kernel_split_ms(fla_prefill(x, lengths))) if FLA_PREFILL else None
    record(f"kernel_split_ms_B{len(lengths)}_T{lengths[0]}", **res)


def main():
    if "--warm" in sys.argv:
        return warm_up(sys.argv[-1], [c for _, c in state_configs()], decode_jobs(), DECODE_CASES)
    spawn = lambda what: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", what])  # noqa: E731
    os.environ["KDA_BENCH_POISON"] = f"/tmp/kda_bench_poison_{os.getpid()}.txt"  # see _kda_bench_inputs.poisoned
    gpu = DEV == "cuda"
    n_dec, n_fla = (int(os.environ.get(f"KDA_BENCH_WARM_{k}", v)) for k, v in (("DECODE", "6"), ("FLA", "5")))
    warm_dec = [spawn(f"decode:{i}:{n_dec}") for i in range(n_dec)] if gpu else []
    warm_pre = [spawn(f"prefill:{i}:4") for i in range(4)] if gpu and PREFILL else []
    warm_fla = [spawn(f"fla:{i}:{n_fla}") for i in range(n_fla)] if FLA else []
    DOC["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("KDA_BENCH", "K31C_"))}
    DOC["machine"] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                      "triton": triton.__version__, "device": torch.cuda.get_device_name() if gpu else "cpu",
                      "tiny": TINY, "fla": getattr(__import__("fla"), "__version__", "?") if FLA else "not used"}
    wait_all(warm_dec, "decode", 60, DOC, REPORT.t0)
    check_decode()
    check_gluon_ragged()
    wait_all(warm_pre, "prefill", 45, DOC, REPORT.t0)
    DOC["notes"] += [f"killed a warm-up's CUDA context: {k}" for k in sorted(poisoned())]
    if PREFILL:
        check_prefill()
    # nothing may time while a warm-up still runs kernels (the fla ones run each compiled kernel once): in session
    # 8 the timings overlapped them (B=64 decode 103 us vs 88 in s6 with the same code, PDL off)
    wait_all(warm_fla, "fla", float(os.environ.get("KDA_BENCH_WARM_WAIT_S", "60")), DOC, REPORT.t0)
    ceiling()
    state_copy_ceiling()
    if PREFILL:
        time_prefill(([T_PRE] * 4, True))
    time_decode((1,))
    pdl_race_check()
    if PREFILL:
        time_fla_prefill([T_PRE] * 4)
        time_prefill(([T_PRE], False), ([4 * T_PRE], False))
        time_fla_prefill([T_PRE], [4 * T_PRE])
    time_decode((8,))
    if PREFILL:
        kernel_splits([T_PRE] * 4)
    print(save()[:0])
    print(f"\n== summary (total {time.time() - REPORT.t0:.0f} s; passing checks: kda.json) ==")
    skip = ("name", "bytes", "H", "D", "tol", "byte_floor_us", "launch_gap_us", "heuristic_config", "chain")
    for m in (m for m in DOC["measurements"] if "_check" not in m["name"] or not m.get("ok")):
        print(f"{m['name']:<22} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                             f"{k}={list(v.values()) if isinstance(v, dict) else v}"
                                             for k, v in m.items() if k not in skip))
    for e in DOC["errors"]:
        print("ERROR", e["section"], e["error"][:300])


if __name__ == "__main__":
    main()
