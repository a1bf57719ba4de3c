"""How much does bf16 storage alone move k31-tiny's logits? The reference interpreter computes every op in
fp32 but rounds each value the IR declares bf16 to bf16 when it is produced (what the runtime stores
between kernels); compared with fp64 and plain fp32 on one prefill. This is the yardstick for the compiled
bf16 run (benches/gpu_e2e.py, benches/bf16_bisect.py): random tiny weights amplify rounding layer by layer.
Run: `PYTHONPATH=. python benches/bf16_storage_reference.py` (CPU is fine)."""

from __future__ import annotations

import json

import torch

from ir.interpreter import Interpreter
from k31c.model.build import build_module
from k31c.model.init_weights import random_weights
from k31c.model.presets import get_preset
from k31c.runtime.reference import ReferenceRuntime


class Bf16StorageInterpreter(Interpreter):
    def _execute(self, n, args, env):
        outs = super()._execute(n, args, env)
        return [t.to(torch.bfloat16).to(t.dtype) if v.type.dtype.name == "bf16" and t.is_floating_point() else t
                for v, t in zip(n.outputs, outs)]


def main():
    cfg = get_preset("k31-tiny")
    weights, module = random_weights(cfg, 0), build_module(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engines = {"fp64": Interpreter(module, weights, torch.float64),
               "fp32": Interpreter(module, weights, torch.float32),
               "bf16_storage": Bf16StorageInterpreter(module, weights, torch.float32)}
    logits = {}
    for name, eng in engines.items():
        rt = ReferenceRuntime(module, weights, max_rows=64, max_requests=1, engine=eng)
        rt.add_request("r", 48)
        logits[name] = rt.prefill({"r": prompt}).double()
    ref = logits["fp64"]
    print(json.dumps({f"{k}_vs_fp64": float((v - ref).norm() / ref.norm()) for k, v in logits.items() if k != "fp64"}))


if __name__ == "__main__":
    main()
