"""The CUDA context's L2 fetch granularity: how many bytes an L2 miss brings from HBM (driver limit
CU_LIMIT_MAX_L2_FETCH_GRANULARITY; a per-context hint, 64 bytes by default on the H200, ending with the process).

The runtime sets RUNTIME_BYTES on the device it runs on (`Executor` on cuda): the routed experts' MXFP4 kernels read
32-byte row pieces a K step, which at 64 bytes leave half of each fetched sector pair unused until the next step.
H200, session 15, the rank decode graph at 8K (benches/results/h200-2026-11-30-s15/, graph replay device time, two
rounds each, 64 -> 128 bytes): runtime_l2fetch.json batch 1 545.5 / 544.9 -> 546.0 / 545.6 us (no change), batch 8
1069.3 / 1069.0 -> 992.0 / 998.1 (-7%), batch 64 2287.7 / 2326.5 -> 2270.7 / 2283.0; runtime_final.json (the final
tree) batch 1 558.0 / 553.3 -> 554.5 / 553.0, batch 8 1072.7 / 1071.2 -> 992.4 / 997.7, batch 64 2486.0 / 2502.4 ->
2205.2 / 2214.3 (-11%). The grouped gate-up in Gluon at T=64 (`_moe_configs.GLUON_T64`, the MoE heuristic's under
this setting): batch 64 2231.9 / 2215.3 and 2221.0 / 2220.0 against the Triton one's 2270.7 / 2283.0 and 2205.2 /
2214.3 in the same runs; the op alone 0.891 vs 0.942 ms at 128 bytes (0.962 vs 0.947 at 64;
moe_t64_gluon_l2fetch.json).
"""

from __future__ import annotations

import ctypes

RUNTIME_BYTES = 128
_LIMIT = 5          # CU_LIMIT_MAX_L2_FETCH_GRANULARITY


class L2FetchError(RuntimeError):
    pass


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def l2_fetch_granularity(value: int | None = None) -> int:
    """The current CUDA context's L2 fetch granularity in bytes; set to `value` first when given (after a device
    synchronisation, so kernels in flight keep the setting they started under). Returns the value before."""
    cu = _driver()
    cu.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    cu.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    before = ctypes.c_size_t()
    rc = cu.cuCtxGetLimit(ctypes.byref(before), _LIMIT)
    if rc:
        raise L2FetchError(f"cuCtxGetLimit(L2 fetch granularity) failed with CUresult {rc}: no current CUDA context?")
    if value is not None:
        if value not in (0, 32, 64, 128):
            raise L2FetchError(f"L2 fetch granularity {value} bytes: expected 0, 32, 64 or 128")
        import torch
        torch.cuda.synchronize()
        rc = cu.cuCtxSetLimit(_LIMIT, value)
        if rc:
            raise L2FetchError(f"cuCtxSetLimit(L2 fetch granularity, {value}) failed with CUresult {rc}")
    return before.value


def set_for_runtime(device) -> int | None:
    """Put RUNTIME_BYTES on `device`'s context (made current; a torch.device or its string). None off cuda; returns
    the value before."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        torch.cuda.init()
        torch.empty(1, device=device)   # the primary context exists and is current
        return l2_fetch_granularity(RUNTIME_BYTES)
