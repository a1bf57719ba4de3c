"""`fused.packed_linear_glu` (passes/glu_epilogue.py): one packed GEMM whose gate/up halves go through
the FFN's gated activation in the epilogue.

Operands x [.., K], plain weights W_p (outputs y_p), gate W_g [I, K], up W_u [I, K]; the weights are
row-packed once (`gemm.packed_weight`, plain rows [0, P), gate rows [G0, G0 + I), up rows [U0, U0 + I)).
Programs per BLOCK_M row block: ceil(P / BLOCK_N) plain tiles, then ceil(I / (BLOCK_N / 2)) pair tiles.
A plain tile computes rows n0 .. n0 + BLOCK_N of x W^T and stores them. A pair tile computes the
interleaved rows
    offs_n[2i] = G0 + q0 + i,   offs_n[2i + 1] = U0 + q0 + i          (i < BLOCK_N / 2)
with the same tile code as the GEMM (`gemv_tile` for decode rows, `gemm_tile` otherwise; each output
element's K reduction does not depend on which rows share its tile), rounds g = acc[2i], u = acc[2i + 1]
to x's dtype exactly as the unfused GEMM stores them, and writes
    a[m, q0 + i] = act(g, u)                                            (`glu.binary_math`, fp32)
so a equals packed_linear + situ_glu / swiglu run as two kernels with the same config, bit for bit, and
the [M, 2I] gate/up tensor never reaches memory. No split-K (the epilogue needs whole sums). Configs,
tunables and the decode heuristic are the GEMM's (gemm.py), with BLOCK_N >= 2 and SPLIT_K = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable
from codegen.triton import gemm as gm
from codegen.triton._gemv import dot_numerics, gemm_tile, gemv_tile
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.glu import ACTS, binary_math

OP = "fused.packed_linear_glu"


@triton.jit
def _packed_glu_kernel(x_ptr, w_ptr, s_ptr, y_ptr, a_ptr, M, P, I, K, G0, U0,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_am, stride_sn, stride_sk,
                       beta1, beta2, SCALE_MODE: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                       PRECISION: tl.constexpr, EVEN_K: tl.constexpr, GEMV: tl.constexpr, LOOP_STAGES: tl.constexpr,
                       ACT: tl.constexpr, HAS_B2: tl.constexpr, CDT: tl.constexpr, SMALL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    plain_tiles = tl.cdiv(P, BLOCK_N)
    per_m = plain_tiles + tl.cdiv(I, HALF)
    t = pid % per_m
    offs_m = (pid // per_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    j = tl.arange(0, BLOCK_N)
    pair = t >= plain_tiles
    q = (t - plain_tiles) * HALF + j // 2  # the gate/up pair of lane j (pair tiles)
    offs_n = tl.where(pair, tl.where(j % 2 == 0, G0 + q, U0 + q), t * BLOCK_N + j)
    n_ok = tl.where(pair, q < I, offs_n < P)
    offs_n = tl.where(n_ok, offs_n, 0)  # masked lanes read row 0 (in bounds), their values are dropped
    if GEMV:  # waits for the previous kernel itself, after its first weight tile
        acc = gemv_tile(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, ACC_DTYPE, EVEN_K,
                        BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES, PDL)
    else:
        pdl_enter(PDL)
        acc = gemm_tile(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, DOT_DTYPE, ACC_DTYPE,
                        X_SPLITS, PRECISION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if pair:
        v = acc.to(a_ptr.dtype.element_ty).to(CDT)  # g and u as the unfused GEMM would have stored them
        g, u = tl.split(tl.reshape(v, (BLOCK_M, HALF, 2)))
        y = binary_math(g, u, beta1, beta2, ACT, HAS_B2, SMALL)
        qq = (t - plain_tiles) * HALF + tl.arange(0, HALF)
        tl.store(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + qq[None, :], y.to(a_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (qq < I)[None, :])
    else:
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def packed_linear_glu(x: torch.Tensor, ws: list, splits: list, act: str, config: dict, beta1=None, beta2=None):
    """(plain outputs..., a) of the fused op for x [.., K] and weights [W_p..., W_g, W_u] (module doc)."""
    if act not in ("situ_glu", "swiglu"):
        raise ValueError(f"{OP}: act {act!r} is not a gated activation (situ_glu, swiglu)")
    if len(splits) != len(ws) or len(ws) < 2 or any(int(w.shape[0]) != s for w, s in zip(ws, splits)) \
            or splits[-1] != splits[-2]:
        raise ValueError(f"{OP}: splits {splits} do not match weights {[tuple(w.shape) for w in ws]} "
                         f"(plain weights, then gate and up of equal rows)")
    if config.get("SPLIT_K", 1) != 1 or config["BLOCK_N"] < 2:
        raise ValueError(f"{OP}: config needs SPLIT_K=1 and BLOCK_N >= 2, found {config}")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M, I, P = x2.shape[0], int(splits[-1]), int(sum(splits[:-2]))
    w = gm.packed_weight(ws)
    wq = w.q if isinstance(w, gm.FP8Weight) else w
    y = torch.empty(M, P, dtype=x.dtype, device=x.device)
    a = torch.empty(M, I, dtype=x.dtype, device=x.device)
    if M and K:
        scale_mode, gn, gk, s, s_strides = gm.scale_args(w, config, a)
        per_m = triton.cdiv(P, config["BLOCK_N"]) + triton.cdiv(I, config["BLOCK_N"] // 2)
        fp64 = x.dtype == torch.float64
        _packed_glu_kernel[(triton.cdiv(M, config["BLOCK_M"]) * per_m,)](
            x2, wq, s, y if P else a, a, M, P, I, K, P, P + I, x2.stride(0), x2.stride(1), wq.stride(0), wq.stride(1),
            y.stride(0), a.stride(0), *s_strides, 1.0 if beta1 is None else float(beta1),
            1.0 if beta2 is None else float(beta2), SCALE_MODE=scale_mode, SCALE_GN=gn, SCALE_GK=gk,
            **dot_numerics(x.dtype, wq.dtype), EVEN_K=K % config["BLOCK_K"] == 0, GEMV=int(config.get("GEMV", 0)),
            LOOP_STAGES=max(1, int(config["num_stages"])), ACT=ACTS[act], HAS_B2=beta2 is not None,
            CDT=tl.float64 if fp64 else tl.float32, SMALL=1e-3 if fp64 else 0.25,
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
            num_warps=config["num_warps"], num_stages=config["num_stages"], **launch_kwargs())
    else:  # K = 0: g = u = 0, act(0, 0) = 0
        a.zero_()
        y.zero_()
    lead = x.shape[:-1]
    plain = [part.reshape(*lead, part.shape[-1]) for part in torch.split(y, list(splits[:-2]), dim=1)] if P else []
    return (*plain, a.reshape(*lead, I))


# ---- template plumbing ---------------------------------------------------------------------------
TUNABLES = tuple(Tunable(t.name, (1,)) if t.name == "SPLIT_K" else
                 Tunable(t.name, tuple(v for v in t.values if v >= 2)) if t.name == "BLOCK_N" else t
                 for t in gm.TUNABLES)


def heuristic(key: dict, target: str) -> dict:
    """The GEMM's heuristic for the packed shape (gemm.heuristic), without split-K and with BLOCK_N >= 2."""
    cfg = dict(gm.heuristic(key, target), SPLIT_K=1)
    cfg["BLOCK_N"] = max(2, cfg["BLOCK_N"])
    return cfg


