"""End-to-end checks and timings of the whole tiny model on a GPU, one JSON document.

1. the reference interpreter on the GPU (fp32) vs on the CPU (fp64): prefill + decode logits;
2. a compiled artifact (target h200: Triton kernels) on the GPU in fp32 and bf16 vs the CPU reference;
3. batch-invariant mode on the GPU: a request alone vs inside a batch of 5 other random requests,
   bitwise (and the default mode, to show the check can fail);
4. per-step wall time of reference vs compiled execution (host overhead dominates at this size).

Run from the repository root: `PYTHONPATH=. python benches/gpu_e2e.py` (writes $OUT/gpu_e2e.json).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
import traceback

import torch


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def machine():
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "command": " ".join(sys.argv)}


def run_steps(rt, prompts, decode_steps):
    """Prefill all prompts together, then decode_steps steps of every request; first request's rows."""
    for i, p in enumerate(prompts):
        rt.add_request(f"r{i}", len(p) + decode_steps + 1)
    logits = rt.prefill({f"r{i}": p for i, p in enumerate(prompts)})
    rows, times = [logits[:len(prompts[0])]], []
    for s in range(decode_steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = rt.decode({f"r{i}": (13 * s + 7 * i) % 256 for i in range(len(prompts))})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        rows.append(out[:1])
    return torch.cat(rows).float().cpu(), times


def main():
    from k31c.compiler import CompileOptions, compile_model, load_artifact
    from k31c.model.build import build_module
    from k31c.model.init_weights import random_weights
    from k31c.model.presets import get_preset
    from k31c.plan import plan_options
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime

    res = {"bench": "gpu_e2e", "machine": machine(), "checks": {}, "timings": {}, "errors": []}
    cfg = get_preset("k31-tiny")
    weights = random_weights(cfg, 0)
    module = build_module(cfg)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    others = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in (5, 17, 9, 33, 12)]
    steps = 4

    ref_rt = ReferenceRuntime(module, weights, max_rows=512, max_requests=8, compute_dtype=torch.float64)
    ref, _ = run_steps(ref_rt, [prompt], steps)

    def section(name, fn):
        try:
            fn()
        except Exception as e:  # report and go on: one call, several sections
            res["errors"].append({"section": name, "error": f"{type(e).__name__}: {e}",
                                  "trace": traceback.format_exc()[-2000:]})

    def interp_gpu():
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            rt = ReferenceRuntime(module, weights, max_rows=512, max_requests=8, device="cuda", compute_dtype=dtype)
            out, t = run_steps(rt, [prompt], steps)
            res["checks"][f"reference_interpreter_gpu_{name}_vs_cpu_fp64"] = rel(out, ref)
            res["timings"][f"reference_{name}_decode_step_ms"] = 1e3 * sorted(t)[len(t) // 2]

    art_dir = tempfile.mkdtemp()

    def compiled(bi: bool, path: str):
        opts = CompileOptions(plan=plan_options("k31-tiny", target="h200"), batch_invariant=bi)
        compile_model(cfg, weights, path, opts, model_source="preset k31-tiny (seed 0)")
        return load_artifact(path)

    def compiled_gpu():
        art = compiled(False, os.path.join(art_dir, "a"))
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            eng = Executor(art.module, art.weights, art.choices, target="h200", configs=art.configs,
                           compute_dtype=dtype, device="cuda")
            rt = ReferenceRuntime(art.module, art.weights, max_rows=512, max_requests=8, engine=eng)
            out, t = run_steps(rt, [prompt], steps)
            res["checks"][f"compiled_gpu_{name}_vs_cpu_fp64"] = rel(out, ref)
            res["timings"][f"compiled_{name}_decode_step_ms"] = 1e3 * sorted(t)[len(t) // 2]
            res["timings"][f"compiled_{name}_kernel_launches"] = eng.stats()["kernel_launches"]
            res["checks"][f"compiled_{name}_nodes_on_side_stream"] = eng.stats()["overlapped_nodes"]
        res["checks"]["kernel_families_selected"] = sorted({c.template.family for c in art.choices if c.template})

    def batch_invariance():
        art = compiled(True, os.path.join(art_dir, "bi"))
        for bi in (True, False):
            outs = []
            for batch in ([prompt], [prompt] + others):
                eng = Executor(art.module, art.weights, art.choices, target="h200", configs=art.configs,
                               batch_invariant=bi, compute_dtype=torch.bfloat16, device="cuda")
                rt = ReferenceRuntime(art.module, art.weights, max_rows=1024, max_requests=8, engine=eng)
                outs.append(run_steps(rt, batch, steps)[0])
            res["checks"][f"alone_vs_batch_bitwise_equal_bi_{bi}"] = bool(torch.equal(outs[0], outs[1]))
            res["checks"][f"alone_vs_batch_max_abs_diff_bi_{bi}"] = float((outs[0] - outs[1]).abs().max())

    wanted = os.environ.get("GPU_E2E_SECTIONS", "interpreter_gpu,compiled_gpu,batch_invariance").split(",")
    for name, fn in (("interpreter_gpu", interp_gpu), ("compiled_gpu", compiled_gpu),
                     ("batch_invariance", batch_invariance)):
        if name in wanted:
            section(name, fn)
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_e2e.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
