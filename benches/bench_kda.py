"""KDA kernels on one GPU (issue 4): bf16 correctness at full shapes and timings vs fla-core 0.6.0.

Emits one JSON document (stdout and $OUT/kda.json, rewritten after every section so a timeout keeps
what was measured). Sections, in priority order:
  ceiling    device-to-device copy bandwidth (read + write bytes / time), measured here
  prefill    B=1, T=8192, H=32, D=128 bf16: ours vs the fp32 reference (`ir.ref.kda.kda_chunked`), fla
             `chunk_kda` vs the same reference; times of ours (and of its two kernels) and of fla
  decode     fused decode (conv + gate + recurrence + gated RMSNorm), B=64 and B=1 (1 token each) and
             B=64 x 8 tokens (verification, states kept): error vs the unfused fp32 op sequence; time
             vs fla `fused_recurrent_kda` (recurrence only, l2/gate/beta in its kernel) and vs the state
             byte floor B*H*D*D*4*2 / copy bandwidth; plain launches and CUDA-graph replays
  prefill_more  T=32K (B=1) and B=4 x 8192, ours vs fla
  sweeps     tunables of both families around the heuristic, while the time budget lasts

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
from ir.ref.basic import gated_rms_norm, l2_norm  # noqa: E402

TINY = os.environ.get("KDA_BENCH_TINY") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D = (2, 32) if TINY else (32, 128)
T_PRE, B_DEC = (128, 4) if TINY else (8192, 64)
ACT = torch.float32 if TINY else torch.bfloat16   # the interpreter computes bf16 wrongly (TOOLCHAIN.md)
BUDGET_S = float(os.environ.get("KDA_BENCH_BUDGET_S", "250"))
REPORT = BenchReport("kda")
DOC, save, section = REPORT.doc, REPORT.save, REPORT.section


def left() -> float:
    return BUDGET_S - (time.time() - REPORT.t0)


def ms(fn, rep=100):
    return median_ms(fn, DEV, rep)


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
    DOC["measurements"].append({"name": name, **kw})
    save()
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
    return dict(q=q, k=k, v=r(T, H, D), g=g, beta=torch.sigmoid(r(T, H)), pool=r(R + 1, H, D, D) * 0.3,
                slots=torch.arange(1, R + 1, device=DEV), cu=cu)


def prefill_bytes(T, R):
    act = ACT.itemsize if hasattr(ACT, "itemsize") else 2
    return 3 * T * H * D * act + T * H * D * 4 + T * H * act + T * H * D * act + 2 * R * H * D * D * 4


def prefill_flops(T):
    """Chunked-form matmul FLOPs per (64-chunk, head): A, Aqk (2*64*64*D each), W, U (2*64*64*D),
    d, o, state update (3 * 2*64*D*D), Aqk d (2*64*64*D)."""
    per_chunk = 5 * 2 * 64 * 64 * D + 3 * 2 * 64 * D * D
    return (T // 64) * H * per_chunk


@section
def ceiling():
    n = (1 << 26) if TINY else (1 << 29)   # 2 GiB of fp32 on the GPU
    x = torch.empty(n, dtype=torch.float32, device=DEV).uniform_()
    y = torch.empty_like(x)
    t = ms(lambda: y.copy_(x))
    DOC["ceilings"]["copy_GBps"] = 2 * x.numel() * 4 / t / 1e6
    record("copy_bandwidth", bytes=2 * x.numel() * 4, median_ms=t, GBps=DOC["ceilings"]["copy_GBps"])
    del x, y


@section
def prefill_main():
    lengths = [T_PRE]
    x = prefill_inputs(lengths)
    scale = D ** -0.5
    cast = {n: x[n].to(ACT) for n in ("q", "k", "v", "beta")}
    want = x["pool"].clone()
    o_ref = ref.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], want, x["slots"], x["cu"], scale)
    mine = x["pool"].clone()
    o = kda_prefill(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], mine, x["slots"], x["cu"], scale)
    record("prefill_bf16_vs_fp32_ref", T=T_PRE, rel_err_o=rel(o.float(), o_ref),
           rel_err_state=rel(mine[1:], want[1:]), tol=1e-2)
    mine32 = x["pool"].clone()
    o32 = kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], mine32, x["slots"], x["cu"], scale)
    record("prefill_fp32_kernel_vs_fp32_ref", rel_err_o=rel(o32, o_ref), rel_err_state=rel(mine32[1:], want[1:]),
           tol=1e-5)
    f = torch.randn(T_PRE, H * D, device=DEV) * 2
    A_log, dt_bias = torch.zeros(H, device=DEV), torch.randn(H * D, device=DEV)
    gg = ref.kda_gate(f, A_log, dt_bias, -5.0)
    want_g, mine_g = x["pool"].clone(), x["pool"].clone()
    o_g = ref.kda_chunked(x["q"], x["k"], x["v"], gg, x["beta"], want_g, x["slots"], x["cu"], scale)
    o_f = kda_prefill(cast["q"], cast["k"], cast["v"], None, cast["beta"], mine_g, x["slots"], x["cu"], scale,
                      f=f.to(ACT), A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    record("prefill_fused_gate_bf16_vs_fp32_ref", rel_err_o=rel(o_f.float(), o_g), tol=1e-2)
    cfg = prefill_heuristic({"D": D, "Dv": D}, DEV)
    nbytes, flops = prefill_bytes(T_PRE, 1), prefill_flops(T_PRE)
    pool = x["pool"].clone()
    t_ours = ms(lambda: kda_prefill(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], pool, x["slots"],
                                    x["cu"], scale))
    starts, lens, req_chunks = device_chunk_table(x["cu"], T_PRE)
    ws = run_intra(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], starts, lens, scale, cfg)
    t_intra = ms(lambda: run_intra(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], starts, lens, scale, cfg))
    slots32 = x["slots"].to(torch.int32)
    t_state = ms(lambda: run_state(ws, pool, slots32, starts, lens, req_chunks, cfg, ACT, n_tokens=T_PRE))
    DOC["prefill_config"] = cfg
    res = dict(B=1, T=T_PRE, H=H, D=D, median_ms=t_ours, intra_ms=t_intra, state_ms=t_state, bytes=nbytes,
               flops=flops, x_byte_floor=t_ours / (nbytes / DOC["ceilings"].get("copy_GBps", 1) / 1e6))
    peers = fla()
    if peers:
        chunk_kda = peers[0]
        init = x["pool"][1:].clone()
        args = [t[None] for t in (cast["q"], cast["k"], cast["v"], x["g"], cast["beta"])]
        o_fla, s_fla = chunk_kda(*args, scale=scale, initial_state=init.clone(), output_final_state=True)
        record("fla_chunk_kda_bf16_vs_fp32_ref", rel_err_o=rel(o_fla[0].float(), o_ref),
               rel_err_state=rel(s_fla, want[1:]))
        t_fla = ms(lambda: chunk_kda(*args, scale=scale, initial_state=init, output_final_state=True))
        res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / t_ours)
    record("prefill_time", **res)


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
    o = ref.kda_recurrence(qh, kh, y[:, 2 * P:].reshape(T, H, D), g, torch.sigmoid(b), state, slots, cu, scale)
    return gated_rms_norm(o, gate.reshape(T, H, D), w, eps).reshape(T, P), (qh, kh, y[:, 2 * P:].reshape(T, H, D), g)


def low(ops):
    """Activations and weights in the compute dtype; pools (conv tails, states) stay fp32."""
    return [x.to(ACT) if i not in (6, 9, 10, 12, 15, 16) and x is not None else x for i, x in enumerate(ops)]


@section
def decode():
    scale, lb = D ** -0.5, -5.0
    peers = fla()
    for B, qlen in ((B_DEC, 1), (1, 1), (B_DEC, 8)):
        ops = decode_operands([qlen] * B)
        want = [x.clone() for x in ops]
        y_ref, front = unfused(want, scale, lb, 1e-5)
        mine = low([x.clone() for x in ops])
        out = kda_decode(*mine, scale=scale, lower_bound=lb, norm_eps=1e-5, keep_states=qlen > 1)
        err = dict(rel_err_out=rel(out[0].float(), y_ref), rel_err_state=rel(out[2][1:], want[12][1:]))
        cfg = decode_heuristic({"D": D}, DEV)
        run = lambda: kda_decode(*mine, scale=scale, lower_bound=lb, norm_eps=1e-5, keep_states=qlen > 1,  # noqa: E731
                                 block_v=cfg["BV"], num_warps=cfg["WARPS"])
        t, tg = ms(run), graph_ms(run)
        floor = B * H * D * D * 4 * 2 / DOC["ceilings"].get("copy_GBps", 1) / 1e6
        res = dict(B=B, q_len=qlen, H=H, D=D, **err, tol=1e-2, median_ms=t, graph_ms=tg, byte_floor_ms=floor,
                   x_floor=t / floor, x_floor_graph=(tg / floor) if tg else None, config=cfg)
        if peers and qlen == 1:
            fused_recurrent_kda = peers[1]
            q, k, v, b = (mine[i] for i in (0, 1, 2, 11))
            f_raw = (mine[7] @ mine[8].T).view(1, B, H, D)
            h0 = want[12][1:].clone()
            kw = dict(A_log=ops[9], dt_bias=ops[10], scale=scale, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      lower_bound=lb)
            fr = lambda: fused_recurrent_kda(q.view(1, B, H, D), k.view(1, B, H, D), v.view(1, B, H, D),  # noqa: E731
                                             f_raw, b.view(1, B, H), cu_seqlens=ops[16], **kw)
            try:
                t_fla = ms(fr)
                res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / t)
                tgf = graph_ms(fr)
                res.update(fla_graph_ms=tgf, speedup_vs_fla_graph=(tgf / tg) if tg and tgf else None)
            except Exception as e:  # noqa: BLE001
                res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
        record(f"decode_B{B}_q{qlen}", **res)


@section
def prefill_more():
    scale = D ** -0.5
    peers = fla()
    for lengths in ([4 * T_PRE], [T_PRE] * 4):
        if left() < 40:
            DOC["notes"].append(f"prefill_more {lengths[:1]}x{len(lengths)} skipped: time budget")
            continue
        x = prefill_inputs(lengths, seed=2)
        T, R = sum(lengths), len(lengths)
        cast = {n: x[n].to(ACT) for n in ("q", "k", "v", "beta")}
        pool = x["pool"].clone()
        t = ms(lambda: kda_prefill(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], pool, x["slots"], x["cu"],
                                   scale))
        res = dict(B=R, T_each=lengths[0], median_ms=t, bytes=prefill_bytes(T, R), flops=prefill_flops(T))
        if peers:
            args = [t_.view(R, lengths[0], *t_.shape[1:]) for t_ in (cast["q"], cast["k"], cast["v"], x["g"],
                                                                    cast["beta"])]
            init = x["pool"][1:].clone()
            t_fla = ms(lambda: peers[0](*args, scale=scale, initial_state=init, output_final_state=True))
            res.update(fla_ms=t_fla, speedup_vs_fla=t_fla / t)
        record(f"prefill_B{R}_T{lengths[0]}", **res)


@section
def sweeps():
    scale = D ** -0.5
    x = prefill_inputs([T_PRE])
    cast = {n: x[n].to(ACT) for n in ("q", "k", "v", "beta")}
    starts, lens, req_chunks = device_chunk_table(x["cu"], T_PRE)
    base = prefill_heuristic({"D": D, "Dv": D}, DEV)
    slots32, pool = x["slots"].to(torch.int32), x["pool"].clone()
    for bk, w in ((32, 4), (32, 8), (16, 8)):
        if left() < 30:
            break
        cfg = dict(base, BK=min(bk, D), WARPS_INTRA=w)
        record("sweep_intra", BK=bk, WARPS_INTRA=w,
               median_ms=ms(lambda: run_intra(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], starts, lens,
                                              scale, cfg)))
    ws = run_intra(cast["q"], cast["k"], cast["v"], x["g"], cast["beta"], starts, lens, scale, base)
    for bv, w, st in ((32, 8, 2), (32, 4, 3), (16, 4, 3), (64, 8, 3)):
        if left() < 30:
            break
        cfg = dict(base, BV=min(bv, D), WARPS=w, STAGES=st)
        record("sweep_state", BV=bv, WARPS=w, STAGES=st,
               median_ms=ms(lambda: run_state(ws, pool, slots32, starts, lens, req_chunks, cfg, ACT, n_tokens=T_PRE)))
    ops = low(decode_operands([1] * B_DEC))
    for bv, w in ((32, 4), (32, 8), (64, 4)):
        if left() < 20:
            break
        run = lambda: kda_decode(*ops, scale=scale, lower_bound=-5.0, norm_eps=1e-5, block_v=min(bv, D),  # noqa: E731
                                 num_warps=w)
        record("sweep_decode_B64", BV=bv, WARPS=w, median_ms=ms(run), graph_ms=graph_ms(run))


def main():
    DOC["machine"] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                      "triton": triton.__version__, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      "tiny": TINY}
    try:
        import fla as _fla
        DOC["machine"]["fla"] = getattr(_fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        DOC["machine"]["fla"] = f"unavailable: {e}"
    torch.manual_seed(0)
    ceiling()
    prefill_main()
    decode()
    prefill_more()
    sweeps()
    text = save()
    print(text)
    print("\n== summary (ms) ==")
    for m in DOC["measurements"]:
        keys = [k for k in ("BK", "WARPS_INTRA", "BV", "WARPS", "STAGES", "median_ms", "graph_ms", "fla_ms",
                            "speedup_vs_fla", "x_floor", "x_floor_graph", "rel_err_o", "rel_err_out", "rel_err_state",
                            "intra_ms", "state_ms") if m.get(k) is not None]
        print(f"{m['name']:<36} " + " ".join(f"{k}={m[k]:.4g}" if isinstance(m[k], float) else f"{k}={m[k]}"
                                             for k in keys))
    for e in DOC["errors"]:
        print("ERROR", e["section"], e["error"][:200])


if __name__ == "__main__":
    main()
