"""One eager call of the grouped expert kernels at issue 5's decode shape (T=64 tokens, top-16 of 112 experts,
MXFP4, l=3584, I=3072, bf16), for a profiler: a warm-up call (compiles), then the profiled call. Config: the
H200 heuristic's, updated by the JSON in MOE_PROFILE_CFG. Under Nsight Compute, skip the warm-up's two
grouped launches:

    ncu --clock-control none --kernel-name regex:_moe_ --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis python3 benches/moe_t64_profile.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen.triton import moe_grouped_gemm as gg  # noqa: E402
from codegen.triton import moe_router as mr  # noqa: E402
from ir.packed import PackedMXFP4  # noqa: E402

E, T, K, ELL, INTER = 112, 64, 16, 3584, 3072


def main():
    if not torch.cuda.is_available():
        raise SystemExit("moe_t64_profile: needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)

    def mx(n, k):
        return PackedMXFP4(torch.randint(0, 256, (E, n, k // 2), generator=g, device="cuda", dtype=torch.uint8),
                           torch.randint(119, 122, (E, n, k // 32), generator=g, device="cuda", dtype=torch.uint8))

    w1, w3, w2 = mx(INTER, ELL), mx(INTER, ELL), mx(ELL, INTER)
    z = torch.randn(T, ELL, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = mr.router(torch.randn(T, E, generator=g, device="cuda"), torch.randn(E, generator=g, device="cuda") * 0.1,
                       K, "sigmoid", True, 1.0)
    cfg = {**gg.heuristic(gg.bucket(gg._key(T, E, K, ELL, INTER, True, torch.bfloat16, {})), "h200"),
           **json.loads(os.environ.get("MOE_PROFILE_CFG", "{}"))}
    seg = mr.permute_tokens(ids, E)
    for _ in range(2):      # warm-up (compiles), then the profiled call
        gg.expert_pair_outputs(z, ids, w1, w2, w3, "situ", 4.0, 25.0, cfg, seg)
        torch.cuda.synchronize()
    print(json.dumps({"config": cfg, "live_experts": int((seg.counts > 0).sum()),
                      "tiles_16": int(((seg.counts + 15) // 16).sum())}))


if __name__ == "__main__":
    main()
