"""`fused.routed_linear` (passes/router_epilogue.py): the MoE router's logits GEMM with the router in its
epilogue, one launch instead of two.

    logits = x @ W^T                  (x read as f32 when attr x_dtype="f32": the widened bf16 hidden state)
    w, ids = moe_router(logits, bias) (sigmoid | softmax, (grouped) top-k, renormalisation, scaling)

Every program computes its [BLOCK_M, BLOCK_N] logits tile of K split `split` with the GEMM's tiles
(`gemv_tile` / `gemm_tile`: the same per-element K order as gemm.py under the same config) and stores it as
an fp32 partial, then counts itself in on its row block's counter (one acq_rel atomic after a barrier). The
program that arrives last for a row block (every column tile and split of it written) adds the partials in
split order, (((P_0 + P_1) + P_2) + ...), the bits of the GEMM's combine, stores the row block's logits,
and runs the router on them (`moe_router.route_rows`, the router kernel's own code), then resets the counter.
So ids equal the unfused GEMM + router launched with the same configs, and the weights too whenever the
router's reductions see the same operand order (top-2: one addition). The logits stay in a scratch buffer.

Decode shapes only (M <= ROUTE_MAX_M rows): the last arriver routes a whole row block in registers. Larger
M (prefill) runs the two kernels it replaces, gemm() then router(), with the same configs. Configs,
tunables and heuristic are the GEMM's (gemm.py) for the logits shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate
from codegen.triton import gemm as gm
from codegen.triton._gemv import dot_numerics, gemm_tile, gemv_tile, k_chunk, tile_counters
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.moe_router import expert_lanes, route_rows, router

OP = "fused.routed_linear"
ROUTE_MAX_M = 64          # rows a launch routes in its epilogue; above: the GEMM and the router kernels
ROUTE_TILE = 32768        # BLOCK_M x expert lanes one program routes (the router kernel's own bound)


@triton.jit
def _routed_gemm_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, p_ptr, cnt_ptr, wout_ptr, ids_ptr, M, N, K, K_CHUNK,
                        stride_xm, stride_xk, stride_wn, stride_wk, scaling,
                        DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                        PRECISION: tl.constexpr, EVEN_K: tl.constexpr, GEMV: tl.constexpr, SPLIT_K: tl.constexpr,
                        LOOP_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PER: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        G_PAD: tl.constexpr, P_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                        SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    if SPLIT_K > 1:
        k_lo = split * K_CHUNK
        K = tl.minimum(K - k_lo, K_CHUNK)
        x_ptr += k_lo * stride_xk
        w_ptr += k_lo * stride_wk
    eid, lane = expert_lanes(PER, N_GROUP, G_PAD, P_PAD)
    bias = tl.load(bias_ptr + eid, mask=lane & HAS_BIAS, other=0.0).to(tl.float32)  # a parameter: before the wait
    if GEMV:
        acc = gemv_tile(x_ptr, w_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, 0, 0, 0, 1, 1, ACC_DTYPE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES, PDL)
    else:
        pdl_enter(PDL)
        acc = gemm_tile(x_ptr, w_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, 0, 0, 0, 1, 1, DOT_DTYPE, ACC_DTYPE, X_SPLITS, PRECISION, EVEN_K, BLOCK_M,
                        BLOCK_N, BLOCK_K)
    mn = tl.cast(M, tl.int64) * N
    tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(p_ptr + split * mn + tile, acc.to(tl.float32), mask=m_ok[:, None] & n_ok[None, :])
    tl.debug_barrier()  # every thread's partial before the release
    arrived = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * SPLIT_K - 1:
        if SPLIT_K > 1:  # the row block's logits, partials added in split order
            cols = tl.arange(0, G_PAD * P_PAD)
            ok = m_ok[:, None] & (cols < N)[None, :]
            rows = offs_m[:, None].to(tl.int64) * N + cols[None, :]
            total = tl.load(p_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(p_ptr + s * mn + rows, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(logits_ptr + rows, total, mask=ok)
            tl.debug_barrier()
        route_rows(logits_ptr, bias, offs_m, M, N, wout_ptr, ids_ptr, scaling, PER, N_GROUP, TOPK_GROUP, G_PAD,
                   P_PAD, TOPK, K_PAD, BLOCK_M, SOFTMAX, HAS_BIAS, RENORM)
        tl.atomic_xchg(cnt_ptr + pid_m, 0, sem="relaxed", scope="gpu")


def _router_args(E: int, attrs: dict) -> dict:
    n_group, topk = int(attrs.get("n_group", 1)), int(attrs["topk"])
    return dict(PER=E // n_group, N_GROUP=n_group, TOPK_GROUP=int(attrs.get("topk_group", 1)),
                G_PAD=triton.next_power_of_2(n_group), P_PAD=triton.next_power_of_2(E // n_group), TOPK=topk,
                K_PAD=triton.next_power_of_2(topk), SOFTMAX=attrs.get("activation", "sigmoid") == "softmax",
                RENORM=bool(attrs.get("renormalize", True)))


def routed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, attrs: dict, config: dict):
    """(weights f32 [M, topk], ids i64 [M, topk]) = moe_router(x @ w^T, bias) with the router attrs `attrs`
    (and x read as attrs["x_dtype"] when given)."""
    x2 = x.reshape(-1, x.shape[-1])
    as_dtype = torch.float32 if attrs.get("x_dtype") == "f32" else None
    M, E = x2.shape[0], w.shape[0]
    if M > ROUTE_MAX_M:   # prefill: the two kernels this one replaces
        logits = gm.gemm(x2, w, config, as_dtype=as_dtype)
        return router(logits, bias, int(attrs["topk"]), attrs.get("activation", "sigmoid"),
                      bool(attrs.get("renormalize", True)), float(attrs.get("scaling", 1.0)),
                      int(attrs.get("n_group", 1)), int(attrs.get("topk_group", 1)))
    ra = _router_args(E, attrs)
    K = x2.shape[1]
    if w.dim() != 2 or w.shape[1] != K or (bias is not None and tuple(bias.shape) != (E,)):
        raise ValueError(f"routed_linear: weight {tuple(w.shape)} / bias {None if bias is None else tuple(bias.shape)}"
                         f" do not match x {tuple(x2.shape)} ({E} experts)")
    if config["BLOCK_M"] * ra["G_PAD"] * ra["P_PAD"] > ROUTE_TILE:
        raise ValueError(f"routed_linear: BLOCK_M={config['BLOCK_M']} x {ra['G_PAD'] * ra['P_PAD']} expert lanes "
                         f"exceeds {ROUTE_TILE} values for the routing epilogue")
    dev = x2.device
    wout = torch.empty(M, ra["TOPK"], dtype=torch.float32, device=dev)
    ids = torch.empty(M, ra["TOPK"], dtype=torch.int64, device=dev)
    if M == 0:
        return wout, ids
    chunk, n_split = k_chunk(K, config["BLOCK_K"], int(config.get("SPLIT_K", 1)))
    logits = torch.empty(M, E, dtype=torch.float32, device=dev)
    partials = torch.empty(n_split, M, E, dtype=torch.float32, device=dev) if n_split > 1 else logits
    grid = (triton.cdiv(E, config["BLOCK_N"]), triton.cdiv(M, config["BLOCK_M"]), n_split)
    _routed_gemm_kernel[grid](
        x2, w, bias if bias is not None else w, logits, partials, tile_counters(dev, grid[1]), wout, ids, M, E, K,
        chunk, x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), float(attrs.get("scaling", 1.0)),
        **dot_numerics(as_dtype or x2.dtype, w.dtype), EVEN_K=K % config["BLOCK_K"] == 0,
        GEMV=int(config.get("GEMV", 0)), SPLIT_K=n_split, LOOP_STAGES=max(1, int(config["num_stages"])),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], **ra,
        HAS_BIAS=bias is not None, num_warps=config["num_warps"], num_stages=config["num_stages"], **launch_kwargs())
    return wout, ids


# ---- template plumbing ---------------------------------------------------------------------------
def _key(a, attrs) -> dict:
    return {**gm.gemm_key(a.operands[0], [a.operands[1]], attrs), "topk": int(attrs["topk"]),
            "G": int(attrs.get("n_group", 1))}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    lanes = triton.next_power_of_2(key["G"]) * triton.next_power_of_2(key["N"] // max(1, key["G"]))
    if key["M"] <= ROUTE_MAX_M and config["BLOCK_M"] * lanes > ROUTE_TILE:
        return [f"BLOCK_M={config['BLOCK_M']} x {lanes} expert lanes exceeds {ROUTE_TILE} routed values a program"]
    if config.get("GROUP_M", 1) != 1 and key["M"] <= ROUTE_MAX_M:
        return ["GROUP_M: the routed kernel's grid is (column tiles, row blocks, splits)"]
    return gm.constraints(config, key, target)


def heuristic(key: dict, target: str) -> dict:
    """The GEMM's heuristic for the logits shape, GROUP_M 1 (the routed grid has no grouped order)."""
    return dict(gm.heuristic(key, target), GROUP_M=1)


