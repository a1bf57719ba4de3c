"""TVM fused KDA decode / verification step for the CPU: `fused.kda_decode` (passes/kda_decode_fusion.py).

Operands, in order (as the pass creates them; see codegen/triton/kda_decode.py for the same contract):
    q, k, v [T, P]; q_conv, k_conv, v_conv [P, K]; conv_state [S, K-1, 3P] (in place); f_a [T, r], f_b [P, r];
    A_log [H], dt_bias [P] | None; b [T, H]; state [S, H, D, D] (in place); gate [T, P]; o_norm_w [D] | None;
    state_slot [R], cu_seqlens [R+1]  (request r owns tokens cu[r]:cu[r+1], any count, ragged)
Per request r and head h, token by token (fp32, state pool fp32):
    x_c = silu(sum_j w[c, j] ctx[t - (K-1) + j])  for the q, k, v channels of h (ctx: the request's inputs
          preceded by its conv_state row);  q <- q / sqrt(|q|^2 + l2_eps) * scale;  k <- k / sqrt(|k|^2 + l2_eps)
    f = f_a[t] . f_b[c] (+ dt_bias);  g = lower_bound * sigmoid(exp(A_log[h]) f)  (or -exp(A_log[h]) softplus(f));
    beta = sigmoid(b[t, h]);  S' = diag(e^g) S;  S = S' + beta k (v - S'^T k)^T;  o = S^T q
    out[t, h] = o / sqrt(|o|^2 / D + norm_eps) * o_norm_w * sigmoid(gate[t, h])
then conv_state[slot] <- the request's last K-1 context rows (old rows included when it had < K-1 tokens).
The state is updated in place in the pool (rows of the listed slots only). With attrs keep_states (verify)
two more results: states [T, H, D, D] (the state after each token) and conv_states [T, K-1, 3P] (the conv
tail after each token), which the runtime copies back when it rolls a request back.

Schedule (the tunables): one task per (request, head); PAR = 2 spreads them over the thread pool; the
D x D state is swept row by row (key channel i) with VEC-wide vectors over its columns, so S'^T k and S^T q
accumulate column vectors without horizontal sums (two sweeps of the state per token). No reduction order
depends on the batch: batch invariant.
"""

from __future__ import annotations

import torch

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket

from ..triton.kda_decode import FUSED_OP, fused_operands  # the fused node's operand order, defined once
from ._build import ALIGN, HAVE_TVM, aligned, build, cpu_rule, largest_divisor, static_int, type_name

if HAVE_TVM:
    from tvm.script import tirx as T

TUNABLES = (Tunable("VEC", (4, 8, 16)), Tunable("PAR", (1, 2)))
F32 = "float32"


