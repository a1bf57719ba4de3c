"""KDA kernels on one GPU (issue 4): bf16 correctness at full shapes and timings vs fla-core 0.6.0.

Emits one JSON document (stdout and $OUT/kda.json, rewritten after every section so a timeout keeps
what was measured). Sections, in order:
  ceiling    device-to-device copy bandwidth (read + write bytes / time), measured here
  candidates a few variants of each kernel (prefill kernel 1: bf16 tensor-core products LOWP_A/LOWP_WU, split
             into A/inverse + W/U kernels; decode: SPLIT/BV/prefetch/gate GEMM/RB at B=64 and B=1) with ptxas
             registers/spills; the fastest ("tuned") is checked and timed below next to the heuristic
  prefill    B=1, T=8192, H=32, D=128 bf16: ours vs the fp32 reference (`ir.ref.kda.kda_chunked`), fla
             `chunk_kda` vs the same reference; times of ours (chunk table, two kernels) and of fla
  decode     fused decode (conv + gate + recurrence + gated RMSNorm), B=64 and B=1 (1 token each) and B=64 x 8
             tokens (verification, per-token states kept): error vs the unfused fp32 op sequence; time vs fla
             `fused_recurrent_kda` (recurrence only, f precomputed) and vs the state byte floor
             B*H*D*D*4*2 / copy bandwidth; plain launches and CUDA-graph replays
  prefill_more  T=32K (B=1) and B=4 x 8192, ours vs fla
KDA_BENCH_SWEEP=1 adds candidates; KDA_BENCH_FLA_PREFILL=0 skips fla's chunk_kda (its first call autotunes for
~100 s); KDA_BENCH_BUDGET_S (215 s) paces the sections: give the call >= 240 s.

    python benches/bench_kda.py                    # on a CUDA machine
    KDA_BENCH_TINY=1 python benches/bench_kda.py   # toy shapes through the interpreter (logic dry run)
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch
from _report import BenchReport, median_ms  # benches/_report.py (the script's folder is on sys.path)

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen.triton._kda_common import device_chunk_table  # noqa: E402
from codegen.triton.kda_decode import heuristic as decode_heuristic  # noqa: E402
from codegen.triton.kda_decode import kda_decode  # noqa: E402
from codegen.triton.kda_prefill import heuristic as prefill_heuristic  # noqa: E402
from codegen.triton.kda_prefill import kda_prefill, run_intra, run_state  # noqa: E402
from ir.ref import kda as ref  # noqa: E402
from ir.ref.basic import l2_norm  # noqa: E402
from tests.kda_decode_case import unfused_decode as unfused  # noqa: E402  (the fp32 op sequence the kernel fuses)

TINY = os.environ.get("KDA_BENCH_TINY") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D = (2, 32) if TINY else (32, 128)
T_PRE, B_DEC = (128, 4) if TINY else (8192, 64)
ACT = torch.float32 if TINY else torch.bfloat16   # the interpreter computes bf16 wrongly (TOOLCHAIN.md)
BUDGET_S = float(os.environ.get("KDA_BENCH_BUDGET_S", "215"))
SWEEP = os.environ.get("KDA_BENCH_SWEEP") == "1"  # more candidates (adds ~40 s)
FLA_PREFILL = os.environ.get("KDA_BENCH_FLA_PREFILL", "1") == "1"
TUNED: dict = {}  # family -> fastest config of the candidates sections
REPORT = BenchReport("kda")
DOC, save, section = REPORT.doc, REPORT.save, REPORT.section


left = lambda: BUDGET_S - (time.time() - REPORT.t0)  # noqa: E731  (seconds of the budget left)
ms = lambda fn, rep=100: median_ms(fn, DEV, rep)  # noqa: E731


def graph_ms(fn):
    """Median time of CUDA-graph replays of fn (host launch overhead removed)."""
    if DEV == "cpu":
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=25, rep=100, return_mode="median")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm()).item()
    return err if torch.isfinite(a).all() else float("nan")


def record(name, **kw):
    DOC["measurements"].append({"name": name, **kw}), save()
    print(f"   {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()),
          flush=True)


def fla():
    if DEV == "cpu":
        return None
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    return chunk_kda, fused_recurrent_kda


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


def prefill_flops(T):
    """Chunked-form matmul FLOPs per (64-chunk, head): A, Aqk, W, U, Aqk d (2*64*64*D each); d, o, S (2*64*D*D)."""
    return (T // 64) * H * (5 * 2 * 64 * 64 * D + 3 * 2 * 64 * D * D)


def ours_prefill(x, pool, cfg):
    return lambda: kda_prefill(x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], pool,  # noqa: E731
                               x["slots"], x["cu"], D ** -0.5, config=cfg)


def fla_prefill(x, lengths):
    R = len(lengths)
    args = [t.view(R, lengths[0], *t.shape[1:]) for t in (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"])]
    init = x["pool"][1:].clone()
    return lambda: fla()[0](*args, scale=D ** -0.5, initial_state=init, output_final_state=True)  # noqa: E731


def decode_operands(lengths, rank=None, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    T, P, K, R = sum(lengths), H * D, 4, len(lengths)
    rank = rank or D
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    return [r(T, P), r(T, P), r(T, P), r(P, K) * 0.5, r(P, K) * 0.5, r(P, K) * 0.5, r(R + 1, K - 1, 3 * P),
            r(T, rank), r(P, rank) / rank ** 0.5, r(H) * 0.5, r(P), r(T, H), r(R + 1, H, D, D) * 0.3, r(T, P),
            r(D), torch.arange(1, R + 1, device=DEV), cu]


def low(ops):
    """Activations and weights in the compute dtype; pools (conv tails, states) stay fp32."""
    return [x.to(ACT) if i not in (6, 9, 10, 12, 15, 16) and x is not None else x for i, x in enumerate(ops)]


def fla_decode(ops, B, scale, lb):
    """fla's fused_recurrent_kda on the same step (f = f_a f_b^T precomputed, not timed), as a closure."""
    mine = low(ops)
    q, k, v, b = (mine[i] for i in (0, 1, 2, 11))
    f_raw = (mine[7] @ mine[8].T).view(1, B, H, D)
    kw = dict(A_log=ops[9], dt_bias=ops[10], scale=scale, initial_state=ops[12][1:].clone(), output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lb)
    return lambda: fla()[1](q.view(1, B, H, D), k.view(1, B, H, D), v.view(1, B, H, D), f_raw,  # noqa: E731
                            b.view(1, B, H), cu_seqlens=ops[16], **kw)


