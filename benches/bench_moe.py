"""MoE kernels on one GPU (issue 5): checks bf16 correctness at full shapes, times kernels and peers.

Emits one JSON document (stdout and $OUT/moe.json, rewritten after every section so a timeout keeps
what was measured). Sections: ceilings measured in the same run (HBM read, copy, bf16 and fp8 matmul
8192³); router (112 experts, T=1 top-2, T=8 top-2, T=64 top-16, graph replay: session 5's config vs the
heuristic's, PDL launches on and off); decode (ℓ=3584, I=3072, MXFP4, 112 experts; T=1 top-2, the rank
preset's step, T=8 top-2, its batch 8, and T=64 top-16): the whole moe_experts op under CUDA-graph replay
(several distinct routings per graph, so T=1's 35 MB of routed experts do not stay in L2), the session-3
grouped path vs the heuristic's (the per-pair GV=2 kernels at T=1 and 8; PDL on, its graph replay checked
bitwise against eager, and PDL off) vs a sweep of per-pair tiles incl. session 6's configurations, the
best again with PDL off and bitwise-checked, one empty launch (the graph's per-launch floor), as the
routed experts' weight bytes over the measured copy bandwidth (floor) and over the read bandwidth, plus
a torch._grouped_mm peer on bf16 weights (eager); prefill (T=8192) as TFLOP/s over the measured bf16 and fp8 ceilings; the whole
MoE layer (d=7168, 2 shared experts) vs the reference layer written inline here, in torch eager and
torch.compile, plus a torch._grouped_mm peer; t64 (issue 5's decode target, T=64 top-16: the grouped
gate-up and down kernels swept apart with registers / spills / SASS per K step, a read-pattern probe;
_moe_t64.py). Every kernel variant is checked against an fp32 reference on bf16-exact weights before it is timed.

    python benches/bench_moe.py            # on a CUDA machine: ~6 min on the H200, 3 of them inductor
    MOE_BENCH_SECTIONS=router,decode python benches/bench_moe.py      # ~150 s
    MOE_BENCH_SECTIONS=t64 MOE_BENCH_DECODE_DEADLINE=140 python benches/bench_moe.py   # ~120 s
    MOE_BENCH_SECTIONS=decode,prefill MOE_BENCH_SWEEP=wide python benches/bench_moe.py   # variant sweep
    MOE_BENCH_SECTIONS=prefill,layer,decode MOE_BENCH_LAYER_T=8192 python benches/bench_moe.py   # a subset

Knobs: MOE_BENCH_SECTIONS (order kept), MOE_BENCH_LAYER_T (the layer's token counts),
MOE_BENCH_DECODE_SHAPES ("1x2,8x2,64x16": decode (T, top-k) in that order), MOE_BENCH_GEMV_SWEEP=0 (per-pair
tiles: the heuristic's only), and
MOE_BENCH_{DECODE,COMPILE,PREFILL}_DEADLINE: seconds into the run after which no further decode variant,
torch.compile peer (the reference layer's took 76 s at T=64) or prefill variant is started.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch
from _moe_common import (ACT, B1, B2, COMPILE_DEADLINE, D, DEV, DOC, E, ELL, EPS, INTER, K, LAYER_T,  # noqa: E402
                         PREFILL_DEADLINE, REPORT, SECTIONS, SHARED_I, T_DECODE, T_PREFILL, TINY, W, WIDE_SWEEP,
                         PackedMXFP4, _cfg, gg, graph_ms, mr, ms, mt, mx_bytes, pdl_mod, rand_mx, record, ref_experts,
                         rel_err, routing, save, section, situ_glu, to_bf16, triton)
from _moe_decode import (DECODE_SHAPES, DECODE_VARIANTS, GEMV_SWEEP, PREVIOUS, decode_case,  # noqa: E402
                         decode_parts, gemv_parts, decode_side_measurements, decode_variant, launch_floor, summarize_decode,
                         wide_check)
from _moe_t64 import t64_sweep  # noqa: E402
from _read_ceiling import read_fn  # noqa: E402


# ------------------------------------------------------------------------------------- ceilings
@section
def ceilings():
    n = 1 << (16 if TINY else 30)
    x = torch.empty(n, device=DEV).uniform_()
    t_tr = ms(read_fn(x))
    t_sum = ms(lambda: x.sum())
    y = torch.empty_like(x)
    t_cp = ms(lambda: y.copy_(x))
    c = DOC["ceilings"]
    c["read_TBps_triton"], c["read_TBps_torch_sum"] = 4 * n / t_tr / 1e9, 4 * n / t_sum / 1e9
    c["read_TBps"] = max(c["read_TBps_triton"], c["read_TBps_torch_sum"])
    c["copy_TBps_read_plus_write"] = 8 * n / t_cp / 1e9
    del x, y
    m = 256 if TINY else 8192
    a, b = (torch.randn(m, m, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    c["bf16_matmul_TFLOPs"] = 2 * m ** 3 / ms(lambda: a @ b) / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    c["fp8_matmul_TFLOPs"] = 2 * m ** 3 / ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                                       out_dtype=torch.bfloat16)) / 1e9
    print(json.dumps(c), flush=True)


# ----------------------------------------------------------------------------------------- data
@section
def make_weights():
    g = torch.Generator(device=DEV).manual_seed(0)
    W["w1"], W["w3"], W["w2"] = rand_mx(g, INTER, ELL), rand_mx(g, INTER, ELL), rand_mx(g, ELL, INTER)
    for n in ("w1", "w2", "w3"):
        W[n + "_bf16"] = to_bf16(W[n])


# --------------------------------------------------------------------------------------- decode
PREFILL_CFGS = [(_cfg(128, 64, 64, 4, 3, 128), ("asm", "asm16")), (_cfg(128, 64, 64, 4, 3, 128, sl=1), ("asm",)),
                (_cfg(128, 128, 64, 8, 3), ("asm16",))]
if WIDE_SWEEP:
    PREFILL_CFGS += [(_cfg(128, 64, 64, 4, 3, 128), ("dot_scaled",)), (_cfg(128, 64, 64, 4, 3, 128, pf=1), ("asm",)),
                     (_cfg(128, 64, 128, 4, 3, 128), ("asm16",)), (_cfg(64, 128, 64, 4, 3), ("asm16",))]
if DEV != "cuda":      # the interpreter runs only the pure-Triton decodes, in fp32
    PREFILL_CFGS = [(_cfg(32, 64, 64, 4, 3), ("bytes16",))]


def sweep(tag, T, cfgs, dense, check_rows, floor, deadline):
    """Time gate-up + down (pre-permuted) for each (config, DEQ) and, when `dense`, the first config on
    bf16 weights; check rows [:check_rows] against the fp32 reference first. -> best MXFP4 (ms, cfg)."""
    g = torch.Generator(device=DEV).manual_seed(T)
    z = torch.randn(T, ELL, generator=g, device=DEV).to(ACT)
    w, ids = routing(g, T)
    seg = mr.permute_tokens(ids, E)
    exp = ref_experts(z[:check_rows], w[:check_rows], ids[:check_rows], W["w1_bf16"], W["w2_bf16"], W["w3_bf16"])
    live = int((seg.counts > 0).sum())
    runs = [("", c, d) for c, deqs in cfgs for d in deqs] + ([("_bf16", cfgs[0][0], "bytes")] if dense else [])
    best = None
    for wname, cfg, deq in runs:
        w1, w2, w3 = (W[n + wname] for n in ("w1", "w2", "w3"))
        cfg = {**cfg, "DEQ": deq, "GROUP_M": 8}
        name = (f"{tag}_{'mxfp4_' + deq if wname == '' else 'dense'}_{cfg['BM']}x{cfg['BN']}x{cfg['BK']}"
                f"_w{cfg['num_warps']}s{cfg['num_stages']}_pf{cfg.get('PF', 1)}")
        key = gg._key(T, E, K, ELL, INTER, wname == "", ACT, {})
        bad = gg.constraints(cfg, key, "h200" if DEV == "cuda" else None)
        if bad or time.time() - REPORT.t0 > deadline:
            DOC["notes"].append(f"{name} {cfg} skipped: {bad or 'time budget'}")
            continue
        try:
            run = lambda: gg.expert_pair_outputs(z, ids, w1, w2, w3, "situ", B1, B2, cfg, seg)[0]  # noqa: E731
            y = mt.combine(run(), w, ids, E)[:check_rows]
            err = rel_err(y, exp)
            t = ms(run)
        except Exception as e:
            DOC["errors"].append({"section": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            print(f"!! {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        wbytes = sum(mx_bytes(x, live) if isinstance(x, PackedMXFP4) else x.numel() // E * live * 2
                     for x in (w1, w2, w3))
        m = record(name, t, config=cfg, rel_err=err, ok=err < (2e-2 if wname == "" else 1e-2),
                   **floor(t, wbytes))
        if m["ok"] and (best is None or t < best[0]) and wname == "":
            best = (t, cfg)
    return best, (z, w, ids, seg)


def prefill_floor(t, wbytes):
    flops = 6 * T_PREFILL * K * INTER * ELL
    tf, c = flops / t / 1e9, DOC["ceilings"]
    return {"flops": flops, "weight_bytes": wbytes, "TFLOPs": round(tf, 1),
            "ratio_vs_bf16_matmul": round(tf / c.get("bf16_matmul_TFLOPs", float("nan")), 3),
            "ratio_vs_fp8_matmul": round(tf / c.get("fp8_matmul_TFLOPs", float("nan")), 3)}

@section
def decode():
    """Per shape: the whole moe_experts op (gemv: 2 launches; grouped: permutation, gate-up, down, combine)
    under CUDA-graph replay, checked against the fp32 reference first: the session-3 path, the heuristic's
    (PDL on, graph replay checked bitwise against eager, and PDL off), then the launch floor, the per-pair
    sweep (session 6's configs and the GV=2 variants), the best with PDL off and its bitwise check, the peer."""
    cases = {sk: decode_case(*sk) for sk in DECODE_SHAPES}
    heur = {}
    for (T, k), case in cases.items():
        heur[T, k] = gg.heuristic(gg.bucket(gg._key(T, E, k, ELL, INTER, True, ACT, {})),
                                  "h200" if DEV == "cuda" else None)
        decode_variant(T, k, "previous", PREVIOUS, case, fused_max=0)
        decode_variant(T, k, "heuristic", heur[T, k], case, bitwise=True)
        decode_variant(T, k, "heuristic_pdl_off", heur[T, k], case, pdl=False)
    launch_floor()
    for (T, k), case in cases.items():
        if heur[T, k]["PATH"] == "grouped" or T == T_DECODE:     # the permutation / GEMMs / combine split
            decode_parts(T, k, {**heur[T, k], "PATH": "grouped"}, case)
    for (T, k), case in cases.items():
        for name, over in GEMV_SWEEP.get((T, k), {}).items():
            decode_variant(T, k, "gemv_" + name, {**heur[T, k], **over}, case)
        for name, over in DECODE_VARIANTS.get((T, k), {}).items():
            decode_variant(T, k, name, {**heur[T, k], **over}, case)
    for (T, k), case in cases.items():
        best = DOC.get("decode_best", {}).get(f"T{T}_k{k}")
        if best and best["config"] != heur[T, k]:
            decode_variant(T, k, "best_pdl_off", best["config"], case, pdl=False)
            decode_variant(T, k, "best_again_bitwise", best["config"], case, bitwise=True)
    if (1, 2) in cases:     # the per-pair launches apart at T=1: the heuristic's and the best's
        gemv_parts(1, 2, "heuristic", heur[1, 2], cases[1, 2])
        best1 = DOC.get("decode_best", {}).get("T1_k2")
        if best1 and best1["config"] != heur[1, 2]:
            gemv_parts(1, 2, "best", best1["config"], cases[1, 2])
    for (T, k), case in cases.items():
        decode_side_measurements(T, k, case)
    best = DOC.get("decode_best", {}).get(f"T{T_DECODE}_k{K}")
    if best:
        DOC["decode_best_config"] = best["config"]
        calls = cases[T_DECODE, K][0]
        wide_check(*calls[0], best["config"])
    best1 = DOC.get("decode_best", {}).get("T1_k2")
    if best1:
        z, w, ids = cases[1, 2][0][0]
        wide_check(z, w, ids, best1["config"], "T1_")
    summarize_decode()

ROUTER_SHAPES = ((1, 2), (8, 2)) if TINY else ((1, 2), (64, 16), (8, 2))


@section
def router():
    """moe_router alone under graph replay (112 experts, sigmoid + bias, renormalised): session 5's
    config (BLOCK_T 32, 4 warps) vs the heuristic's (one row on one warp at T=1), ids checked exactly."""
    from ir.ref.moe import moe_router as ref_router
    g = torch.Generator(device=DEV).manual_seed(3)
    for T, k in ROUTER_SHAPES:
        inputs = [(torch.randn(T, E, generator=g, device=DEV), torch.randn(E, generator=g, device=DEV) * 0.1)
                  for _ in range(8)]
        rw, rids = ref_router(*inputs[0], k, "sigmoid", True, 1.0)
        heur = mr._heuristic(mr._bucket({"T": T, "E": E, "K": k, "G": 1}))
        for name, cfg, pdl in (("previous_cfg", {"BLOCK_T": 32, "num_warps": 4}, True), ("heuristic", heur, True),
                               ("heuristic_pdl_off", heur, False)):
            before = pdl_mod.set_enabled(pdl)
            try:
                run = lambda lg, b: mr.router(lg, b, k, "sigmoid", True, 1.0, block_t=cfg["BLOCK_T"],  # noqa: E731
                                                num_warps=cfg["num_warps"])
                w, ids = run(*inputs[0])
                ok = bool(torch.equal(ids, rids)) and rel_err(w, rw) < 1e-5
                record(f"router_T{T}_k{k}_{name}", graph_ms([lambda a=a: run(*a) for a in inputs]), config=cfg,
                       ok=ok, goal_ms=0.0025 if T == 1 else None, timing="cuda graph, 8 distinct inputs")
            except Exception as e:
                DOC["errors"].append({"section": f"router_T{T}_{name}", "error": f"{type(e).__name__}: {str(e)[:300]}"})
            finally:
                pdl_mod.set_enabled(before)


@section
def t64():
    """Issue 5's decode target, T=64 top-16: the grouped gate-up and down kernels swept apart (_moe_t64.py)."""
    t64_sweep()


@section
def prefill():
    best, _ = sweep("prefill_experts_gemms", T_PREFILL, PREFILL_CFGS, True, 256, prefill_floor, PREFILL_DEADLINE)
    if best:
        DOC["prefill_best_config"] = best[1]


# ---------------------------------------------------------------------------------- whole layer
def peer_router(logits, bias):
    s = torch.sigmoid(logits)
    ids = torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, :K]
    wt = s.gather(1, ids)
    return wt / (wt.sum(-1, keepdim=True) + 1e-20), ids


