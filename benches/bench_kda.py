"""KDA kernels on one GPU (issue 4): bf16 correctness at full shapes and timings vs fla-core 0.6.0.

One JSON document (stdout and $OUT/kda.json, rewritten after every record). Warm-up subprocesses (`--warm
decode:i:n | prefill:i:n | fla`) fill the compile cache in parallel; then, with nothing else on the GPU:
  check  bf16 vs fp32 references: fused decode (conv + gate + recurrence + gated RMSNorm) vs the unfused ops at
         B=1 H=12 (the rank preset), B=1 / B=64 at H=32, B=64 x 8 tokens (states kept); prefill kernel-1 and
         kernel-2 variants at B=1 T=8192 H=32 D=128 vs ir.ref kda_chunked
  time   copy bandwidth (the byte floors), launch gap; prefill B=4 x 8192 (kernel-2 variants apart), decode per
         launch in ONE CUDA graph of launches on distinct (L2-cold) pools and weights (candidates; ours with f
         given; fla fused_recurrent_kda, f given or + the f GEMM; floor B*H*D*D*4*2 bytes), prefill 1 x 8192
         (kernel-1 candidates) and 1 x 32768; whole prefill (heuristic, previous) vs fla chunk_kda each
Run: `python benches/bench_kda.py` on a CUDA machine (~250 s with fla's autotuning; cases that would start after
KDA_BENCH_DEADLINE_S=240 are skipped); KDA_BENCH_TINY=1: toy shapes in the interpreter (a dry run on a CPU).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch
from _report import BenchReport, copy_bandwidth_GBps, graph_ms, median_ms  # benches/ (the script's folder)

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
# fla's autotune results stay in memory: the process that times fla tunes it on a quiet GPU (warm-ups compile)
os.environ["TRITON_CACHE_AUTOTUNING"] = os.environ["FLA_CACHE_RESULTS"] = "0"
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen.triton._kda_common import device_chunk_table  # noqa: E402
from codegen.triton.kda_decode import heuristic as decode_heuristic, kda_decode  # noqa: E402
from codegen.triton.kda_prefill import heuristic as prefill_heuristic, kda_prefill, run_intra, run_state  # noqa: E402
from ir.ref import kda as ref  # noqa: E402
from ir.ref.basic import l2_norm  # noqa: E402
from tests.kda_decode_case import unfused_decode as unfused  # noqa: E402  (the fp32 op sequence the kernel fuses)

TINY = os.environ.get("KDA_BENCH_TINY") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D, H_RANK, T_PRE, B_DEC = (2, 32, 2, 128, 4) if TINY else (32, 128, 12, 8192, 64)  # H_RANK: the rank preset
ACT = torch.float32 if TINY else torch.bfloat16   # the interpreter computes bf16 wrongly (TOOLCHAIN.md)
FLA = DEV == "cuda" and os.environ.get("KDA_BENCH_FLA", "1") == "1"
REPORT = BenchReport("kda")
DOC, save, section = REPORT.doc, REPORT.save, REPORT.section
ms = lambda fn, rep=100: median_ms(fn, DEV, rep)  # noqa: E731
STATE: dict = {}  # results of the check phase the time phase uses
# previous = the heuristics of sessions 5 and 6 (benches/results/h200-2026-11-29-s5/kda_helper.json)
PREV_PREFILL = {"BK": 64, "BV_INTRA": 64, "WARPS_INTRA": 4, "STAGES_INTRA": 2, "BV": 32, "WARPS": 4, "STAGES": 3,
                "SPLIT_INTRA": 0, "LOWP_A": 1, "LOWP_WU": 1}
INTRA_VARIANTS = [{}, {"WARPS_INTRA": 8}, {"BK": 128, "WARPS_INTRA": 8}, {"STAGES_INTRA": 3}]
INTRA_SHOWN = ("BK", "WARPS_INTRA", "STAGES_INTRA", "LOWP_A", "LOWP_WU")
STATE_VARIANTS = [(32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2)]  # kernel 2 (BV, WARPS, STAGES)
DEC_KEYS = ("SPLIT", "BV", "WARPS", "PREFETCH", "GATE_MM", "RB", "MAXNREG", "GEMV")  # MAXNREG 0: no register cap
# decode: the first candidate is the heuristic (sessions 5 and 6); session 6 timed and dropped one program per head
# (8 / 16 warps), BV 16 and 8-16 warps at B=64, MAXNREG 128 (benches/results: kda_helper.json of session 6)
_B1 = [(4, 32, 4, 1, 0, 128, 0, 0), (8, 16, 4, 1, 0, 128, 0, 0), (8, 16, 4, 1, 0, 32, 0, 1),
       (2, 64, 4, 1, 0, 128, 0, 0)]
DECODE_CASES = [  # (B, heads, tokens per request, candidates as DEC_KEYS)
    (1, H_RANK, 1, [_B1[1], _B1[0]] + _B1[2:]), (1, H, 1, _B1),
    (B_DEC, H, 1, [(1, 64, 4, 1, 1, 32, 0, 0), (1, 32, 4, 1, 1, 32, 0, 0), (1, 64, 4, 1, 0, 32, 0, 1)]),
    (B_DEC, H, 8, [(1, 64, 4, 1, 0, 32, 0, 0)])]
DEADLINE = float(os.environ.get("KDA_BENCH_DEADLINE_S", "240"))  # later sections skip what would pass it


def late(what) -> bool:  # past the deadline: note the skipped case
    over = time.time() - REPORT.t0 > DEADLINE
    DOC["notes"] += [f"{what} skipped: past KDA_BENCH_DEADLINE_S={DEADLINE:.0f}"] if over else []
    return over


def rel(a, b) -> float:  # ||a - b|| / ||b||, NaN unless a is finite
    return ((a.double() - b.double()).norm() / b.double().norm()).item() if torch.isfinite(a).all() else float("nan")


def record(name, **kw):
    DOC["measurements"].append({"name": name, **kw}), save()
    print(f"   {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()))


def fla():
    return __import__("fla.ops.kda").ops.kda.chunk_kda, __import__("fla.ops.kda").ops.kda.fused_recurrent_kda


def chain_us(fns):
    """µs per launch in ONE CUDA graph of fns (each on its own inputs: L2-cold), as a captured step runs them."""
    return ms(fns[0]) * 1e3 if DEV == "cpu" else graph_ms(fns, reps=20) * 1e3


@triton.jit
def _empty_kernel(x):
    tl.store(x + tl.program_id(0), 1.0)


def prefill_inputs(lengths, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, R = sum(lengths), len(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q, k = l2_norm(r(T, H, D), 1e-6), l2_norm(r(T, H, D), 1e-6)
    g = -5.0 * torch.sigmoid(r(T, H, D) * 2.0 - 4.0)            # the K3 gate's range, mostly mild
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    x = dict(q=q, k=k, v=r(T, H, D), g=g, beta=torch.sigmoid(r(T, H)), pool=r(R + 1, H, D, D) * 0.3,
             slots=torch.arange(1, R + 1, device=DEV), cu=cu)
    x.update({f"{n}_act": x[n].to(ACT) for n in ("q", "k", "v", "beta")})
    return x


def prefill_bytes(T, R):  # q, k, v, beta, o in the activation dtype, g fp32, the state read and written
    return (4 * T * H * D + T * H) * ACT.itemsize + T * H * D * 4 + 2 * R * H * D * D * 4


def ours_prefill(x, pool, cfg):
    return lambda: kda_prefill(x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], pool,  # noqa: E731
                               x["slots"], x["cu"], D ** -0.5, config=cfg)


def fla_prefill(x, lengths):
    R = len(lengths)
    args = [t.view(R, lengths[0], *t.shape[1:]) for t in (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"])]
    init = x["pool"][1:].clone()
    return lambda: fla()[0](*args, scale=D ** -0.5, initial_state=init, output_final_state=True)  # noqa: E731


def decode_operands(lengths, heads, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    T, P, K, R = sum(lengths), heads * D, 4, len(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    return [r(T, P), r(T, P), r(T, P), r(P, K) * 0.5, r(P, K) * 0.5, r(P, K) * 0.5, r(R + 1, K - 1, 3 * P),
            r(T, D), r(P, D) / D ** 0.5, r(heads) * 0.5, r(P), r(T, heads), r(R + 1, heads, D, D) * 0.3, r(T, P),
            r(D), torch.arange(1, R + 1, device=DEV), cu]


def low(ops):
    """Activations and weights in the compute dtype; pools (conv tails, states) stay fp32."""
    return [None if x is None else x.to(ACT) if i not in (6, 9, 10, 12, 15, 16) else x.clone()
            for i, x in enumerate(ops)]


def decode_run(mine, cfg, keep=False):
    return lambda: kda_decode(*mine, scale=D ** -0.5, lower_bound=-5.0, norm_eps=1e-5, keep_states=keep,  # noqa: E731
                              block_v=cfg["BV"], num_warps=cfg["WARPS"], split=cfg["SPLIT"],
                              prefetch=bool(cfg["PREFETCH"]), gate_mm=bool(cfg["GATE_MM"]), rank_block=cfg["RB"],
                              max_regs=cfg.get("MAXNREG", 0), gemv=bool(cfg.get("GEMV", 0)))


def fla_decode(ops, heads, with_gemm=False):
    """fla's fused_recurrent_kda on the same step (recurrence only: no conv, no norm) as a closure: f = f_a f_b^T
    precomputed and not timed, or (with_gemm) computed by torch before it, as our kernel does in-kernel."""
    mine, B = low(ops), ops[15].numel()
    q, k, v, b = (mine[i].view(1, B, heads, -1) for i in (0, 1, 2, 11))
    f = lambda: (mine[7] @ mine[8].T).view(1, B, heads, D)  # noqa: E731
    f0 = f()
    kw = dict(A_log=ops[9], dt_bias=ops[10], scale=D ** -0.5, initial_state=ops[12][1:].clone(),
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    return lambda: fla()[1](q, k, v, f() if with_gemm else f0, b[..., 0], cu_seqlens=ops[16], **kw)  # noqa: E731


def f_given(ops):
    """Our operands with the gate input f = f_a f_b^T computed beforehand (f_b None), as fla is given it."""
    return ops[:7] + [(ops[7].float() @ ops[8].float().T).to(ops[7].dtype), None] + ops[9:]


def n_chain(B, heads):  # launches per timed graph: distinct state pools (~200 MB) that L2 (50 MB) cannot hold
    return max(3, min(48, -(-200 * 2 ** 20 // (B * heads * D * D * 4))))


def resources(**fns) -> list:
    """ptxas registers / spills / shared KiB / warps of every compiled variant of the named kernels."""
    cks = [(n, c) for n, fn in fns.items() for cache in getattr(fn, "device_caches", {}).values()
           for c in cache[0].values()]
    for _, ck in cks:
        ck._init_handles()
    return [f"{n}:{c.n_regs}r/{c.n_spills}s/{c.metadata.shared // 1024}K/w{c.metadata.num_warps}" for n, c in cks]


def prefill_configs():
    """(intra variants, kernel-2 variants) as full configs over the previous one."""
    intra = [{**PREV_PREFILL, **var} for var in INTRA_VARIANTS]
    state = [{**PREV_PREFILL, "BV": min(bv, D), "WARPS": w, "STAGES": st} for bv, w, st in STATE_VARIANTS]
    return intra, [c for i, c in enumerate(state) if c not in state[:i]]


@section
def check_prefill():
    from codegen.triton import kda_prefill as pre
    x = prefill_inputs([T_PRE])
    want = x["pool"].clone()
    o_ref = ref.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], want, x["slots"], x["cu"], D ** -0.5)
    intra, state = prefill_configs()
    STATE["intra"], STATE["state"] = [], []
    for kind, cfgs in (("intra", intra), ("state", state)):
        for cfg in cfgs:
            mine = x["pool"].clone()
            try:
                o = ours_prefill(x, mine, cfg)()
                errs = dict(rel_err_o=rel(o.float(), o_ref), rel_err_state=rel(mine[1:], want[1:]))
                good = all(e < 1e-2 for e in errs.values())
                STATE[kind] += [cfg] if good else []
                record(f"prefill_check_{kind}", T=T_PRE, **errs, tol=1e-2, ok=good,
                       config={k: cfg[k] for k in (INTRA_SHOWN if kind == "intra" else ("BV", "WARPS", "STAGES"))})
            except Exception as e:  # noqa: BLE001
                record(f"prefill_check_{kind}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
    DOC["kernel_resources_prefill"] = resources(intra=pre._kda_intra_kernel, state=pre._kda_state_kernel)
    # fla's error here (4.8e-3 / 3.9e-3 in sessions 5 and 6) is not re-checked: its first call autotunes (slow)


def decode_candidates(B, heads, qlen, grid):
    heur = decode_heuristic({"D": D, "H": heads, "R": B, "T": B * qlen}, DEV)
    cands = [{**c, "BV": min(c["BV"], D // c["SPLIT"])} for c in (dict(zip(DEC_KEYS, c)) for c in grid)]
    return cands + ([heur] if heur not in cands else []), heur


@section
def check_decode():
    from codegen.triton import kda_decode as dec
    STATE["decode"] = []
    for B, heads, qlen, grid in DECODE_CASES:
        ops = decode_operands([qlen] * B, heads)
        want = [x.clone() for x in ops]
        y_ref, states_ref = unfused(want, D ** -0.5, -5.0, 1e-5)
        cands, heur = decode_candidates(B, heads, qlen, grid)
        ok = []
        for i, cfg in enumerate(cands):
            try:
                out = decode_run(low(ops), cfg, keep=qlen > 1)()
                errs = dict(rel_err_out=rel(out[0].float(), y_ref), rel_err_state=rel(out[2][1:], want[12][1:]))
                errs.update(rel_err_kept_states=rel(out[3], states_ref)) if qlen > 1 else None
                good = all(e < 1e-2 for e in errs.values())
                record(f"decode_check_B{B}_H{heads}_q{qlen}", **errs, tol=1e-2, ok=good, config=cfg,
                       role="previous" if i == 0 else ("heuristic" if cfg == heur else "candidate"))
                ok += [cfg] if good else []
            except Exception as e:  # noqa: BLE001
                record(f"decode_check_B{B}_H{heads}_q{qlen}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
        STATE["decode"].append((B, heads, qlen, ok, heur))
    DOC["kernel_resources_decode"] = resources(decode=dec._kda_decode_kernel)


@section
def ceiling():
    DOC["ceilings"]["copy_GBps"] = copy_bandwidth_GBps(DEV) if DEV == "cuda" else 1.0
    record("copy_bandwidth", GBps=DOC["ceilings"]["copy_GBps"])
    buf = torch.zeros(64, device=DEV)
    DOC["ceilings"]["empty_launch_us"] = chain_us([lambda: _empty_kernel[(1,)](buf)] * 48)
    record("empty_kernel_chain", us_per_launch=DOC["ceilings"]["empty_launch_us"])


@section
def time_decode(qlens):
    for B, heads, qlen, ok, heur in STATE.get("decode", []):
        if qlen not in qlens or late(f"decode B={B} H={heads} q={qlen}"):
            continue
        ops = decode_operands([qlen] * B, heads)
        n = n_chain(B, heads)
        sets = [low(ops) for _ in range(n)]  # distinct pools and weights per launch
        floor_us = B * heads * D * D * 4 * 2 / DOC["ceilings"].get("copy_GBps", 1) / 1e3
        best, prev = (float("inf"), None), None
        for i, cfg in enumerate(ok):
            try:
                t = chain_us([decode_run(s, cfg, keep=qlen > 1) for s in sets])
            except Exception as e:  # noqa: BLE001
                record(f"decode_time_B{B}_H{heads}_q{qlen}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            prev = t if i == 0 else prev
            record(f"decode_time_B{B}_H{heads}_q{qlen}", us=t, x_floor=t / floor_us, chain=n, config=cfg,
                   heuristic=cfg == heur, previous=i == 0)
            best = min(best, (t, cfg), key=lambda p: p[0])
        res = dict(B=B, H=heads, q_len=qlen, best_us=best[0], best_config=best[1], previous_us=prev,
                   byte_floor_us=floor_us, x_floor=best[0] / floor_us,
                   launch_gap_us=DOC["ceilings"].get("empty_launch_us"))
        if qlen == 1 and best[1] is not None:  # like for like with fla: f given, not timed
            f_cfg = {**best[1], "GATE_MM": 0}
            attempt(res, "ours_f_given_us",
                    lambda: chain_us([decode_run(f_given(s), f_cfg) for s in sets]))  # noqa: B023
        if FLA and qlen == 1:
            attempt(res, "fla_us", lambda: chain_us([fla_decode(ops, heads) for _ in range(n)]))  # noqa: B023
            attempt(res, "fla_plus_gate_gemm_us",
                    lambda: chain_us([fla_decode(ops, heads, True) for _ in range(n)]))  # noqa: B023
            res["speedup_vs_fla"] = res.get("fla_us", 0) / best[0]
            res["speedup_vs_fla_f_given"] = res.get("fla_us", 0) / res.get("ours_f_given_us", float("inf"))
        record(f"decode_B{B}_H{heads}_q{qlen}", **res)


def time_prefill_case(lengths, intra_candidates=False):
    """Whole prefill (heuristic, previous config, fla) at `lengths`; kernel 1 candidates (B=1) or kernel 2
    variants apart; the heuristic's config is what kda_prefill picks at this batch."""
    x, T, R = prefill_inputs(lengths, seed=2), sum(lengths), len(lengths)
    starts, lens, req_chunks = device_chunk_table(x["cu"], T)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    heur = prefill_heuristic({"D": D, "Dv": D, "H": H, "R": R, "T": T}, DEV)
    res = dict(B=R, T_each=lengths[0], bytes=prefill_bytes(T, R), heuristic_config=heur)
    intra_c, state_c = STATE.get("intra", [PREV_PREFILL]), STATE.get("state", [PREV_PREFILL])
    for cfg in intra_c if intra_candidates else [heur]:
        t = ms(lambda: run_intra(*args, cfg), rep=50)  # noqa: B023
        record(f"prefill_intra_B{R}_T{lengths[0]}", median_ms=t, **{k: cfg[k] for k in INTRA_SHOWN})
    ws, pool, best = run_intra(*args, heur), x["pool"].clone(), (float("inf"), heur)
    for cfg in state_c + ([heur] if heur not in state_c else []):
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
    res["previous_ms"] = ms(ours_prefill(x, x["pool"].clone(), PREV_PREFILL))
    res["best_state_tiles"] = {k: best[1][k] for k in ("BV", "WARPS", "STAGES")}
    res["best_state_tiles_ms"] = ms(ours_prefill(x, x["pool"].clone(), best[1]))  # kernel 1 as the heuristic's
    res["x_byte_floor"] = res["heuristic_ms"] / (res["bytes"] / DOC["ceilings"].get("copy_GBps", 1) / 1e6)
    if FLA:
        res["fla_ms"] = ms(fla_prefill(x, lengths))
        res.update(speedup_vs_fla=res["fla_ms"] / res["heuristic_ms"],
                   speedup_vs_fla_previous=res["fla_ms"] / res["previous_ms"],
                   speedup_vs_fla_best_state_tiles=res["fla_ms"] / res["best_state_tiles_ms"])
    record(f"prefill_B{R}_T{lengths[0]}", **res)