def decode_run(mine, cfg, keep=False):
    return lambda: kda_decode(*mine, scale=D ** -0.5, lower_bound=-5.0, norm_eps=1e-5, keep_states=keep,  # noqa: E731
                              block_v=cfg["BV"], num_warps=cfg["WARPS"], split=cfg.get("SPLIT", 1),
                              prefetch=bool(cfg.get("PREFETCH", 1)), gate_mm=bool(cfg.get("GATE_MM", 0)),
                              rank_block=cfg.get("RB", 32))


def decode_time(mine, B, cfg, keep=False):
    run = decode_run(mine, cfg, keep)
    t, tg = ms(run), graph_ms(run)
    floor = B * H * D * D * 4 * 2 / DOC["ceilings"].get("copy_GBps", 1) / 1e6
    return dict(median_ms=t, graph_ms=tg, byte_floor_ms=floor, x_floor=t / floor,
                x_floor_graph=(tg / floor) if tg else None)


# ------------------------------------------------------------------------------------------ sections
@section
def ceiling():
    n = (1 << 26) if TINY else (1 << 29)   # 2 GiB of fp32 on the GPU
    x, y = torch.empty(n, dtype=torch.float32, device=DEV).uniform_(), torch.empty(n, device=DEV)
    t = ms(lambda: y.copy_(x))
    DOC["ceilings"]["copy_GBps"] = 2 * x.numel() * 4 / t / 1e6
    record("copy_bandwidth", bytes=2 * x.numel() * 4, median_ms=t, GBps=DOC["ceilings"]["copy_GBps"])


