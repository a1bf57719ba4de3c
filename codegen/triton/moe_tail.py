"""Fused LatentMoE tail: the fused op `fused.latent_moe_tail` (SPEC §6, DESIGN §5 T12).

The subgraph it replaces, as `k31c/model/build.py::_ModelWriter._ffn` writes it for a LatentMoE layer:

    y   = moe_experts(z, weights, ids, w1, w2, w3; act, beta1, beta2)   # f32 [T, ℓ], weighted combine
    y   = rms_norm(y, norm_weight; eps)                                 # only if latent_moe_use_norm
    y   = cast(y; dtype)                                                # activation dtype
    y   = linear(y, up_weight)                                          # ℓ -> d  (routed_expert_up_proj)
    out = add(y, shared)                                                # shared = shared-expert MLP(x), [T, d]

Operands, in order (the fusion pass binds them like this; `bind_tail` maps a positional list):
    z [T, ℓ], weights f32 [T, k], ids i64 [T, k], w1 [E, I, ℓ], w2 [E, ℓ, I], w3 [E, I, ℓ]  (moe_experts'
    operands; w1/w2/w3 dense or PackedMXFP4), up_weight [d, ℓ], shared [T, d], norm_weight [ℓ] (optional,
    last: present iff the rms_norm has a gain).
Attributes: act, beta1, beta2 (moe_experts'), eps (float: the latent rms_norm's eps; absent/None when
the layer has no latent norm), dtype (the cast's dtype; the kernel computes the normalised latent in
`shared`'s dtype, which is that activation dtype at run time), batch_invariant (optional bool).
Result: out [T, d] in `shared`'s dtype.

Kernels: the grouped expert GEMMs of moe_grouped_gemm.py write per-pair outputs o [T·k, ℓ]; then
  1. combine + norm: y = Σ_j w[t,j]·o[t·k+j] (fp32, slot order), y / sqrt(mean(y²) + eps) ⊙ norm_weight,
     one program holding whole rows of ℓ, stored in the activation dtype. Applying the gain to the
     activation tile equals the folded up-projection (W_lu·diag(w)) y/rms without a pass over W_lu.
  2. up-projection + shared add: out = y_n @ W_luᵀ + shared, fp32 accumulation, no split-K.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable
from codegen.triton import moe_grouped_gemm as gg
from ir.packed import PackedMXFP4

TAIL_OP = "fused.latent_moe_tail"
TAIL_OPERANDS = ("z", "weights", "ids", "w1", "w2", "w3", "up_weight", "shared", "norm_weight?")
TAIL_ATTRS = ("act", "beta1", "beta2", "eps", "dtype", "batch_invariant")


def bind_tail(operands) -> SimpleNamespace:
    """Positional operands (order of TAIL_OPERANDS) -> namespace; a missing norm_weight is None."""
    names = [n.rstrip("?") for n in TAIL_OPERANDS]
    if not len(names) - 1 <= len(operands) <= len(names):
        raise ValueError(f"{TAIL_OP} takes operands ({', '.join(TAIL_OPERANDS)}), got {len(operands)}")
    return SimpleNamespace(**dict(zip(names, list(operands) + [None] * (len(names) - len(operands)))))


@triton.jit
def _up_proj_add_kernel(y_ptr, w_ptr, sh_ptr, out_ptr, T, D, ELL, stride_y, stride_w, stride_sh, stride_out,
                        IEEE: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """out[t, n] = Σ_k y[t, k]·W[n, k] + shared[t, n] (fp32 accumulation, K in BK steps, one program)."""
    pm, pn = gg._swizzle(tl.program_id(0), tl.cdiv(T, BM), tl.cdiv(D, BN), GROUP_M)
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
        acc = gg._dot(a, b, acc, IEEE)
    ok = m_ok[:, None] & n_ok[None, :]
    off = rm.to(tl.int64)[:, None]
    acc += tl.load(sh_ptr + off * stride_sh + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + off * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def up_proj_add(y: torch.Tensor, up_weight: torch.Tensor, shared: torch.Tensor, config: dict) -> torch.Tensor:
    """y [T, ℓ] @ up_weightᵀ [ℓ, d] + shared [T, d] -> [T, d] in shared's dtype."""
    T, ell = y.shape
    D = up_weight.shape[0]
    if tuple(up_weight.shape) != (D, ell) or tuple(shared.shape) != (T, D):
        raise ValueError(f"{TAIL_OP}: up_weight {tuple(up_weight.shape)} / shared {tuple(shared.shape)} "
                         f"do not match latent [{T}, {ell}] -> [{T}, d]")
    w = up_weight if up_weight.stride(-1) == 1 else up_weight.contiguous()
    sh = shared if shared.stride(-1) == 1 else shared.contiguous()
    out = torch.empty(T, D, dtype=shared.dtype, device=y.device)
    if T == 0:
        return out
    bm, bn, bk = config["U_BM"], config["U_BN"], config["U_BK"]
    _up_proj_add_kernel[(triton.cdiv(T, bm) * triton.cdiv(D, bn),)](
        y, w, sh, out, T, D, ell, y.stride(0), w.stride(0), sh.stride(0), out.stride(0),
        IEEE=y.dtype == torch.float32, DT=gg._TL[y.dtype], BM=bm, BN=bn, BK=bk, GROUP_M=config["U_group"],
        num_warps=config["U_warps"], num_stages=config["U_stages"])
    return out


