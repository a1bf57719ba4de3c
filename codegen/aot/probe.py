"""A small set of real project launches, used to build and check binaries without a whole artifact.

`probe_launches(device)` runs a bf16 GEMM (`codegen.triton.gemm.gemm`: y = x @ w^T, fp32 accumulate)
and the KDA forget gate (`codegen.triton._kda_common.kda_gate`: g = lower_bound * sigmoid(exp(A_log[h])
* (f + dt_bias)), fp32) on seeded random inputs and returns {name: (kernel result, float64 reference)}.
On the CPU inside the AOT worker (`record`) the launches are only recorded; on a GPU the results are real
and compared with the references (`check`).
"""

from __future__ import annotations

import torch

GEMM_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def probe_launches(device: str = "cpu", seed: int = 0) -> dict:
    from codegen.triton._kda_common import kda_gate
    from codegen.triton.gemm import gemm
    from ir.ref.kda import kda_gate as kda_gate_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 256, generator=g).to(device, torch.bfloat16)
    w = torch.randn(160, 256, generator=g).to(device, torch.bfloat16)
    y = gemm(x, w, GEMM_CONFIG)
    y_ref = x.double() @ w.double().T
    H, D, T = 4, 32, 24
    f = torch.randn(T, H * D, generator=g).to(device, torch.bfloat16)
    a_log, dt_bias = torch.randn(H, generator=g).to(device), torch.randn(H * D, generator=g).to(device)
    gate = kda_gate(f, a_log, dt_bias, -5.0)
    gate_ref = kda_gate_ref(f.double(), a_log.double(), dt_bias.double(), -5.0)
    return {"gemm": (y, y_ref), "kda_gate": (gate, gate_ref)}


def record():
    """The worker's callable: launches on CPU tensors (recorded, not run)."""
    probe_launches("cpu")


def check(device: str = "cuda") -> dict:
    """{name: relative error ||out - ref|| / ||ref||} of the probe launches on `device`."""
    out = {}
    for name, (y, ref) in probe_launches(device).items():
        y64 = y.double().reshape(ref.shape)
        err = float((y64 - ref).norm() / ref.norm())
        out[name] = err if torch.isfinite(y64).all() else float("nan")
    return out
