"""Measured HBM read bandwidth: a Triton kernel that only reads (each program sums BLOCK x ITERS contiguous fp32, one
store a program), the ceiling of read-dominated byte floors (bench_moe.py's ceilings; bench_runtime_gpu.py's decode
step, which reads ~100x what it writes, beside the copy bandwidth it used before). Imported once the bench has
chosen the interpreter or the GPU (the kernel is defined at import)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benches._report import event_ms


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_fn(x: torch.Tensor, block: int = 4096, iters: int = 16):
    """A callable reading all of fp32 `x` (numel a multiple of block x iters) once."""
    part = torch.empty(x.numel() // (block * iters), device=x.device)
    return lambda: _read_kernel[(part.numel(),)](x, part, BLOCK=block, ITERS=iters, num_warps=8)


def read_bandwidth_GBps(device, nbytes: int = 1 << 31) -> float:
    """Read bytes / time of `read_fn` over `nbytes`, timed by events after one warm-up (`_report.event_ms`; GPU)."""
    x = torch.empty(nbytes // 4, device=device).uniform_()
    fn = read_fn(x)
    fn()
    return nbytes / (event_ms(fn) * 1e-3) / 1e9