@section
def prefill_check():
    x = prefill_inputs([T_PRE])
    scale = D ** -0.5
    want = x["pool"].clone()
    o_ref = ref.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], want, x["slots"], x["cu"], scale)
    for name, cfg in (("heuristic", None), ("tuned", TUNED.get("prefill"))):
        if name == "tuned" and cfg is None:
            continue
        mine = x["pool"].clone()
        o = ours_prefill(x, mine, cfg)()
        record(f"prefill_bf16_vs_fp32_ref_{name}", T=T_PRE, rel_err_o=rel(o.float(), o_ref),
               rel_err_state=rel(mine[1:], want[1:]), tol=1e-2, config=cfg)
    mine32 = x["pool"].clone()
    o32 = kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], mine32, x["slots"], x["cu"], scale)
    record("prefill_fp32_kernel_vs_fp32_ref", rel_err_o=rel(o32, o_ref), rel_err_state=rel(mine32[1:], want[1:]),
           tol=1e-5)
    f = torch.randn(T_PRE, H * D, device=DEV) * 2
    A_log, dt_bias = torch.zeros(H, device=DEV), torch.randn(H * D, device=DEV)
    want_g, mine_g = x["pool"].clone(), x["pool"].clone()
    o_g = ref.kda_chunked(x["q"], x["k"], x["v"], ref.kda_gate(f, A_log, dt_bias, -5.0), x["beta"], want_g,
                          x["slots"], x["cu"], scale)
    o_f = kda_prefill(x["q_act"], x["k_act"], x["v_act"], None, x["beta_act"], mine_g, x["slots"], x["cu"], scale,
                      f=f.to(ACT), A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, config=TUNED.get("prefill"))
    record("prefill_fused_gate_bf16_vs_fp32_ref", rel_err_o=rel(o_f.float(), o_g), tol=1e-2)
    if fla() and FLA_PREFILL:
        o_fla, s_fla = fla_prefill(x, [T_PRE])()
        record("fla_chunk_kda_bf16_vs_fp32_ref", rel_err_o=rel(o_fla[0].float(), o_ref),
               rel_err_state=rel(s_fla, want[1:]))


# Candidates timed before the checked/timed sections; the fastest ("tuned") is then checked in bf16 at full shape
# and timed next to the heuristic. H200, 2026-11-29: the state kernel's BV 32 / 4 warps / 3 stages beat BV 16/64
# and 8 warps by 1.6-2.1x, and 8-warp intra kernels ran 1.5-1.8x slower, so those are not repeated.
_WU = {"BK_WU": 64, "BV_WU": 64, "WARPS_WU": 4, "STAGES_WU": 2}
INTRA_VARIANTS = [{}, {"LOWP_WU": 1}, {"LOWP_A": 1, "LOWP_WU": 1}, {"SPLIT_INTRA": 1, "LOWP_A": 1, "LOWP_WU": 1, **_WU}]
INTRA_MORE = [{"BK": 64, "LOWP_A": 1, "LOWP_WU": 1}, {"STAGES_INTRA": 3, "LOWP_A": 1, "LOWP_WU": 1},
              {"SPLIT_INTRA": 1, **_WU}, {"SPLIT_INTRA": 1, "LOWP_WU": 1, **_WU, "BK_WU": 32}]
DECODE_VARIANTS = {  # SPLIT, BV, WARPS, PREFETCH, GATE_MM, RB
    B_DEC: [(1, 64, 4, 1, 1, 32), (1, 64, 4, 0, 1, 32), (1, 64, 4, 1, 0, 128)],
    1: [(4, 32, 4, 1, 0, 32), (4, 32, 4, 1, 0, 128), (1, 64, 4, 1, 0, 128)]}
DECODE_MORE = {B_DEC: [(1, 64, 4, 1, 0, 32), (1, 32, 4, 1, 1, 32), (4, 32, 4, 1, 1, 32)],
               1: [(2, 64, 4, 1, 0, 128), (4, 32, 2, 1, 0, 64)]}
SWEEP_STOP = {"intra": 150, "decode": 140}  # seconds of budget the candidates leave to the sections after them


SEEN: set = set()  # compiled kernels already reported


