"""KDA chunked prefill, kernel 2 (`kda_prefill.py` has the math): one program per (request, head, Dv block),
sequential over the request's chunks with the state S in registers (fp32). Per chunk, from kernel 1's workspace
(W, U, QG = scale q e^G, KG = k e^{G_C - G} [64, D], Aqk [64, 64], G_C [D]):
    d = U - W S,   o = QG S + Aqk d,   S <- diag(e^{G_C}) S + KG^T d
writes o, the optional checkpoint states (after chunks marked in ck_index) and the final state back to the pool
row `state_slot[r]` in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.triton import _precision as precision


@triton.jit
def _kda_state_kernel(W, U, QG, KG, AQK, GL, o, s_o, state, slots, chunk_start, chunk_len, req_chunks,
                      CK, ck_index, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      HAS_CK: tl.constexpr, PREC: tl.constexpr):
    r, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + r).to(tl.int64)
    c_lo, c_hi = tl.load(req_chunks + r).to(tl.int64), tl.load(req_chunks + r + 1).to(tl.int64)
    dk = tl.arange(0, D)
    cv = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, 64)
    sp = state + ((slot * H + h) * D + dk[:, None]) * DV + cv[None, :]
    S = tl.load(sp).to(tl.float32)
    for c in range(c_lo, c_hi):
        base = c * H + h  # int64 (the loop bounds are)
        t0 = tl.load(chunk_start + c).to(tl.int64)
        L = tl.load(chunk_len + c)
        w = tl.load(W + (base * 64 + rows[:, None]) * D + dk[None, :])
        qg = tl.load(QG + (base * 64 + rows[:, None]) * D + dk[None, :])
        kg = tl.load(KG + (base * 64 + rows[:, None]) * D + dk[None, :])
        u = tl.load(U + (base * 64 + rows[:, None]) * DV + cv[None, :]).to(tl.float32)
        aqk = tl.load(AQK + (base * 64 + rows[:, None]) * 64 + rows[None, :])
        gl = tl.exp(tl.load(GL + base * D + dk))
        sd = S.to(w.dtype)
        d = u - tl.dot(w, sd, input_precision=PREC)
        dd = d.to(w.dtype)
        out = tl.dot(aqk, dd, tl.dot(qg, sd, input_precision=PREC), input_precision=PREC)
        tl.store(o + (t0 + rows)[:, None] * s_o + h * DV + cv[None, :], out.to(o.dtype.element_ty),
                 mask=(rows < L)[:, None])
        S = S * gl[:, None] + tl.dot(tl.trans(kg), dd, input_precision=PREC)
        if HAS_CK:
            ci = tl.load(ck_index + c)
            if ci >= 0:
                tl.store(CK + ((ci.to(tl.int64) * H + h) * D + dk[:, None]) * DV + cv[None, :], S)
    tl.store(sp, S.to(state.dtype.element_ty))


def run_state(ws, state, state_slot, starts, lens, req_chunks, cfg, out_dtype, ck_index=None, n_ck=0, *,
              n_tokens: int):
    """Kernel 2: o [T, H, Dv], the pool rows updated in place, checkpoint states [n_ck, H, D, Dv]."""
    W, U = ws[0], ws[1]
    H, D, Dv = W.shape[1], W.shape[3], U.shape[3]
    T, R, dev = n_tokens, state_slot.numel(), W.device
    o = torch.empty(T, H, Dv, device=dev, dtype=out_dtype)
    CK = torch.empty(max(n_ck, 1), H, D, Dv, device=dev, dtype=torch.float32)
    bv = min(cfg["BV"], Dv)
    if R > 0:
        _kda_state_kernel[(R, H, Dv // bv)](
            *ws, o, H * Dv, state, state_slot, starts, lens, req_chunks, CK, ck_index if n_ck else lens,
            H=H, D=D, DV=Dv, BV=bv, HAS_CK=n_ck > 0, PREC="ieee" if W.dtype == torch.float32 else precision.fast_fp32(),
            # fp32 workspaces take twice the shared memory per stage: 3 stages of BV 32 overflow the H200's 227 KiB
            num_warps=cfg["WARPS"], num_stages=cfg["STAGES"] if W.element_size() <= 2 else min(cfg["STAGES"], 2))
    return o, CK


_SMEM_BYTES = 232448  # per block on the H200 (sm_90)


def state_kernel_smem(config, key, itemsize: int = 2) -> int:
    """Kernel 2's shared memory: per stage W, QG, KG [64, D], U [64, BV], Aqk [64, 64], + 8 KiB, + 256 B per state
    column above 32, as Triton 3.6 allocated on the H200 (s6: BV/stages 32/3 188 KiB, 64/3 208, 64/2 144, 128/2 176)."""
    stages = config["STAGES"] * (3 * 64 * key["D"] + 64 * config["BV"] + 64 * 64) * itemsize
    return stages + 8192 + max(0, config["BV"] - 32) * 256
