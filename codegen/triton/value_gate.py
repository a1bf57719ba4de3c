"""MLA value up-projection (`mla_value_proj`) and value projection + sigmoid output gate in one kernel
(`fused.value_gate`).

Per token t and head h, W_UV^h = rows dn..dn+dv of head h of kv_b viewed [H, dn+dv, kv]:
    o[t, h, :]         = W_UV^h o~[t, h, :]                         (mla_value_proj, [T, H, dv])
    y[t, h*dv + n]     = o[t, h, n] * sigmoid(gate[t, h*dv + n])     (fused.value_gate, [T, H*dv])
A program computes one (BLOCK_T tokens) x (one head) x (BLOCK_V value channels) tile with the shared
GEMM tile loop (`gemm.gemm_tile`, kv reduced in BLOCK_K steps, fp32 accumulation, no split-K) and
applies the gate in registers before the only store: o never goes to memory. BLOCK_T = 1 (decode, one
token): no tensor cores, the tile is a dot-free GEMV (fp32 products summed over each BLOCK_K lane, then
across lanes), so narrow BLOCK_V slices spread W_UV over many programs. Its first weight tile (all of
W_UV's slice when kv <= BLOCK_K) is loaded before `pdl_wait` (_pdl.py), so it streams while the previous
kernel finishes; after the wait the o~ row (broadcast over the tile's rows: loaded in the tile's register
layout, no shared-memory exchange) and the gate are loaded together. H200, session 12, rank preset (12 heads,
kv 512, dv 128; benches/results/h200-2026-11-30-s12/decode_fallbacks_front_value_gate.json; µs alone in a
graph / marginal in a PDL chain after an rms_norm producer; byte floor 0.76): the session-6 form (every load
after the wait, 16 rows x 4 warps) 2.27 / 2.09; preloaded, BLOCK_V x warps: 8 x 4 1.53 / 1.17, 16 x 4
1.49 / 1.26, 8 x 2 1.57 / 1.24, 4 x 2 1.54 / 1.27, 4 x 1 1.61 / 1.55, 16 x 8 1.53 / 1.52, 32 x 8 1.70 / 1.87.

`fused.value_gate` operands (passes/fused_value_gate.py): (o_latent [T, H, kv], kv_b [H*(dn+dv), kv],
gate [T, H*dv] (the gate projection's output, before the sigmoid)); attr nope_dim; result y [T, H*dv].
Under `batch_invariant` the config ignores T, so a token's reduction order is the same in any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.gemm import dot_numerics, gemm_tile


@triton.jit
def _value_gate_kernel(o_ptr, w_ptr, g_ptr, y_ptr, T, KV, DV, stride_ot, stride_oh, stride_wn, stride_gt,
                       stride_yt, ROWS_PER_HEAD, NOPE,
                       GATE: tl.constexpr, DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr,
                       X_SPLITS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    t_ok = offs_t < T
    v_ok = offs_v < DV
    x_ptr = o_ptr + head.to(tl.int64) * stride_oh
    wh_ptr = w_ptr + (head.to(tl.int64) * ROWS_PER_HEAD + NOPE) * stride_wn
    cols = head * DV + offs_v
    ok = t_ok[:, None] & v_ok[None, :]
    rows64 = offs_t.to(tl.int64)[:, None]
    if BLOCK_T == 1:  # one token: dot-free GEMV, P[v, j] = sum_i W[v, k0_i + j] o~[k0_i + j], then sum_j
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = wh_ptr + offs_v.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        w0 = tl.load(w_ptrs, mask=v_ok[:, None] & (rk < KV)[None, :], other=0.0)  # weights: before the wait
        pdl_enter(PDL)
        x_ptrs = x_ptr + tl.program_id(0).to(tl.int64) * stride_ot + rk[None, :] + (offs_v * 0)[:, None]
        x0 = tl.load(x_ptrs, mask=(tl.program_id(0) < T) & (rk < KV)[None, :], other=0.0)
        if GATE:
            g = tl.load(g_ptr + rows64 * stride_gt + cols[None, :], mask=ok, other=0.0)
        part = w0.to(ACC_DTYPE) * x0.to(ACC_DTYPE)
        for k0 in range(BLOCK_K, KV, BLOCK_K):
            k_ok = k0 + rk < KV
            wt = tl.load(w_ptrs + k0, mask=v_ok[:, None] & k_ok[None, :], other=0.0).to(ACC_DTYPE)
            xt = tl.load(x_ptrs + k0, mask=k_ok[None, :] & (tl.program_id(0) < T), other=0.0).to(ACC_DTYPE)
            part += wt * xt
        acc = tl.sum(part, axis=1)[None, :]
    else:
        pdl_enter(PDL)
        acc = gemm_tile(x_ptr, wh_ptr, wh_ptr, offs_t, offs_v, t_ok, v_ok, KV, stride_ot, 1, stride_wn, 1, 0, 0,
                        0, 1, 1, DOT_DTYPE, ACC_DTYPE, X_SPLITS, PRECISION, EVEN_K, BLOCK_T, BLOCK_V, BLOCK_K)
        if GATE:
            g = tl.load(g_ptr + rows64 * stride_gt + cols[None, :], mask=ok, other=0.0)
    if GATE:
        acc = acc / (1.0 + tl.exp(-g.to(ACC_DTYPE)))
    tl.store(y_ptr + rows64 * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


def value_gate(o_latent: torch.Tensor, kv_b: torch.Tensor, nope_dim: int, config: dict,
               gate: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H*dv]: W_UV o~ per head, times sigmoid(gate) when a gate is given."""
    if o_latent.dim() != 3:
        raise ValueError(f"value projection: o_latent must be [T, H, kv], found {tuple(o_latent.shape)}")
    T, H, kv = o_latent.shape
    if kv_b.dim() != 2 or kv_b.shape[1] != kv or kv_b.shape[0] % H:
        raise ValueError(f"value projection: kv_b {tuple(kv_b.shape)} is not [H*(dn+dv), {kv}] for H={H}")
    rows = kv_b.shape[0] // H
    dv = rows - nope_dim
    if dv <= 0:
        raise ValueError(f"value projection: nope_dim {nope_dim} leaves no value rows in kv_b {tuple(kv_b.shape)}")
    if gate is not None and tuple(gate.shape) != (T, H * dv):
        raise ValueError(f"value gate: gate {tuple(gate.shape)} must be [{T}, {H * dv}]")
    o = o_latent if o_latent.stride(-1) == 1 else o_latent.contiguous()
    w = kv_b if kv_b.stride(-1) == 1 else kv_b.contiguous()
    g = None if gate is None else (gate if gate.stride(-1) == 1 else gate.contiguous())
    y = torch.empty(T, H * dv, dtype=o.dtype, device=o.device)
    if T == 0:
        return y
    bt, bv, bk = config["BLOCK_T"], config["BLOCK_V"], config["BLOCK_K"]
    grid = (triton.cdiv(T, bt), H, triton.cdiv(dv, bv))
    _value_gate_kernel[grid](
        o, w, g if g is not None else y, y, T, kv, dv, o.stride(0), o.stride(1), w.stride(0),
        g.stride(0) if g is not None else 0, y.stride(0), rows, nope_dim, GATE=g is not None,
        **dot_numerics(o.dtype, w.dtype), EVEN_K=kv % bk == 0, BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=bk,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **launch_kwargs())
    return y