def peer_layer(h, P, w1, w2, w3):
    """The reference MoE layer (SPEC §6) written plainly in torch: loop over experts with tokens."""
    w, ids = peer_router(h.float() @ P["gate"].t(), P["bias"])
    z = h @ P["down"].t()
    outs = z.new_zeros(*ids.shape, ELL)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        zt = z[tok]
        outs[tok, slot] = situ_glu(zt @ w1[e].t(), zt @ w3[e].t()) @ w2[e].t()
    y = (w.to(z.dtype).unsqueeze(-1) * outs).sum(1).float()
    y = (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * P["norm"].float()).to(h.dtype)
    return y @ P["up"].t() + situ_glu(h @ P["sg"].t(), h @ P["su"].t()) @ P["sd"].t()


def peer_layer_grouped(h, P, w1, w2, w3):
    """Same layer with torch._grouped_mm for the experts (no data-dependent Python control flow)."""
    w, ids = peer_router(h.float() @ P["gate"].t(), P["bias"])
    z = h @ P["down"].t()
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    x = z[order // K]
    hh = situ_glu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs), torch._grouped_mm(x, w3.transpose(1, 2), offs=offs))
    o = torch.empty_like(x)
    o[order] = torch._grouped_mm(hh, w2.transpose(1, 2), offs=offs)
    y = (w.unsqueeze(-1) * o.view(*ids.shape, ELL).float()).sum(1)
    y = (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * P["norm"].float()).to(h.dtype)
    return y @ P["up"].t() + situ_glu(h @ P["sg"].t(), h @ P["su"].t()) @ P["sd"].t()


