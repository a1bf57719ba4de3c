"""KDA kernels on one GPU (issue 4): bf16 correctness at full shapes and timings vs fla-core 0.6.0.

Emits one JSON document (stdout and $OUT/kda.json, rewritten after every section so a timeout keeps
what was measured). Sections, in priority order:
  ceiling    device-to-device copy bandwidth (read + write bytes / time), measured here
  prefill    B=1, T=8192, H=32, D=128 bf16: ours vs the fp32 reference (`ir.ref.kda.kda_chunked`), fla
             `chunk_kda` vs the same reference; times of ours (and of its chunk table and two kernels) and of fla
  decode     fused decode (conv + gate + recurrence + gated RMSNorm), B=64 and B=1 (1 token each) and
             B=64 x 8 tokens (verification, per-token states kept): error vs the unfused fp32 op sequence
             (kept states vs the recurrence's state after each token); time vs fla `fused_recurrent_kda`
             (recurrence only, l2/gate/beta in its kernel, f precomputed) and vs the state byte floor
             B*H*D*D*4*2 / copy bandwidth; plain launches and CUDA-graph replays
  prefill_more  T=32K (B=1) and B=4 x 8192, ours vs fla
  tuning     (KDA_BENCH_TUNE=1) before the timed sections: each family's tunables over a grid (intra
             kernel, state kernel, decode at B=64 and B=1); the fastest config ("tuned", what `k31c tune`
             would record) is timed below next to the declared heuristic

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
from codegen.triton.kda_prefill import constraints, heuristic as prefill_heuristic  # noqa: E402
from codegen.triton.kda_prefill import kda_prefill, run_intra, run_state  # noqa: E402
from ir.ref import kda as ref  # noqa: E402
from ir.ref.basic import gated_rms_norm, l2_norm  # noqa: E402

TINY = os.environ.get("KDA_BENCH_TINY") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D = (2, 32) if TINY else (32, 128)
T_PRE, B_DEC = (128, 4) if TINY else (8192, 64)
ACT = torch.float32 if TINY else torch.bfloat16   # the interpreter computes bf16 wrongly (TOOLCHAIN.md)
BUDGET_S = float(os.environ.get("KDA_BENCH_BUDGET_S", "185"))
TUNE = os.environ.get("KDA_BENCH_TUNE") == "1"  # the tuning section (adds ~60 s)
TUNED: dict = {}  # family -> fastest config of the tuning section
REPORT = BenchReport("kda")
DOC, save, section = REPORT.doc, REPORT.save, REPORT.section


def left() -> float:
    return BUDGET_S - (time.time() - REPORT.t0)


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


def unfused(ops, scale, lb, eps):
    q, k, v, qc, kc, vc, conv, f_a, f_b, A_log, dt_bias, b, state, gate, w, slots, cu = ops
    T, P = q.shape
    y = ref.causal_conv1d(torch.cat([q, k, v], 1), torch.cat([qc, kc, vc], 0), conv, slots, cu)
    qh, kh = l2_norm(y[:, :P].reshape(T, H, D), 1e-6), l2_norm(y[:, P:2 * P].reshape(T, H, D), 1e-6)
    g = ref.kda_gate(f_a @ f_b.T, A_log, dt_bias, lb)
    o, states = ref.kda_recurrence(qh, kh, y[:, 2 * P:].reshape(T, H, D), g, torch.sigmoid(b), state, slots, cu, scale,
                                   keep_states=True)
    return gated_rms_norm(o, gate.reshape(T, H, D), w, eps).reshape(T, P), states


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
                              prefetch=bool(cfg.get("PREFETCH", 1)))


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
    x = torch.empty(n, dtype=torch.float32, device=DEV).uniform_()
    y = torch.empty_like(x)
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
    if fla():
        o_fla, s_fla = fla_prefill(x, [T_PRE])()
        record("fla_chunk_kda_bf16_vs_fp32_ref", rel_err_o=rel(o_fla[0].float(), o_ref),
               rel_err_state=rel(s_fla, want[1:]))


INTRA_GRID = [(32, 4, 2), (32, 4, 3), (32, 4, 1), (64, 4, 2), (32, 8, 2)]  # BK, WARPS_INTRA, STAGES_INTRA
STATE_GRID = [(32, 4, 3), (64, 8, 2), (64, 4, 2), (16, 4, 4)]  # BV, WARPS, STAGES
DECODE_GRID = {  # SPLIT, BV, WARPS, PREFETCH
    B_DEC: [(1, 64, 4, 1), (1, 32, 4, 1), (1, 32, 4, 0), (1, 64, 8, 1), (2, 32, 4, 1)],
    1: [(4, 32, 4, 1), (4, 32, 2, 1), (4, 16, 4, 1), (2, 32, 4, 1), (2, 64, 8, 1)]}


@section
def tune_prefill():
    x = prefill_inputs([T_PRE])
    starts, lens, req_chunks = device_chunk_table(x["cu"], T_PRE)
    base = prefill_heuristic({"D": D, "Dv": D}, DEV)
    pool, best = x["pool"].clone(), (float("inf"), None)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    for bk, w, st in INTRA_GRID:
        if left() < 80:
            break
        cfg = dict(base, BK=min(bk, D), WARPS_INTRA=w, STAGES_INTRA=st)
        t = ms(lambda: run_intra(*args, cfg), rep=40)
        record("sweep_intra", BK=bk, WARPS_INTRA=w, STAGES_INTRA=st, median_ms=t)
        best = min(best, (t, cfg), key=lambda b: b[0])
    cfg_i = best[1] or base
    ws = run_intra(*args, cfg_i)
    best = (float("inf"), None)
    for bv, w, st in STATE_GRID:
        if left() < 70:
            break
        cfg = dict(cfg_i, BV=min(bv, D), WARPS=w, STAGES=st)
        if constraints(cfg, {"D": D, "Dv": D}, DEV):
            continue
        t = ms(lambda: run_state(ws, pool, x["slots"], starts, lens, req_chunks, cfg, ACT, n_tokens=T_PRE), rep=40)
        record("sweep_state", BV=bv, WARPS=w, STAGES=st, median_ms=t)
        best = min(best, (t, cfg), key=lambda b: b[0])
    TUNED["prefill"] = {k: v for k, v in (best[1] or cfg_i).items() if v is not None}
    DOC["tuned_configs"] = TUNED


@section
def tune_decode():
    for B, grid in DECODE_GRID.items():
        ops = low(decode_operands([1] * B))
        best = (float("inf"), None)
        for split, bv, w, pf in grid:
            if left() < 125 or (D // split) % min(bv, D // split):
                continue
            cfg = {"SPLIT": split, "BV": min(bv, D // split), "WARPS": w, "PREFETCH": pf}
            res = decode_time([t.clone() if t is not None else t for t in ops], B, cfg)
            record(f"sweep_decode_B{B}", **cfg, **res)
            t = res["graph_ms"] or res["median_ms"]
            best = min(best, (t, cfg), key=lambda b: b[0])
        if best[1]:
            TUNED[f"decode_B{B}"] = best[1]
            if B == B_DEC:  # the gate's up-projection outside (f given whole): what the fused f_b costs
                f_ops = list(ops)
                f_ops[7], f_ops[8] = (ops[7] @ ops[8].T).contiguous(), None
                record(f"decode_B{B}_f_given", **best[1], **decode_time(f_ops, B, best[1]))
    DOC["tuned_configs"] = TUNED


@section
def prefill_time():
    x = prefill_inputs([T_PRE])
    nbytes, flops = prefill_bytes(T_PRE, 1), prefill_flops(T_PRE)
    res = dict(B=1, T=T_PRE, H=H, D=D, bytes=nbytes, flops=flops)
    for name, cfg in (("heuristic", prefill_heuristic({"D": D, "Dv": D}, DEV)), ("tuned", TUNED.get("prefill"))):
        if cfg is not None:
            res[f"{name}_ms"] = ms(ours_prefill(x, x["pool"].clone(), cfg))
            res[f"{name}_config"] = cfg
    cfg = TUNED.get("prefill") or res["heuristic_config"]
    starts, lens, req_chunks = device_chunk_table(x["cu"], T_PRE)
    args = (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], starts, lens, D ** -0.5)
    ws = run_intra(*args, cfg)
    res.update(median_ms=min(res.get("tuned_ms", 1e9), res["heuristic_ms"]),
               table_ms=ms(lambda: device_chunk_table(x["cu"], T_PRE)), intra_ms=ms(lambda: run_intra(*args, cfg)),
               state_ms=ms(lambda: run_state(ws, x["pool"].clone(), x["slots"], starts, lens, req_chunks, cfg, ACT,
                                             n_tokens=T_PRE)))
    res["x_byte_floor"] = res["median_ms"] / (nbytes / DOC["ceilings"].get("copy_GBps", 1) / 1e6)
    if fla():
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
        heur = decode_heuristic({"D": D, "H": H, "R": B}, DEV)
        cfg = TUNED.get(f"decode_B{B}", heur)
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
        if fla():
            t_fla = ms(fla_prefill(x, lengths))
            res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / res["median_ms"])
        record(f"prefill_B{R}_T{lengths[0]}", **res)


def kernel_resources():
    """Registers, spills and shared memory of every compiled variant of the KDA kernels (ptxas report)."""
    from codegen.triton import kda_decode as dec
    from codegen.triton import kda_prefill as pre
    out = []
    for name, fn in (("intra", pre._kda_intra_kernel), ("state", pre._kda_state_kernel),
                     ("decode", dec._kda_decode_kernel)):
        for ck in (ck for cache in getattr(fn, "device_caches", {}).values() for ck in cache[0].values()):
            try:
                ck._init_handles()
                out.append({"kernel": name, "regs": ck.n_regs, "spills": ck.n_spills, "shared": ck.metadata.shared,
                            "warps": ck.metadata.num_warps, "stages": ck.metadata.num_stages})
            except Exception as e:  # noqa: BLE001
                out.append({"kernel": name, "error": str(e)[:120]})
    DOC["kernel_resources"] = out


def main():
    DOC["machine"] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                      "triton": triton.__version__, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      "tiny": TINY}
    try:
        DOC["machine"]["fla"] = getattr(__import__("fla"), "__version__", "?")
    except Exception as e:  # noqa: BLE001
        DOC["machine"]["fla"] = f"unavailable: {e}"
    torch.manual_seed(0)
    tuning = (tune_decode, tune_prefill) if TUNE else ()
    for sec in (ceiling, *tuning, prefill_check, prefill_time, decode, prefill_more):
        sec()
    if DEV == "cuda":
        kernel_resources()
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
