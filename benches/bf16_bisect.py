"""Where does the compiled model's bf16 run leave the fp32 run? Runs one prefill of k31-tiny through
the compiled kernels twice (compute dtype fp32, then bf16) with the same inputs, records every node's
results, and prints the nodes in execution order with their relative difference: the first node whose
error jumps is where to look. Run on a GPU: `PYTHONPATH=. python benches/bf16_bisect.py`
(writes $OUT/bf16_bisect.json)."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from k31c.compiler import CompileOptions, compile_model, load_artifact
from k31c.model.init_weights import random_weights
from k31c.model.presets import get_preset
from k31c.plan import plan_options
from k31c.runtime.executor import Executor
from k31c.runtime.reference import ReferenceRuntime


class RecordingExecutor(Executor):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.trace: list[tuple[str, str, torch.Tensor]] = []

    def _execute(self, n, args, env):
        outs = super()._execute(n, args, env)
        for v, t in zip(n.outputs, outs):
            if t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
                self.trace.append((v.name, n.op, t.detach().float().cpu().clone()))
        return outs


def main():
    cfg = get_preset("k31-tiny")
    weights = random_weights(cfg, 0)
    path = os.path.join(tempfile.mkdtemp(), "a")
    compile_model(cfg, weights, path, CompileOptions(plan=plan_options("k31-tiny", target="h200")))
    art = load_artifact(path)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    traces = {}
    for dtype in (torch.float32, torch.bfloat16):
        eng = RecordingExecutor(art.module, art.weights, art.choices, target="h200", configs=art.configs,
                                compute_dtype=dtype, device="cuda")
        rt = ReferenceRuntime(art.module, art.weights, max_rows=128, max_requests=1, engine=eng)
        rt.add_request("r", 48)
        rt.prefill({"r": prompt})
        traces[str(dtype)] = eng.trace
    a, b = traces["torch.float32"], traces["torch.bfloat16"]
    rows = []
    for (name, op, x), (name2, _, y) in zip(a, b):
        assert name == name2, (name, name2)
        den = x.norm().item()
        err = (y - x).norm().item() / den if den > 0 else float("nan")
        rows.append({"value": name, "op": op, "rel_err": err})
    out = {"nodes": len(rows), "first_over_5pct": [r for r in rows if r["rel_err"] > 0.05][:20],
           "all": rows}
    print(json.dumps(out["first_over_5pct"], indent=1))
    for r in rows[:400:4]:
        print(f"{r['value']:<40} {r['op']:<28} {r['rel_err']:.3e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bf16_bisect.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