def our_layer(h, P, cfg):
    """Router kernel, expert kernels with their combine, fused latent tail; torch for the dense linears."""
    w, ids = mr.router(h.float() @ P["gate"].t(), P["bias"], K, "sigmoid", True, 1.0)
    z = h @ P["down"].t()
    shared = situ_glu(h @ P["sg"].t(), h @ P["su"].t()) @ P["sd"].t()
    y = gg.moe_experts(z, w, ids, W["w1"], W["w2"], W["w3"], "situ", B1, B2, cfg)
    return mt.latent_tail(y, P["norm"], P["up"], shared, EPS, cfg)


@section
def layer():
    g = torch.Generator(device=DEV).manual_seed(5)
    bf = dict(device=DEV, dtype=ACT)
    P = {"gate": torch.randn(E, D, generator=g, device=DEV) / D ** 0.5,
         "bias": torch.randn(E, generator=g, device=DEV) * 0.1,
         "down": torch.randn(ELL, D, generator=g, **bf) / D ** 0.5, "up": torch.randn(D, ELL, generator=g, **bf) / ELL ** 0.5,
         "norm": (1 + 0.1 * torch.randn(ELL, generator=g, device=DEV)).to(ACT),
         "sg": torch.randn(SHARED_I, D, generator=g, **bf) / D ** 0.5, "su": torch.randn(SHARED_I, D, generator=g, **bf) / D ** 0.5,
         "sd": torch.randn(D, SHARED_I, generator=g, **bf) / SHARED_I ** 0.5}
    wb = (W["w1_bf16"], W["w2_bf16"], W["w3_bf16"])
    for T in LAYER_T or (T_DECODE, T_PREFILL):
        h = torch.randn(T, D, generator=g, **bf)
        cfg = {**mt.heuristic({"T": T, "L": ELL, "D": D, "BF16": int(ACT == torch.bfloat16), "BI": 0}),
               **gg.heuristic(gg._key(T, E, K, ELL, INTER, True, ACT, {})),
               **DOC.get("decode_best_config" if T == T_DECODE else "prefill_best_config", {})}
        ours = our_layer(h, P, cfg)
        t_ours = ms(lambda: our_layer(h, P, cfg))
        mine = record(f"layer_T{T}_ours", t_ours, config=cfg, speedup_vs={}, rel_err_vs={})
        # the peers first; inductor spends ~60 s on the grouped_mm graph: only with MOE_BENCH_SWEEP=wide
        peers = [("torch_eager_reference", peer_layer, False), ("torch_compile_reference", peer_layer, True),
                 ("torch_eager_grouped_mm", peer_layer_grouped, False)]
        peers += [("torch_compile_grouped_mm", peer_layer_grouped, True)] if WIDE_SWEEP else []
        for name, fn, compiled in peers:
            if compiled and (time.time() - REPORT.t0 > COMPILE_DEADLINE or DEV == "cpu"):
                DOC["notes"].append(f"layer_T{T}_{name} skipped: {'time budget' if DEV == 'cuda' else 'cpu dry run'}")
                continue
            try:
                f = torch.compile(fn) if compiled else fn
                t_c = time.time()
                err = rel_err(ours, f(h, P, *wb))
                first_s = time.time() - t_c
                t = ms(lambda: f(h, P, *wb))
                record(f"layer_T{T}_{name}", t, rel_err_vs_ours=err, first_call_s=round(first_s, 1))
                mine["speedup_vs"][name] = round(t / t_ours, 2)
                mine["rel_err_vs"][name] = err
            except Exception as e:
                DOC["errors"].append({"section": f"layer_T{T}_{name}", "error": f"{type(e).__name__}: {str(e)[:400]}"})
        mine["ok"] = bool(mine["rel_err_vs"]) and all(v < 2e-2 for v in mine["rel_err_vs"].values())
        save()