def compiled_resources(fns, seen: set) -> list:
    """ptxas registers / spills / shared memory of the kernels compiled since `seen` (updated)."""
    out = []
    for name, fn in fns:
        for ck in (ck for cache in getattr(fn, "device_caches", {}).values() for ck in cache[0].values()):
            if id(ck) in seen:
                continue
            try:
                seen.add(id(ck))
                ck._init_handles()
                out.append(f"{name}:{ck.n_regs}r/{ck.n_spills}s/{ck.metadata.shared // 1024}K")
            except Exception as e:  # noqa: BLE001
                out.append(f"{name}:error {str(e)[:80]}")
    return out


def _variant(name, fn, fns, **kw):
    """Time one variant (failures recorded, never raised) with its compiled kernels' resources."""
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001
        record(name, **kw, error=f"{type(e).__name__}: {str(e)[:200]}")
        compiled_resources(fns, SEEN)
        return None
    res = res if isinstance(res, dict) else {"median_ms": res}
    record(name, **kw, **res, resources=compiled_resources(fns, SEEN) if DEV == "cuda" else [])
    return res


@section
def candidates_prefill():
    """Kernel 1 (intra, or intra + W/U) per candidate on the B=1 T=8192 inputs; kernel 2 is the same for all."""
    from codegen.triton import _kda_wu, kda_prefill as pre
    fns = [("intra", pre._kda_intra_kernel), ("wu", _kda_wu._kda_wu_kernel)]
    x = prefill_inputs([T_PRE])
    starts, lens, _ = device_chunk_table(x["cu"], T_PRE)
    base = prefill_heuristic({"D": D, "Dv": D}, DEV)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    best = (float("inf"), base)
    for var in INTRA_VARIANTS + (INTRA_MORE if SWEEP else []):
        if left() < SWEEP_STOP["intra"]:
            break
        cfg = {**base, **{k: (min(v, D) if k.startswith("B") else v) for k, v in var.items()}}
        r = _variant("candidate_intra", lambda: ms(lambda: run_intra(*args, cfg), rep=40), fns, **var)
        if r and r["median_ms"] < best[0]:
            best = (r["median_ms"], cfg)
    TUNED["prefill"] = best[1]
    DOC["tuned_configs"] = TUNED


