"""TVM CPU kernels (codegen/tvm/) vs the torch reference on this CPU (issue 6 item 4).

For every TVM family, at k31-tiny shapes (decode and prefill rows) and one larger shape: the error vs a
float64 formula, and the median time of the TVM kernel with its declared heuristic config ("default"), of
the best config of a small sweep, of the torch reference in eager mode (what `--target cpu` runs without a
kernel: the op's ir.ref math, or the unfused body of a fused op) and of torch.compile of that reference
(first tiny shape and the large shape, where it compiles). Ratios: speedup = eager / TVM, eager being the
faster of torch with its default threads and with one thread (on a loaded 2-core machine torch's 2-thread
GEMMs can stall for milliseconds; taking the faster keeps the comparison conservative); floor_fraction
= max(bytes / copy bandwidth, FLOPs / matmul peak) / time, both ceilings measured here.

The "preference" section is the selection rule's data (codegen/tvm/_build.cpu_rule): a family is preferred
on `--target cpu` when the geometric mean over its k31-tiny shapes of eager / TVM-default is > 1.

Timing: the TVM configs of one case run interleaved in rounds (batches of ~0.5 ms of calls), then the torch
peers likewise (apart: torch's OpenMP workers spin after a call and stall what follows on a loaded 2-core
machine); the per-call time of the fastest round is the figure used ("min_of_rounds_us": on a shared
machine the least disturbed round); the median of 5 more rounds of TVM default and eager is kept as
"median_us"; activations rotate over 4 input sets. The load average is recorded with every case.

    PYTHONPATH=. python benches/bench_tvm_cpu.py [--save benches/results/cpu-2026-11-29/tvm.json]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from _report import BenchReport  # benches/_report.py (the script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tvm  # noqa: E402

from codegen.tvm._build import host_target  # noqa: E402

from codegen.tvm import gemm as G  # noqa: E402
from codegen.tvm import gemm_mxfp4 as GX  # noqa: E402
from codegen.tvm import kda_decode as KD  # noqa: E402
from codegen.tvm import norms as NM  # noqa: E402
from ir.formats import quantize_mxfp4  # noqa: E402
from ir.packed import PackedMXFP4  # noqa: E402
from ir.ref import basic as refb  # noqa: E402
from ir.ref import kda as refk  # noqa: E402


# ---- cases ----------------------------------------------------------------------------------------
class Case:
    """One (family, shape): `sets` rotating input sets; run(cfg, inputs) -> TVM result; eager(inputs) ->
    the reference; want(inputs) float64; pick(result) the compared tensor."""

    def __init__(self, family, label, tiny, shape, sets, run, eager, want, default, sweep, nbytes, flops,
                 pick=lambda r: r, peers=None):
        self.family, self.label, self.tiny, self.shape, self.sets = family, label, tiny, shape, sets
        self._run, self._eager, self._want, self.default = run, eager, want, default
        self._sweep, self.bytes, self.flops, self.result, self._peers = sweep, nbytes, flops, pick, peers or {}

    def _cycle(self, fn):
        it = [0]

        def call():
            it[0] = (it[0] + 1) % len(self.sets)
            return fn(self.sets[it[0]])
        return call

    def tvm(self, cfg):
        return self._cycle(lambda s: self._run(cfg, s))

    def eager(self, compiled: bool = False):
        return self._cycle(torch.compile(self._eager, dynamic=False) if compiled else self._eager)

    def extra_peers(self):
        return {n: self._cycle(f) for n, f in self._peers.items()}

    def reference(self):
        return self._want(self.sets[1])  # the set the first call of a cycled callable uses

    def sweep(self):
        return [c for c in self._sweep if c != self.default]


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def gemm_cases():
    out = []
    for tiny, (M, N, K) in [(1, (1, 512, 256)), (1, (8, 512, 256)), (1, (64, 512, 256)), (0, (8, 1536, 7168))]:
        w = _r(N, K, seed=1) / K ** 0.5
        sets = [(_r(M, K, seed=10 + i), w) for i in range(4)]
        key = {"M": M, "N": N, "K": K}
        sweep = [{"BM": bm, "BN": bn, "UNROLL": 1, "PAR": par} for bm in (1, 2, 4, 8) for bn in (32, 64)
                 for par in (1, 2) if bm <= max(2, M)]
        out.append(Case("tvm_gemm", f"linear M={M} N={N} K={K}", bool(tiny), key, sets,
                        lambda cfg, s: G.gemm(s[0], [s[1]], cfg), lambda s: s[0] @ s[1].t(),
                        lambda s: s[0].double() @ s[1].double().t(), G.heuristic(key, "cpu"), sweep,
                        4 * (M * K + N * K + M * N), 2 * M * N * K))
    for tiny, M, splits, K in [(1, 1, [256, 256, 256, 64, 4, 256], 256), (1, 8, [256, 256, 256, 64, 4, 256], 256),
                               (1, 64, [256, 256, 256, 64, 4, 256], 256), (0, 8, [1536, 576, 7168], 7168)]:
        ws = [_r(n, K, seed=2 + j) / K ** 0.5 for j, n in enumerate(splits)]
        sets = [(_r(M, K, seed=20 + i), ws) for i in range(4)]
        N = sum(splits)
        key = {"M": M, "N": N, "K": K}
        sweep = [{"BM": bm, "BN": 64, "UNROLL": 1, "PAR": par} for bm in (1, 2, 4, 8) for par in (1, 2)
                 if bm <= max(2, M)]
        out.append(Case("tvm_packed_gemm", f"packed_linear M={M} N={splits} K={K}", bool(tiny), key, sets,
                        lambda cfg, s: torch.split(G.gemm(s[0], s[1], cfg), [w.shape[0] for w in s[1]], dim=1),
                        lambda s: [s[0] @ w.t() for w in s[1]],
                        lambda s: torch.cat([s[0].double() @ w.double().t() for w in s[1]], 1),
                        G.heuristic(key, "cpu"), sweep, 4 * (M * K + N * K + M * N), 2 * M * N * K,
                        pick=lambda r: torch.cat(list(r), 1)))
    return out


def mxfp4_cases():
    out = []
    for tiny, (M, N, K) in [(1, (1, 64, 128)), (1, (4, 128, 64)), (1, (16, 64, 128)), (0, (8, 3072, 3584))]:
        wp = PackedMXFP4(*quantize_mxfp4(_r(N, K, seed=3)))
        wd = wp.dequantize()  # the interpreter holds MXFP4 weights dequantised once (ir/interpreter.py)
        sets = [(_r(M, K, seed=30 + i), wp, wd) for i in range(4)]
        key = {"M": M, "N": N, "K": K}
        sweep = [{"BM": bm, "BN": bn, "VB": vb, "UNROLL": 1, "PAR": par} for bm in (1, 4) for bn in (2, 8)
                 for vb in (8, 16) for par in (1, 2) if bm * bn <= 16 and N % bn == 0]
        out.append(Case("tvm_gemm_mxfp4", f"linear mxfp4 M={M} N={N} K={K}", bool(tiny), key, sets,
                        lambda cfg, s: GX.gemm_mxfp4(s[0], s[1], cfg), lambda s: s[0] @ s[2].t(),
                        lambda s: s[0].double() @ s[2].double().t(), GX.heuristic(key, "cpu"), sweep,
                        N * K // 2 + N * K // 32 + 4 * (M * K + M * N), 2 * M * N * K,
                        peers={"eager_dequantise_per_call": lambda s: s[0] @ s[1].dequantize().t()}))
    return out


def norm_cases():
    out = []
    sweep = [{"VEC": v, "PAR": p} for v in (4, 8, 16) for p in (1, 2)]
    for tiny, M, d in [(1, 1, 256), (1, 8, 256), (1, 64, 256), (0, 64, 7168)]:
        w = _r(d, seed=4)
        sets = [(_r(M, d, seed=40 + i), w) for i in range(4)]
        key = {"T": M, "d": d, "n": 1}
        out.append(Case("tvm_rms_norm", f"rms_norm T={M} d={d}", bool(tiny), key, sets,
                        lambda cfg, s: NM.rms_norm(s[0], s[1], 1e-5, cfg), lambda s: refb.rms_norm(s[0], s[1], 1e-5),
                        lambda s: refb.rms_norm(s[0].double(), s[1].double(), 1e-5), NM.heuristic(key, "cpu"), sweep,
                        4 * (2 * M * d + d), 4 * M * d))
    for tiny, M, d in [(1, 1, 256), (1, 8, 256), (1, 64, 256), (0, 64, 7168)]:
        table, w = _r(512, d, seed=10), _r(d, seed=11)
        sets = [(torch.randint(-512, 512, (M,), generator=torch.Generator().manual_seed(70 + i)), table, w)
                for i in range(4)]
        key = {"T": M, "d": d, "n": 1}
        out.append(Case("tvm_embedding_rms_norm", f"embedding_rms_norm T={M} d={d}", bool(tiny), key, sets,
                        lambda cfg, s: NM._launch_embedding_rms(SimpleNamespace(operands=(s[1], s[0], s[2])),
                                                                {"eps": 1e-5}, cfg),
                        lambda s: (lambda e: (e, refb.rms_norm(e, s[2], 1e-5)))(s[1][s[0]]),
                        lambda s: refb.rms_norm(s[1].double()[s[0]], s[2].double(), 1e-5), NM.heuristic(key, "cpu"),
                        sweep, 4 * (3 * M * d + d), 4 * M * d, pick=lambda r: r[1]))
    for tiny, M, n, d in [(1, 1, 3, 256), (1, 8, 3, 256), (1, 64, 3, 256), (0, 8, 9, 7168)]:
        pw = (_r(1, d, seed=5), _r(d, seed=6))
        sets = [([_r(M, d, seed=50 + 10 * i + j) for j in range(n)], pw) for i in range(4)]
        key = {"T": M, "d": d, "n": n}
        out.append(Case("tvm_attn_res_mix", f"attn_res_mix T={M} n={n} d={d}", bool(tiny), key, sets,
                        lambda cfg, s: NM.attn_res_mix(s[0][:-1], s[0][-1], *s[1], 1e-5, cfg)[1],
                        lambda s: refb.attn_res_mix(s[0], s[1][0].reshape(-1), s[1][1], 1e-5),
                        lambda s: refb.attn_res_mix([v.double() for v in s[0]], s[1][0].double().reshape(-1),
                                                    s[1][1].double(), 1e-5),
                        NM.heuristic(key, "cpu"), sweep, 4 * (n + 1) * M * d, 8 * n * M * d))
    for tiny, M, nb, d in [(1, 1, 2, 256), (1, 8, 2, 256), (1, 64, 2, 256), (0, 8, 8, 7168)]:
        pw = (_r(1, d, seed=7), _r(d, seed=8), _r(d, seed=9))
        sets = [([_r(M, d, seed=60 + 10 * i + j) for j in range(nb + 2)], pw) for i in range(4)]
        key = {"T": M, "d": d, "n": nb + 1}

        def eager(s, nb=nb):
            prefix = s[0][nb] + s[0][nb + 1]
            x = refb.attn_res_mix([*s[0][:nb], prefix], s[1][0].reshape(-1), s[1][1], 1e-5)
            return prefix, refb.rms_norm(x, s[1][2], 1e-5)

        def want(s, nb=nb):
            v = [t.double() for t in s[0]]
            x = refb.attn_res_mix([*v[:nb], v[nb] + v[nb + 1]], s[1][0].double().reshape(-1), s[1][1].double(), 1e-5)
            return refb.rms_norm(x, s[1][2].double(), 1e-5)
        out.append(Case("tvm_attn_res_mix_norm", f"attn_res_mix_norm T={M} bank={nb} d={d}", bool(tiny), key, sets,
                        lambda cfg, s, nb=nb: NM.attn_res_mix(s[0][:nb], s[0][nb], *s[1][:2], 1e-5, cfg,
                                                              part=s[0][nb + 1], norm_weight=s[1][2], norm_eps=1e-5),
                        eager, want, NM.heuristic(key, "cpu"), sweep, 4 * (nb + 4) * M * d, 10 * (nb + 1) * M * d,
                        pick=lambda r: r[1]))
    return out


def kda_cases():
    out = []
    for tiny, H, D, lengths in [(1, 4, 64, [1]), (1, 4, 64, [1] * 4), (1, 4, 64, [2, 3, 1, 2]), (0, 16, 128, [1] * 8)]:
        T, P, R, rank, S = sum(lengths), H * D, len(lengths), D, len(lengths) + 1
        g = torch.Generator().manual_seed(70 + H)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        par = [r(P, 4) * 0.5, r(P, 4) * 0.5, r(P, 4) * 0.5, r(P, rank) / rank ** 0.5, r(H) * 0.5, r(P), r(D)]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        slots = torch.arange(1, R + 1)
        sets = [dict(q=r(T, P), k=r(T, P), v=r(T, P), conv=r(S, 3, 3 * P), fa=r(T, rank), b=r(T, H),
                     state=r(S, H, D, D) * 0.3, gate=r(T, P)) for _ in range(4)]
        attrs = {"scale": D ** -0.5, "lower_bound": -5.0, "l2_eps": 1e-6, "norm_eps": 1e-5}

        def ops(s, par=par, slots=slots, cu=cu):
            qc, kc, vc, fb, alog, dtb, onw = par
            return dict(q=s["q"], k=s["k"], v=s["v"], q_conv=qc, k_conv=kc, v_conv=vc, conv_state=s["conv"],
                        f_a=s["fa"], f_b=fb, A_log=alog, dt_bias=dtb, b=s["b"], state=s["state"], gate=s["gate"],
                        o_norm_w=onw, state_slot=slots, cu_seqlens=cu)

        def eager(s, ops=ops, H=H, D=D, dbl=False):
            o = ops(s)
            if dbl:  # the float64 yardstick: every float operand widened (pools copied: no side effect)
                o = {k: (v.double().clone() if v.is_floating_point() else v) for k, v in o.items()}
            T_, P_ = o["q"].shape
            y = refk.causal_conv1d(torch.cat([o["q"], o["k"], o["v"]], 1),
                                   torch.cat([o["q_conv"], o["k_conv"], o["v_conv"]], 0), o["conv_state"],
                                   o["state_slot"], o["cu_seqlens"])
            qh = refb.l2_norm(y[:, :P_].reshape(T_, H, D), 1e-6)
            kh = refb.l2_norm(y[:, P_:2 * P_].reshape(T_, H, D), 1e-6)
            gg = refk.kda_gate(o["f_a"] @ o["f_b"].t(), o["A_log"], o["dt_bias"], -5.0)
            oo = refk.kda_recurrence(qh, kh, y[:, 2 * P_:].reshape(T_, H, D), gg, torch.sigmoid(o["b"]), o["state"],
                                     o["state_slot"], o["cu_seqlens"], D ** -0.5)
            return refb.gated_rms_norm(oo, o["gate"].reshape(T_, H, D), o["o_norm_w"], 1e-5).reshape(T_, P_)

        def want(s, eager=eager):
            return eager(s, dbl=True)
        key = {"H": H, "D": D, "T": T, "R": R}
        sweep = [{"VEC": v, "PAR": p} for v in (4, 8, 16) for p in (1, 2)]
        nbytes = 4 * (2 * R * H * D * D + 6 * R * 3 * P + T * (4 * P + rank + H) + P * (rank + 12))
        out.append(Case("tvm_kda_decode", f"kda_decode H={H} D={D} tokens={lengths}", bool(tiny), key, sets,
                        lambda cfg, s, ops=ops, attrs=attrs: KD.kda_decode(ops(s), attrs, cfg), eager,
                        want, KD.heuristic(key, "cpu"), sweep, nbytes, T * H * (6 * D * D + 2 * D * rank),
                        pick=lambda r: r[0]))
    return out


CASES = gemm_cases() + mxfp4_cases() + norm_cases() + kda_cases()


REPORT = BenchReport("tvm")
DOC, section = REPORT.doc, REPORT.section
ROUNDS = int(os.environ.get("TVM_BENCH_ROUNDS", "15"))
BUDGET_S = float(os.environ.get("TVM_BENCH_BUDGET_S", "900"))


def per_call_us(fns: dict, rounds: int = ROUNDS, stat: str = "min") -> dict:
    """µs per call of each callable, measured interleaved in `rounds` rounds of calibrated batches (~0.5 ms):
    the fastest round ("min", the least disturbed on a shared machine) or the median round."""
    reps = {}
    for name, fn in fns.items():
        fn()
        t = time.perf_counter()
        fn()
        reps[name] = max(1, min(2000, int(5e-4 / max(time.perf_counter() - t, 1e-7))))
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - t) / reps[name] * 1e6)
    return {n: (min(s) if stat == "min" else sorted(s)[len(s) // 2]) for n, s in samples.items()}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


@section
def machine():
    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                   .stdout.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    DOC["machine"] = {"cpu": cpu, "cores": os.cpu_count(), "llvm_target": str(host_target()),
                      "python": platform.python_version(), "torch": torch.__version__, "tvm": tvm.__version__,
                      "torch_threads": torch.get_num_threads(), "load_average_start": load()}


@section
def ceilings():
    x = torch.empty(1 << 24, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t = per_call_us({"copy": lambda: y.copy_(x), "matmul": lambda: a @ b}, rounds=5)
    DOC["ceilings"] = {"copy_GBps": 2 * x.numel() * 4 / t["copy"] / 1e3,
                       "matmul_GFLOPs": 2 * 1024 ** 3 / t["matmul"] / 1e3}
    print(f"   ceilings: {DOC['ceilings']}", flush=True)


def run_case(case, with_compile: bool):
    """Time one case: TVM default, the sweep, eager reference (and torch.compile of it)."""
    fns, errs = {}, {}
    for name, cfg in [("tvm_default", case.default)] + [
            ("tvm " + ",".join(f"{k}={v}" for k, v in c.items()), c) for c in case.sweep()]:
        try:
            fn = case.tvm(cfg)
            want = case.reference()  # before the call: state pools are updated in place
            errs[name] = rel(case.result(fn()), want)
            fns[name] = fn
        except Exception as e:  # a config that fails to build is reported, not fatal
            DOC["errors"].append({"section": case.label, "config": cfg, "error": f"{type(e).__name__}: {e}"[:800]})
            print(f"!! {case.label} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    fns["eager"] = case.eager()
    for name, fn in case.extra_peers().items():
        fns[name] = fn
    if with_compile:
        try:
            compiled = case.eager(compiled=True)
            t0 = time.time()
            compiled()
            DOC["notes"].append(f"{case.label}: torch.compile build {time.time() - t0:.1f}s")
            fns["torch_compile"] = compiled
        except Exception as e:
            DOC["errors"].append({"section": case.label, "peer": "torch_compile",
                                  "error": f"{type(e).__name__}: {e}"[:500]})
    # TVM configs and torch peers are timed in separate phases: torch's OpenMP workers keep spinning after
    # each call and, on a loaded 2-core machine, stall whatever runs next in the same round
    t = per_call_us({n: f for n, f in fns.items() if n.startswith("tvm")})
    t.update(per_call_us({n: f for n, f in fns.items() if not n.startswith("tvm")}))
    t_median = {n: per_call_us({n: fns[n]}, rounds=5, stat="median")[n] for n in ("tvm_default", "eager")}
    threads = torch.get_num_threads()
    if threads > 1:  # torch on one thread: a loaded 2-core machine can make its 2-thread GEMMs pathological
        torch.set_num_threads(1)
        try:
            t["eager_1thread"] = per_call_us({"e": fns["eager"]})["e"]
        finally:
            torch.set_num_threads(threads)
    sweep = {n: v for n, v in t.items() if n.startswith("tvm ")}
    best_name = min(sweep, key=sweep.get) if sweep else "tvm_default"
    best = min(t["tvm_default"], sweep.get(best_name, math.inf))
    eager = min(t["eager"], t.get("eager_1thread", math.inf))  # the faster way torch runs it here
    floor_us = max(case.bytes / DOC["ceilings"]["copy_GBps"] / 1e3, case.flops / DOC["ceilings"]["matmul_GFLOPs"] / 1e3)
    m = {"name": case.label, "family": case.family, "tiny": case.tiny, "shape": case.shape, "bytes": case.bytes,
         "flops": case.flops, "default_config": case.default, "min_of_rounds_us": t, "median_us": t_median,
         "best_config": best_name if best < t["tvm_default"] else "tvm_default",
         "speedup_default_vs_eager": eager / t["tvm_default"], "speedup_best_vs_eager": eager / best,
         "floor_us": floor_us, "floor_fraction_default": floor_us / t["tvm_default"],
         "rel_err_vs_float64": errs, "load_average": load()}
    if "torch_compile" in t:
        m["speedup_default_vs_torch_compile"] = t["torch_compile"] / t["tvm_default"]
    DOC["measurements"].append(m)
    print(f"   {case.label}: tvm {t['tvm_default']:.1f}us (best {best:.1f}) eager {t['eager']:.1f}us"
          f" (1 thread {t.get('eager_1thread', math.nan):.1f}us)"
          + (f" compile {t['torch_compile']:.1f}us" if "torch_compile" in t else "")
          + f"  x{m['speedup_default_vs_eager']:.2f}  err {errs['tvm_default']:.1e}", flush=True)


def family_section(family: str):
    def run():
        first = True
        for case in (c for c in CASES if c.family == family):
            if time.time() - REPORT.t0 > BUDGET_S:
                DOC["notes"].append(f"{case.label}: skipped, over the {BUDGET_S:.0f}s budget")
                continue
            try:
                run_case(case, with_compile=(first and case.tiny) or not case.tiny)
            except Exception as e:
                DOC["errors"].append({"section": case.label, "error": f"{type(e).__name__}: {e}"[:800]})
                print(f"!! {case.label}: {type(e).__name__}: {e}", flush=True)
            first = first and not case.tiny
    run.__name__ = family
    return section(run)


def preference():
    out = {}
    for fam in sorted({c.family for c in CASES}):
        sp = [m["speedup_default_vs_eager"] for m in DOC["measurements"] if m["family"] == fam and m["tiny"]]
        if sp:
            g = math.exp(sum(math.log(s) for s in sp) / len(sp))
            out[fam] = {"prefer": g > 1.0, "speedup": round(g, 3), "shapes": len(sp),
                        "basis": "geometric mean over the k31-tiny shapes of eager / TVM default config"}
    DOC["preference"] = out
    print("preference:", {f: (v["prefer"], v["speedup"]) for f, v in out.items()}, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", default=None, help="also write the JSON document here")
    p.add_argument("--family", action="append", default=None, help="only these families")
    args = p.parse_args()
    machine()
    ceilings()
    for fam in sorted({c.family for c in CASES}):
        if args.family is None or fam in args.family:
            family_section(fam)()
    DOC["machine"]["load_average_end"] = load()
    preference()
    text = REPORT.save()
    if args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        with open(args.save + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.save + ".tmp", args.save)
    print(text)


if __name__ == "__main__":
    main()
