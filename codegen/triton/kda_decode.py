"""Fused KDA decode / verification step: conv-state update + causal conv + SiLU + L2 norm of q, k +
forget gate + beta sigmoid + delta-rule recurrence + gated RMSNorm, one kernel, 1-8 (any) tokens per
request, optionally keeping the per-token states that speculative verification rolls back to.

Implements the fused op `fused.kda_decode` that the KDA-decode fusion pass creates from this
unfused group of `k31c/model/build.py::_ModelWriter._kda` (SPEC §3 steps 2-7 between projections):
    y_c, conv_state' = causal_conv1d(qkv, conv_w, conv_state, state_slot, cu_seqlens)
    q = l2_norm(reshape(slice(y_c, 0:P)));  k = l2_norm(reshape(slice(y_c, P:2P)));  v = reshape(slice(y_c, 2P:3P))
    g = kda_gate(f, A_log, dt_bias; lower_bound);  beta = sigmoid(b)
    o, state' = kda(q, k, v, g, beta, state, state_slot, cu_seqlens; scale)
    y = gated_rms_norm(o, gate, o_norm_w; eps)
Operands, in order (the fusion's first-use order):
    0 qkv [T, 3P]            concatenated q/k/v projections (conv input), P = H*D
    1 conv_w [3P, K]         concatenated depthwise conv weights (tap K-1 = current token)
    2 conv_state [S, K-1, 3P] conv tail pool, updated in place
    3 state_slot [R]         pool rows of the requests (distinct)
    4 cu_seqlens [R+1]
    5 f [T, P]               raw forget-gate input (f_b projection)
    6 A_log [H]
    7 dt_bias [P] or None
    8 b [T, H]               beta logits (attr beta_logits=True, the sigmoid is in the group) or beta
    9 state [S, H, D, D]     KDA state pool (fp32 or bf16), updated in place
    10 gate [T, H, D] or [T, P]  output-gate projection (sigmoid applied here)
    11 o_norm_w [D]          o_norm weight (or None)
Attrs: scale (kda), lower_bound (kda_gate; None = Kimi-Linear softplus gate), l2_eps (l2_norm, default
1e-6), norm_eps (gated_rms_norm), beta_logits (default True), keep_states (default False).
Results: (conv_state, state, y [T, H, D]) — the group's escaping values in order — and with
keep_states also states [T, H, D, D] fp32 (state after each token) and conv_states [T, K-1, 3P]
(conv tail after each token). One program per (request, head) holds the head's D x D state in
registers (fp32) across the request's tokens: the state is read and written once per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from .kda_prefill import kda_gate_math

FUSED_OP = "fused.kda_decode"
OPERANDS = ("qkv", "conv_w", "conv_state", "state_slot", "cu_seqlens", "f", "A_log", "dt_bias", "b", "state",
            "gate", "o_norm_w")


@triton.jit
def _window(x, s_x, cst, C3, bos, src0, ch, NR: tl.constexpr, NRP: tl.constexpr, KW: tl.constexpr):
    """Context rows src0 .. src0+NR-1 of a request (its inputs, preceded for src < 0 by its conv-state
    row, oldest first) for channels `ch`: [NRP, len(ch)] fp32, rows >= NR zero."""
    j = tl.arange(0, NRP)
    src = src0 + j
    ok = j < NR
    from_x = tl.load(x + (bos + src)[:, None] * s_x + ch[None, :], mask=(ok & (src >= 0))[:, None], other=0.0)
    from_s = tl.load(cst + (src + KW - 1)[:, None] * C3 + ch[None, :], mask=(ok & (src < 0))[:, None], other=0.0)
    return from_x.to(tl.float32) + from_s.to(tl.float32)


@triton.jit
def _conv_silu(x, s_x, cst, C3, bos, t, ch, w, KW: tl.constexpr, KWP: tl.constexpr):
    acc = tl.sum(_window(x, s_x, cst, C3, bos, t - (KW - 1), ch, KW, KWP, KW) * w, axis=0)
    return acc * tl.sigmoid(acc)


@triton.jit
def _store_tail(x, s_x, cst, C3, bos, src0, ch, dst, KW: tl.constexpr, KWP: tl.constexpr):
    j = tl.arange(0, KWP)
    tail = _window(x, s_x, cst, C3, bos, src0, ch, KW - 1, KWP, KW)
    tl.store(dst + j[:, None] * C3 + ch[None, :], tail.to(dst.dtype.element_ty), mask=(j < KW - 1)[:, None])


@triton.jit
def _kda_decode_kernel(x, s_x, cw, cstate, slots, cu, f, s_f, alog, dtb, b, s_b, st, gate, s_gt, onw, y,
                       st_keep, cs_keep, scale, lower_bound, l2_eps, norm_eps,
                       H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr,
                       GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_LOGITS: tl.constexpr,
                       HAS_NW: tl.constexpr, KEEP: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu + r).to(tl.int64)
    n = tl.load(cu + r + 1).to(tl.int64) - bos
    slot = tl.load(slots + r).to(tl.int64)
    P: tl.constexpr = H * D
    C3: tl.constexpr = 3 * H * D
    dd = tl.arange(0, D)
    cq = h * D + dd
    ck = P + cq
    cv = 2 * P + cq
    cst = cstate + slot * (KW - 1) * C3
    j = tl.arange(0, KWP)
    wm = (j < KW)[:, None]
    wq = tl.load(cw + cq[None, :] * KW + j[:, None], mask=wm, other=0.0).to(tl.float32)
    wk = tl.load(cw + ck[None, :] * KW + j[:, None], mask=wm, other=0.0).to(tl.float32)
    wv = tl.load(cw + cv[None, :] * KW + j[:, None], mask=wm, other=0.0).to(tl.float32)
    sp = st + ((slot * H + h) * D + dd[:, None]) * D + dd[None, :]
    S = tl.load(sp).to(tl.float32)
    a_h = tl.exp(tl.load(alog + h).to(tl.float32))
    bias = tl.zeros([D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(dtb + cq).to(tl.float32)
    nw = tl.full([D], 1.0, dtype=tl.float32)
    if HAS_NW:
        nw = tl.load(onw + dd).to(tl.float32)
    for t in range(0, n):
        row = bos + t
        xq = _conv_silu(x, s_x, cst, C3, bos, t, cq, wq, KW, KWP)
        xk = _conv_silu(x, s_x, cst, C3, bos, t, ck, wk, KW, KWP)
        xv = _conv_silu(x, s_x, cst, C3, bos, t, cv, wv, KW, KWP)
        qn = xq / tl.sqrt(tl.sum(xq * xq, axis=0) + l2_eps) * scale
        kn = xk / tl.sqrt(tl.sum(xk * xk, axis=0) + l2_eps)
        g = kda_gate_math(tl.load(f + row * s_f + cq).to(tl.float32) + bias, a_h, lower_bound, GATE)
        bt = tl.load(b + row * s_b + h).to(tl.float32)
        if BETA_LOGITS:
            bt = tl.sigmoid(bt)
        S = S * tl.exp(g)[:, None]
        pred = tl.sum(S * kn[:, None], axis=0)                      # S'^T k
        S = S + kn[:, None] * (bt * (xv - pred))[None, :]
        o = tl.sum(S * qn[:, None], axis=0)                         # S^T q
        z = tl.load(gate + row * s_gt + h * D + dd).to(tl.float32)
        yv = o / tl.sqrt(tl.sum(o * o, axis=0) / D + norm_eps) * nw * tl.sigmoid(z)
        tl.store(y + (row * H + h) * D + dd, yv.to(y.dtype.element_ty))
        if KEEP:
            tl.store(st_keep + ((row * H + h) * D + dd[:, None]) * D + dd[None, :], S)
            dst = cs_keep + row * (KW - 1) * C3
            _store_tail(x, s_x, cst, C3, bos, t + 1 - (KW - 1), cq, dst, KW, KWP)
            _store_tail(x, s_x, cst, C3, bos, t + 1 - (KW - 1), ck, dst, KW, KWP)
            _store_tail(x, s_x, cst, C3, bos, t + 1 - (KW - 1), cv, dst, KW, KWP)
    tl.store(sp, S.to(st.dtype.element_ty))
    # new conv tail = last K-1 context rows; read (old state included) before anything is overwritten
    src0 = n - (KW - 1)
    tq = _window(x, s_x, cst, C3, bos, src0, cq, KW - 1, KWP, KW)
    tk = _window(x, s_x, cst, C3, bos, src0, ck, KW - 1, KWP, KW)
    tv = _window(x, s_x, cst, C3, bos, src0, cv, KW - 1, KWP, KW)
    tl.debug_barrier()
    tm = (j < KW - 1)[:, None]
    tl.store(cst + j[:, None] * C3 + cq[None, :], tq.to(cst.dtype.element_ty), mask=tm)
    tl.store(cst + j[:, None] * C3 + ck[None, :], tk.to(cst.dtype.element_ty), mask=tm)
    tl.store(cst + j[:, None] * C3 + cv[None, :], tv.to(cst.dtype.element_ty), mask=tm)


def _rows(x: torch.Tensor, T: int, width: int, what: str) -> torch.Tensor:
    if x.numel() != T * width:
        raise ValueError(f"kda_decode: {what} has shape {tuple(x.shape)}, expected {T} rows of {width}")
    x = x.reshape(T, width)
    return x if x.stride(1) == 1 else x.contiguous()


def kda_decode(qkv, conv_w, conv_state, state_slot, cu_seqlens, f, A_log, dt_bias, b, state, gate, o_norm_w, *,
               scale: float, lower_bound, norm_eps: float, l2_eps: float = 1e-6, beta_logits: bool = True,
               keep_states: bool = False, num_warps: int = 8):
    """The fused op `fused.kda_decode` (operands and results: see the module docstring)."""
    T, C3 = qkv.shape
    H = A_log.numel()
    P = C3 // 3
    D = P // H
    KW = conv_w.shape[-1]
    R = state_slot.numel()
    if C3 != 3 * H * D or conv_w.shape != (C3, KW) or conv_state.shape[1:] != (KW - 1, C3):
        raise ValueError(f"kda_decode: qkv {tuple(qkv.shape)}, conv_w {tuple(conv_w.shape)}, conv_state "
                         f"{tuple(conv_state.shape)} do not fit H={H} heads of D={D} with conv width {KW}")
    if state.shape[1:] != (H, D, D):
        raise ValueError(f"kda_decode: state pool {tuple(state.shape)} must be [S, {H}, {D}, {D}]")
    if KW < 2 or not (conv_state.is_contiguous() and state.is_contiguous() and conv_w.is_contiguous()):
        raise ValueError("kda_decode: conv width must be >= 2 and conv_w / pools contiguous")
    x = _rows(qkv, T, C3, "qkv")
    fv, bv, gv = _rows(f, T, P, "f"), _rows(b, T, H, "b"), _rows(gate, T, P, "gate")
    dev = qkv.device
    y = torch.empty(T, H, D, device=dev, dtype=qkv.dtype)
    keep_s = torch.empty(T if keep_states else 1, H, D, D, device=dev, dtype=torch.float32)
    keep_c = torch.empty(T if keep_states else 1, KW - 1, C3, device=dev, dtype=conv_state.dtype)
    dummy = A_log
    if R > 0:
        _kda_decode_kernel[(R, H)](
            x, x.stride(0), conv_w, conv_state, state_slot, cu_seqlens, fv, fv.stride(0), A_log,
            dt_bias if dt_bias is not None else dummy, bv, bv.stride(0), state, gv, gv.stride(0),
            o_norm_w if o_norm_w is not None else dummy, y, keep_s, keep_c, float(scale),
            float(lower_bound) if lower_bound is not None else 0.0, float(l2_eps), float(norm_eps),
            H=H, D=D, KW=KW, KWP=triton.next_power_of_2(KW), GATE=1 if lower_bound is not None else 2,
            HAS_BIAS=dt_bias is not None, BETA_LOGITS=bool(beta_logits), HAS_NW=o_norm_w is not None,
            KEEP=bool(keep_states), num_warps=num_warps)
    out = (conv_state, state, y)
    return out + (keep_s, keep_c) if keep_states else out


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
    return kda_decode(*(o[n] for n in OPERANDS), scale=attrs["scale"], lower_bound=attrs.get("lower_bound"),
                      norm_eps=attrs["norm_eps"], l2_eps=attrs.get("l2_eps", 1e-6),
                      beta_logits=attrs.get("beta_logits", True), keep_states=attrs.get("keep_states", False),
                      num_warps=config["WARPS"])


def key_dims(a, attrs):
    o = _operands(a)
    H = int(o["A_log"].shape[0])
    return {"H": H, "D": int(o["qkv"].shape[1]) // (3 * H), "T": int(o["qkv"].shape[0]),
            "R": int(o["state_slot"].shape[0])}


def heuristic(key, target):
    """One program per (request, head) holding D x D fp32: 8 warps keep D=128 at 64 registers/thread."""
    return {"WARPS": 4 if key["D"] <= 64 else 8}


def supports(a, attrs, target):
    o = _operands(a)
    try:
        H, C3 = int(o["A_log"].shape[0]), int(o["qkv"].shape[1])
    except TypeError:
        return "head count and qkv width must be static"
    D = C3 // (3 * H)
    if C3 != 3 * H * D or D < 16 or D > 256 or D & (D - 1):
        return f"head dim must be a power of two in 16..256, got qkv width {C3} for {H} heads"
    if "scale" not in attrs or "norm_eps" not in attrs:
        return "attrs scale and norm_eps are required"
    return None


TEMPLATES = [
    KernelTemplate(
        family="kda_decode", backend="triton", ops=(FUSED_OP,), launch=_launch, key_dims=key_dims,
        heuristic=heuristic, bucket=lambda key: {**key, "T": pow2_bucket(key["T"]), "R": pow2_bucket(key["R"])},
        supports=supports, tunables=(Tunable("WARPS", (4, 8, 16)),), batch_invariant=True,
        doc="fused KDA decode/verify: conv + SiLU + L2 + gate + recurrence + gated RMSNorm, per-token states"),
]
