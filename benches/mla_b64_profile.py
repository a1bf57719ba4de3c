"""One eager call of the sparse MLA decode launcher at issue 4's shape (batch 64, 12 heads, top-2048 FP8 latent rows
of 8K contexts: bench_mla_b64.py's inputs), for a profiler: a warm-up call (compiles), then the profiled call. Config:
the H200 heuristic's (ORIENT 3, `_mla_gluon.py`), updated by the JSON in MLA_PROFILE_CFG. Under Nsight Compute,
profile the Gluon kernel of the second call (stall reasons: is the per-step chain waiting on the gathers, the wgmmas
or the softmax's barriers?):

    ncu --clock-control none --kernel-name regex:_mla_gluon --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        --section SourceCounters --section MemoryWorkloadAnalysis python3 benches/mla_b64_profile.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _attention_checks import mla_call, mla_set  # noqa: E402

from codegen.triton.mla_sparse import heuristic  # noqa: E402


def main():
    if not torch.cuda.is_available():
        raise SystemExit("mla_b64_profile: needs a CUDA device (the ORIENT 3 kernel is Gluon, sm_90)")
    cfg = {**heuristic({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "sparse": 1, "T": 64, "bi": 0}, "h200"),
           **json.loads(os.environ.get("MLA_PROFILE_CFG", "{}"))}
    run = mla_call(mla_set(64, 8192, 2048, seed=7), cfg)
    run()                      # compiles
    torch.cuda.synchronize()
    o, lse = run()             # the profiled call
    torch.cuda.synchronize()
    if not (torch.isfinite(o).all() and torch.isfinite(lse).all()):
        raise SystemExit("mla_b64_profile: non-finite output")
    print(json.dumps({"config": cfg, "out": list(o.shape), "lse": list(lse.shape)}))


if __name__ == "__main__":
    main()