@section
def time_prefill(*cases):
    for lengths, cands in cases:  # (request lengths, time the kernel-1 candidates too)
        if not late(f"prefill {len(lengths)} x {lengths[0]}"):
            time_prefill_case(lengths, cands)


def attempt(res, key, fn):
    """res[key] = fn(), or res[key + "_error"] = what it raised (one shot on the GPU: report and go on)."""
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001
        res[key + "_error"] = f"{type(e).__name__}: {e}"[:300]


def warm_up(what):
    """Subprocess: compile into the disk cache (a failing candidate is skipped: the check phase records it) our
    prefill variants or decode candidates part i of n ("prefill:i:n"), or fla's kernels at the bench's shapes."""
    kind, i, n = (what.split(":") + ["0", "1"])[:3]
    if kind == "prefill":
        x = prefill_inputs([T_PRE])
        for cfg in sum(prefill_configs(), [])[int(i)::int(n)]:
            attempt({}, "warm", ours_prefill(x, x["pool"].clone(), cfg))  # the check phase records failures
    if kind == "decode":
        jobs = [(B, heads, qlen, c) for B, heads, qlen, grid in DECODE_CASES
                for c in decode_candidates(B, heads, qlen, grid)[0]]
        for B, heads, qlen, cfg in jobs[int(i)::int(n)]:
            attempt({}, "warm", decode_run(low(decode_operands([qlen] * B, heads)), cfg, keep=qlen > 1))
    for lengths in ([T_PRE], [4 * T_PRE], [T_PRE] * 4) if kind == "fla" else []:
        fla_prefill(prefill_inputs(lengths), lengths)()
    for B, heads, qlen, _ in DECODE_CASES if kind == "fla" else []:
        fla_decode(decode_operands([1] * B, heads), heads)() if qlen == 1 else None
    torch.cuda.synchronize()


