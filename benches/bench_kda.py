"""KDA kernels on one GPU (issue 4): bf16 correctness at full shapes and timings vs fla-core 0.6.0.

Emits one JSON document (stdout and $OUT/kda.json, rewritten after every section). Two phases; fla's and our
prefill compiles run in subprocesses (`--warm fla`, `--warm prefill`: the disk cache) during the check phase,
so nothing else uses the GPU while anything is timed:
  check  every candidate once, bf16: prefill B=1 T=8192 H=32 D=128 vs the fp32 reference (ir.ref kda_chunked),
         fla chunk_kda vs the same; fused decode (conv + gate + recurrence + gated RMSNorm) vs the unfused fp32
         op sequence: B=64 and B=1 at H=32, B=1 at H=12 (the rank preset), B=64 x 8 tokens (states kept)
  time   copy ceiling; kernel-1 candidates (fastest = "tuned"); prefill: previous (session-3) config, tuned,
         fla; decode per launch in CUDA graphs of N launches on N distinct (L2-cold) pools and weights, as a
         captured step sees it, vs fla fused_recurrent_kda (recurrence only; f given, or + the f GEMM), ours
         with f given, an empty kernel (launch gap), the state byte floor B*H*D*D*4*2 / copy bandwidth;
         T=32K and B=4 x 8192 (intra / state kernels apart) vs fla
Run: `python benches/bench_kda.py` on a CUDA machine (~150-190 s); KDA_BENCH_TINY=1: toy shapes, interpreter.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch
from _report import BenchReport, median_ms  # benches/_report.py (the script's folder is on sys.path)

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
# fla's autotune results stay in memory: the process that times fla tunes it itself, on a quiet GPU (the warm-up
# subprocess only fills the disk cache with compiled kernels; its timings ran next to our check phase)
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

# previous = session 3's heuristic (benches/results/h200-2026-11-29-s3/kda.json)
PREV_PREFILL = {"BK": 32, "BV_INTRA": 64, "WARPS_INTRA": 4, "STAGES_INTRA": 2, "BV": 32, "WARPS": 4, "STAGES": 3,
                "SPLIT_INTRA": 0, "LOWP_A": 0, "LOWP_WU": 0}
_WU, _LOWP = {"BK_WU": 64, "BV_WU": 64, "WARPS_WU": 4, "STAGES_WU": 2}, {"LOWP_A": 1, "LOWP_WU": 1}
INTRA_VARIANTS = [{}, {"LOWP_WU": 1}, _LOWP, {"BK": 64, **_LOWP}, {"SPLIT_INTRA": 1, **_LOWP, **_WU},
                  {"BK": 64, "WARPS_INTRA": 8, **_LOWP}, {"BK": 128, "WARPS_INTRA": 8, **_LOWP}]
INTRA_SHOWN = ("BK", "WARPS_INTRA", "SPLIT_INTRA", "LOWP_A", "LOWP_WU")
DEC_KEYS = ("SPLIT", "BV", "WARPS", "PREFETCH", "GATE_MM", "RB", "MAXNREG")  # MAXNREG 0: no register cap
_B1 = [(4, 32, 4, 1, 0, 32, 0), (4, 32, 4, 1, 0, 128, 0), (8, 16, 4, 1, 0, 128, 0), (8, 16, 2, 1, 0, 128, 0),
       (2, 64, 4, 1, 0, 128, 0), (1, 128, 8, 1, 0, 128, 0)]
DECODE_CASES = [  # (B, heads, tokens per request, candidates as DEC_KEYS; the first: the previous config)
    (B_DEC, H, 1, [(1, 64, 4, 1, 1, 32, 0), (1, 64, 4, 1, 0, 32, 0), (1, 32, 2, 1, 1, 32, 0), (2, 64, 4, 1, 1, 32, 0),
                   (4, 32, 4, 1, 1, 32, 0), (1, 64, 4, 1, 1, 32, 168), (1, 32, 4, 1, 1, 32, 128)]),
    (1, H, 1, _B1), (1, H_RANK, 1, _B1[:5]), (B_DEC, H, 8, [(1, 64, 4, 1, 0, 32, 0)])]


def rel(a, b) -> float:  # ||a - b|| / ||b||, NaN unless a is finite
    return ((a.double() - b.double()).norm() / b.double().norm()).item() if torch.isfinite(a).all() else float("nan")


def record(name, **kw):
    DOC["measurements"].append({"name": name, **kw}), save()
    print(f"   {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()),
          flush=True)


def fla():
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    return chunk_kda, fused_recurrent_kda


def chain_us(fns):
    """Device time per launch (µs) of a CUDA graph that runs fns one after another (each on its own inputs);
    on CPU (dry run) one plain call."""
    if DEV == "cpu":
        return ms(fns[0]) * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    return ms(g.replay) * 1e3 / len(fns)


@triton.jit
def _empty_kernel(x):
    tl.store(x + tl.program_id(0), 1.0)


# ------------------------------------------------------------------------------------------ inputs
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
                              max_regs=cfg.get("MAXNREG", 0))


def fla_decode(ops, heads, with_gemm=False):
    """fla's fused_recurrent_kda on the same step (recurrence only: no conv, no norm) as a closure: f = f_a f_b^T
    precomputed and not timed, or (with_gemm) computed by torch before it, as our kernel does in-kernel."""
    mine = low(ops)
    B = ops[15].numel()
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


def n_chain(B, heads):
    """Launches per timed graph: enough distinct state pools (~200 MB) that L2 (50 MB) holds none of them."""
    return max(3, min(48, -(-200 * 2 ** 20 // (B * heads * D * D * 4))))


def resources(**fns) -> list:
    """ptxas registers / spills / shared KiB / warps of every compiled variant of the named kernels."""
    out = []
    for name, fn in fns.items():
        for ck in (c for cache in getattr(fn, "device_caches", {}).values() for c in cache[0].values()):
            try:
                ck._init_handles()
                out.append(f"{name}:{ck.n_regs}r/{ck.n_spills}s/{ck.metadata.shared // 1024}K/w{ck.metadata.num_warps}")
            except Exception as e:  # noqa: BLE001
                out.append(f"{name}:? {str(e)[:60]}")
    return out


# ------------------------------------------------------------------------------------------ check phase
@section
def check_prefill():
    from codegen.triton import _kda_wu, kda_prefill as pre
    x = prefill_inputs([T_PRE])
    starts, lens, _ = device_chunk_table(x["cu"], T_PRE)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    STATE["intra"] = []
    for var in INTRA_VARIANTS:
        cfg = {**PREV_PREFILL, **{k: (min(v, D) if k.startswith("B") else v) for k, v in var.items()}}
        try:
            run_intra(*args, cfg)
            STATE["intra"].append(cfg)
        except Exception as e:  # noqa: BLE001
            record("candidate_intra_error", **var, error=f"{type(e).__name__}: {str(e)[:200]}")
    want = x["pool"].clone()
    o_ref = ref.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], want, x["slots"], x["cu"], D ** -0.5)
    for cfg in STATE["intra"]:
        mine = x["pool"].clone()
        o = ours_prefill(x, mine, cfg)()
        record("prefill_bf16_vs_fp32_ref", T=T_PRE, rel_err_o=rel(o.float(), o_ref),
               rel_err_state=rel(mine[1:], want[1:]), tol=1e-2, config={k: cfg[k] for k in INTRA_SHOWN})
    DOC["kernel_resources_prefill"] = resources(intra=pre._kda_intra_kernel, wu=_kda_wu._kda_wu_kernel,
                                                state=pre._kda_state_kernel)
    if FLA:
        o_fla, s_fla = fla_prefill(x, [T_PRE])()
        record("fla_chunk_kda_bf16_vs_fp32_ref", rel_err_o=rel(o_fla[0].float(), o_ref),
               rel_err_state=rel(s_fla, want[1:]))


@section
def check_decode():
    from codegen.triton import kda_decode as dec
    STATE["decode"] = []
    for B, heads, qlen, grid in DECODE_CASES:
        ops = decode_operands([qlen] * B, heads)
        want = [x.clone() for x in ops]
        y_ref, states_ref = unfused(want, D ** -0.5, -5.0, 1e-5)
        heur = decode_heuristic({"D": D, "H": heads, "R": B, "T": B * qlen}, DEV)
        cands = [{**c, "BV": min(c["BV"], D // c["SPLIT"])} for c in (dict(zip(DEC_KEYS, c)) for c in grid)]
        cands += [heur] if heur not in cands else []
        ok = []
        for i, cfg in enumerate(cands):
            try:
                out = decode_run(low(ops), cfg, keep=qlen > 1)()
                errs = dict(rel_err_out=rel(out[0].float(), y_ref), rel_err_state=rel(out[2][1:], want[12][1:]))
                if qlen > 1:
                    errs["rel_err_kept_states"] = rel(out[3], states_ref)
                good = all(e < 1e-2 for e in errs.values())
                record(f"decode_check_B{B}_H{heads}_q{qlen}", **errs, tol=1e-2, ok=good, config=cfg,
                       role="previous" if i == 0 else ("heuristic" if cfg == heur else "candidate"))
                ok += [cfg] if good else []
            except Exception as e:  # noqa: BLE001
                record(f"decode_check_B{B}_H{heads}_q{qlen}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
        STATE["decode"].append((B, heads, qlen, ok, heur))
    DOC["kernel_resources_decode"] = resources(decode=dec._kda_decode_kernel)


# ------------------------------------------------------------------------------------------ time phase
@section
def ceiling():
    n = (1 << 22) if TINY else (1 << 29)   # 2 GiB of fp32 on the GPU
    x, y = torch.empty(n, dtype=torch.float32, device=DEV).uniform_(), torch.empty(n, device=DEV)
    t = ms(lambda: y.copy_(x))
    DOC["ceilings"]["copy_GBps"] = 2 * x.numel() * 4 / t / 1e6
    record("copy_bandwidth", bytes=2 * x.numel() * 4, median_ms=t, GBps=DOC["ceilings"]["copy_GBps"])
    buf = torch.zeros(64, device=DEV)
    DOC["ceilings"]["empty_launch_us"] = chain_us([lambda: _empty_kernel[(1,)](buf)] * 48)
    record("empty_kernel_chain", us_per_launch=DOC["ceilings"]["empty_launch_us"])


@section
def time_prefill():
    x = prefill_inputs([T_PRE])
    starts, lens, _ = device_chunk_table(x["cu"], T_PRE)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    best = (float("inf"), PREV_PREFILL)
    for cfg in STATE.get("intra", [PREV_PREFILL]):
        t = ms(lambda: run_intra(*args, cfg), rep=50)
        record("candidate_intra", median_ms=t, **{k: cfg[k] for k in INTRA_SHOWN})
        best = min(best, (t, cfg), key=lambda p: p[0])
    STATE["prefill"] = DOC.setdefault("tuned_configs", {})["prefill"] = best[1]
    nbytes = prefill_bytes(T_PRE, 1)
    res = dict(B=1, T=T_PRE, H=H, D=D, bytes=nbytes, tuned_config=best[1],
               previous_ms=ms(ours_prefill(x, x["pool"].clone(), PREV_PREFILL)),
               tuned_ms=ms(ours_prefill(x, x["pool"].clone(), best[1])),
               heuristic_ms=ms(ours_prefill(x, x["pool"].clone(), None)),
               heuristic_config=prefill_heuristic({"D": D, "Dv": D}, DEV))
    res["x_byte_floor"] = res["tuned_ms"] / (nbytes / DOC["ceilings"].get("copy_GBps", 1) / 1e6)
    if FLA:
        t_fla = ms(fla_prefill(x, [T_PRE]))
        res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / res["tuned_ms"],
                   speedup_vs_fla_previous=t_fla / res["previous_ms"])
    record("prefill_B1_T8192", **res)


@section
def time_decode():
    for B, heads, qlen, ok, heur in STATE.get("decode", []):
        ops = decode_operands([qlen] * B, heads)
        n = n_chain(B, heads)
        sets = [low(ops) for _ in range(n)]  # distinct pools and weights per launch
        floor_us = B * heads * D * D * 4 * 2 / DOC["ceilings"].get("copy_GBps", 1) / 1e3
        best = (float("inf"), None)
        for i, cfg in enumerate(ok):
            try:
                t = chain_us([decode_run(s, cfg, keep=qlen > 1) for s in sets])
            except Exception as e:  # noqa: BLE001
                record(f"decode_time_B{B}_H{heads}_q{qlen}", config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            record(f"decode_time_B{B}_H{heads}_q{qlen}", us=t, x_floor=t / floor_us, chain=n, config=cfg,
                   heuristic=cfg == heur)
            best = min(best, (t, cfg), key=lambda p: p[0])
        res = dict(B=B, H=heads, q_len=qlen, best_us=best[0], best_config=best[1], byte_floor_us=floor_us,
                   x_floor=best[0] / floor_us, launch_gap_us=DOC["ceilings"].get("empty_launch_us"))
        if qlen == 1 and best[1] is not None:  # like for like with fla: f given, not timed
            try:
                res["ours_f_given_us"] = chain_us([decode_run(f_given(s), best[1]) for s in sets])
            except Exception as e:  # noqa: BLE001
                res["ours_f_given_error"] = f"{type(e).__name__}: {e}"[:300]
        if FLA and qlen == 1:
            try:
                t_fla = chain_us([fla_decode(ops, heads) for _ in range(n)])
                res.update(fla_us=t_fla, speedup_vs_fla=t_fla / best[0],
                           fla_plus_gate_gemm_us=chain_us([fla_decode(ops, heads, True) for _ in range(n)]))
            except Exception as e:  # noqa: BLE001
                res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
        record(f"decode_B{B}_H{heads}_q{qlen}", **res)


@section
def time_prefill_more():
    for lengths in ([4 * T_PRE], [T_PRE] * 4):
        if time.time() - REPORT.t0 > float(os.environ.get("KDA_BENCH_DEADLINE_S", "210")):
            DOC["notes"].append(f"prefill {len(lengths)} x {lengths[0]} skipped: past KDA_BENCH_DEADLINE_S")
            continue
        x, T, R = prefill_inputs(lengths, seed=2), sum(lengths), len(lengths)
        cfg = STATE.get("prefill") or prefill_heuristic({"D": D, "Dv": D}, DEV)
        res = dict(B=R, T_each=lengths[0], median_ms=ms(ours_prefill(x, x["pool"].clone(), cfg)), config=cfg,
                   previous_ms=ms(ours_prefill(x, x["pool"].clone(), PREV_PREFILL)), bytes=prefill_bytes(T, R))
        starts, lens, req_chunks = device_chunk_table(x["cu"], T)  # kernels 1 and 2 apart:
        args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
        ws = run_intra(*args, cfg)
        res.update(intra_ms=ms(lambda: run_intra(*args, cfg)), state_ms=ms(  # noqa: B023
            lambda: run_state(ws, x["pool"].clone(), x["slots"], starts, lens, req_chunks, cfg, ACT, n_tokens=T)))
        if FLA:
            res["fla_ms"] = ms(fla_prefill(x, lengths))
            res["speedup_vs_fla"] = res["fla_ms"] / res["median_ms"]
        record(f"prefill_B{R}_T{lengths[0]}", **res)


def warm_up(what):
    """Subprocess: our prefill candidates (kernels 1, 2) or fla's kernels at the bench's shapes, compiled into
    the disk cache (a failing candidate stops it: the check phase records that candidate's error)."""
    x = prefill_inputs([T_PRE])
    for var in INTRA_VARIANTS if what == "prefill" else []:
        ours_prefill(x, x["pool"].clone(), {**PREV_PREFILL, **var})()
    for lengths in ([T_PRE], [4 * T_PRE], [T_PRE] * 4) if what == "fla" else []:
        fla_prefill(prefill_inputs(lengths), lengths)()
    for B, heads, qlen, _ in DECODE_CASES if what == "fla" else []:
        fla_decode(decode_operands([1] * B, heads), heads)() if qlen == 1 else None
    torch.cuda.synchronize()


def wait(proc, what, timeout):
    """Wait for a warm-up subprocess (killed after timeout s): its compiles are then in the disk cache."""
    t, rc = time.time(), None
    if proc is not None:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        DOC["notes"].append(f"{what} warm-up subprocess: rc {rc}, waited {time.time() - t:.1f} s")


def main():
    if "--warm" in sys.argv:
        return warm_up(sys.argv[-1])
    spawn = lambda what: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", what])  # noqa: E731
    warm, warm_pre = spawn("fla") if FLA else None, spawn("prefill") if DEV == "cuda" else None
    DOC["machine"] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                      "triton": triton.__version__, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      "tiny": TINY, "fla": getattr(__import__("fla"), "__version__", "?") if FLA else "not used"}
    torch.manual_seed(0)
    check_decode()
    wait(warm_pre, "prefill", 60)
    check_prefill()
    wait(warm, "fla", float(os.environ.get("KDA_BENCH_WARM_WAIT_S", "90")))
    for sec in (ceiling, time_prefill, time_decode, time_prefill_more):
        sec()
    print(save()[:0])
    print(f"\n== summary (total {time.time() - REPORT.t0:.0f} s) ==")
    skip = ("name", "bytes", "H", "D", "tol", "byte_floor_us", "launch_gap_us")
    for m in DOC["measurements"]:
        print(f"{m['name']:<26} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in m.items() if k not in skip))
    for e in DOC["errors"]:
        print("ERROR", e["section"], e["error"][:300])


if __name__ == "__main__":
    main()
