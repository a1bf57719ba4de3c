"""Fused KDA decode / verification step in one kernel: conv-state update + causal conv + SiLU + L2 norm
of q, k + forget gate (its low-rank up-projection included) + beta sigmoid + delta-rule recurrence +
gated RMSNorm, 1-8 tokens per request (any count works), optionally keeping the per-token states that
speculative verification rolls back to.

Implements `fused.kda_decode` exactly as `passes/kda_decode_fusion.py` creates it from one KDA layer
(`k31c/model/build.py::_ModelWriter._kda`, SPEC §3 steps 2-7 between the projections). Operands, in
order (`a.operands`):
    0-2  q, k, v [T, P]               projections before the conv (P = H*D; row strides free)
    3-5  q_conv, k_conv, v_conv [P, K] depthwise conv weights (tap K-1 = current token)
    6    conv_state [S, K-1, 3P]      conv tails (q | k | v channels), updated in place
    7-8  f_a [T, r], f_b [P, r]       forget gate f = f_a f_b^T (low rank r)
    9-10 A_log [H], dt_bias [P] (or None)
    11   b [T, H]                     beta logits (sigmoid applied here)
    12   state [S, H, D, D]           KDA state pool (fp32 or bf16), updated in place
    13   gate [T, P]                  output-gate projection (sigmoid applied here)
    14   o_norm_w [D] (or None)
    15-16 state_slot [R] (distinct), cu_seqlens [R+1]
Attrs: heads, head_dim, scale, lower_bound (None: Kimi-Linear softplus gate), l2_eps, norm_eps, and
keep_states (default False). Results: (out [T, P], conv_state, state); with keep_states also states
[T, H, D, D] fp32 (state after each token) and conv_states [T, K-1, 3P] (conv tail after each token).
Per token: S' = diag(e^g) S; S = S' + beta k (v - S'^T k)^T; o = S^T (q*scale);
out = rmsnorm(o) * o_norm_w * sigmoid(gate), per head.

One program per (request, head). Its tokens' front (conv, L2, gate, beta) is computed for groups of
MAXT tokens at once as [MAXT, D] tiles (MAXT = min(8, pow2(T/R)): 1 in decode, 8 in 8-token
verification; f_a f_b^T as one 16-row tensor-core dot); the recurrence then walks the
head's D x D state in [D, BV] column blocks (state columns are independent), so the state is read and
written once per step and the registers hold one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from ._kda_common import kda_gate_math

FUSED_OP = "fused.kda_decode"
OPERANDS = ("q", "k", "v", "q_conv", "k_conv", "v_conv", "conv_state", "f_a", "f_b", "A_log", "dt_bias", "b",
            "state", "gate", "o_norm_w", "state_slot", "cu_seqlens")


@triton.jit
def _conv_silu(x, s_x, cst, C3, cw, bos, t0, nt, ch, KW: tl.constexpr, MAXT: tl.constexpr):
    """silu(causal depthwise conv) of tokens t0..t0+MAXT-1 (rows >= nt are 0) for channels ch; the
    context before the request's first new token comes from its conv-state row `cst`."""
    tt = tl.arange(0, MAXT)
    acc = tl.zeros([MAXT, ch.shape[0]], dtype=tl.float32)
    for j in tl.static_range(KW):
        src = t0 + tt - (KW - 1) + j
        ok = tt < nt
        xv = tl.load(x + (bos + src)[:, None] * s_x + ch[None, :], mask=(ok & (src >= 0))[:, None], other=0.0)
        sv = tl.load(cst + (src + KW - 1)[:, None] * C3 + ch[None, :], mask=(ok & (src < 0))[:, None], other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * tl.load(cw + ch * KW + j).to(tl.float32)[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def _tail(x, s_x, cst, C3, bos, src0, ch, KW: tl.constexpr, KWP: tl.constexpr):
    """Context rows src0 .. src0+K-2 (inputs, or conv-state rows for src < 0): [KWP, len(ch)]."""
    j = tl.arange(0, KWP)
    src = src0 + j
    ok = j < KW - 1
    xv = tl.load(x + (bos + src)[:, None] * s_x + ch[None, :], mask=(ok & (src >= 0))[:, None], other=0.0)
    sv = tl.load(cst + (src + KW - 1)[:, None] * C3 + ch[None, :], mask=(ok & (src < 0))[:, None], other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _put_tail(dst, C3, ch, val, KW: tl.constexpr, KWP: tl.constexpr):
    j = tl.arange(0, KWP)
    tl.store(dst + j[:, None] * C3 + ch[None, :], val.to(dst.dtype.element_ty), mask=(j < KW - 1)[:, None])


@triton.jit
def _row(x2, t):
    """Row t of a [MAXT, n] tile."""
    return tl.sum(tl.where((tl.arange(0, x2.shape[0]) == t)[:, None], x2, 0.0), axis=0)


@triton.jit
def _kda_decode_kernel(q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, fa, s_fa, fb, alog, dtb, bl, s_bl, st, gate,
                       s_gt, onw, out, slots, cu, st_keep, cs_keep, scale, lower_bound, l2_eps, norm_eps,
                       H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr, RL: tl.constexpr,
                       RB: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_NW: tl.constexpr, KEEP: tl.constexpr, MAXT: tl.constexpr, PREC: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu + r).to(tl.int64)
    n = tl.load(cu + r + 1).to(tl.int64) - bos
    slot = tl.load(slots + r).to(tl.int64)
    P: tl.constexpr = H * D
    C3: tl.constexpr = 3 * H * D
    NV: tl.constexpr = D // BV
    dd = tl.arange(0, D)
    tt = tl.arange(0, MAXT)
    ch = h * D + dd
    cst = cstate + slot * (KW - 1) * C3
    a_h = tl.exp(tl.load(alog + h).to(tl.float32))
    st_h = st + (slot * H + h) * D * D
    tg = tl.arange(0, 16)
    sp0 = st_h + dd[:, None] * D + tl.arange(0, BV)[None, :]
    s_first = tl.load(sp0).to(tl.float32)  # issued first: its latency hides behind the front
    for t0 in range(0, n, MAXT):  # token groups of MAXT (a power of two <= 16; verification: 1-8)
        nt = n - t0
        rows = bos + t0 + tt
        rm = (tt < nt)[:, None]
        # token-parallel front: conv + SiLU + L2 of q, k; gate from f_a f_b^T; beta  -> [MAXT, D] tiles
        xq = _conv_silu(q, s_q, cst, C3, qw, bos, t0, nt, ch, KW, MAXT)
        xk = _conv_silu(k, s_k, cst + P, C3, kw, bos, t0, nt, ch, KW, MAXT)
        qn = xq / tl.sqrt(tl.sum(xq * xq, axis=1) + l2_eps)[:, None] * scale
        kn = xk / tl.sqrt(tl.sum(xk * xk, axis=1) + l2_eps)[:, None]
        fx = tl.zeros([16, D], dtype=tl.float32)  # f_a f_b^T on tensor cores (16 rows, >= MAXT used)
        for jb in tl.static_range(0, RL, RB):
            jj = jb + tl.arange(0, RB)
            fm = ((tg < nt) & (tg < MAXT))[:, None] & (jj < RL)[None, :]
            fa_t = tl.load(fa + (bos + t0 + tg)[:, None] * s_fa + jj[None, :], mask=fm, other=0.0)
            fb_t = tl.load(fb + ch[None, :] * RL + jj[:, None], mask=(jj < RL)[:, None], other=0.0)
            fx = tl.dot(fa_t.to(fb_t.dtype), fb_t, fx, input_precision=PREC)
        fx = tl.sum(tl.reshape(fx, [16 // MAXT, MAXT, D]), axis=0)  # rows >= MAXT are zero
        if HAS_BIAS:
            fx += tl.load(dtb + ch).to(tl.float32)[None, :]
        eg = tl.exp(kda_gate_math(fx, a_h, lower_bound, GATE))
        bt = tl.sigmoid(tl.load(bl + rows * s_bl + h, mask=tt < nt, other=0.0).to(tl.float32))
        o3 = tl.zeros([MAXT, NV, BV], dtype=tl.float32)
        # the recurrence, one [D, BV] column block of the state at a time
        for vb in tl.static_range(NV):
            cv = vb * BV + tl.arange(0, BV)
            sp = sp0 + vb * BV
            if vb == 0:
                S = s_first
            else:
                S = s_next
            if vb + 1 < NV:  # prefetch the next column block (columns are independent)
                s_next = tl.load(sp + BV).to(tl.float32)
            xv = _conv_silu(v, s_v, cst + 2 * P, C3, vw, bos, t0, nt, h * D + cv, KW, MAXT)
            for t in range(0, tl.minimum(nt, MAXT)):
                kt = _row(kn, t)
                S = S * _row(eg, t)[:, None]
                pred = tl.sum(S * kt[:, None], axis=0)                       # S'^T k
                beta_t = tl.sum(tl.where(tt == t, bt, 0.0), axis=0)
                S = S + kt[:, None] * (beta_t * (_row(xv, t) - pred))[None, :]
                o = tl.sum(S * _row(qn, t)[:, None], axis=0)                 # S^T (q scale)
                put = (tt == t)[:, None] & (tl.arange(0, NV) == vb)[None, :]
                o3 += tl.where(put[:, :, None], o[None, None, :], 0.0)
                if KEEP:
                    tl.store(st_keep + ((bos + t0 + t) * H + h) * D * D + dd[:, None] * D + cv[None, :], S)
            tl.store(sp, S.to(st.dtype.element_ty))
        if t0 + MAXT < n:  # another group follows: reload block 0 after this group's stores
            tl.debug_barrier()
            s_first = tl.load(sp0).to(tl.float32)
        # gated RMSNorm over the head's D outputs of each token
        o2 = tl.reshape(o3, [MAXT, D])
        z = tl.load(gate + rows[:, None] * s_gt + ch[None, :], mask=rm, other=0.0).to(tl.float32)
        y = o2 / tl.sqrt(tl.sum(o2 * o2, axis=1) / D + norm_eps)[:, None] * tl.sigmoid(z)
        if HAS_NW:
            y = y * tl.load(onw + dd).to(tl.float32)[None, :]
        tl.store(out + rows[:, None] * P + ch[None, :], y.to(out.dtype.element_ty), mask=rm)
    if KEEP:  # conv tail after each token
        for t in range(0, n):
            dst = cs_keep + (bos + t) * (KW - 1) * C3
            _put_tail(dst, C3, ch, _tail(q, s_q, cst, C3, bos, t + 2 - KW, ch, KW, KWP), KW, KWP)
            _put_tail(dst + P, C3, ch, _tail(k, s_k, cst + P, C3, bos, t + 2 - KW, ch, KW, KWP), KW, KWP)
            _put_tail(dst + 2 * P, C3, ch, _tail(v, s_v, cst + 2 * P, C3, bos, t + 2 - KW, ch, KW, KWP), KW, KWP)
    # new conv tail = last K-1 context rows, all read (old state included) before any is overwritten
    tq = _tail(q, s_q, cst, C3, bos, n + 1 - KW, ch, KW, KWP)
    tk = _tail(k, s_k, cst + P, C3, bos, n + 1 - KW, ch, KW, KWP)
    tv = _tail(v, s_v, cst + 2 * P, C3, bos, n + 1 - KW, ch, KW, KWP)
    tl.debug_barrier()
    _put_tail(cst, C3, ch, tq, KW, KWP)
    _put_tail(cst + P, C3, ch, tk, KW, KWP)
    _put_tail(cst + 2 * P, C3, ch, tv, KW, KWP)


def _rows(x: torch.Tensor, T: int, width: int, what: str) -> torch.Tensor:
    if x.shape[0] != T or x.numel() != T * width:
        raise ValueError(f"kda_decode: {what} has shape {tuple(x.shape)}, expected [{T}, {width}]")
    x = x.reshape(T, width)
    return x if x.stride(1) == 1 else x.contiguous()


def kda_decode(q, k, v, q_conv, k_conv, v_conv, conv_state, f_a, f_b, A_log, dt_bias, b, state, gate, o_norm_w,
               state_slot, cu_seqlens, *, scale: float, lower_bound, norm_eps: float, l2_eps: float = 1e-6,
               keep_states: bool = False, block_v: int = 64, num_warps: int = 8, group: int | None = None):
    """The fused op `fused.kda_decode` (operands and results: see the module docstring). `group`
    (tokens per front tile, a power of two <= 16) defaults to min(8, pow2(T/R)); fix it (8) for
    batch-invariant results, since the tile shape sets the order of the L2 / RMS reductions."""
    T, P = q.shape
    H = A_log.numel()
    D = P // H
    KW = q_conv.shape[-1]
    RL = f_b.shape[-1]
    R = state_slot.numel()
    conv_ws = [w.reshape(P, KW).contiguous() for w in (q_conv, k_conv, v_conv)]
    if P != H * D or conv_state.shape[1:] != (KW - 1, 3 * P) or f_b.shape != (P, RL) or KW < 2:
        raise ValueError(f"kda_decode: q {tuple(q.shape)}, conv weights [{P}, {KW}], conv_state "
                         f"{tuple(conv_state.shape)}, f_b {tuple(f_b.shape)} do not fit H={H} heads of D={D}")
    if state.shape[1:] != (H, D, D) or not (state.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError(f"kda_decode: state pool {tuple(state.shape)} must be contiguous [S, {H}, {D}, {D}]")
    qv, kv_, vv = _rows(q, T, P, "q"), _rows(k, T, P, "k"), _rows(v, T, P, "v")
    fav, bv, gv = _rows(f_a, T, RL, "f_a"), _rows(b, T, H, "b"), _rows(gate, T, P, "gate")
    fbc = f_b.contiguous()
    dev = q.device
    out = torch.empty(T, P, device=dev, dtype=q.dtype)
    group = group or (min(8, triton.next_power_of_2(-(-T // R))) if R and T else 1)
    if group & (group - 1) or not 1 <= group <= 16:
        raise ValueError(f"kda_decode: group must be a power of two in 1..16, got {group}")
    keep_s = torch.empty(T if keep_states else 1, H, D, D, device=dev, dtype=torch.float32)
    keep_c = torch.empty(T if keep_states else 1, KW - 1, 3 * P, device=dev, dtype=conv_state.dtype)
    low = fbc.dtype in (torch.bfloat16, torch.float16)
    if R > 0:
        _kda_decode_kernel[(R, H)](
            qv, kv_, vv, qv.stride(0), kv_.stride(0), vv.stride(0), *conv_ws, conv_state, fav, fav.stride(0), fbc,
            A_log, dt_bias if dt_bias is not None else A_log, bv, bv.stride(0), state, gv, gv.stride(0),
            o_norm_w if o_norm_w is not None else A_log, out, state_slot, cu_seqlens, keep_s, keep_c, float(scale),
            float(lower_bound) if lower_bound is not None else 0.0, float(l2_eps), float(norm_eps),
            H=H, D=D, KW=KW, KWP=triton.next_power_of_2(KW), RL=RL, RB=max(16, min(32, triton.next_power_of_2(RL))),
            BV=min(block_v, D), GATE=1 if lower_bound is not None else 2, HAS_BIAS=dt_bias is not None,
            HAS_NW=o_norm_w is not None, KEEP=bool(keep_states), MAXT=group,
            PREC="tf32" if low else "ieee", num_warps=num_warps)
    res = (out, conv_state, state)
    return res + (keep_s, keep_c) if keep_states else res


# ---------------------------------------------------------------------------------- template
def _operands(a) -> dict:
    """Bound operands of the fused node: `a.operands` (list, as codegen binds fused ops) or names."""
    ops = getattr(a, "operands", None)
    if ops is None:
        return {n: getattr(a, n) for n in OPERANDS}
    if len(ops) != len(OPERANDS):
        raise ValueError(f"{FUSED_OP} takes {len(OPERANDS)} operands ({', '.join(OPERANDS)}), got {len(ops)}")
    return dict(zip(OPERANDS, ops))


def _launch(a, attrs, config):
    o = _operands(a)
    group = None
    if attrs.get("batch_invariant"):  # a fixed tile shape and config: reductions independent of the batch
        group, config = 8, heuristic(key_dims(a, attrs), "cuda" if o["q"].is_cuda else "cpu")
    return kda_decode(*(o[n] for n in OPERANDS), scale=attrs["scale"], lower_bound=attrs.get("lower_bound"),
                      norm_eps=attrs["norm_eps"], l2_eps=attrs.get("l2_eps", 1e-6),
                      keep_states=attrs.get("keep_states", False), block_v=config["BV"], num_warps=config["WARPS"],
                      group=group)


def key_dims(a, attrs):
    o = _operands(a)
    H = int(o["A_log"].shape[0])
    return {"H": H, "D": int(o["q"].shape[1]) // H, "T": int(o["q"].shape[0]), "R": int(o["state_slot"].shape[0])}


def heuristic(key, target):
    """GPU: BV 64 with 4 warps, the fastest of the H200 sweep (B=64, H=32, D=128: 126 µs vs 200 µs with 8
    warps); CPU: one block."""
    if str(target).startswith("cpu"):
        return {"BV": key["D"], "WARPS": 4}
    return {"BV": min(64, key["D"]), "WARPS": 4}


def supports(a, attrs, target):
    o = _operands(a)
    try:
        H, P = int(o["A_log"].shape[0]), int(o["q"].shape[1])
    except TypeError:
        return "head count and projection width must be static"
    D = P // H
    if P != H * D or D < 16 or D > 256 or D & (D - 1):
        return f"head dim must be a power of two in 16..256, got width {P} for {H} heads"
    missing = [x for x in ("scale", "norm_eps") if x not in attrs]
    return f"attrs {missing} are required" if missing else None


TEMPLATES = [
    KernelTemplate(
        family="kda_decode", backend="triton", ops=(FUSED_OP,), launch=_launch, key_dims=key_dims,
        heuristic=heuristic, bucket=lambda key: {**key, "T": pow2_bucket(key["T"]), "R": pow2_bucket(key["R"])},
        constraints=lambda config, key, target: [] if key["D"] % config["BV"] == 0 else
        [f"BV={config['BV']} must divide D={key['D']}"],
        supports=supports, tunables=(Tunable("BV", (32, 64)), Tunable("WARPS", (4, 8))), batch_invariant=True,
        doc="fused KDA decode/verify: conv + SiLU + L2 + gate + recurrence + gated RMSNorm, per-token states"),
]
