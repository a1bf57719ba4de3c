"""One latent-MoE layer's decode segment at batch 1 (the runtime bench's rank preset: d 7168, latent 3584, 112
experts top-2 MXFP4 of 3072, one bf16 shared expert of 3072), from the post-attention norm to the tail's output,
as CUDA graphs:

    runtime   the decode graph's schedule: side stream router -> shared gate/up -> shared down; main stream
              z -> routed experts (their heuristic: the Gluon gate-up, GV=2 down) -> tail
    hfuse     side stream router; main z, then the two horizontally fused launches of
              codegen/triton/_moe_shared_hfuse.py (routed gate-up | shared gate/up, routed down | shared down),
              then the tail; per routed / shared tile config in HFUSE_CONFIGS

    python3 benches/bench_moe_shared_hfuse.py [--replays 300] [--sections variants,pieces,sweep_a,...]

Per variant: graph replay time (median of rounds of back-to-back replays), the byte floor (every weight byte
the segment reads at the measured copy bandwidth), checks: graph replay == eager bitwise, the tail output vs the
runtime variant's (rel. error), and each fused job vs its own kernels with the same tiles (bitwise). JSON to
$OUT/moe_shared_hfuse.json.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches._report import BenchReport, copy_bandwidth_GBps  # noqa: E402

D, L, I, E, K, IS = 7168, 3584, 3072, 112, 2, 3072
B1, B2 = 4.0, 25.0
HFUSE_CONFIGS = {  # routed tiles (GV=2 meaning), program order MIX, register cap GREG, shared tiles (SBN, DBN ...)
    "gn4_mix": dict(GN=4, GK=512, GN2=8, GK2=1024, MIX=1),
    "gn8_mix": dict(GN=8, GK=512, GN2=16, GK2=1024, MIX=1),
}
HFUSE_PIECES = "gn4_mix"
TAIL_SWEEP = {  # overrides of the latent tail's heuristic (T = 1: the one-launch GEMV)
    "st1": dict(G_ST=1), "st2": dict(G_ST=2), "st3": dict(G_ST=3), "st4": dict(G_ST=4),
    "bk512_st3": dict(G_BK=512, G_ST=3), "bn8_st3": dict(G_BN=8, G_ST=3), "bn8_bk512_st3": dict(G_BN=8, G_BK=512, G_ST=3),
    "bn32_st3": dict(G_BN=32, G_ST=3), "w8_st3": dict(G_warps=8, G_ST=3), "bn8_bk512_st4": dict(G_BN=8, G_BK=512, G_ST=4),
    "bk128_st4": dict(G_BK=128, G_ST=4), "bn4_bk512_st3": dict(G_BN=4, G_BK=512, G_ST=3, G_warps=2),
}
GEMV_SWEEP = {  # overrides of the GEMV heuristic (gemm.py decode_gemv_config) for z and the shared gate/up
    "heuristic": {}, "st4": dict(num_stages=4), "st5": dict(num_stages=5), "st2": dict(num_stages=2),
    "bk1024_st3": dict(BLOCK_K=1024, num_stages=3), "bk256_st4": dict(BLOCK_K=256, num_stages=4),
    "bn8_st4": dict(BLOCK_N=8, num_stages=4), "bn4_st4": dict(BLOCK_N=4, num_stages=4),
    "bn16_st4": dict(BLOCK_N=16, num_stages=4), "w8_st4": dict(num_warps=8, num_stages=4),
    "bn4_bk512_st1": dict(BLOCK_N=4, BLOCK_K=512, num_stages=1),
}
A_SWEEP = {  # overrides of HFUSE_PIECES' config for the first launch alone
    "base": {}, "gn2": dict(GN=2), "gn8": dict(GN=8), "gk256": dict(GK=256), "gk1024": dict(GK=1024),
    "gn8_gk256": dict(GN=8, GK=256), "gn2_gk1024": dict(GN=2, GK=1024), "sbn4": dict(SBN=4), "sbn16": dict(SBN=16),
    "sbk1024": dict(SBK=1024), "sst2": dict(SST=2), "sst1": dict(SST=1), "first": dict(MIX=0),
    "w2_gn2_sbn4": dict(GN=2, SBN=4, num_warps=2), "w8_gn8_sbn16": dict(GN=8, SBN=16, num_warps=8),
    "xv0": dict(XV=0), "early2": dict(EARLY=3),
}
SHARED = dict(SBN=8, SBK=512, SST=3, DBN=8, DBK=256, DST=3, PREF=1, XV=1, EARLY=1, num_warps=4)


def _weights(dev, g):
    from ir.packed import PackedMXFP4

    def lin(n, k):
        return (torch.randn(n, k, generator=g, device=dev) * (0.7 / math.sqrt(k))).to(torch.bfloat16)

    def mx(n, k):
        e = 127 + round(math.log2(0.7 / math.sqrt(k) / 3))
        return PackedMXFP4(torch.randint(0, 256, (E, n, k // 2), generator=g, device=dev, dtype=torch.uint8),
                           torch.randint(e - 1, e + 2, (E, n, k // 32), generator=g, device=dev, dtype=torch.uint8))
    return dict(gate=lin(E, D), bias=0.01 * torch.randn(E, generator=g, device=dev), wz=lin(L, D),
                w1=mx(I, L), w3=mx(I, L), w2=mx(L, I), wg=lin(IS, D), wu=lin(IS, D), wd=lin(D, IS),
                norm=(1 + 0.1 * torch.randn(L, generator=g, device=dev)).to(torch.bfloat16), up=lin(D, L))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--sections", default="variants,pieces,jobs_vs_own_kernels,registers",
                    help="comma-separated, in this order; also sweep_a (the first fused launch alone over A_SWEEP)")
    args = ap.parse_args()
    import triton

    from codegen.triton import gemm as gm
    from codegen.triton import moe_grouped_gemm as gg
    from codegen.triton import moe_tail, packed_glu, routed_gemm
    from codegen.triton import _moe_shared_hfuse as hf
    from codegen.triton._moe_host import _gemv_weight

    rep = BenchReport("moe_shared_hfuse")
    doc = rep.doc
    dev = torch.device("cuda")
    doc["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name(0)}
    bw = copy_bandwidth_GBps(dev)
    doc["ceilings"]["bandwidth_GBps"] = bw
    g = torch.Generator(dev).manual_seed(0)
    W = _weights(dev, g)
    x = torch.randn(1, D, generator=g, device=dev).to(torch.bfloat16)
    rattrs = dict(topk=K, activation="sigmoid", renormalize=True, scaling=1.0, n_group=1, topk_group=1, x_dtype="f32")
    key = lambda w: gm.gemm_key(x, [w], {"batch_invariant": False})  # noqa: E731
    cfg_r = routed_gemm.heuristic({**key(W["gate"]), "topk": K, "G": 1}, "h200")
    cfg_z, cfg_d = gm.heuristic(key(W["wz"]), "h200"), gm.heuristic(gm.gemm_key(x[:, :IS], [W["wd"]], {"batch_invariant": False}), "h200")
    cfg_s = packed_glu.heuristic(gm.gemm_key(x, [W["wg"], W["wu"]], {"batch_invariant": False}), "h200")
    cfg_e = gg.heuristic({"T": 1, "K": K, "E": E, "L": L, "I": I, "MX": 1, "BF16": 1, "BI": 0}, "h200")
    cfg_t = moe_tail.heuristic({"T": 1, "L": L, "D": D, "BF16": 1, "BI": 0})
    doc["configs"] = {"router": cfg_r, "z": cfg_z, "shared_glu": cfg_s, "shared_down": cfg_d, "experts": cfg_e,
                      "tail": cfg_t, "hfuse_shared": SHARED, "hfuse_routed": HFUSE_CONFIGS}
    g1, g3, g2 = (_gemv_weight(W[n], n, s, None, torch.bfloat16) for n, s in
                  (("w1", (E, I, L)), ("w3", (E, I, L)), ("w2", (E, L, I))))
    act_kw = dict(betas=(B1, B2), ACT=0, HAS_BETA2=True)
    side = torch.cuda.Stream(dev)

    def router():
        return routed_gemm.routed_linear(x, W["gate"], W["bias"], rattrs, cfg_r)

    def tail(y, d):
        return moe_tail.latent_tail(y, W["norm"], W["up"], d, 1e-5, cfg_t)

    def runtime_step():
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            w, ids = router()
            ev_r = torch.cuda.Event()
            ev_r.record(side)
            a, = packed_glu.packed_linear_glu(x, [W["wg"], W["wu"]], [IS, IS], "situ_glu", cfg_s, B1, B2)
            d = gm.gemm(a, W["wd"], cfg_d)
        z = gm.gemm(x, W["wz"], cfg_z)
        main.wait_event(ev_r)
        y = gg.moe_experts(z, w, ids, W["w1"], W["w2"], W["w3"], "situ", B1, B2, cfg_e)
        main.wait_stream(side)
        return tail(y, d)

    def hfuse_step(rc):
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            w, ids = router()
        z = gm.gemm(x, W["wz"], cfg_z)
        main.wait_stream(side)
        y, d = hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"], W["wd"],
                                        dict(act="situ_glu", beta1=B1, beta2=B2), {**SHARED, **rc})
        return tail(y, d)

    def hfuse_a_step(rc):
        """The first fused launch, then the routed down kernel (GV=2, the heuristic's down tiles) on the main
        stream beside the shared down GEMV on the side stream (the decode graph's overlap)."""
        from codegen.triton._moe_configs import GEMV_T1
        from codegen.triton._moe_gemv_words import _gemv_v2
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            w, ids = router()
        z = gm.gemm(x, W["wz"], cfg_z)
        main.wait_stream(side)
        buf = {}
        y, _ = hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"], W["wd"],
                                        dict(act="situ_glu", beta1=B1, beta2=B2), {**SHARED, **rc}, "A", buf)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            d = gm.gemm(buf["a"], W["wd"], cfg_d)
        _gemv_v2(z, w, ids.contiguous(), g1, g3, g2, y, act_kw, {**GEMV_T1, "HX": 1}, ("down",), h=buf["h"])
        main.wait_stream(side)
        return tail(y, d)

    def graph_of(fn):
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(dev).wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            out = fn()
        return gr, out

    def time_graph(gr, n):
        for _ in range(20):
            gr.replay()
        rounds = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n // 5):
                gr.replay()
            b.record()
            b.synchronize()
            rounds.append(a.elapsed_time(b) * 1000 / (n // 5))
        return statistics.median(rounds), min(rounds)

    nbytes = sum(t.numel() * t.element_size() for k, t in W.items() if k in ("gate", "wz", "wg", "wu", "wd", "up"))
    nbytes += sum(K * W[n].nbytes // E for n in ("w1", "w3", "w2"))  # two experts' rows (distinct ids)
    floor_us = nbytes / bw / 1e3
    doc["floor"] = {"bytes": nbytes, "us": floor_us}
    ref_out = runtime_step().float()
    torch.cuda.synchronize()

    @rep.section
    def variants():
        res = doc.setdefault("variants", {})
        cands = [("runtime", runtime_step)] + [(f"hfuse_{n}", (lambda rc=rc: hfuse_step(rc))) for n, rc in
                                               HFUSE_CONFIGS.items()]
        cands += [(f"hfuseA_{n}", (lambda rc=rc: hfuse_a_step(rc))) for n, rc in HFUSE_CONFIGS.items()]
        for name, fn in cands + cands[:2]:  # the first two again: drift between captures
            eager = fn().clone()
            gr, out = graph_of(fn)
            med, mn = time_graph(gr, args.replays)
            gr.replay()
            torch.cuda.synchronize()
            r = res.setdefault(name, {"us": [], "min_us": []})
            r["us"].append(med)
            r["min_us"].append(mn)
            r["x_floor"] = med / floor_us
            r["graph_equals_eager"] = bool(torch.equal(out, eager))
            r["rel_err_vs_runtime"] = float((out.float() - ref_out).norm() / ref_out.norm())
            print(f"{name}: {med:.2f} us (min {mn:.2f}), {med / floor_us:.3f}x floor {floor_us:.2f}, "
                  f"graph==eager {r['graph_equals_eager']}, rel vs runtime {r['rel_err_vs_runtime']:.2e}", flush=True)

    @rep.section
    def jobs_vs_own_kernels():
        """Each fused job's outputs vs its own kernels with the same tiles, bitwise (GV=2 on 4 warps)."""
        from codegen.triton._moe_gemv_words import _gemv_v2
        w, ids = router()
        z = gm.gemm(x, W["wz"], cfg_z)
        out = doc.setdefault("jobs_vs_own", {})
        for n, rc in HFUSE_CONFIGS.items():
            cfg = {**SHARED, **rc}
            y, d = hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"], W["wd"],
                                            dict(act="situ_glu", beta1=B1, beta2=B2), cfg)
            y_own = torch.empty_like(y)
            nw = cfg["num_warps"]
            _gemv_v2(z, w, ids.contiguous(), g1, g3, g2, y_own, act_kw, {**cfg, "HX": 1, "GW2": nw})
            a, = packed_glu.packed_linear_glu(x, [W["wg"], W["wu"]], [IS, IS], "situ_glu",
                                              dict(BLOCK_M=1, BLOCK_N=cfg["SBN"], BLOCK_K=cfg["SBK"], GROUP_M=1,
                                                   SPLIT_K=1, GEMV=1, num_warps=nw, num_stages=cfg["SST"]), B1, B2)
            d_own = gm.gemm(a, W["wd"], dict(BLOCK_M=1, BLOCK_N=cfg["DBN"], BLOCK_K=cfg["DBK"], GROUP_M=1, SPLIT_K=1,
                                              GEMV=1, num_warps=nw, num_stages=cfg["DST"]))
            y_heur = gg.moe_experts(z, w, ids, W["w1"], W["w2"], W["w3"], "situ", B1, B2, cfg_e)
            out[n] = {"routed_bitwise": bool(torch.equal(y, y_own)), "shared_bitwise": bool(torch.equal(d, d_own)),
                      "routed_rel_vs_heuristic": float((y - y_heur).norm() / y_heur.norm())}
            print(n, out[n], flush=True)

    @rep.section
    def pieces():
        """Each launch of the hfuse schedule alone (a graph of that one launch, replayed back to back) vs its
        bytes, for HFUSE_PIECES; and the runtime schedule's pieces."""
        from codegen.triton._moe_gemv_words import _gemv_v2
        out = doc.setdefault("pieces", {})
        rc = {**SHARED, **HFUSE_CONFIGS[HFUSE_PIECES]}
        w, ids = router()
        z = gm.gemm(x, W["wz"], cfg_z)
        y, d = hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"], W["wd"],
                                        dict(act="situ_glu", beta1=B1, beta2=B2), rc)
        mb = lambda *ts: sum(t.numel() * t.element_size() for t in ts) / 1e6  # noqa: E731
        ex = lambda *ns: sum(K * W[n].nbytes // E for n in ns) / 1e6  # noqa: E731
        runs = {
            "router": (router, mb(W["gate"])),
            "z": (lambda: gm.gemm(x, W["wz"], cfg_z), mb(W["wz"])),
            "shared_glu": (lambda: packed_glu.packed_linear_glu(x, [W["wg"], W["wu"]], [IS, IS], "situ_glu", cfg_s,
                                                                B1, B2), mb(W["wg"], W["wu"])),
            "shared_down": (lambda: gm.gemm(x[:, :IS].contiguous(), W["wd"], cfg_d), mb(W["wd"])),
            "experts_heuristic": (lambda: gg.moe_experts(z, w, ids, W["w1"], W["w2"], W["w3"], "situ", B1, B2, cfg_e),
                                  ex("w1", "w3", "w2")),
            "hfuse_both": (lambda: hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"],
                                                            W["wd"], dict(act="situ_glu", beta1=B1, beta2=B2), rc),
                           ex("w1", "w3", "w2") + mb(W["wg"], W["wu"], W["wd"])),
            "hfuse_A": (lambda: hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"], W["wd"],
                                                         dict(act="situ_glu", beta1=B1, beta2=B2), rc, "A"),
                        ex("w1", "w3") + mb(W["wg"], W["wu"])),
            "hfuse_B": (lambda: hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"], W["wd"],
                                                         dict(act="situ_glu", beta1=B1, beta2=B2), rc, "B"),
                        ex("w2") + mb(W["wd"])),
            "routed_gate_up_alone": (lambda: _gemv_v2(z, w, ids.contiguous(), g1, g3, g2, y, act_kw,
                                                      {**rc, "HX": 1, "GW2": rc["num_warps"]}, ("gate_up",)),
                                     ex("w1", "w3")),
            "routed_down_alone": (lambda: _gemv_v2(z, w, ids.contiguous(), g1, g3, g2, y, act_kw,
                                                   {**rc, "HX": 1, "GW2": rc["num_warps"]}, ("down",)), ex("w2")),
            "tail": (lambda: tail(y, d), mb(W["up"])),
        }
        for name, (fn, nmb) in runs.items():
            gr, _ = graph_of(fn)
            med, mn = time_graph(gr, 200)
            out[name] = {"us": med, "MB": nmb, "x_floor": med / (nmb * 1e6 / bw / 1e3)}
            print(f"piece {name}: {med:.2f} us for {nmb:.1f} MB ({out[name]['x_floor']:.2f}x floor)", flush=True)

    @rep.section
    def sweep_a():
        """The first fused launch alone (routed gate-up | shared gate/up) over A_SWEEP's tile choices."""
        out = doc.setdefault("sweep_a", {})
        w, ids = router()
        z = gm.gemm(x, W["wz"], cfg_z)
        floor_a = (K * (W["w1"].nbytes + W["w3"].nbytes) // E + 2 * W["wg"].numel() * 2) / bw / 1e3
        for name, over in A_SWEEP.items():
            rc = {**SHARED, **HFUSE_CONFIGS[HFUSE_PIECES], **over}
            gr, _ = graph_of(lambda: hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, W["wg"], W["wu"],
                                                              W["wd"], dict(act="situ_glu", beta1=B1, beta2=B2), rc,
                                                              "A"))
            med, _ = time_graph(gr, 200)
            out[name] = {"us": med, "x_floor": med / floor_a, "config": rc}
            print(f"A {name}: {med:.2f} us ({med / floor_a:.2f}x floor {floor_a:.2f})", flush=True)

    @rep.section
    def sweep_tail():
        """The latent tail's one-launch GEMV alone over TAIL_SWEEP (G_BN, G_BK, G_ST pipeline depth, G_warps)."""
        out = doc.setdefault("sweep_tail", {})
        y = torch.randn(1, L, generator=g, device=dev)
        d = torch.randn(1, D, generator=g, device=dev).to(torch.bfloat16)
        floor_t = W["up"].numel() * 2 / bw / 1e3
        base = tail(y, d)
        for name, over in TAIL_SWEEP.items():
            ct = {**cfg_t, **over}
            gr, o = graph_of(lambda: moe_tail.latent_tail(y, W["norm"], W["up"], d, 1e-5, ct))
            med, _ = time_graph(gr, 200)
            out[name] = {"us": med, "x_floor": med / floor_t, "config": ct, "equals_heuristic": bool(torch.equal(o, base))}
            print(f"tail {name}: {med:.2f} us ({med / floor_t:.2f}x floor {floor_t:.2f}), "
                  f"same bits as the heuristic's: {out[name]['equals_heuristic']}", flush=True)

    @rep.section
    def sweep_gemv():
        """The z projection (7168 -> 3584) and the shared gate/up (7168 -> 2 x 3072) alone over GEMV_SWEEP."""
        out = doc.setdefault("sweep_gemv", {})
        for name, over in GEMV_SWEEP.items():
            cz, cs = {**cfg_z, **over}, {**cfg_s, **over}
            for what, fn, nb in (("z", lambda: gm.gemm(x, W["wz"], cz), W["wz"].numel() * 2),
                                 ("glu", lambda: packed_glu.packed_linear_glu(x, [W["wg"], W["wu"]], [IS, IS],
                                                                             "situ_glu", cs, B1, B2),
                                  4 * W["wg"].numel())):
                if what == "glu" and cs["BLOCK_N"] < 2:
                    continue
                gr, _ = graph_of(fn)
                med, _ = time_graph(gr, 200)
                fl = nb / bw / 1e3
                out[f"{what}_{name}"] = {"us": med, "x_floor": med / fl, "config": cz if what == "z" else cs}
                print(f"gemv {what} {name}: {med:.2f} us ({med / fl:.2f}x floor {fl:.2f})", flush=True)

    @rep.section
    def registers():
        """Registers / spills of every compiled fused kernel (Triton's device cache; best effort)."""
        out = doc.setdefault("registers", [])
        for k in (hf._hfuse_gate_up_kernel, hf._hfuse_down_kernel):
            for cache in getattr(k, "device_caches", {}).values():
                for ck in cache[0].values():
                    out.append({"kernel": k.fn.__name__, "n_regs": getattr(ck, "n_regs", None),
                                "n_spills": getattr(ck, "n_spills", None)})
        print(out, flush=True)

    for name in args.sections.split(","):
        {"variants": variants, "pieces": pieces, "sweep_a": sweep_a, "sweep_tail": sweep_tail, "sweep_gemv": sweep_gemv,
         "jobs_vs_own_kernels": jobs_vs_own_kernels, "registers": registers}[name]()
    print(rep.save()[-600:])


if __name__ == "__main__":
    main()
