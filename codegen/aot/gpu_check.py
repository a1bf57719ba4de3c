"""On the GPU: run an artifact from its stored binaries, prove no JIT compile happened, compare with JIT.

    python -m codegen.aot.gpu_check ART [--probe DIR ...] [--extra '{"prompts": [37, 3], "decode": 2}'] [--out F]

Each run is a fresh process with its own empty TRITON_CACHE_DIR (aot first, alone; then extra and jit side
by side):
  aot    the artifact's workload scenarios (bf16, cuda) inside `use_binaries(ART)`: binaries loaded, JIT
         compiles counted by the hook; afterwards the cache folder is listed (kernel files = compiles;
         Triton's host-side launcher stubs `*.so` are C, built per signature, not kernels)
  extra  a scenario outside the build's workload with JIT fallback: the misses are compiled and counted
  jit    the same scenarios with the plain JIT (kernel files in its cache = its compiles)
and then: logits aot vs jit (max |diff|, relative error, bit-identical?), first-step (cold) and total
times, refusal messages for a mismatched arch / Triton version, and each --probe store (a GEMM + KDA
gate built elsewhere, e.g. by another Triton version) loaded and checked against float64 references.
One JSON document goes to stdout and --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

KERNEL_EXTS = (".cubin", ".ptx", ".ttir", ".ttgir", ".llir", ".hsaco", ".amdgcn")


def _cache_files(folder: str) -> dict:
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    kern = [f for f in files if f.endswith(KERNEL_EXTS)]
    return {"files": len(files), "kernel_files": len(kern), "cubins": sum(f.endswith(".cubin") for f in files),
            "launcher_so": sum(f.endswith(".so") for f in files)}


def _run_mode(mode: str, art: str, out: str, extra: dict | None):
    """Inside a child process: run the scenarios, save logits, write a JSON summary."""
    import torch

    from codegen.aot.loader import use_binaries
    from codegen.aot.store import read_index
    from codegen.aot.workload import run_scenario
    from k31c.compiler import load_artifact
    from k31c.runtime.executor import Executor

    t0 = time.perf_counter()
    a = load_artifact(art, check_live=False)  # the manifest's build toolchain is not this machine's: see report
    from codegen.aot.loader import live_target

    index = read_index(os.path.join(art, "kernels", "bin", live_target()["arch_name"]))
    scenarios = [extra] if mode == "extra" else list(index["workload"])
    res = {"mode": mode, "load_s": time.perf_counter() - t0, "steps": []}
    logits = []

    def engine():
        return Executor(a.module, a.weights, a.choices, target=a.manifest["target"]["name"], configs=a.configs,
                        batch_invariant=a.manifest["options"].get("batch_invariant", False),
                        compute_dtype=torch.bfloat16, device="cuda")

    def run_all():
        for i, sc in enumerate(scenarios):
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = run_scenario(a.module, a.weights, engine(), sc, 99 if mode == "extra" else i)
            torch.cuda.synchronize()
            res["steps"].append({"scenario": sc, "seconds": time.perf_counter() - t})
            logits.extend(o.float().cpu() for o in outs)

    if mode == "jit":
        run_all()
    else:
        with use_binaries(art, jit_fallback=mode == "extra") as stats:
            run_all()
        res["binaries"] = stats.summary()
    res["total_s"] = time.perf_counter() - t0
    res["cache"] = _cache_files(os.environ["TRITON_CACHE_DIR"])
    torch.save(logits, os.path.join(out, f"{mode}.pt"))
    with open(os.path.join(out, f"{mode}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def _start(mode: str, art: str, work: str, extra) -> tuple:
    cache = os.path.join(work, f"cache_{mode}")
    os.makedirs(cache, exist_ok=True)
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    cmd = [sys.executable, "-m", "codegen.aot.gpu_check", art, "--mode", mode, "--work", work]
    if extra:
        cmd += ["--extra", json.dumps(extra)]
    log = open(os.path.join(work, f"{mode}.log"), "w")
    return mode, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), time.perf_counter(), log


def _finish(started: tuple, work: str, deadline: float) -> dict:
    mode, proc, t0, log = started
    try:
        proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"mode": mode, "error": "timed out", "log": open(log.name).read()[-2000:]}
    finally:
        log.close()
    path = os.path.join(work, f"{mode}.json")
    if proc.returncode != 0 or not os.path.isfile(path):
        return {"mode": mode, "error": f"exit {proc.returncode}", "log": open(log.name).read()[-3000:]}
    r = json.load(open(path))
    r["process_s"] = time.perf_counter() - t0
    return r


def _refusals(art: str, work: str) -> dict:
    """The messages for a foreign arch and a foreign Triton version (copies of the store, tampered)."""
    from codegen.aot.loader import use_binaries
    from codegen.aot.store import AOTError

    out = {}
    for case in ("arch", "triton"):
        dst = os.path.join(work, f"refuse_{case}")
        shutil.copytree(os.path.join(art, "kernels", "bin"), os.path.join(dst, "kernels", "bin"))
        b = os.path.join(dst, "kernels", "bin")
        if case == "arch":
            os.rename(os.path.join(b, "sm_90a"), os.path.join(b, "sm_100a"))
        else:
            p = os.path.join(b, "sm_90a", "index.json")
            idx = json.load(open(p))
            idx["triton"]["version"] = "0.0.0-other"
            json.dump(idx, open(p, "w"))
        try:
            with use_binaries(dst):
                out[case] = "NOT REFUSED"
        except AOTError as e:
            out[case] = str(e)
    return out


def _probe(folder: str) -> dict:
    """Load a probe store (GEMM + KDA gate) and check its results. A store built by another Triton is
    refused first; then it is loaded with the version check and keying relaxed (match by function,
    signature and constexprs; options ignored) to find out whether such a binary loads and runs here."""
    import triton
    from triton.runtime import jit as jit_mod

    from codegen.aot import probe
    from codegen.aot.loader import BinaryStore, use_binaries
    from codegen.aot.record import describe
    from codegen.aot.store import AOTError, arch_dir, read_index

    index = read_index(arch_dir(folder, "sm_90a"))
    res = {"built_by": index["triton"]["version"], "live": triton.__version__}
    try:
        _clear_jit_caches()
        with use_binaries(folder) as stats:
            res["errors"] = probe.check("cuda")
        res["binaries"] = stats.summary()
        return res
    except AOTError as e:
        res["refused"] = str(e)[:600]
    store = BinaryStore.__new__(BinaryStore)  # files verified below by sha only, the version check skipped
    store.folder, store.index = arch_dir(folder, "sm_90a"), index
    original, loaded = jit_mod.JITFunction._do_compile, []

    def relaxed(jitfn, key, signature, device, constexprs, options, attrs, warmup):
        d = describe(jitfn, signature, constexprs, attrs, options)
        for e in index["kernels"]:
            if (e["function"], e["signature"], e["constexprs"]) == (d["function"], d["signature"], d["constexprs"]):
                k = store.load(e, jitfn, signature, constexprs, attrs)
                jitfn.device_caches[device][0][key] = k
                loaded.append(e["name"])
                return k
        raise AOTError(f"relaxed probe: no stored entry for {d['function']} with signature {d['signature']}")

    jit_mod.JITFunction._do_compile = relaxed
    try:
        _clear_jit_caches()
        res["forced_errors"] = probe.check("cuda")
        res["forced_loaded"] = loaded
    except Exception as e:  # the finding: a binary written by another Triton does not load or launch here
        res["forced_failure"] = f"{type(e).__name__}: {e}"[:1500]
    finally:
        jit_mod.JITFunction._do_compile = original
        _clear_jit_caches()
    return res


def _clear_jit_caches():
    from codegen.triton import _kda_common, gemm

    for k in (gemm._gemm_kernel, _kda_common._kda_gate_kernel):
        if hasattr(k, "device_caches"):  # a JITFunction (an InterpretedFunction has no compile cache)
            k.device_caches.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.aot.gpu_check")
    ap.add_argument("artifact")
    ap.add_argument("--probe", action="append", default=[], help="a folder holding kernels/bin/sm_90a (probe store)")
    ap.add_argument("--extra", default='{"prompts": [37, 3], "decode": 2, "verify": 0}')
    ap.add_argument("--out", default=None)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=150, help="seconds for all the child runs together")
    args = ap.parse_args(argv)
    if args.mode:
        _run_mode(args.mode, args.artifact, args.work, json.loads(args.extra) if args.mode == "extra" else None)
        return 0
    import torch
    import triton

    from codegen.aot.loader import live_target

    work = tempfile.mkdtemp(prefix="aot-check-")
    doc = {"command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
           "python": sys.version.split()[0], "live": live_target()}
    runs = {}
    deadline = time.perf_counter() + args.timeout
    runs["aot"] = _finish(_start("aot", args.artifact, work, None), work, deadline)  # alone: clean timings
    started = [_start("extra", args.artifact, work, json.loads(args.extra)), _start("jit", args.artifact, work, None)]
    for st in started:  # these two run side by side (the JIT one compiles every kernel)
        runs[st[0]] = _finish(st, work, deadline)
    for mode, r in runs.items():
        brief = {k: r.get(k) for k in ("total_s", "binaries", "cache", "error")}
        print(f"gpu_check: {mode}: {json.dumps(brief, default=str)[:700]}", file=sys.stderr, flush=True)
    doc["runs"] = runs
    if os.path.isfile(os.path.join(work, "aot.pt")) and os.path.isfile(os.path.join(work, "jit.pt")):
        a, j = torch.load(os.path.join(work, "aot.pt")), torch.load(os.path.join(work, "jit.pt"))
        diffs = [float((x - y).abs().max()) for x, y in zip(a, j)]
        rel = [float((x - y).norm() / y.norm()) for x, y in zip(a, j)]
        doc["aot_vs_jit"] = {"steps": len(a), "max_abs_diff": max(diffs), "max_rel_err": max(rel),
                             "bit_identical": all(torch.equal(x, y) for x, y in zip(a, j)),
                             "all_finite": all(bool(torch.isfinite(x).all()) for x in a)}
    try:
        doc["refusals"] = _refusals(args.artifact, work)
    except Exception as e:
        doc["refusals"] = {"error": f"{type(e).__name__}: {e}"}
    doc["probes"] = {}
    for p in args.probe:
        try:
            doc["probes"][p] = _probe(p)
        except Exception as e:
            doc["probes"][p] = {"error": f"{type(e).__name__}: {e}"[:1500]}
    text = json.dumps(doc, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
