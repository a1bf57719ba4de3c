"""LatentMoE tail (SPEC §6, DESIGN §5 T12): the MoE weighted combine and `fused.latent_moe_tail`.

Weighted combine (`combine`, used by `moe_experts`): y[t] = Σ_j w[t,j]·o[t·k+j] over the per-pair expert
outputs o [T·k, ℓ], in slot order, fp32, no atomics (pairs whose expert is outside [0, E) add 0).

`fused.latent_moe_tail`, as passes/latent_moe_tail.py creates it from k31c/model/build.py::_ffn:

    %yn  = rms_norm(%y, @routed_expert_norm.weight) {eps}     y = moe_experts(...)  f32 [T, ℓ]
    %yc  = cast(%yn) {dtype}
    %yu  = linear(%yc, @routed_expert_up_proj.weight)         ℓ -> d
    %out = add(%yu, %shared)                                   shared = shared-expert MLP(x) [T, d]
 -> %out = fused.latent_moe_tail(%y, @norm_w, @w_up, %shared) {eps, dtype}

Operands (`a.operands`, this order): y f32 [T, ℓ], norm_w [ℓ], w_up [d, ℓ], shared [T, d]; attrs eps,
dtype (+ batch_invariant at run time). Result: out [T, d] in shared's dtype.
T = 1 (config U_GEMV=1): one kernel, `_latent_tail_gemv_kernel` (norm, cast, dot-free GEMV streaming W_up
over d / G_BN programs, shared add). Otherwise two kernels:
  1. latent norm: yn = (y / sqrt(mean(y²) + eps) ⊙ norm_w) cast to the activation dtype, one program
     per block of whole rows. Applying the gain to the activation equals the folded up-projection
     W_up·diag(norm_w) without a pass over W_up, and rounds where the reference's cast rounds.
  2. up-projection + shared add: out = yn @ W_upᵀ + shared, fp32 accumulation, one program per output
     tile (no split-K), grouped raster order.
The activation dtype is that of the tensors the executor passes (`shared`'s): the reference's `cast`
is the identity in the fp32 interpreter, and bf16 on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton import _moe_tiles as tiles
from codegen.triton import moe_grouped_gemm as gg
from codegen.triton._moe_splits import _combine_splits_kernel
from codegen.triton._pdl import launch_kwargs, pdl_enter

TAIL_OP = "fused.latent_moe_tail"
TAIL_OPERANDS = ("y", "norm_w", "w_up", "shared")


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def _latent_norm_kernel(y_ptr, g_ptr, out_ptr, T, ELL, stride_y, stride_out, eps,
                        BT: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr):
    """out = y / sqrt(mean(y²) + eps) · g over whole rows (BL >= ℓ), stored in out's dtype."""
    pdl_enter(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rl = tl.arange(0, BL)
    ok = (rt < T)[:, None] & (rl < ELL)[None, :]
    y = tl.load(y_ptr + rt.to(tl.int64)[:, None] * stride_y + rl[None, :], mask=ok, other=0.0).to(tl.float32)
    y = y / tl.sqrt(tl.sum(y * y, 1) / ELL + eps)[:, None]
    y = y * tl.load(g_ptr + rl, mask=rl < ELL, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_out + rl[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _up_proj_add_kernel(y_ptr, w_ptr, sh_ptr, out_ptr, T, D, ELL, stride_y, stride_w, stride_sh, stride_out,
                        IEEE: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """out[t, n] = Σ_k y[t, k]·W[n, k] + shared[t, n] (fp32 accumulation, K in BK steps, one program)."""
    pdl_enter(PDL)
    pm, pn = tiles._swizzle(tl.program_id(0), tl.cdiv(T, BM), tl.cdiv(D, BN), GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < T
    n_ok = rn < D
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_w + rk[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, ELL, BK):
        k_ok = k0 + rk < ELL
        a = tl.load(y_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(DT)
        b = tl.load(w_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(DT)
        acc = tiles._dot(a, b, acc, IEEE)
    ok = m_ok[:, None] & n_ok[None, :]
    off = rm.to(tl.int64)[:, None]
    acc += tl.load(sh_ptr + off * stride_sh + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + off * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _latent_tail_gemv_kernel(y_ptr, g_ptr, w_ptr, sh_ptr, out_ptr, D, ELL, stride_y, stride_w, stride_sh, stride_out,
                             eps, YN_DT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One token row t = program_id(1), outputs n in one BLOCK_N slice, no tensor cores (dot-free GEMV):
        r      = sqrt(mean(y[t]²) + eps)                       (whole row, every program: 14 KB from L2)
        yn[k]  = YN_DT(y[t, k] / r · g[k])                      (rounded where the reference's cast rounds)
        out[n] = Σ_j P[n, j] + shared[t, n],  P[n, j] = Σ_i yn[k0_i + j]·W[n, k0_i + j]   (fp32, k0_i in order)
    The first W tile is requested before the norm's reduction (and before the PDL wait: `_pdl.py`) so the
    stream starts at once."""
    t = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < D
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
    w_next = tl.load(w_ptrs, mask=n_ok[:, None] & (rk < ELL)[None, :], other=0.0)
    pdl_enter(PDL)
    rl = tl.arange(0, BLOCK_L)
    yr = tl.load(y_ptr + t * stride_y + rl, mask=rl < ELL, other=0.0).to(tl.float32)
    rs = tl.sqrt(tl.sum(yr * yr, 0) / ELL + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, ELL, BLOCK_K):
        wt = w_next.to(tl.float32)
        kn = k0 + BLOCK_K + rk
        w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=n_ok[:, None] & (kn < ELL)[None, :], other=0.0)
        kk = k0 + rk
        k_ok = kk < ELL
        yk = tl.load(y_ptr + t * stride_y + kk, mask=k_ok, other=0.0).to(tl.float32)
        gk = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        xk = (yk / rs * gk).to(YN_DT).to(tl.float32)
        acc += wt * xk[None, :]
    o = tl.sum(acc, 1) + tl.load(sh_ptr + t * stride_sh + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + rn, o.to(out_ptr.dtype.element_ty), mask=n_ok)


# ------------------------------------------------------------------------------------------ host
def combine(o: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Σ_j weights[t,j]·o[t·k+j] -> f32 [T, ℓ] (slot order)."""
    T, K = weights.shape
    ell = o.shape[1]
    y = torch.empty(T, ell, dtype=torch.float32, device=o.device)
    if T == 0:
        return y
    bl = min(1024, triton.next_power_of_2(ell))
    bt = max(1, min(16, 4096 // bl))
    w = weights if weights.is_contiguous() else weights.contiguous()
    i = ids if ids.is_contiguous() else ids.contiguous()
    _combine_splits_kernel[(triton.cdiv(T, bt), triton.cdiv(ell, bl))](  # one "split": the plain weighted sum
        o, w, i, y, T, num_experts, ell, 0, o.stride(0), y.stride(0), TOPK=K, SPLIT=1, BT=bt, BL=bl, num_warps=4,
        **launch_kwargs())
    return y


def latent_tail(y: torch.Tensor, norm_w: torch.Tensor, w_up: torch.Tensor, shared: torch.Tensor, eps: float,
                config: dict) -> torch.Tensor:
    """(rms_norm(y)·norm_w, cast to shared's dtype) @ w_upᵀ + shared -> [T, d] in shared's dtype."""
    if y.dim() != 2 or tuple(norm_w.shape) != (y.shape[1],) or w_up.dim() != 2 or w_up.shape[1] != y.shape[1] \
            or tuple(shared.shape) != (y.shape[0], w_up.shape[0]):
        raise ValueError(f"{TAIL_OP}: y {tuple(y.shape)}, norm_w {tuple(norm_w.shape)}, w_up {tuple(w_up.shape)}, "
                         f"shared {tuple(shared.shape)} do not fit y [T, l], norm_w [l], w_up [d, l], shared [T, d]")
    if shared.dtype not in gg._TL:
        raise ValueError(f"{TAIL_OP}: shared dtype {shared.dtype} is not bf16/fp16/fp32")
    T, ell = y.shape
    D = w_up.shape[0]
    out = torch.empty(T, D, dtype=shared.dtype, device=y.device)
    if T == 0:
        return out
    w = w_up if w_up.stride(-1) == 1 else w_up.contiguous()
    sh = shared if shared.stride(-1) == 1 else shared.contiguous()
    if config.get("U_GEMV"):  # one launch: norm + cast + GEMV + shared add (decode rows)
        _latent_tail_gemv_kernel[(triton.cdiv(D, config["G_BN"]), T)](
            y, norm_w, w, sh, out, D, ell, y.stride(0), w.stride(0), sh.stride(0), out.stride(0), float(eps),
            YN_DT=gg._TL[shared.dtype], BLOCK_L=triton.next_power_of_2(ell), BLOCK_N=config["G_BN"],
            BLOCK_K=config["G_BK"], num_warps=config["G_warps"], **launch_kwargs())
        return out
    yn = torch.empty(T, ell, dtype=shared.dtype, device=y.device)
    bl = triton.next_power_of_2(ell)
    bt = max(1, min(16, 4096 // bl))
    _latent_norm_kernel[(triton.cdiv(T, bt),)](y, norm_w, yn, T, ell, y.stride(0), yn.stride(0), float(eps),
                                               BT=bt, BL=bl, num_warps=4 if bl <= 4096 else 8, **launch_kwargs())
    bm, bn = config["U_BM"], config["U_BN"]
    _up_proj_add_kernel[(triton.cdiv(T, bm) * triton.cdiv(D, bn),)](
        yn, w, sh, out, T, D, ell, yn.stride(0), w.stride(0), sh.stride(0), out.stride(0),
        IEEE=yn.dtype == torch.float32, DT=gg._TL[yn.dtype], BM=bm, BN=bn, BK=config["U_BK"],
        GROUP_M=config["U_group"], num_warps=config["U_warps"], num_stages=config["U_stages"], **launch_kwargs())
    return out


# --------------------------------------------------------------------------------------- template
U_BATCH_INVARIANT = {"U_BM": 64, "U_BN": 64, "U_BK": 64, "U_warps": 4, "U_stages": 3, "U_group": 8}


def key_dims(a, attrs) -> dict:
    y, _, w_up, shared = a.operands
    return {"T": int(y.shape[0]), "L": int(y.shape[1]), "D": int(w_up.shape[0]),
            "BF16": int(gg.storage(shared) == "bf16"), "BI": int(bool(attrs.get("batch_invariant", False)))}


def bucket(key: dict) -> dict:
    """T to a power of two; in batch-invariant mode T is dropped: one config serves every batch."""
    return {**key, "T": 0 if key.get("BI") else pow2_bucket(key["T"])}


GEMV_OFF = {"U_GEMV": 0, "G_BN": 16, "G_BK": 512, "G_warps": 4}


def heuristic(key: dict, target=None) -> dict:
    """T = 1 (not batch-invariant): the one-launch dot-free GEMV, 16 output rows × 256 K per step and
    8 warps a program (d / 16 programs: ~3 per SM at d = 7168).
    Decode (T <= 64): BM covers the batch, narrow BN for > 1 wave over d; prefill: 128×128 tiles."""
    if key.get("BI"):
        cfg = dict(U_BATCH_INVARIANT)
    elif key["T"] == 1:
        # H200, session 6 (L=3584, N=7168, bf16): G_BK 256 16.2 µs, 512 17.9, G_BN 8 17.0, 8 warps x 32 rows 17.2.
        # Session 18, inside the rank decode graph (benches/bench_runtime_gpu.py --sections graph_configs, batch 1,
        # medians of 8 captures): 8 warps 550.7 vs 4 warps 554.0 us a step (3 tails); 8 warps with G_BN 8 571.1,
        # with G_BK 512 557.9, G_BK 128 571.2; 2 warps 558.8. (Alone, as a graph of itself, 4 warps is as fast: what
        # the tail costs in the step depends on what runs beside it.)
        cfg = {**U_BATCH_INVARIANT, "U_GEMV": 1, "G_BN": 16, "G_BK": 256, "G_warps": 8}
    elif key["T"] <= 64:
        cfg = {"U_BM": max(16, pow2_bucket(key["T"])), "U_BN": 32, "U_BK": 128, "U_warps": 4, "U_stages": 4,
               "U_group": 8}
    else:
        cfg = {"U_BM": 128, "U_BN": 128, "U_BK": 64, "U_warps": 8, "U_stages": 3, "U_group": 8}
    cfg["U_BK"] = gg._fit_bk(cfg["U_BK"], key["L"], False)
    return {**GEMV_OFF, **cfg}


def constraints(config: dict, key: dict, target=None) -> list[str]:
    out = []
    if key.get("BI") and any(config[k] != v for k, v in U_BATCH_INVARIANT.items()):
        out.append("batch_invariant: up-projection tiles are fixed to U_BATCH_INVARIANT")
    if config["U_stages"] * (config["U_BM"] + config["U_BN"]) * config["U_BK"] * 2 > 220 * 1024:
        out.append("up-projection pipeline exceeds ~220 KiB of shared memory")
    if config.get("U_GEMV") and (key.get("BI") or key["T"] != 1):
        out.append("the GEMV path serves T = 1 only, never under batch invariance (its K order differs)")
    if config.get("U_GEMV") and config["G_BN"] * config["G_BK"] > 64 * config["G_warps"] * 32:
        out.append("GEMV tile G_BN*G_BK > 64 fp32 accumulator values a thread spills")
    return out


def supports(a, attrs, target=None):
    """Operands may be tensors (run time) or TensorTypes (compile time)."""
    if len(a.operands) != 4:
        return f"expects operands ({', '.join(TAIL_OPERANDS)}), found {len(a.operands)}"
    kinds = dict(zip(TAIL_OPERANDS, (gg.storage(x) for x in a.operands)))
    bad = {n: k for n, k in kinds.items() if k not in ("bf16", "f32", "f16")}
    if bad:
        return f"operands {bad} are not float (the up-projection is not packed)"
    if attrs.get("eps") is None:
        return "no eps attribute (the latent rms_norm's)"
    return None


def launch(a, attrs, config=None):
    y, norm_w, w_up, shared = a.operands
    cfg = {**heuristic(key_dims(a, attrs)), **(config or {})}
    return latent_tail(y, norm_w, w_up, shared, attrs["eps"], cfg)


TEMPLATES = [KernelTemplate(
    family="moe_latent_tail", backend="triton", ops=(TAIL_OP,), launch=launch, key_dims=key_dims,
    heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
    tunables=(Tunable("U_BM", (16, 32, 64, 128)), Tunable("U_BN", (32, 64, 128)), Tunable("U_BK", (32, 64, 128)),
              Tunable("U_warps", (4, 8)), Tunable("U_stages", (2, 3, 4)), Tunable("U_group", (1, 8, 16)),
              Tunable("U_GEMV", (0, 1)), Tunable("G_BN", (4, 8, 16, 32)), Tunable("G_BK", (128, 256, 512, 1024)),
              Tunable("G_warps", (2, 4, 8))),
    doc="latent RMSNorm with its gain on the activation (= folded W_up·diag(w)) + cast in one kernel, then the "
        "up-projection with the shared-expert add in its epilogue")]

__all__ = ["TAIL_OP", "TAIL_OPERANDS", "combine", "latent_tail", "TEMPLATES"]
