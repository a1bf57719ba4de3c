"""The AOT build worker: `python -m codegen.aot.worker REQUEST.json` (started by `build.py`, never by hand).

It runs in its own process because Triton decides at import time whether it interprets: the parent
(tests, `k31c compile` on a CPU machine) interprets, this process must not (`TRITON_INTERPRET=0`), and
it may run a different Triton (`PYTHONPATH` set by the parent) than the parent's.

Request (JSON): {target: {backend, arch, warp_size}, out: DIR, mode: "artifact" | "callable",
artifact: DIR, dtypes: ["bf16", "fp32"], workload: [scenario, ...] | callable: "module:function",
compile: bool, jobs: parallel compiles (default: the CPU count, at most 8)}. A scenario is
{prompts: [lengths], decode: steps, verify: draft length} (workload.py).

1. Record (record.py): run the workload through the artifact's kernels (or call the callable), with
   launches recorded as specialisations for the target and nothing computed on a device.
2. Compile each specialisation (in `jobs` forked processes) with `triton.compile(ASTSource(fn, signature,
   constexprs, attrs), target=GPUTarget(...), options=...)`, exactly what the JIT would compile on that device.
3. Write OUT/<key>/<name>.{json, cubin|hsaco, ptx|amdgcn} and OUT/worker.json: Triton version,
   every specialisation (description, files, compile seconds, launches, where first seen) and errors.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
import traceback

BINARY = {"cuda": ("cubin", "ptx"), "hip": ("hsaco", "amdgcn")}


def _load_request(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def device_like_weights(weights: dict) -> dict:
    """Every weight in a fresh allocation, as the live run's copies to the device are.

    Triton specialises pointers on 16-byte alignment; safetensors loads tensors as views into the file
    at arbitrary offsets, while `.to("cuda")` allocates (256-byte aligned). Recording from the file's views
    would record unaligned weight pointers the device never launches with."""
    import torch

    from ir.packed import PackedMXFP4

    out = {}
    for name, w in weights.items():
        if isinstance(w, PackedMXFP4):
            out[name] = PackedMXFP4(w.packed.clone(), w.scales.clone())
        else:
            out[name] = w.clone() if isinstance(w, torch.Tensor) else w
    return out


def _run_workload(req: dict, recorder) -> list[str]:
    """Drive the artifact's entry functions (prefill / decode / verify) through a RecordingExecutor."""
    import torch

    from codegen.aot.record import recording_executor_class
    from codegen.aot.workload import run_scenario
    from k31c.compiler import load_artifact

    art = load_artifact(req["artifact"], check_live=False)
    if art.weights is None:
        raise ValueError(f"artifact {req['artifact']} has no weights: its launches cannot be recorded "
                         f"(compile from a checkpoint or a preset small enough to carry weights)")
    weights = device_like_weights(art.weights)
    Recording = recording_executor_class()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    done = []
    for dname in req["dtypes"]:
        for si, sc in enumerate(req["workload"]):
            recorder.label = f"{dname} scenario {si} {sc}"
            eng = Recording(art.module, weights, art.choices, target=req["target_name"], configs=art.configs,
                            batch_invariant=art.manifest["options"].get("batch_invariant", False),
                            compute_dtype=dtypes[dname], device="cpu", recorder=recorder)
            run_scenario(art.module, weights, eng, sc, si)
            done.append(recorder.label)
    return done


def _compile(spec, target, out: str) -> dict:
    from triton.compiler import ASTSource, compile as triton_compile

    jitfn, signature, constexprs, attrs, options = spec.compile_args
    t0 = time.perf_counter()
    kernel = triton_compile(ASTSource(jitfn, signature, constexprs, attrs), target=target, options=dict(vars(options)))
    secs = time.perf_counter() - t0
    group = {os.path.basename(f): p for f, p in kernel.metadata_group.items()}  # Triton's cache files
    binary, asm = BINARY[target.backend]
    dest = os.path.join(out, spec.key)
    os.makedirs(dest, exist_ok=True)
    files = {}
    for ext in ("json", binary, asm):
        name = f"{kernel.name}.{ext}"
        if name not in group:
            raise FileNotFoundError(f"Triton wrote no {ext} for {kernel.name} (files: {sorted(group)})")
        shutil.copyfile(group[name], os.path.join(dest, name))
        files[ext] = name
    md = kernel.metadata
    return {"key": spec.key, **spec.description, "kernel_name": kernel.name, "files": files,
            "shared": int(getattr(md, "shared", 0)), "num_warps": int(md.num_warps),
            "num_stages": int(getattr(md, "num_stages", 0)), "compile_s": round(secs, 3),
            "launches": spec.launches, "first_seen": spec.first_seen}


_JOBS: dict = {}  # what the compile jobs read (set before forking)


def _compile_job(i: int) -> tuple[bool, dict]:
    """Compile specialisation i: (True, index entry) or (False, error) — a failure loses no other kernel."""
    spec = _JOBS["specs"][i]
    try:
        return True, _compile(spec, _JOBS["target"], _JOBS["out"])
    except Exception as e:
        root = e
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        why = f"{type(e).__name__}: {e}" + (f" (cause: {type(root).__name__}: {root})" if root is not e else "")
        return False, {"key": spec.key, "function": spec.description["function"], "error": why[-2000:],
                       "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        print("codegen.aot.worker: TRITON_INTERPRET is set: an interpreting process cannot compile ahead of time",
              file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"  # codegen/triton/__init__ would choose the interpreter without a GPU
    req = _load_request(argv[0])
    import triton
    from triton.backends.compiler import GPUTarget

    from codegen.aot.record import Recorder

    t = req["target"]
    target = GPUTarget(t["backend"], t["arch"], t["warp_size"])
    out = req["out"]
    os.makedirs(out, exist_ok=True)
    result = {"triton": triton.__version__, "triton_path": os.path.dirname(os.path.dirname(triton.__file__)),
              "python": sys.version.split()[0], "target": t, "kernels": [], "errors": [], "recorded": []}
    t0 = time.perf_counter()
    with Recorder(target) as rec:
        if req["mode"] == "artifact":
            result["recorded"] = _run_workload(req, rec)
        else:
            mod, fn = req["callable"].split(":")
            rec.label = req["callable"]
            getattr(importlib.import_module(mod), fn)()
            result["recorded"] = [req["callable"]]
    result["record_s"] = round(time.perf_counter() - t0, 3)
    specs = list(rec.specs.values())
    if not req.get("compile", True):
        result["kernels"] = [{"key": s.key, **s.description, "launches": s.launches, "first_seen": s.first_seen}
                             for s in specs]
        specs = []
    _JOBS.update(specs=specs, target=target, out=out)
    jobs = max(1, min(len(specs), int(req.get("jobs") or os.cpu_count() or 1), 8))
    if jobs > 1 and hasattr(os, "fork"):  # forked children inherit the recorded JIT functions
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(jobs)
        outcomes = pool.imap(_compile_job, range(len(specs)))
    else:
        pool, outcomes = None, map(_compile_job, range(len(specs)))
    for i, (ok, entry) in enumerate(outcomes):
        result["kernels" if ok else "errors"].append(entry)
        print(f"aot: {i + 1}/{len(specs)} {specs[i].description['name']}", file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
        pool.join()
    result["jobs"] = jobs
    result["total_s"] = round(time.perf_counter() - t0, 3)
    with open(os.path.join(out, "worker.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