def latent_moe_tail(z, weights, ids, w1, w2, w3, up_weight, shared, norm_weight=None, eps: float | None = None,
                    act: str = "situ", beta1=None, beta2=None, config: dict | None = None) -> torch.Tensor:
    """Experts + weighted combine + latent RMSNorm (eps given) + up-projection + shared add."""
    if norm_weight is not None and eps is None:
        raise ValueError(f"{TAIL_OP}: norm_weight given but no eps (the latent rms_norm's eps attribute)")
    if shared.dtype not in gg._TL:
        raise ValueError(f"{TAIL_OP}: shared dtype {shared.dtype} is not bf16/fp16/fp32")
    key = _key_from(z, ids, w1, up_weight, config or {})
    cfg = {**heuristic(key), **(config or {})}
    o, seg = gg.expert_pair_outputs(z, ids, w1, w2, w3, act, beta1, beta2, cfg)
    y = gg.combine(o, weights, ids, seg.num_experts, gain=norm_weight, eps=eps, out_dtype=shared.dtype)
    return up_proj_add(y, up_weight, shared, cfg)


# --------------------------------------------------------------------------------------- template
U_BATCH_INVARIANT = {"U_BM": 64, "U_BN": 64, "U_BK": 64, "U_warps": 4, "U_stages": 3, "U_group": 8}


def _key_from(z, ids, w1, up_weight, attrs) -> dict:
    key = gg._key(z.shape[0], w1.shape[0], ids.shape[1], z.shape[1], w1.shape[1], isinstance(w1, PackedMXFP4),
                  z.dtype, attrs)
    return {**key, "D": int(up_weight.shape[0])}


def key_dims(a, attrs) -> dict:
    return _key_from(a.z, a.ids, a.w1, a.up_weight, attrs)


def bucket(key: dict) -> dict:
    return {**gg.bucket(key), "D": key["D"]}


def heuristic(key: dict, target=None) -> dict:
    cfg = gg.heuristic(key, target)
    if key.get("BI"):
        u = dict(U_BATCH_INVARIANT)
    elif key["T"] <= 64:
        u = {"U_BM": max(16, triton.next_power_of_2(key["T"])), "U_BN": 32, "U_BK": 128, "U_warps": 4, "U_stages": 4,
             "U_group": 8}
    else:
        u = {"U_BM": 128, "U_BN": 128, "U_BK": 64, "U_warps": 8, "U_stages": 3, "U_group": 8}
    u["U_BK"] = gg._fit_bk(u["U_BK"], key["L"], False)
    return {**cfg, **u}


def constraints(config: dict, key: dict, target=None) -> list[str]:
    out = gg.constraints(config, key, target)
    if key.get("BI") and any(config[k] != v for k, v in U_BATCH_INVARIANT.items()):
        out.append("batch_invariant: up-projection tiles are fixed to U_BATCH_INVARIANT")
    if config["U_stages"] * (config["U_BM"] + config["U_BN"]) * config["U_BK"] * 2 > 220 * 1024:
        out.append("up-projection pipeline exceeds ~220 KiB of shared memory")
    return out


def supports(a, attrs, target=None):
    why = gg.supports(a, attrs, target)
    if why:
        return why
    if isinstance(a.up_weight, PackedMXFP4) or not a.up_weight.is_floating_point():
        return "up_weight must be a float tensor"
    if a.norm_weight is not None and attrs.get("eps") is None:
        return "norm_weight given without eps"
    return None


def launch(a, attrs, config=None):
    cfg = dict(config or {})
    bi = bool(attrs.get("batch_invariant") or cfg.pop("batch_invariant", False))
    cfg = {**heuristic(key_dims(a, {"batch_invariant": bi})), **cfg}
    return latent_moe_tail(a.z, a.weights, a.ids, a.w1, a.w2, a.w3, a.up_weight, a.shared, a.norm_weight,
                           attrs.get("eps"), attrs["act"], attrs.get("beta1"), attrs.get("beta2"), cfg)


TEMPLATES = [KernelTemplate(
    family="moe_latent_tail", backend="triton", ops=(TAIL_OP,), launch=launch, key_dims=key_dims,
    heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
    tunables=gg.TEMPLATES[0].tunables + (Tunable("U_BM", (16, 32, 64, 128)), Tunable("U_BN", (32, 64, 128)),
                                         Tunable("U_BK", (32, 64, 128)), Tunable("U_warps", (4, 8)),
                                         Tunable("U_stages", (2, 3, 4)), Tunable("U_group", (1, 8, 16))),
    doc="grouped experts, then fp32 slot-order combine + latent RMSNorm (gain on the activation = folded "
        "W_lu·diag(w)) in one kernel, then up-projection with the shared-expert add in its epilogue")]

__all__ = ["TAIL_OP", "TAIL_OPERANDS", "TAIL_ATTRS", "bind_tail", "latent_moe_tail", "up_proj_add", "TEMPLATES"]
