"""Decode-size GEMM / GEMV bench (issue 7): codegen/triton/gemm.py at batch 1 and 8 against the HBM floor.

    python benches/bench_gemm_decode.py [--m 1 8] [--budget-s 140]

One JSON document (stdout and $OUT/gemm_decode.json): machine, versions, command, the measured copy
bandwidth, and per (shape, M, variant): median time per launch, bytes, achieved bandwidth, ratio to the
byte floor (weight + x + y bytes / copy bandwidth) and to the torch peer, the error against a float64
reference, and whether two runs were bitwise identical. Shapes: the k31-pro rank's decode GEMMs (lm head
f32 x, routers f32 x, packed projections and o_proj/down bf16 x; a packed_linear is one GEMM over the
concatenated weight, so it is timed as that [N, K] weight). Variants: `new` (the declared heuristic),
`old` (the previous heuristic: 16-row tensor-core tiles, no split), a config sweep, and torch
(`x @ w.T` in bf16; for f32-x shapes also in f32 against an f32 copy of the weight, as the reference does).

Timing: a CUDA graph of `reps` launches cycling over rotated weight copies (together >= 200 MB, so the 50 MB
L2 holds none of them between uses), replayed >= 50 times; median replay time / reps. On CPU (no GPU) the
script checks its own logic with tiny shapes in the Triton interpreter.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benches._report import BenchReport, copy_bandwidth_GBps  # noqa: E402

CUDA = torch.cuda.is_available()
# (name, N, K, x dtype): the rank preset's decode GEMMs (benches/bench_runtime_gpu.py rank_config)
SHAPES = [("lm_head", 20480, 7168, torch.float32), ("router", 112, 7168, torch.float32),
          ("packed_3808", 3808, 7168, torch.bfloat16), ("packed_6284", 6284, 7168, torch.bfloat16),
          ("packed_8448", 8448, 7168, torch.bfloat16), ("packed_9728", 9728, 7168, torch.bfloat16),
          ("down_1536", 7168, 1536, torch.bfloat16), ("down_3072", 7168, 3072, torch.bfloat16),
          ("down_4224", 7168, 4224, torch.bfloat16)]
SWEEP = {1: ("lm_head", "router", "down_1536", "packed_6284", "down_3072", "down_4224", "packed_8448"),
         8: ("lm_head", "packed_8448", "down_3072", "router", "packed_3808")}


def old_config(n: int) -> dict:
    """The heuristic before the decode path (M <= 64): 16-row tensor-core tiles, no split-K."""
    return dict(BLOCK_M=16, BLOCK_N=64 if n >= 200 * 64 else 32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4,
                SPLIT_K=1, GEMV=0)


def sweep_configs(gemm, key: dict) -> list[tuple[str, dict]]:
    """Configs around the heuristic: GEMV tiles (BLOCK_N x BLOCK_K, warps) and tensor-core tiles, K split
    by the heuristic's rule for each tile (`gemm._fill`), plus forced splits for narrow N."""
    m = gemm.pow2_bucket(key["M"])
    out = []

    def add(tag, gemv, bm, bn, bk, warps=4, stages=1, split=None):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=1, GEMV=gemv, num_warps=warps,
                   num_stages=stages)
        cfg = gemm._fill(cfg, key, 4 * 132 if gemv else 66, bn) if split is None else dict(cfg, SPLIT_K=split)
        if not gemm.constraints(cfg, key, "h200"):
            out.append((tag, cfg))

    if m == 1:
        for bn, bk, w in ((8, 512, 4), (4, 512, 4), (16, 512, 4), (8, 1024, 4), (8, 256, 4), (16, 1024, 8)):
            add(f"gemv_bn{bn}_bk{bk}_w{w}", 1, 1, bn, bk, w)
    elif m <= 8:
        for bn, bk in ((2, 256), (4, 128)):
            add(f"gemv_bm{m}_bn{bn}_bk{bk}", 1, m, bn, bk)
    for bn, bk in ((16, 128), (32, 128), (64, 128), (32, 256)) if m > 1 else ((32, 128), (64, 128)):
        add(f"dot_bn{bn}_bk{bk}", 0, 16, bn, bk, 4, 4)
    if key["N"] < 1024:
        for bn, split in ((1, 8), (4, 16), (8, 16), (8, 32), (16, 32)):
            add(f"gemv_bn{bn}_split{split}", 1, m, bn, 256, 4, 1, split)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget-s", type=float, default=140.0, help="no sweep config starts after this many seconds")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    rep = BenchReport("gemm_decode")
    import triton

    from codegen.triton import gemm

    dev = "cuda" if CUDA else "cpu"
    rep.doc["machine"] = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
                          "triton": triton.__version__}
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = SHAPES if CUDA else [("lm_head", 40, 96, torch.float32), ("router", 7, 96, torch.float32),
                                  ("packed_small", 50, 64, torch.bfloat16)]
    results = rep.doc["measurements"]
    t0 = time.time()

    @rep.section
    def bandwidth():
        if not CUDA:
            return rep.doc["ceilings"].update(bandwidth_GBps=10.0)
        rep.doc["ceilings"]["bandwidth_GBps"] = copy_bandwidth_GBps(dev)

    def timed(fn, reps: int) -> float:
        """Median ms per call of fn() (which cycles its operands) in a graph of `reps` calls."""
        if not CUDA:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.replays):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        del g
        return statistics.median(ts) / reps

    def run_case(name, n, k, xdt, m, sweep: bool):
        bw = rep.doc["ceilings"].get("bandwidth_GBps", 10.0)
        gen = torch.Generator(device=dev).manual_seed(n + k + m)
        wbytes = n * k * 2
        copies = max(2, min(64, math.ceil(200e6 / wbytes))) if CUDA else 2
        reps = max(20, copies) if CUDA else 1
        ws = [(torch.randn(n, k, generator=gen, device=dev) * 0.05).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, generator=gen, device=dev).to(xdt)
        ref = (x.double() @ ws[0].double().t())
        nbytes = wbytes + x.numel() * x.element_size() + m * n * x.element_size()
        floor_us = nbytes / (bw * 1e9) * 1e6
        key = dict(M=m, N=n, K=k, x="f32" if xdt == torch.float32 else "bf16", w="bf16", gk=0, bi=0)
        variants = [("new", gemm.heuristic(key, "h200")), ("old", old_config(n))]
        if sweep:
            variants += sweep_configs(gemm, key)
        case = {"shape": name, "M": m, "N": n, "K": k, "x": str(xdt), "bytes": nbytes, "floor_us": floor_us,
                "copies": copies, "graph_launches": reps, "variants": []}
        results.append(case)
        peer = None
        torch_variants = [("torch_bf16", lambda w: torch.nn.functional.linear(x.to(torch.bfloat16), w))]
        if xdt == torch.float32:
            wf = {id(w): w.float() for w in ws}
            torch_variants.append(("torch_f32", lambda w: torch.nn.functional.linear(x, wf[id(w)])))
        for tag, cfg in variants + torch_variants:
            if tag not in ("new", "old") and not tag.startswith("torch") and time.time() - t0 > args.budget_s:
                case["variants"].append({"variant": tag, "skipped": "budget"})
                continue
            row = {"variant": tag, "config": cfg if isinstance(cfg, dict) else None}
            try:
                if isinstance(cfg, dict):
                    call = lambda w, cfg=cfg: gemm.gemm(x, w, cfg)  # noqa: E731
                else:
                    call = cfg
                y = call(ws[0])
                y2 = call(ws[0])
                row["rel_err"] = (torch.linalg.vector_norm(y.double() - ref) / torch.linalg.vector_norm(ref)).item()
                row["finite"] = bool(torch.isfinite(y).all())
                row["bitwise_repeat"] = bool(torch.equal(y, y2))
                it = [0]

                def cycle(call=call):
                    it[0] = (it[0] + 1) % copies
                    return call(ws[it[0]])

                ms = timed(cycle, reps)
                row.update(us=ms * 1e3, GBps=nbytes / (ms * 1e-3) / 1e9, x_floor=ms * 1e3 / floor_us)
                if tag == "torch_bf16":
                    peer = row["us"]
            except Exception as e:  # one shot on the GPU: report the variant and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            case["variants"].append(row)
        for row in case["variants"]:
            if peer and "us" in row:
                row["x_torch_bf16"] = row["us"] / peer
        best = min((r for r in case["variants"] if "us" in r and not r["variant"].startswith("torch")),
                   key=lambda r: r["us"], default=None)
        case["best"] = best and {"variant": best["variant"], "us": best["us"], "config": best["config"]}
        ws.clear()  # free the copies before the next shape
        if CUDA:
            torch.cuda.empty_cache()

    bandwidth()
    for sweep_pass in (False, True):  # every shape's new / old / torch first, then the sweeps
        for m in args.m:
            for name, n, k, xdt in shapes:
                if sweep_pass == (name in SWEEP.get(m, ()) or not CUDA):
                    rep.section(lambda: run_case(name, n, k, xdt, m, sweep_pass))()
    head = ("shape", "M", "floor", "new", "x", "old", "x", "torch", "best")
    lines = ["{:12} {:>2} {:>7} {:>7} {:>5} {:>7} {:>5} {:>7} {:>7} best".format(*head)]
    for c in results:
        v = {r["variant"]: r for r in c["variants"]}
        g = lambda t, f="us": v.get(t, {}).get(f, float("nan"))  # noqa: E731
        lines.append(f"{c['shape']:12} {c['M']:>2} {c['floor_us']:7.1f} {g('new'):7.1f} {g('new', 'x_floor'):5.2f} "
                     f"{g('old'):7.1f} {g('old', 'x_floor'):5.2f} {g('torch_bf16'):7.1f} "
                     f"{(c['best'] or {}).get('us', float('nan')):7.1f} {(c['best'] or {}).get('variant')}")
    rep.doc["table"] = lines
    text = rep.save()
    print(text if not os.environ.get("OUT") else f"(full JSON in $OUT/gemm_decode.json, {len(text)} chars)")
    print("\n".join(lines))
    bad = [(c["shape"], c["M"], r["variant"], r.get("rel_err"), r.get("error")) for c in results for r in c["variants"]
           if "error" in r or not r.get("finite", True) or r.get("rel_err", 0) > (2e-2)]
    print("problems:", bad)


if __name__ == "__main__":
    main()
