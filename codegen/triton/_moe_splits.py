"""Split-K reductions of the grouped expert GEMMs (moe_grouped_gemm.py, config SPLIT / SPLIT2 > 1): the
gate-up kernel's fp32 partial sums of W1 z and W3 z reduced in split order before the activation, and
the down kernel's fp32 partials reduced inside the weighted slot-order combine. Not a kernel family
(no TEMPLATES). Both keep the PDL contract (codegen/triton/_pdl.py): they read only earlier kernels' outputs,
so every program waits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.triton._moe_tiles import _glu
from codegen.triton._pdl import launch_kwargs, pdl_enter


@triton.jit
def _glu_splits_kernel(part_ptr, h_ptr, R, INTER, stride_split, up_off, stride_row, stride_h, beta1, beta2,
                       SPLIT: tl.constexpr, ACT: tl.constexpr, HAS_BETA2: tl.constexpr, BR: tl.constexpr,
                       BI: tl.constexpr, PDL: tl.constexpr):
    """h[r] = act(Σ_s a_s[r], Σ_s u_s[r]) in h's dtype, from the split gate-up kernel's fp32 partials
    (a_s at part[s·stride_split + r·stride_row], u_s up_off further; summed in split order)."""
    pdl_enter(PDL)
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    ri = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (rr < R)[:, None] & (ri < INTER)[None, :]
    ptr = part_ptr + rr.to(tl.int64)[:, None] * stride_row + ri[None, :]
    a = tl.zeros([BR, BI], dtype=tl.float32)
    u = tl.zeros([BR, BI], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        a += tl.load(ptr + s * stride_split, mask=m, other=0.0)
        u += tl.load(ptr + s * stride_split + up_off, mask=m, other=0.0)
    h = _glu(a, u, beta1, beta2, ACT, HAS_BETA2)
    tl.store(h_ptr + rr.to(tl.int64)[:, None] * stride_h + ri[None, :], h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_splits_kernel(o_ptr, w_ptr, ids_ptr, y_ptr, T, E, ELL, stride_os, stride_o, stride_y,
                           TOPK: tl.constexpr, SPLIT: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr,
                           PDL: tl.constexpr = False):     # default: moe_tail.combine's plain launch
    """y[t] = Σ_j w[t,j] · Σ_s o[s, t·k+j] (fp32; slots in order, splits in order; ids outside [0, E) add 0)."""
    pdl_enter(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    t_ok = rt < T
    l_ok = rl < ELL
    y = tl.zeros([BT, BL], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pj = rt.to(tl.int64) * TOPK + j
        ej = tl.load(ids_ptr + pj, mask=t_ok, other=-1)
        wj = tl.load(w_ptr + pj, mask=t_ok, other=0.0).to(tl.float32)
        m = (t_ok & (ej >= 0) & (ej < E))[:, None] & l_ok[None, :]
        oj = tl.zeros([BT, BL], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            oj += tl.load(o_ptr + s * stride_os + pj[:, None] * stride_o + rl[None, :], mask=m, other=0.0)
        y += wj[:, None] * oj
    tl.store(y_ptr + rt.to(tl.int64)[:, None] * stride_y + rl[None, :], y, mask=t_ok[:, None] & l_ok[None, :])


def combine_pairs(o: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """y f32 [T, ℓ] = Σ_j w[t,j]·o[t·k+j] for expert_pair_outputs' o: per-pair rows [T·k, ℓ] (moe_tail's
    combine) or fp32 split partials [S, T·k, ℓ], summed in split order inside the slot sum."""
    if o.dim() == 2:
        from codegen.triton.moe_tail import combine  # the weighted combine lives with the tail (no import cycle)
        return combine(o, weights, ids, num_experts)
    T, K = ids.shape
    ell = o.shape[-1]
    y = torch.empty(T, ell, dtype=torch.float32, device=o.device)
    if T and ell:
        ids = ids if ids.is_contiguous() else ids.contiguous()
        weights = weights if weights.is_contiguous() else weights.contiguous()
        bt, bl = min(4, triton.next_power_of_2(T)), min(1024, triton.next_power_of_2(ell))
        _combine_splits_kernel[(triton.cdiv(T, bt), triton.cdiv(ell, bl))](
            o, weights, ids, y, T, num_experts, ell, o.stride(0), o.stride(1), y.stride(0),
            TOPK=K, SPLIT=o.shape[0], BT=bt, BL=bl, num_warps=4, **launch_kwargs())
    return y