def _prim(H: int, D: int, KW: int, RL: int, gate_kind: int, has_bias: bool, has_nw: bool, keep: bool, VEC: int,
          PAR: int):
    P = H * D

    @T.macro
    def conv(x, w, part, dst, cs, slot, bos, t, c0):
        for c in range(D):
            dst[c] = T.float32(0)
            for j in range(KW):
                src = t - (KW - 1) + j
                dst[c] = dst[c] + w[c0 + c, j] * T.if_then_else(
                    src >= 0, x[T.max(bos + src, 0), c0 + c], cs[slot, T.min(src + KW - 1, KW - 2), part * P + c0 + c])
            dst[c] = dst[c] / (T.float32(1) + T.exp(-dst[c]))

    @T.macro
    def l2(dst, tmp, eps, mult):
        tmp[0] = T.float32(0)
        for c in range(D):
            tmp[0] = tmp[0] + dst[c] * dst[c]
        tmp[0] = T.sqrt(tmp[0] + T.cast(eps, F32))
        for c in range(D):
            dst[c] = dst[c] / tmp[0] * mult

    @T.macro
    def tail(x, part, cs, slot, bos, n, c0, dst, drow):
        # dst[drow, m] <- context row n - (K-1) + m (inputs, or conv-state rows before the first input)
        for mm in range(KW - 1):
            src = n - (KW - 1) + mm
            for c in range(D):
                dst[drow, mm, part * P + c0 + c] = T.if_then_else(
                    src >= 0, x[T.max(bos + src, 0), c0 + c], cs[slot, T.min(src + KW - 1, KW - 2), part * P + c0 + c])

    @T.prim_func(s_tir=True)
    def kda_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, qw: T.Buffer((P, KW), F32),
                   kw: T.Buffer((P, KW), F32), vw: T.Buffer((P, KW), F32), cs_h: T.handle, fa_h: T.handle,
                   fb: T.Buffer((P, RL), F32), alog: T.Buffer((H,), F32), dtb: T.Buffer((P,), F32), b_h: T.handle,
                   st_h: T.handle, gate_h: T.handle, onw: T.Buffer((D,), F32), out_h: T.handle, slots_h: T.handle,
                   cu_h: T.handle, keep_s_h: T.handle, keep_c_h: T.handle, scale: T.float64,
                   lower_bound: T.float64, l2_eps: T.float64, norm_eps: T.float64):
        T.func_attr({"tirx.noalias": True})
        NT, S, R, NK = T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (NT, P), F32)
        k = T.match_buffer(k_h, (NT, P), F32)
        v = T.match_buffer(v_h, (NT, P), F32)
        cs = T.match_buffer(cs_h, (S, KW - 1, 3 * P), F32)
        fa = T.match_buffer(fa_h, (NT, RL), F32)
        b = T.match_buffer(b_h, (NT, H), F32)
        st = T.match_buffer(st_h, (S, H, D, D), F32)
        gate = T.match_buffer(gate_h, (NT, P), F32)
        out = T.match_buffer(out_h, (NT, P), F32)
        slots = T.match_buffer(slots_h, (R,), "int64")
        cu = T.match_buffer(cu_h, (R + 1,), "int64")
        keep_s = T.match_buffer(keep_s_h, (NK, H, D, D), F32)  # NK = T with keep_states, else a 1-row dummy
        keep_c = T.match_buffer(keep_c_h, (NK, KW - 1, 3 * P), F32)
        for rh in T.parallel(R * H) if PAR > 1 else T.serial(R * H):
            qv = T.alloc_buffer((D,), F32, scope="local")
            kv = T.alloc_buffer((D,), F32, scope="local")
            vv = T.alloc_buffer((D,), F32, scope="local")
            eg = T.alloc_buffer((D,), F32, scope="local")
            pred = T.alloc_buffer((D,), F32, scope="local")
            ov = T.alloc_buffer((D,), F32, scope="local")
            tmp = T.alloc_buffer((2,), F32, scope="local")
            r = rh // H
            h = rh % H
            bos = cu[r]
            n = cu[r + 1] - cu[r]
            slot = slots[r]
            c0 = h * D
            for t in range(n):
                row = bos + t
                conv(q, qw, 0, qv, cs, slot, bos, t, c0)
                conv(k, kw, 1, kv, cs, slot, bos, t, c0)
                conv(v, vw, 2, vv, cs, slot, bos, t, c0)
                l2(qv, tmp, l2_eps, T.cast(scale, F32))
                l2(kv, tmp, l2_eps, T.float32(1))
                for c in range(D):
                    tmp[0] = T.float32(0)
                    for j in range(RL):
                        tmp[0] = tmp[0] + fa[row, j] * fb[c0 + c, j]
                    if has_bias:
                        tmp[0] = tmp[0] + dtb[c0 + c]
                    tmp[1] = T.exp(alog[h])
                    if gate_kind == 1:
                        eg[c] = T.exp(T.cast(lower_bound, F32) / (T.float32(1) + T.exp(-tmp[1] * tmp[0])))
                    else:
                        eg[c] = T.exp(-tmp[1] * T.if_then_else(tmp[0] > T.float32(20), tmp[0],
                                                               T.log1p(T.exp(T.min(tmp[0], T.float32(20))))))
                tmp[1] = T.float32(1) / (T.float32(1) + T.exp(-b[row, h]))  # beta
                for jo in range(D // VEC):
                    for jv in T.vectorized(VEC):
                        pred[jo * VEC + jv] = T.float32(0)
                        ov[jo * VEC + jv] = T.float32(0)
                for i in range(D):
                    for jo in range(D // VEC):
                        for jv in T.vectorized(VEC):
                            st[slot, h, i, jo * VEC + jv] = st[slot, h, i, jo * VEC + jv] * eg[i]
                            pred[jo * VEC + jv] = pred[jo * VEC + jv] + st[slot, h, i, jo * VEC + jv] * kv[i]
                for jo in range(D // VEC):
                    for jv in T.vectorized(VEC):
                        pred[jo * VEC + jv] = tmp[1] * (vv[jo * VEC + jv] - pred[jo * VEC + jv])
                for i in range(D):
                    for jo in range(D // VEC):
                        for jv in T.vectorized(VEC):
                            st[slot, h, i, jo * VEC + jv] = st[slot, h, i, jo * VEC + jv] + kv[i] * pred[jo * VEC + jv]
                            ov[jo * VEC + jv] = ov[jo * VEC + jv] + st[slot, h, i, jo * VEC + jv] * qv[i]
                            if keep:
                                keep_s[row, h, i, jo * VEC + jv] = st[slot, h, i, jo * VEC + jv]
                if keep:  # the conv tail after this token (read before the pool's tail is rewritten)
                    tail(q, 0, cs, slot, bos, t + 1, c0, keep_c, row)
                    tail(k, 1, cs, slot, bos, t + 1, c0, keep_c, row)
                    tail(v, 2, cs, slot, bos, t + 1, c0, keep_c, row)
                tmp[0] = T.float32(0)
                for c in range(D):
                    tmp[0] = tmp[0] + ov[c] * ov[c]
                tmp[0] = T.sqrt(tmp[0] / T.float32(D) + T.cast(norm_eps, F32))
                for c in range(D):
                    if has_nw:
                        out[row, c0 + c] = ov[c] / tmp[0] * onw[c] / (T.float32(1) + T.exp(-gate[row, c0 + c]))
                    else:
                        out[row, c0 + c] = ov[c] / tmp[0] / (T.float32(1) + T.exp(-gate[row, c0 + c]))
            tail(q, 0, cs, slot, bos, n, c0, cs, slot)  # in place: row m reads row n + m >= m, m ascending
            tail(k, 1, cs, slot, bos, n, c0, cs, slot)
            tail(v, 2, cs, slot, bos, n, c0, cs, slot)
    return kda_decode


def kda_decode(o: dict, attrs: dict, config: dict):
    """(out [T, P], conv_state, state[, states [T, H, D, D], conv_states [T, K-1, 3P]]) for the operands `o`
    (by name) of one fused.kda_decode node; the last two with attrs keep_states (verification)."""
    q, state, conv_state = o["q"], o["state"], o["conv_state"]
    T_, P = q.shape
    H = o["A_log"].numel()
    D = P // H
    KW = o["q_conv"].shape[-1]
    RL = o["f_b"].shape[-1]
    f32 = lambda x: aligned(x.to(torch.float32))  # noqa: E731  (a no-op for the fp32 CPU path)
    for name, t in (("state", state), ("conv_state", conv_state)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.data_ptr() % ALIGN:
            raise ValueError(f"tvm kda_decode: the {name} pool must be contiguous float32 aligned to {ALIGN} bytes, "
                             f"found {t.dtype}, strides {t.stride()}, address % {ALIGN} = {t.data_ptr() % ALIGN}")
    if P != H * D or state.shape[1:] != (H, D, D) or conv_state.shape[1:] != (KW - 1, 3 * P) or KW < 2:
        raise ValueError(f"tvm kda_decode: q {tuple(q.shape)}, state {tuple(state.shape)}, conv_state "
                         f"{tuple(conv_state.shape)} do not fit H={H} heads of D={D} and conv width {KW}")
    if D % config["VEC"]:
        raise ValueError(f"tvm kda_decode: VEC={config['VEC']} does not divide D={D}")
    out = torch.empty(T_, P, dtype=torch.float32)
    keep = bool(attrs.get("keep_states", False))
    keep_s = torch.empty(T_ if keep else 1, H, D, D, dtype=torch.float32)
    keep_c = torch.empty(T_ if keep else 1, KW - 1, 3 * P, dtype=torch.float32)
    res = (out, conv_state, state) + ((keep_s, keep_c) if keep else ())
    slots, cu = aligned(o["state_slot"].to(torch.int64)), aligned(o["cu_seqlens"].to(torch.int64))
    if slots.numel() == 0 or T_ == 0:
        return res
    lb = attrs.get("lower_bound")
    flags = (H, D, KW, RL, 1 if lb is not None else 2, o["dt_bias"] is not None, o["o_norm_w"] is not None, keep)
    cfg = (config["VEC"], config["PAR"])
    fn = build("tvm_kda_decode", (*flags, cfg), lambda: _prim(*flags, *cfg))
    conv_w = [f32(o[n].reshape(P, KW)) for n in ("q_conv", "k_conv", "v_conv")]
    dtb = f32(o["dt_bias"]) if o["dt_bias"] is not None else q.new_zeros(P, dtype=torch.float32)
    onw = f32(o["o_norm_w"]) if o["o_norm_w"] is not None else q.new_ones(D, dtype=torch.float32)
    fn(f32(q), f32(o["k"]), f32(o["v"]), *conv_w, conv_state, f32(o["f_a"]), f32(o["f_b"]), f32(o["A_log"]), dtb,
       f32(o["b"]), state, f32(o["gate"]), onw, out, slots, cu, keep_s, keep_c, float(attrs["scale"]),
       float(lb) if lb is not None else 0.0, float(attrs.get("l2_eps", 1e-6)), float(attrs["norm_eps"]))
    return res


# ---- template plumbing ---------------------------------------------------------------------------
def key_dims(a, attrs) -> dict:
    o = fused_operands(a)
    H = int(o["A_log"].shape[0])
    return {"H": H, "D": int(o["q"].shape[1]) // H, "T": int(o["q"].shape[0]), "R": int(o["state_slot"].shape[0])}


def heuristic(key: dict, target: str) -> dict:
    """8 lanes, no thread pool: the best of the sweep at every measured shape on the 2-core CPU (k31-tiny
    H=4 D=64 with 1..8 requests and H=16 D=128 with 8; benches/results/cpu-2026-11-29/tvm.json)."""
    return {"VEC": largest_divisor(key["D"], (4, 8)), "PAR": 1}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    return [] if key["D"] % config["VEC"] == 0 else [f"VEC={config['VEC']} does not divide D={key['D']}"]


def supports(a, attrs, target) -> str | None:
    why = cpu_rule("tvm_kda_decode", target)
    if why:
        return why
    o = fused_operands(a)
    H, P = static_int(o["A_log"].shape[0]), static_int(o["q"].shape[1])
    if H is None or P is None or P % H or (P // H) % 4:
        return f"head count and width must be static with D a multiple of 4, found H={H}, P={P}"
    if type_name(o["state"]) != "f32" or type_name(o["conv_state"]) != "f32":
        return f"state pools must be f32, found {type_name(o['state'])}/{type_name(o['conv_state'])}"
    missing = [x for x in ("scale", "norm_eps") if x not in attrs]
    return f"attrs {missing} are required" if missing else None


TEMPLATES = [] if not HAVE_TVM else [
    KernelTemplate(
        family="tvm_kda_decode", backend="tvm", ops=(FUSED_OP,),
        launch=lambda a, attrs, config: kda_decode(fused_operands(a), attrs, config), key_dims=key_dims,
        heuristic=heuristic, tunables=TUNABLES,
        bucket=lambda key: {**key, "T": pow2_bucket(key["T"]), "R": pow2_bucket(key["R"])},
        constraints=constraints, supports=supports, batch_invariant=True,
        doc="fused KDA decode/verify on the CPU: conv + SiLU + L2 + gate + delta rule + gated RMSNorm"),
]