def wait(procs, what, timeout):  # warm-up subprocesses, killed after timeout s (the main process compiles the rest)
    t = time.time()
    for proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t)))
        except subprocess.TimeoutExpired:
            rc = proc.kill()
        DOC["notes"].append(f"{what} warm-up subprocess: rc {rc}, at {time.time() - REPORT.t0:.1f} s")


def main():
    if "--warm" in sys.argv:
        return warm_up(sys.argv[-1])
    spawn = lambda what: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", what])  # noqa: E731
    n_dec = int(os.environ.get("KDA_BENCH_WARM_PROCS", "4"))
    warm_dec = [spawn(f"decode:{i}:{n_dec}") for i in range(n_dec)] if DEV == "cuda" else []
    warm_pre = [spawn(f"prefill:{i}:3") for i in range(3)] if DEV == "cuda" else []
    warm_fla = [spawn("fla")] if FLA else []
    DOC["machine"] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                      "triton": triton.__version__, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      "tiny": TINY, "fla": getattr(__import__("fla"), "__version__", "?") if FLA else "not used"}
    wait(warm_dec, "decode", 60)
    check_decode()
    wait(warm_pre, "prefill", 30)
    check_prefill()
    wait(warm_fla, "fla", float(os.environ.get("KDA_BENCH_WARM_WAIT_S", "25")))
    ceiling(), time_prefill(([T_PRE] * 4, False),), time_decode((1,))
    time_prefill(([T_PRE], True), ([4 * T_PRE], False)), time_decode((8,))
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
