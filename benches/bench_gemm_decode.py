"""Decode-size GEMM / GEMV bench (issue 7): codegen/triton/gemm.py at batch 1, 8 and 64 against the HBM floor.

    python benches/bench_gemm_decode.py [--m 1 8 64] [--budget-s 140] [--replays 40] [--compile-workers 12]

One JSON document (stdout and $OUT/gemm_decode.json): machine, versions, command, the copy bandwidth measured
in the same run, and per (shape, M, variant): median device time per launch, bytes, achieved bandwidth, ratio
to the byte floor (weight + x + y bytes / copy bandwidth) and to torch.nn.functional.linear (cuBLAS), the
error against a float64 reference, whether two runs were bitwise identical, and for in-launch split-K
combines whether the bits equal the two-launch combine. Shapes: the k31-pro rank's decode GEMMs (lm head and
routers with f32 x, packed projections, o_proj and down projections with bf16 x; a packed_linear is one GEMM
over the concatenated weight, timed as that [N, K] weight). Variants: `new` (the declared heuristic), `prev`
(HEAD c7cb4b0's heuristic, `PREVIOUS`), a config sweep per shape class, torch in bf16 and, for f32-x shapes,
in f32 against an f32 copy of the weight (what the reference computes).

Timing (`_report.graph_ms`): the launches over rotated weight copies (together >= 200 MB, so the 50 MB L2
holds none of them between uses) captured in one CUDA graph, the median replay / launches. Order: every
shape's new / prev / torch first, then the sweeps by priority, none started after --budget-s. On CPU the
script checks its own logic on tiny shapes in the Triton interpreter.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benches._report import BenchReport, copy_bandwidth_GBps, graph_ms  # noqa: E402

CUDA = torch.cuda.is_available()
# (name, N, K, x dtype): the rank preset's decode GEMMs (benches/bench_runtime_gpu.py rank_config)
SHAPES = [("router", 112, 7168, torch.float32), ("o_proj_1536", 7168, 1536, torch.bfloat16),
          ("down_3072", 7168, 3072, torch.bfloat16), ("down_4224", 7168, 4224, torch.bfloat16),
          ("packed_3808", 3808, 7168, torch.bfloat16), ("packed_6284", 6284, 7168, torch.bfloat16),
          ("packed_8448", 8448, 7168, torch.bfloat16), ("packed_9728", 9728, 7168, torch.bfloat16),
          ("lm_head", 20480, 7168, torch.float32), ("z_3584", 3584, 7168, torch.bfloat16)]
CPU_SHAPES = [("router", 7, 96, torch.float32), ("o_proj_1536", 40, 48, torch.bfloat16),
              ("packed_3808", 50, 64, torch.bfloat16)]
# HEAD c7cb4b0's heuristic at these shapes (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GEMV, num_warps, num_stages);
# its split-K added the partials in a second launch. Every other shape class took the first row of its M.
PREVIOUS = {(1, "lm_head"): (1, 4, 512, 1, 1, 4, 1), (1, "router"): (1, 1, 512, 8, 1, 4, 1),
            (1, "packed_3808"): (1, 4, 512, 1, 1, 4, 1), (1, "packed"): (1, 8, 512, 1, 1, 4, 1),
            (1, "z"): (1, 8, 512, 1, 1, 4, 1),
            (1, "o_proj_1536"): (1, 8, 256, 1, 1, 4, 1), (1, "down"): (16, 32, 128, 1, 0, 4, 4),
            (8, "lm_head"): (16, 64, 128, 2, 0, 4, 4), (8, "router"): (16, 16, 128, 16, 0, 4, 4),
            (8, ""): (16, 32, 128, 1, 0, 4, 4), (64, "lm_head"): (64, 64, 128, 1, 0, 4, 4),
            (64, ""): (64, 32, 128, 1, 0, 4, 4)}


def cfg(bm, bn, bk, split=1, gemv=1, warps=4, stages=1, combine=1) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split, GEMV=gemv, num_warps=warps,
                num_stages=stages, COMBINE=combine if split > 1 else 0)


def previous_config(name: str, m: int) -> dict:
    """HEAD c7cb4b0's config for (shape, M): the shape's own row, else its class's (name prefix), else M's."""
    row = PREVIOUS.get((m, name)) or PREVIOUS.get((m, name.split("_")[0])) or PREVIOUS[(m, "")]
    bm, bn, bk, split, gemv, warps, stages = row
    return cfg(bm, bn, bk, split, gemv, warps, stages, combine=0)


def sweep(name: str, m: int) -> list[tuple[str, dict]]:
    """Candidate configs per shape class: GEMV tiles (BLOCK_N x BLOCK_K, warps, K-loop pipeline stages),
    tensor-core tiles, and split-K with the in-launch combine (c1) against the second launch (c0)."""
    def g(bn, bk, w=4, st=1, split=1, c=1):
        tag = f"gemv_n{bn}_k{bk}_w{w}_s{st}" + (f"_x{split}c{c}" if split > 1 else "")
        return tag, cfg(1, bn, bk, split, 1, w, st, c)

    def d(bm, bn, bk, st=4, split=1, c=1, w=4):
        tag = f"dot_m{bm}_n{bn}_k{bk}_s{st}" + (f"_x{split}c{c}" if split > 1 else "")
        return tag, cfg(bm, bn, bk, split, 0, w, st, c)

    if m == 1:
        if name == "router":
            return [g(1, 8192, 8), g(1, 4096, 8, 1, 2), g(1, 4096, 4, 1, 2), g(1, 2048, 4, 1, 4), g(2, 2048, 4, 1, 4),
                    g(1, 1024, 4, 1, 8), g(1, 512, 4, 1, 8), g(1, 1024, 4, 2, 8), g(4, 1024, 4, 1, 8),
                    g(1, 256, 4, 1, 32)]
        if name == "o_proj_1536":
            return [g(8, 256, 4, 3), g(8, 256, 4, 4), g(8, 256, 2, 3), g(4, 512), g(4, 512, 4, 3), g(8, 512),
                    g(8, 512, 4, 3), g(2, 2048), g(4, 2048, 8), g(16, 256, 4, 3), g(16, 256, 4, 4), g(32, 128, 4, 4),
                    g(16, 512, 8, 2), g(1, 2048, 2), g(4, 256, 2, 3), d(16, 32, 128, 5), d(16, 16, 128, 4)]
        if name.startswith("down"):
            out = [g(8, 512), g(8, 512, 4, 2), g(8, 512, 4, 3), g(8, 256, 4, 3), g(8, 256, 4, 4), g(8, 256, 2, 3),
                   g(4, 512, 4, 3), g(4, 1024, 4, 2), g(4, 1024, 8), g(16, 512, 8, 2), g(16, 256, 4, 3),
                   g(16, 256, 4, 4), g(32, 128, 4, 4), g(32, 256, 8, 3), d(16, 32, 128, 5), d(16, 64, 128, 4),
                   d(16, 32, 256, 3), d(16, 32, 128, 4, 2)]
            return out + ([g(2, 4096, 8)] if name == "down_3072" else [])
        if name == "z_3584":
            return [g(8, 512, 4, 3), g(8, 512, 4, 4), g(8, 512, 4, 5), g(8, 1024, 4, 3), g(8, 1024, 4, 4),
                    g(16, 512, 4, 4), g(16, 512, 8, 4), g(4, 512, 4, 4), g(4, 1024, 4, 3), g(2, 1024, 4, 4),
                    g(8, 256, 4, 6), g(4, 512, 2, 4), g(8, 512, 8, 4), g(8, 512, 4, 3, 2)]
        if name.startswith("packed"):
            return [g(8, 512), g(4, 512), g(8, 512, 4, 3), g(4, 512, 4, 3), g(8, 256, 4, 4), g(16, 512, 8, 2),
                    g(4, 1024, 4, 2), g(16, 256, 4, 4), g(32, 128, 4, 4)]
        if name == "lm_head":
            return [g(4, 512, 4, 3), g(8, 512, 4, 2), g(4, 1024, 4, 2), g(4, 512, 4, 2)]
    if m <= 16:
        if name == "router":
            return [d(16, 16, 128, 4, 16, 1), d(16, 16, 128, 4, 8), d(16, 32, 256, 3, 8), d(16, 16, 256, 3, 16),
                    (f"gemv_m{m}_n1_k1024_x8c1", cfg(m, 1, 1024, 8, 1, 4, 1))]
        if name == "lm_head":
            return [d(16, 64, 128, 4, 2, 1), d(16, 128, 64, 4, 2), d(16, 64, 128, 4, 4), d(16, 128, 128, 3)]
        return [d(16, 64, 128, 4), d(16, 32, 256, 3), d(16, 32, 128, 5), d(16, 32, 128, 4, 2)]
    if name == "router":
        return [d(64, 16, 128, 4, 8), d(64, 32, 128, 4, 8), d(64, 16, 128, 3, 16)]
    return [d(64, 64, 128, 4), d(64, 128, 64, 4, w=8), d(64, 32, 128, 4, 2)]


def _precompile(jobs) -> int:
    """Worker (spawned process): launch each (M, N, K, x dtype, config) once so that Triton compiles it into
    the on-disk cache the timing process then reads; failures are left for the timing pass to report."""
    from codegen.triton import gemm

    done, tensors, dev = 0, {}, "cuda" if CUDA else "cpu"
    for m, n, k, xname, c in jobs:
        if (m, n, k, xname) not in tensors:
            tensors[(m, n, k, xname)] = (torch.randn(m, k, device=dev).to(getattr(torch, xname)),
                                         torch.randn(n, k, device=dev).to(torch.bfloat16))
        x, w = tensors[(m, n, k, xname)]
        try:
            gemm.gemm(x, w, c)
            done += 1
        except Exception:
            pass
    if CUDA:
        torch.cuda.synchronize()
    return done


def precompile(plan, workers: int, timeout_s: float) -> dict:
    """Compile every Triton config of `plan` [(name, n, k, xdt, m, variants)] in `workers` processes."""
    import multiprocessing as mp

    configs = [(m, n, k, xdt, c) for _, n, k, xdt, m, vs in plan for _, c in vs if isinstance(c, dict)]
    configs += [(m, n, k, xdt, dict(c, COMBINE=0)) for m, n, k, xdt, c in configs if c.get("COMBINE")]  # bit checks
    jobs = sorted({(m, n, k, str(xdt).split(".")[1], tuple(sorted(c.items()))) for m, n, k, xdt, c in configs})
    jobs = [(m, n, k, xn, dict(c)) for m, n, k, xn, c in jobs]
    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map_async(_precompile, [jobs[i::workers] for i in range(workers)]).get(timeout_s))
    return {"kernels": len(jobs), "compiled": done, "workers": workers, "seconds": round(time.time() - t, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--budget-s", type=float, default=140.0, help="no sweep config starts after this many seconds")
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--isolated", action="store_true",
                    help="also time each launch behind a one-kernel dependency (x *= 1 first): a GEMV after a small "
                         "kernel, as in the decode step, not back to back with itself")
    ap.add_argument("--compile-workers", type=int, default=min(12, os.cpu_count() or 1),
                    help="processes that compile every Triton config into the cache before the timing pass")
    args = ap.parse_args()
    rep = BenchReport("gemm_decode")
    import triton

    from codegen.triton import _gemv, gemm

    dev = "cuda" if CUDA else "cpu"
    rep.doc["machine"] = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
                          "triton": triton.__version__}
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = SHAPES if CUDA else CPU_SHAPES
    if args.shapes:
        shapes = [sh for sh in shapes if sh[0] in args.shapes.split(",")]
    results, t0 = rep.doc["measurements"], time.time()
    rep.doc["ceilings"]["bandwidth_GBps"] = copy_bandwidth_GBps(dev) if CUDA else 10.0

    def timed(calls) -> float:
        if not CUDA:
            t = time.perf_counter()
            calls[0]()
            return (time.perf_counter() - t) * 1e3
        return graph_ms(calls, reps=args.replays)

    def torch_call(kind, x, ws):
        if kind == "torch_bf16":
            xb = x.to(torch.bfloat16)
            return lambda w: torch.nn.functional.linear(xb, w)
        wf = {id(w): w.float() for w in ws}
        return lambda w: torch.nn.functional.linear(x, wf[id(w)])

    def run_case(name, n, k, xdt, m, variants):
        bw = rep.doc["ceilings"]["bandwidth_GBps"]
        gen = torch.Generator(device=dev).manual_seed(n + k + m)
        wbytes = n * k * 2
        copies = max(2, min(64, math.ceil(200e6 / wbytes))) if CUDA else 2
        ws = [(torch.randn(n, k, generator=gen, device=dev) * 0.05).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, generator=gen, device=dev).to(xdt)
        ref = x.double() @ ws[0].double().t()
        nbytes = wbytes + x.numel() * x.element_size() + m * n * x.element_size()
        floor_us = nbytes / (bw * 1e9) * 1e6
        case = next((c for c in results if (c["shape"], c["M"]) == (name, m)), None)
        if case is None:
            case = {"shape": name, "M": m, "N": n, "K": k, "x": str(xdt), "bytes": nbytes, "floor_us": floor_us,
                    "copies": copies, "variants": []}
            results.append(case)
        for tag, c in variants:
            if tag not in ("new", "prev") and not tag.startswith("torch") and time.time() - t0 > args.budget_s:
                case["variants"].append({"variant": tag, "skipped": "budget"})
                continue
            row = {"variant": tag, "config": c if isinstance(c, dict) else None}
            try:
                call = (lambda w, c=c: gemm.gemm(x, w, c)) if isinstance(c, dict) else torch_call(c, x, ws)
                if isinstance(c, dict):
                    key = dict(M=m, N=n, K=k, x="f32" if xdt == torch.float32 else "bf16", w="bf16", gk=0, bi=0)
                    row["constraints"] = gemm.constraints(c, key, "h200")
                y, y2 = call(ws[0]), call(ws[0])
                row["rel_err"] = (torch.linalg.vector_norm(y.double() - ref) / torch.linalg.vector_norm(ref)).item()
                row["finite"] = bool(torch.isfinite(y).all())
                row["bitwise_repeat"] = bool(torch.equal(y, y2))
                if isinstance(c, dict) and c.get("COMBINE") and c.get("SPLIT_K", 1) > 1:
                    row["bits_equal_two_launch"] = bool(torch.equal(y, gemm.gemm(x, ws[0], dict(c, COMBINE=0))))
                ms = timed([lambda w=w: call(w) for w in ws])
                row.update(us=ms * 1e3, GBps=nbytes / (ms * 1e-3) / 1e9, x_floor=ms * 1e3 / floor_us)
                if args.isolated and CUDA:
                    tiny = timed([lambda: x.mul_(1.0) for _ in ws])
                    pair = timed([lambda w=w: (x.mul_(1.0), call(w)) for w in ws])
                    row.update(iso_us=(pair - tiny) * 1e3, iso_x_floor=(pair - tiny) * 1e3 / floor_us)
            except Exception as e:  # one shot on the GPU: report the variant and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            case["variants"].append(row)
            print(f"{name:12} M={m:<3} {tag:28} {row.get('us', float('nan')):8.2f} us "
                  f"iso {row.get('iso_us', float('nan')):7.2f} "
                  f"x{row.get('x_floor', float('nan')):5.2f} err {row.get('rel_err', float('nan')):.1e} "
                  f"{row.get('error', '')[:120]}", flush=True)
        peer = next((r["us"] for r in case["variants"] if r["variant"] == "torch_bf16" and "us" in r), None)
        for r in case["variants"]:
            if peer and "us" in r:
                r["x_torch_bf16"] = r["us"] / peer
        mine = [r for r in case["variants"] if "us" in r and not r["variant"].startswith("torch")
                and r.get("finite") and r.get("bitwise_repeat") and r.get("rel_err", 1) < 2e-2]
        best = min(mine, key=lambda r: r["us"], default=None)
        case["best"] = best and {"variant": best["variant"], "us": best["us"], "x_floor": best["x_floor"],
                                 "config": best["config"]}
        ws.clear()  # free the copies before the next shape
        if CUDA:
            torch.cuda.empty_cache()

    def base_variants(name, n, k, xdt, m):
        key = dict(M=m, N=n, K=k, x="f32" if xdt == torch.float32 else "bf16", w="bf16", gk=0, bi=0)
        out = [("new", gemm.heuristic(key, "h200")), ("prev", previous_config(name, m))]
        out.append(("torch_bf16", "torch_bf16"))
        if xdt == torch.float32:
            out.append(("torch_f32", "torch_f32"))
        return out

    plan = [(name, n, k, xdt, m, base_variants(name, n, k, xdt, m)) for m in args.m for name, n, k, xdt in shapes]
    plan += [(name, n, k, xdt, m, sweep(name, m) if CUDA else sweep(name, m)[:3])  # CPU: the script's logic only
             for m in args.m for name, n, k, xdt in shapes]
    if args.compile_workers > 1:  # on CPU: checks the pool's plumbing (the interpreter caches nothing)
        @rep.section
        def compile_all():
            rep.doc["precompile"] = precompile(plan, args.compile_workers, max(10.0, args.budget_s / 2))
            print("precompile:", rep.doc["precompile"], flush=True)
        compile_all()
    for name, n, k, xdt, m, vs in plan:  # every shape's new / prev / torch first, then the sweeps
        rep.section(lambda: run_case(name, n, k, xdt, m, vs))()

    rep.doc["counters_all_zero"] = all(int(c.abs().sum()) == 0 for c in _gemv._COUNTERS.values())
    head = ("shape", "M", "floor", "new", "x", "prev", "x", "torch", "x", "best", "x")
    lines = ["{:12} {:>3} {:>6} {:>6} {:>5} {:>6} {:>5} {:>6} {:>5} {:>6} {:>5} best".format(*head)]
    for c in results:
        v = {r["variant"]: r for r in c["variants"]}
        g = lambda t, f="us": v.get(t, {}).get(f, float("nan"))  # noqa: E731
        b = c.get("best") or {}
        lines.append(f"{c['shape']:12} {c['M']:>3} {c['floor_us']:6.1f} {g('new'):6.1f} {g('new', 'x_floor'):5.2f} "
                     f"{g('prev'):6.1f} {g('prev', 'x_floor'):5.2f} {g('torch_bf16'):6.1f} "
                     f"{g('torch_bf16', 'x_floor'):5.2f} {b.get('us', float('nan')):6.1f} "
                     f"{b.get('x_floor', float('nan')):5.2f} {b.get('variant')}")
    rep.doc["table"] = lines
    text = rep.save()
    print(text if not os.environ.get("OUT") else f"(full JSON in $OUT/gemm_decode.json, {len(text)} chars)")
    print("\n".join(lines))
    bad = [(c["shape"], c["M"], r["variant"], r.get("rel_err"), r.get("error")) for c in results for r in c["variants"]
           if "error" in r or not r.get("finite", True) or r.get("rel_err", 0) > 2e-2
           or r.get("bits_equal_two_launch") is False or r.get("bitwise_repeat") is False]
    print("counters all zero:", rep.doc["counters_all_zero"], "problems:", bad)


if __name__ == "__main__":
    main()
