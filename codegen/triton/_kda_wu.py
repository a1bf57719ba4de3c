"""Second half of the KDA chunked prefill's intra-chunk work, as its own kernel (prefill config
SPLIT_INTRA=1): the WY/UT products of one (chunk, head) from L^-1, which `_kda_intra_kernel` (built with
FUSE_WU=False) stored in fp32 next to Aqk and G_C.

Math (per chunk of L <= 64 tokens, per key-channel slice; G_t = sum_{i<=t} g_i, the chunk-inclusive
cumulative log decay, recomputed here from g (or from the raw gate input f with the fused gate)):
    W  = L^-1 (beta * k * e^G)           [64, D]
    U  = L^-1 (beta * v)                 [64, Dv]
    QG = scale * q * e^G                 [64, D]
    KG = k * e^{G_C - G}                 [64, D]   (G_C = G of the chunk's last token)
Every exponent is <= 0 (g <= 0), so nothing overflows. Padded rows (t >= L) read as zero and give zero
rows. Splitting this off `_kda_intra_kernel` leaves that kernel only the A / Aqk products and the
triangular inverse, so each kernel holds far fewer registers (the fused one ran at 255 with spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._kda_common import kda_gate_math
from ._kda_chunk_tiles import _load2, _st64


@triton.jit
def _kda_wu_kernel(q, k, v, g, beta, dtb, alog, chunk_start, chunk_len, AI, W, U, QG, KG,
                   s_q, s_k, s_v, s_g, s_b, scale, lower_bound,
                   H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    L = tl.load(chunk_len + n)
    if L <= 0:
        return
    t0 = tl.load(chunk_start + n).to(tl.int64)
    rows = tl.arange(0, 64)
    base = (n.to(tl.int64) * H + h) * 64
    ai = tl.load(AI + (base + rows[:, None]) * 64 + rows[None, :])             # L^-1, fp32 [64, 64]
    if LOWP:  # bf16 tensor-core products, fp32 accumulation
        ai = ai.to(tl.bfloat16)
    b64 = tl.load(beta + h + (t0 + rows) * s_b, mask=rows < L, other=0.0).to(tl.float32)[:, None]
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        gg = _load2(g + h * D, t0, L, s_g, cols)
        if GATE != 0:
            if HAS_BIAS:
                gg += tl.load(dtb + h * D + cols).to(tl.float32)[None, :]
            a_h = tl.exp(tl.load(alog + h).to(tl.float32))
            gg = tl.where((rows < L)[:, None], kda_gate_math(gg, a_h, lower_bound, GATE), 0.0)
        G = tl.cumsum(gg, axis=0)
        e = tl.exp(G)
        kf = _load2(k + h * D, t0, L, s_k, cols)
        w = tl.dot(ai, (kf * e * b64).to(ai.dtype), input_precision=PREC)
        _st64(W + base * D, cols, D, w)
        _st64(QG + base * D, cols, D, _load2(q + h * D, t0, L, s_q, cols) * e * scale)
        _st64(KG + base * D, cols, D, kf * tl.exp(tl.sum(gg, axis=0)[None, :] - G))
    for vb in range(0, DV, BV):
        cols = vb + tl.arange(0, BV)
        u = tl.dot(ai, (_load2(v + h * DV, t0, L, s_v, cols) * b64).to(ai.dtype), input_precision=PREC)
        _st64(U + base * DV, cols, DV, u)


def run_wu(views, starts, lens, AI, ws, scale, *, BK, BV, PREC, gate_mode, dtb, alog, lower_bound, has_bias,
           num_warps, num_stages, LOWP=False):
    """Launch over the chunk table: views = (q, k, v, g or f, beta) as [T, width] rows; fills W, U, QG, KG
    of the workspace `ws` (W, U, QG, KG, AQK, GL) from L^-1 in AI [N, H, 64, 64] fp32."""
    q, k, v, g, beta = views
    W, U, QG, KG = ws[:4]
    N, H, _, D = W.shape
    _kda_wu_kernel[(N, H)](
        q, k, v, g, beta, dtb, alog, starts, lens, AI, W, U, QG, KG, q.stride(0), k.stride(0), v.stride(0),
        g.stride(0), beta.stride(0), float(scale), float(lower_bound), H=H, D=D, DV=U.shape[3], BK=BK, BV=BV,
        GATE=gate_mode, HAS_BIAS=has_bias, PREC=PREC, LOWP=LOWP, num_warps=num_warps, num_stages=num_stages)


def new_inverse_workspace(W: torch.Tensor) -> torch.Tensor:
    """AI [N, H, 64, 64] fp32 for W [N, H, 64, D]."""
    return torch.empty(W.shape[0], W.shape[1], 64, 64, device=W.device, dtype=torch.float32)