def main():
    DOC["machine"] = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                      "python": platform.python_version(), "host": platform.node(), "device": DEV}
    if DEV == "cuda":
        p = torch.cuda.get_device_properties(0)
        DOC["machine"].update(gpu=p.name, cc=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                              mem_GiB=round(p.total_memory / 2 ** 30, 1))
    DOC["shapes"] = {"E": E, "topk": K, "latent": ELL, "inter": INTER, "d": D, "decode_T": T_DECODE,
                     "prefill_T": T_PREFILL, "shared_inter": SHARED_I}
    for step in [ceilings, make_weights] + [{"decode": decode, "layer": layer, "prefill": prefill, "router": router,
                                               "t64": t64}[n]
                                             for n in SECTIONS]:
        step()
    DOC["total_s"] = round(time.time() - REPORT.t0, 1)
    print(save())
    for m in DOC["measurements"]:   # a short table on stderr, after the JSON document
        keys = ("ratio_vs_floor", "TBps", "ratio_vs_read_bw", "pdl", "graph_equals_eager", "TFLOPs", "ratio_vs_bf16_matmul", "ratio_vs_fp8_matmul", "rel_err", "ok",
                "speedup_vs", "rel_err_vs_ours")
        cfg = m.get("config") or {}
        ckeys = (("PATH", "GV", "GMMA", "GASM", "GN", "GK", "GN2", "GK2", "num_warps", "GW2", "num_stages", "PREF", "XV",
                  "HX") if cfg.get("PATH") == "gemv" else ("DEQ", "BM", "BN", "BK", "BN2", "BK2", "num_warps",
                                                           "num_stages", "SPLIT", "PF", "SL", "MAXNREG"))
        tag = "/".join(f"{k}={cfg[k]}" for k in ckeys if k in cfg)
        print(f"{m['name']:<44} {m.get('median_ms', '')!s:>10} ms  {tag:<60} "
              + " ".join(f"{k}={m[k]:.3g}" if isinstance(m.get(k), float) else f"{k}={m[k]}" for k in keys if k in m),
              file=sys.stderr)
    print("ceilings", json.dumps(DOC["ceilings"]), "errors", len(DOC["errors"]), file=sys.stderr)


if __name__ == "__main__":
    main()