def constraints(config: dict, key: dict, target: str) -> list[str]:
    if config.get("SPLIT_K", 1) != 1:
        return ["split-K: the GLU epilogue needs whole sums"]
    if config["BLOCK_N"] < 2:
        return ["BLOCK_N < 2 holds no gate/up pair"]
    return gm.constraints(config, key, target)


def _launch(a, attrs, config):
    gm.check_invariance(attrs, config)
    return packed_linear_glu(a.operands[0], list(a.operands[1:]), list(attrs["splits"]), attrs["act"], config,
                             attrs.get("beta1"), attrs.get("beta2"))


def _supports(a, attrs, target):
    if attrs.get("act") not in ("situ_glu", "swiglu"):
        return f"act {attrs.get('act')!r} has no epilogue (situ_glu, swiglu)"
    return gm.supported_types(a.operands[0], a.operands[1:], target)


TEMPLATES = [
    KernelTemplate(
        family="packed_glu_gemm", backend="triton", ops=(OP,), launch=_launch,
        key_dims=lambda a, attrs: gm.gemm_key(a.operands[0], a.operands[1:], attrs), heuristic=heuristic,
        tunables=TUNABLES, bucket=gm.gemm_bucket, constraints=constraints, supports=_supports, batch_invariant=True,
        doc="[y_p.., act(g, u)] = one packed GEMM, the gated activation applied in its epilogue"),
]