# ---- template plumbing ---------------------------------------------------------------------------
def _key(o_latent, kv_b, attrs) -> dict:
    T, H, kv = (int(d) for d in o_latent.shape)
    return {"T": T, "H": H, "KV": kv, "DV": int(kv_b.shape[0]) // H - int(attrs["nope_dim"]),
            "bi": int(bool(attrs.get("batch_invariant", False)))}


def _bucket(key: dict) -> dict:
    b = dict(key)
    b["T"] = 0 if b["bi"] else pow2_bucket(b["T"])
    return b


TUNABLES = (Tunable("BLOCK_T", (1, 16, 32, 64, 128)), Tunable("BLOCK_V", (8, 16, 32, 64, 128)),
            Tunable("BLOCK_K", (32, 64, 128, 256, 512)), Tunable("num_warps", (1, 2, 4, 8)),
            Tunable("num_stages", (1, 2, 3, 4)))


def heuristic(key: dict, target: str) -> dict:
    """T = 1 (not batch-invariant): the dot-free GEMV, BLOCK_V = 8 value rows x BLOCK_K 512 a program, 4 warps
    (H*dv/8 programs stream W_UV; the module docstring has the H200 sweep); decode (T <= 64): BLOCK_T =
    pow2(T) >= 16, BLOCK_V = 64 so H*dv/64 programs stream W_UV; prefill: 128 x 128 tiles, 3 stages.
    Batch-invariant: 64 x 64 for every T.
    cpu: whole-head tiles."""
    dv = pow2_bucket(key["DV"], 16)
    if key["T"] == 1 and not key["bi"]:
        return {"BLOCK_T": 1, "BLOCK_V": min(dv, 8), "BLOCK_K": min(512, pow2_bucket(key["KV"], 16)),
                "num_warps": 4, "num_stages": 1}
    if target == "cpu":
        return {"BLOCK_T": 64, "BLOCK_V": min(dv, 128), "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    if key["bi"]:
        return {"BLOCK_T": 64, "BLOCK_V": min(dv, 64), "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    if key["T"] <= 64:
        return {"BLOCK_T": max(16, pow2_bucket(key["T"], 16)), "BLOCK_V": min(dv, 64), "BLOCK_K": 128,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_T": 128, "BLOCK_V": min(dv, 128), "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    if config["BLOCK_T"] == 1:
        vpt = config["BLOCK_V"] * config["BLOCK_K"] // (32 * config["num_warps"])
        return [f"GEMV tile of {vpt} fp32 values a thread spills"] if vpt > 64 else []
    smem = (config["BLOCK_T"] + config["BLOCK_V"]) * config["BLOCK_K"] * 2 * max(1, config["num_stages"])
    if target != "cpu" and smem > 232448:
        return [f"shared memory (BLOCK_T+BLOCK_V)*BLOCK_K*2*stages = {smem} B > 232448 B"]
    return []


def _supports(o_latent, kv_b, attrs) -> str | None:
    if len(o_latent.shape) != 3 or len(kv_b.shape) != 2:
        return f"o_latent must be [T, H, kv] and kv_b 2-D, found ranks {len(o_latent.shape)}/{len(kv_b.shape)}"
    if "nope_dim" not in attrs:
        return "attribute nope_dim missing"
    name = getattr(kv_b.dtype, "name", None)
    if name is not None and name not in ("f32", "bf16", "f16", "f64"):
        return f"kv_b dtype {name} is not a plain float"
    return None


def _launch_value_proj(a, attrs, config):
    y = value_gate(a.o_latent, a.kv_b, int(attrs["nope_dim"]), config)
    return y.reshape(a.o_latent.shape[0], a.o_latent.shape[1], -1)


def _launch_value_gate(a, attrs, config):
    o_latent, kv_b, gate = a.operands
    return value_gate(o_latent, kv_b, int(attrs["nope_dim"]), config, gate=gate)


TEMPLATES = [
    KernelTemplate(
        family="mla_value_proj", backend="triton", ops=("mla_value_proj",), launch=_launch_value_proj,
        key_dims=lambda a, attrs: _key(a.o_latent, a.kv_b, attrs), heuristic=heuristic, tunables=TUNABLES,
        bucket=_bucket, constraints=constraints, supports=lambda a, attrs, target: _supports(a.o_latent, a.kv_b, attrs),
        batch_invariant=True, doc="o^h = W_UV^h o~^h, a per-head GEMM"),
    KernelTemplate(
        family="value_gate", backend="triton", ops=("fused.value_gate",), launch=_launch_value_gate,
        key_dims=lambda a, attrs: _key(a.operands[0], a.operands[1], attrs), heuristic=heuristic, tunables=TUNABLES,
        bucket=_bucket, constraints=constraints,
        supports=lambda a, attrs, target: _supports(a.operands[0], a.operands[1], attrs),
        batch_invariant=True, doc="W_UV o~ per head times sigmoid(gate), one store"),
]
