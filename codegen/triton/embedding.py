"""`embedding`: y[t, :] = table[ids[t], :] (ids of any shape; a negative id counts from the end, as
torch indexing does; ids are validated against the vocabulary by the runtime before a step).

A program copies BLOCK_R rows x BLOCK_D columns. Worth a template: the H200 bench
(benches/bench_decode_fallbacks.py) found it faster than torch's `table[ids]` inside a CUDA graph at the
rank preset's decode shapes (7168-wide bf16 rows of a 20480-row table): 1.38 vs 3.07 µs at batch 1,
1.51 vs 1.64 µs at batch 8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._pdl import launch_kwargs, pdl_enter



@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, y_ptr, T, V, D, stride_t, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = rows < T
    idx = tl.load(ids_ptr + rows, mask=r_ok, other=0).to(tl.int64)
    idx = tl.where(idx < 0, idx + V, idx)
    ok = r_ok[:, None] & (cols[None, :] < D)
    v = tl.load(table_ptr + idx[:, None] * stride_t + cols[None, :], mask=ok, other=0.0)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], v, mask=ok)


def embedding(table: torch.Tensor, ids: torch.Tensor, config: dict) -> torch.Tensor:
    if table.dim() != 2 or table.stride(-1) != 1:
        raise ValueError(f"embedding: table must be 2-D with unit-stride rows, found {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"embedding: ids must be integers, found {ids.dtype}")
    V, D = table.shape
    flat = ids.reshape(-1).contiguous()
    y = torch.empty(flat.numel(), D, dtype=table.dtype, device=table.device)
    if flat.numel():
        br, bd = config["BLOCK_R"], config["BLOCK_D"]
        _embedding_kernel[(triton.cdiv(flat.numel(), br), triton.cdiv(D, bd))](
            flat, table, y, flat.numel(), V, D, table.stride(0), BLOCK_R=br, BLOCK_D=bd, num_warps=config["num_warps"],
            **launch_kwargs())
    return y.reshape(*ids.shape, D)


def _key(a, attrs) -> dict:
    t = 1
    for d in a.ids.shape:
        t *= int(d)
    return {"T": t, "D": int(a.table.shape[1])}


def _heuristic(key: dict, target: str) -> dict:
    """GPU (H200, 7168-wide bf16 rows): one row per program, 2048 columns for T <= 4 (1.38 µs at T = 1),
    1024 beyond (1.51 µs at T = 8), 8 warps. cpu (interpreter): 16 rows per program."""
    if target == "cpu":
        return {"BLOCK_R": 16, "BLOCK_D": min(pow2_bucket(key["D"]), 4096), "num_warps": 4}
    return {"BLOCK_R": 1, "BLOCK_D": min(pow2_bucket(key["D"]), 2048 if key["T"] <= 4 else 1024), "num_warps": 8}


def _supports(a, attrs, target) -> str | None:
    name = getattr(a.table.dtype, "name", str(a.table.dtype))
    if getattr(a.table.dtype, "is_packed", False):
        return f"table dtype {name} is packed"
    if len(a.table.shape) != 2 or not getattr(a.table.shape[1], "is_number", True):
        return f"table {a.table} must be 2-D with a static row width"
    return None


TEMPLATES = [
    KernelTemplate(
        family="embedding", backend="triton", ops=("embedding",),
        launch=lambda a, attrs, config: embedding(a.table, a.ids, config), key_dims=_key, heuristic=_heuristic,
        tunables=(Tunable("BLOCK_R", (1, 2, 4, 8, 16)), Tunable("BLOCK_D", (512, 1024, 2048, 4096)),
                  Tunable("num_warps", (1, 2, 4, 8))),
        bucket=lambda key: {"T": pow2_bucket(key["T"]), "D": key["D"]},
        constraints=lambda config, key, target: [] if config["BLOCK_R"] * config["BLOCK_D"] <= 32768 else
        ["tile BLOCK_R*BLOCK_D > 32768 values"],
        supports=_supports, batch_invariant=True, doc="y[t] = table[ids[t]], one program per row tile"),
]