def _launch(a, attrs, config):
    gm.check_invariance(attrs, config)
    x, w = a.operands[:2]
    return routed_linear(x, w, a.operands[2] if len(a.operands) > 2 else None, attrs, config)


def _supports(a, attrs, target):
    x, w = a.operands[:2]
    if attrs.get("activation", "sigmoid") not in ("sigmoid", "softmax"):
        return f"router activation {attrs.get('activation')!r} is not sigmoid|softmax"
    if attrs.get("x_dtype") not in (None, "f32"):
        return f"x read as {attrs['x_dtype']!r} (f32 only)"
    if gm.dtype_name(w) == "f8e4m3":
        return "FP8 router weights (the routed GEMM reads plain weights)"
    if int(w.shape[0]) % int(attrs.get("n_group", 1)):
        return f"{w.shape[0]} experts do not split into n_group={attrs.get('n_group')} groups"
    return gm.supported_types(x, [w], target)


TEMPLATES = [
    KernelTemplate(
        family="routed_gemm", backend="triton", ops=(OP,), launch=_launch, key_dims=_key, heuristic=heuristic,
        tunables=gm.TUNABLES, bucket=gm.gemm_bucket, constraints=constraints, supports=_supports,
        batch_invariant=True, doc="router logits GEMM + the router (top-k, weights) in its last program's epilogue"),
]
