"""A small set of real project launches, used to build and check binaries without a whole artifact.

`probe_launches(device)` runs a bf16 GEMM (`codegen.triton.gemm.gemm`: y = x @ w^T, fp32 accumulate), its
one-row decode GEMV form, the packed GEMV with a SiTU-GLU epilogue (`packed_glu`) and the KDA forget gate (`codegen.triton._kda_common.kda_gate`: g = lower_bound *
sigmoid(exp(A_log[h]) * (f + dt_bias)), fp32) on seeded random inputs and returns {name: (kernel result,
float64 reference)}.
On the CPU inside the AOT worker (`record`) the launches are only recorded; on a GPU the results are real
and compared with the references (`check`).
"""

from __future__ import annotations

import torch

GEMM_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
# the decode GEMV (one row, dot-free, K loop pipelined; under PDL its first weight tile loads before the wait)
GEMV_CONFIG = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "GEMV": 1, "num_warps": 4,
               "num_stages": 3}


def probe_launches(device: str = "cpu", seed: int = 0) -> dict:
    from codegen.triton._kda_common import kda_gate
    from codegen.triton.gemm import gemm
    from codegen.triton.packed_glu import packed_linear_glu
    from ir.ref.basic import situ_glu as situ_glu_ref
    from ir.ref.kda import kda_gate as kda_gate_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 256, generator=g).to(device, torch.bfloat16)
    w = torch.randn(160, 256, generator=g).to(device, torch.bfloat16)
    y = gemm(x, w, GEMM_CONFIG)
    y_ref = x.double() @ w.double().T
    y1 = gemm(x[:1], w, GEMV_CONFIG)
    H, D, T = 4, 32, 24
    f = torch.randn(T, H * D, generator=g).to(device, torch.bfloat16)
    a_log, dt_bias = torch.randn(H, generator=g).to(device), torch.randn(H * D, generator=g).to(device)
    gate = kda_gate(f, a_log, dt_bias, -5.0)
    gate_ref = kda_gate_ref(f.double(), a_log.double(), dt_bias.double(), -5.0)
    ws = [w[:32], w[32:96], w[96:]]  # plain 32 rows, gate and up of 64: the FFN GEMM with its GLU epilogue
    z, act = packed_linear_glu(x[:1], ws, [32, 64, 64], "situ_glu", GEMV_CONFIG, 4.0, 25.0)
    z_ref, gu = y_ref[:1, :32], y_ref[:1, 32:].to(torch.bfloat16).double()  # gate/up rounded as stored
    act_ref = situ_glu_ref(gu[:, :64], gu[:, 64:], 4.0, 25.0)
    return {"gemm": (y, y_ref), "gemv": (y1, y_ref[:1]), "glu_gemv": (act, act_ref), "glu_plain": (z, z_ref),
            "kda_gate": (gate, gate_ref)}


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