@section
def candidates_decode():
    from codegen.triton import kda_decode as dec
    fns = [("decode", dec._kda_decode_kernel)]
    for B, grid in DECODE_VARIANTS.items():
        ops = low(decode_operands([1] * B))
        best = (float("inf"), None)
        for split, bv, w, pf, mm, rb in grid + (DECODE_MORE[B] if SWEEP else []):
            if left() < SWEEP_STOP["decode"] or (D // split) % min(bv, D // split):
                continue
            cfg = {"SPLIT": split, "BV": min(bv, D // split), "WARPS": w, "PREFETCH": pf, "GATE_MM": mm, "RB": rb}
            r = _variant(f"candidate_decode_B{B}", lambda: decode_time([t.clone() if t is not None else t for t in ops],
                                                                       B, cfg), fns, **cfg)
            t = r and (r["graph_ms"] or r["median_ms"])
            if t and t < best[0]:
                best = (t, cfg)
        if best[1]:
            TUNED[f"decode_B{B}"] = best[1]
    DOC["tuned_configs"] = TUNED


@section
def prefill_time():
    x = prefill_inputs([T_PRE])
    nbytes, flops = prefill_bytes(T_PRE, 1), prefill_flops(T_PRE)
    res = dict(B=1, T=T_PRE, H=H, D=D, bytes=nbytes, flops=flops)
    for name, cfg in (("heuristic", prefill_heuristic({"D": D, "Dv": D}, DEV)), ("tuned", TUNED.get("prefill"))):
        if cfg is not None:
            res[f"{name}_ms"], res[f"{name}_config"] = ms(ours_prefill(x, x["pool"].clone(), cfg)), cfg
    cfg = TUNED.get("prefill") or res["heuristic_config"]
    starts, lens, req_chunks = device_chunk_table(x["cu"], T_PRE)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    ws = run_intra(*args, cfg)
    res.update(median_ms=min(res.get("tuned_ms", 1e9), res["heuristic_ms"]),
               table_ms=ms(lambda: device_chunk_table(x["cu"], T_PRE)), intra_ms=ms(lambda: run_intra(*args, cfg)),
               state_ms=ms(lambda: run_state(ws, x["pool"].clone(), x["slots"], starts, lens, req_chunks, cfg, ACT,
                                             n_tokens=T_PRE)))
    res["x_byte_floor"] = res["median_ms"] / (nbytes / DOC["ceilings"].get("copy_GBps", 1) / 1e6)
    if fla() and FLA_PREFILL:
        t_fla = ms(fla_prefill(x, [T_PRE]))
        res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / res["median_ms"],
                   speedup_vs_fla_heuristic=t_fla / res["heuristic_ms"])
    record("prefill_time", **res)


@section
def decode():
    scale, lb = D ** -0.5, -5.0
    for B, qlen in ((B_DEC, 1), (1, 1), (B_DEC, 8)):
        ops = decode_operands([qlen] * B)
        want = [x.clone() for x in ops]
        y_ref, states_ref = unfused(want, scale, lb, 1e-5)
        heur = decode_heuristic({"D": D, "H": H, "R": B, "T": B * qlen}, DEV)
        cfg = TUNED.get(f"decode_B{B}", heur) if qlen == 1 else heur  # candidates are timed at 1 token
        out = decode_run(low([x.clone() for x in ops]), cfg, keep=qlen > 1)()
        res = dict(B=B, q_len=qlen, H=H, D=D, rel_err_out=rel(out[0].float(), y_ref),
                   rel_err_state=rel(out[2][1:], want[12][1:]), tol=1e-2, config=cfg, heuristic_config=heur)
        if qlen > 1:
            res["rel_err_kept_states"] = rel(out[3], states_ref)
        res.update(decode_time(low([x.clone() for x in ops]), B, cfg, keep=qlen > 1))
        if cfg != heur:
            h = decode_time(low([x.clone() for x in ops]), B, heur, keep=qlen > 1)
            res.update(heuristic_ms=h["median_ms"], heuristic_graph_ms=h["graph_ms"])
        if fla() and qlen == 1:
            try:
                fr = fla_decode([x.clone() for x in ops], B, scale, lb)
                t_fla, tgf = ms(fr), graph_ms(fr)
                res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / res["median_ms"], fla_graph_ms=tgf,
                           speedup_vs_fla_graph=(tgf / res["graph_ms"]) if res["graph_ms"] and tgf else None)
            except Exception as e:  # noqa: BLE001
                res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
        record(f"decode_B{B}_q{qlen}", **res)


@section
def prefill_more():
    for lengths in ([4 * T_PRE], [T_PRE] * 4):
        if left() < 15:
            DOC["notes"].append(f"prefill_more {lengths[:1]}x{len(lengths)} skipped: time budget")
            continue
        x, T, R, cfg = prefill_inputs(lengths, seed=2), sum(lengths), len(lengths), TUNED.get("prefill")
        res = dict(B=R, T_each=lengths[0], median_ms=ms(ours_prefill(x, x["pool"].clone(), cfg)), config=cfg,
                   bytes=prefill_bytes(T, R), flops=prefill_flops(T))
        record(f"prefill_B{R}_T{lengths[0]}", **res)  # kept if fla's timing below runs out of time
        if fla() and FLA_PREFILL and left() > 8:
            t_fla = ms(fla_prefill(x, lengths))
            record(f"prefill_B{R}_T{lengths[0]}_vs_fla", median_ms=res["median_ms"], fla_ms=t_fla,
                   speedup_vs_fla=t_fla / res["median_ms"])


def main():
    DOC["machine"] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                      "triton": triton.__version__, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      "tiny": TINY}
    try:
        DOC["machine"]["fla"] = getattr(__import__("fla"), "__version__", "?")
    except Exception as e:  # noqa: BLE001
        DOC["machine"]["fla"] = f"unavailable: {e}"
    torch.manual_seed(0)
    for sec in (ceiling, candidates_prefill, candidates_decode, prefill_check, decode, prefill_time, prefill_more):
        sec()
    text = save()
    print(text)
    print("\n== summary (ms) ==")
    skip = ("name", "bytes", "flops", "H", "D", "tol", "byte_floor_ms")
    for m in DOC["measurements"]:
        print(f"{m['name']:<34} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in m.items() if k not in skip and not isinstance(v, dict)))
    for e in DOC["errors"]:
        print("ERROR", e["section"], e["error"][:200])


if __name__ == "__main__":
    main()
