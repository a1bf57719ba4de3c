"""KDA chunked prefill (chunk 64, WY/UT form) for ragged batches of requests.

Math (SPEC §3.6, `ir.ref.kda.kda_chunked`): per request, head and chunk of C <= 64 tokens with
initial state S0 [D, Dv], inclusive cumulative log decay G_t = sum_{i<=t} g_i (per key channel):
    A_ti = beta_t sum_c k_tc k_ic e^{G_tc - G_ic}  (i < t),   L = I + A (unit lower triangular)
    W = L^-1 (beta e^G * K),  U = L^-1 (beta V),  d = U - W S0        (the delta-rule "new values")
    o = (scale q e^G) S0 + Aqk d,   Aqk_ti = scale sum_c q_tc k_ic e^{G_tc - G_ic}  (i <= t)
    S_C = diag(e^{G_C}) S0 + (e^{G_C - G} * K)^T d.
Two kernels:
  1. `_kda_intra_kernel`, one program per (chunk, head), fully parallel, on 2-D tiles. Phase 0
     stores lc, the cumulative decay since each 16-row sub-block's start (fp32 workspace), and G_C.
     Phase 1 accumulates A and Aqk as four [16, 64] row blocks over key-channel slices of BK: row
     block a takes rows k_i e^{lc_i} (<= 1) against columns k_j e^{G_a0 - G_j}, which are <= 1 for
     earlier sub-blocks (decayed to their end, then across the sub-blocks between) and bounded by
     e^60 in the diagonal block when the sub-block's decay span is < 60 (always for the K3 gate,
     |g| < 5 per token); wider spans take an exact per-column path, so nothing overflows for any
     g <= 0, and every exponent is a difference of nearby partial sums (fp32-accurate). L^-1 is
     built by row blocks from 16x16 diagonal inverses (I-N)(I+N^2)(I+N^4)(I+N^8) (N nilpotent).
     Phase 2 writes W, U, QG = scale q e^G, KG = k e^{G_C - G}, Aqk (input dtype) to the workspace.
     Config SPLIT_INTRA=1 stores L^-1 (fp32) instead and runs phase 2 as `_kda_wu.py`'s kernel;
     LOWP_A / LOWP_WU (bf16/fp16 inputs only) round the operands of the phase-1 / phase-2 products to
     bf16 (bf16 tensor cores, fp32 accumulation) instead of tf32 products of fp32 operands.
     Config A64=1 runs `_kda_intra64.py`'s kernel instead: the same workspace from [64, *] tiles only
     (row-masked 64-row products accumulating one [64, 64] A and Aqk, L^-1 as one [64, 64] tile).
  2. `_kda_state.py`'s kernel, one program per (request, head, Dv block), sequential over the request's
     chunks with S in registers (fp32): d, o and the next S; writes o, optional checkpoint states, and the
     final state back to the pool row `state_slot[r]` in place (Dv blocks: wider for batches, `heuristic`).
MAXNREG_INTRA caps kernel 1's registers (CUDA) so that more programs share an SM.
Chunks are cut from each request's first token (the last one partial; padded rows are exact no-ops); the
chunk table is built on the device by one kernel (`_kda_common.device_chunk_table`).
`kda_prefill(..., checkpoint_positions=...)` also cuts chunks at the requested positions, so the states there
come out of kernel 2 exactly. The optional fused gate computes g from raw f while loading (lower_bound *
sigmoid(exp(A_log)(f+dt_bias)), or -exp(A_log) softplus(f+dt_bias)). The `kda_gate` template is here too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from ._kda_common import BC, CHUNK, device_chunk_table, host_chunk_table, kda_gate
from ._kda_chunk_tiles import (_diag_exact, _gate_slice, _inv_unit_lower, _key_slice, _load2, _mask_rows, _row_block,
                               _solve_store, _spans, _st, _st64, _sub, decay_slices)
from ._kda_intra64 import run_intra64
from ._kda_state import _SMEM_BYTES, run_state, state_kernel_smem
from ._kda_wu import new_inverse_workspace, run_wu
from codegen.triton import _precision as precision


@triton.jit
def _kda_intra_kernel(q, k, v, g, beta, dtb, alog, chunk_start, chunk_len, W, U, QG, KG, AQK, GL, GW, AI,
                      s_q, s_k, s_v, s_g, s_b, scale, lower_bound,
                      H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      GATE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, FUSE_WU: tl.constexpr,
                      LOWP_A: tl.constexpr, LOWP_WU: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    L = tl.load(chunk_len + n)
    if L <= 0:
        return
    t0 = tl.load(chunk_start + n).to(tl.int64)
    q += h * D
    k += h * D
    v += h * DV
    g += h * D
    dtb += h * D
    beta += h
    base = (n.to(tl.int64) * H + h) * 64
    lw = GW + base * D                           # this chunk-head's lc [64, D], fp32
    rows = tl.arange(0, 64)
    # ---- phase 0: lc = cumulative decay since each 16-row sub-block's start (padded rows add 0); G_C
    decay_slices(g, dtb, alog, h, t0, L, s_g, lw, GL + (n.to(tl.int64) * H + h) * D, lower_bound, D, BK, GATE,
                 HAS_BIAS)
    # ---- phase 1 over key-channel slices: row blocks [16, 64] of A (keys x keys), Aqk (queries x keys)
    z = tl.zeros([BC, 64], dtype=tl.float32)
    a0, a1, a2, a3, p0, p1, p2, p3 = z, z, z, z, z, z, z, z
    n_unsafe = 0
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        s1, s2, unsafe, kf, lf, kend, kd = _key_slice(lw, k, t0, L, s_k, cols, D)
        n_unsafe += unsafe
        a0, p0 = _row_block(0, k, q, lw, t0, L, s_k, s_q, cols, kend, kd, s1, s2, a0, p0, D, PREC, LOWP_A)
        a1, p1 = _row_block(1, k, q, lw, t0, L, s_k, s_q, cols, kend, kd, s1, s2, a1, p1, D, PREC, LOWP_A)
        a2, p2 = _row_block(2, k, q, lw, t0, L, s_k, s_q, cols, kend, kd, s1, s2, a2, p2, D, PREC, LOWP_A)
        a3, p3 = _row_block(3, k, q, lw, t0, L, s_k, s_q, cols, kend, kd, s1, s2, a3, p3, D, PREC, LOWP_A)
    if n_unsafe > 0:  # rare (|g| > ~4 per token over a whole sub-block): exact diagonal blocks
        for kb in range(0, D, BK):
            cols = kb + tl.arange(0, BK)
            s0, s1, s2, s3, u0, u1, u2, u3 = _spans(lw, cols, D)
            if u0:
                a0, p0 = _diag_exact(0, k, q, lw, t0, L, s_k, s_q, cols, a0, p0, D)
            if u1:
                a1, p1 = _diag_exact(1, k, q, lw, t0, L, s_k, s_q, cols, a1, p1, D)
            if u2:
                a2, p2 = _diag_exact(2, k, q, lw, t0, L, s_k, s_q, cols, a2, p2, D)
            if u3:
                a3, p3 = _diag_exact(3, k, q, lw, t0, L, s_k, s_q, cols, a3, p3, D)
    aq = AQK + base * 64
    _st(aq, 0, rows, 64, _mask_rows(p0, 0, beta, t0, L, s_b, True) * scale)
    _st(aq, 16, rows, 64, _mask_rows(p1, 1, beta, t0, L, s_b, True) * scale)
    _st(aq, 32, rows, 64, _mask_rows(p2, 2, beta, t0, L, s_b, True) * scale)
    _st(aq, 48, rows, 64, _mask_rows(p3, 3, beta, t0, L, s_b, True) * scale)
    a0, a1 = _mask_rows(a0, 0, beta, t0, L, s_b, False), _mask_rows(a1, 1, beta, t0, L, s_b, False)
    a2, a3 = _mask_rows(a2, 2, beta, t0, L, s_b, False), _mask_rows(a3, 3, beta, t0, L, s_b, False)
    # ---- L^-1 by row blocks: Li_a = (I + A_aa)^-1 (E_a - sum_{m<a} A_am Li_m), E_a = rows a of I
    ii = tl.arange(0, BC)
    l0 = tl.dot(_inv_unit_lower(_sub(a0, 0), PREC), (rows[None, :] == ii[:, None]).to(tl.float32),
                input_precision=PREC)
    t = (rows[None, :] == 16 + ii[:, None]).to(tl.float32) - tl.dot(_sub(a1, 0), l0, input_precision=PREC)
    l1 = tl.dot(_inv_unit_lower(_sub(a1, 1), PREC), t, input_precision=PREC)
    t = (rows[None, :] == 32 + ii[:, None]).to(tl.float32) - tl.dot(_sub(a2, 0), l0, input_precision=PREC)
    t -= tl.dot(_sub(a2, 1), l1, input_precision=PREC)
    l2 = tl.dot(_inv_unit_lower(_sub(a2, 2), PREC), t, input_precision=PREC)
    t = (rows[None, :] == 48 + ii[:, None]).to(tl.float32) - tl.dot(_sub(a3, 0), l0, input_precision=PREC)
    t -= tl.dot(_sub(a3, 1), l1, input_precision=PREC) + tl.dot(_sub(a3, 2), l2, input_precision=PREC)
    l3 = tl.dot(_inv_unit_lower(_sub(a3, 3), PREC), t, input_precision=PREC)
    if not FUSE_WU:  # L^-1 (fp32) for `_kda_wu.py`'s kernel, which applies it (fewer live registers here)
        ai = AI + base * 64
        _st(ai, 0, rows, 64, l0)
        _st(ai, 16, rows, 64, l1)
        _st(ai, 32, rows, 64, l2)
        _st(ai, 48, rows, 64, l3)
        return
    # ---- phase 2: W = L^-1 (beta k e^G), QG = scale q e^G, KG = k e^{G_C - G}; U = L^-1 (beta v)
    if LOWP_WU:  # bf16 tensor-core products (fp32 accumulation) for the two solves
        l0, l1, l2, l3 = l0.to(tl.bfloat16), l1.to(tl.bfloat16), l2.to(tl.bfloat16), l3.to(tl.bfloat16)
    b64 = tl.load(beta + (t0 + rows) * s_b, mask=rows < L, other=0.0).to(tl.float32)[:, None]
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        kf, e, ec = _gate_slice(lw, k, t0, L, s_k, cols, D)     # k, e^G, e^{G_C - G}
        _solve_store(W + base * D, D, cols, kf * e * b64, l0, l1, l2, l3, PREC)
        _st64(QG + base * D, cols, D, _load2(q, t0, L, s_q, cols) * e * scale)
        _st64(KG + base * D, cols, D, kf * ec)
    for vb in range(0, DV, BV):
        cols = vb + tl.arange(0, BV)
        _solve_store(U + base * DV, DV, cols, _load2(v, t0, L, s_v, cols) * b64, l0, l1, l2, l3, PREC)


# ---------------------------------------------------------------------------------- host side
def _rows_view(x: torch.Tensor, T: int, width: int, what: str) -> torch.Tensor:
    """[T, ...] as [T, width] with unit stride inside a token (token stride free)."""
    if x.shape[0] != T or x.numel() != T * width:
        raise ValueError(f"kda_prefill: {what} has shape {tuple(x.shape)}, expected {T} tokens of {width}")
    return x.reshape(T, width) if x.reshape(T, width).stride(1) == 1 else x.reshape(T, width).contiguous()


def run_intra(q, k, v, graw, beta, starts, lens, scale, cfg, *, gate_mode=0, A_log=None, dt_bias=None,
              lower_bound=None):
    """Kernel 1 over the chunk table: the workspace (W, U, QG, KG, AQK, GL) of every (chunk, head)."""
    T, H, D = q.shape
    Dv = v.shape[-1]
    qv, kv_, vv = _rows_view(q, T, H * D, "q"), _rows_view(k, T, H * D, "k"), _rows_view(v, T, H * Dv, "v")
    gv, bv = _rows_view(graw, T, H * D, "g / f"), _rows_view(beta, T, H, "beta")
    low = q.dtype in (torch.bfloat16, torch.float16)
    ws_dt = q.dtype if low else torch.float32
    N, dev = starts.numel(), q.device
    W = torch.empty(N, H, CHUNK, D, device=dev, dtype=ws_dt)
    ws = (W, torch.empty(N, H, CHUNK, Dv, device=dev, dtype=ws_dt), torch.empty_like(W), torch.empty_like(W),
          torch.empty(N, H, CHUNK, CHUNK, device=dev, dtype=ws_dt),
          torch.empty(N, H, D, device=dev, dtype=torch.float32))
    gw = torch.empty(N, H, CHUNK, D, device=dev, dtype=torch.float32)  # lc per chunk, kernel-internal
    dummy = ws[5]  # any fp32 tensor stands in for an absent A_log / dt_bias (never read then)
    dtb, alog = dt_bias if dt_bias is not None else dummy, A_log if A_log is not None else dummy
    split = bool(cfg.get("SPLIT_INTRA", 0))
    ai = new_inverse_workspace(W) if split else dummy
    prec, lb = precision.fast_fp32() if low else "ieee", float(lower_bound) if lower_bound is not None else 0.0
    lowp_a, lowp_wu = low and bool(cfg.get("LOWP_A", 0)), low and bool(cfg.get("LOWP_WU", 0))  # bf16/fp16 in only
    cap = {"maxnreg": int(cfg["MAXNREG_INTRA"])} if cfg.get("MAXNREG_INTRA") and q.is_cuda else {}  # registers cap
    if cfg.get("A64", 0):  # the 64-row form (`_kda_intra64.py`): W/U always fused
        run_intra64((qv, kv_, vv, gv, bv), starts, lens, ws, gw, dtb, alog, scale, lb, gate_mode=gate_mode,
                    has_bias=dt_bias is not None, BK=min(cfg["BK"], D), BV=min(cfg["BV_INTRA"], Dv), PREC=prec,
                    LOWP_A=lowp_a, LOWP_WU=lowp_wu, num_warps=cfg["WARPS_INTRA"],
                    num_stages=cfg.get("STAGES_INTRA", 3), cap=cap)
        return ws
    _kda_intra_kernel[(N, H)](
        qv, kv_, vv, gv, bv, dtb, alog, starts, lens, *ws, gw, ai, qv.stride(0), kv_.stride(0), vv.stride(0),
        gv.stride(0), bv.stride(0), float(scale), lb, H=H, D=D, DV=Dv, BK=min(cfg["BK"], D),
        BV=min(cfg["BV_INTRA"], Dv), GATE=gate_mode, HAS_BIAS=dt_bias is not None, PREC=prec, FUSE_WU=not split,
        LOWP_A=lowp_a, LOWP_WU=lowp_wu,
        num_warps=cfg["WARPS_INTRA"], num_stages=cfg.get("STAGES_INTRA", 3), **cap)
    if split:
        run_wu((qv, kv_, vv, gv, bv), starts, lens, ai, ws, scale, BK=min(cfg.get("BK_WU", 64), D),
               BV=min(cfg.get("BV_WU", 64), Dv), PREC=prec, LOWP=lowp_wu, gate_mode=gate_mode, dtb=dtb, alog=alog,
               lower_bound=lb, has_bias=dt_bias is not None, num_warps=cfg.get("WARPS_WU", 4),
               num_stages=cfg.get("STAGES_WU", 2))
    return ws


def kda_prefill(q, k, v, g, beta, state, state_slot, cu_seqlens, scale: float, *, checkpoint_positions=None,
                f=None, A_log=None, dt_bias=None, lower_bound=None, config: dict | None = None):
    """Chunked KDA over a ragged batch (semantics of `ir.ref.kda.kda_chunked`), pool updated in place.

    q, k: [T, H, D] (L2-normalised), v: [T, H, Dv], g: [T, H, D] log decay (<= 0), beta: [T, H],
    state: pool [S, H, D, Dv] (fp32 or bf16), state_slot: [R] (distinct), cu_seqlens: [R+1].
    Returns o [T, H, Dv] in q's dtype.
    Fused gate: pass g=None and f [T, H*D] (raw), A_log [H], dt_bias [H*D] or None, lower_bound
    (float: K3 sigmoid gate; None: Kimi-Linear softplus gate).
    checkpoint_positions: one list per request of token counts p (1 <= p <= len_r); then returns
    (o, [states_r [len(positions_r), H, D, Dv] fp32]) with the state after the first p tokens (what
    the recurrence holds there; p = len_r is the final state, position 0 is the pool row itself).
    """
    T, H, D = q.shape
    R = state_slot.numel()
    if T == 0 or R == 0:  # nothing to run: no state changes, empty checkpoints (position 0 excluded)
        o = q.new_empty(T, H, v.shape[-1])
        return o if checkpoint_positions is None else (o, [q.new_empty(0, H, D, v.shape[-1]) for _ in range(R)])
    cfg = dict(heuristic({"D": D, "Dv": v.shape[-1], "H": H, "R": R}, "cuda" if q.is_cuda else "cpu"),
               **(config or {}))
    if g is None and (f is None or A_log is None):
        raise ValueError("kda_prefill: pass g, or the raw gate input f with A_log (fused gate)")
    gate_mode = 0 if g is not None else (1 if lower_bound is not None else 2)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    slots = state_slot  # any integer dtype: the kernel widens it
    if checkpoint_positions is None:
        starts, lens, req_chunks = device_chunk_table(cu, T)
        ck_index, n_ck, rows_of = None, 0, None
    else:
        if len(checkpoint_positions) != R:
            raise ValueError(f"kda_prefill: checkpoint_positions needs one list per request ({R}), "
                             f"got {len(checkpoint_positions)}")
        starts, lens, req_chunks, ck_index, n_ck, rows_of = host_chunk_table(cu.tolist(), checkpoint_positions,
                                                                             q.device)
    ws = run_intra(q, k, v, g if g is not None else f, beta, starts, lens, scale, cfg, gate_mode=gate_mode,
                   A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    o, CK = run_state(ws, state, slots, starts, lens, req_chunks, cfg, q.dtype, ck_index, n_ck, n_tokens=T)
    if rows_of is None:
        return o
    return o, [CK[torch.tensor(rw, dtype=torch.int64, device=q.device)] if rw else CK[:0] for rw in rows_of]


# ---------------------------------------------------------------------------------- templates
_dims = lambda x, i: int(x.shape[i])  # noqa: E731


def key_dims(a, attrs):
    return {"H": _dims(a.q, 1), "D": _dims(a.q, 2), "Dv": _dims(a.v, 2), "T": _dims(a.q, 0),
            "R": _dims(a.state_slot, 0)}


def bucket(key):
    return {**key, "T": pow2_bucket(key["T"], 64), "R": pow2_bucket(key["R"])}


def heuristic(key, target):
    """CPU interpreter: big tiles (cost is per program step). GPU, D=128, as measured on the H200 (bf16;
    benches/bench_kda.py): kernel 1 with bf16 tensor-core products in both phases (LOWP_A, LOWP_WU), BK 64,
    4 warps, 2 stages (B=1 T=8192, session 5: 0.669 ms; BK 32 0.732; LOWP_WU only 0.768; tf32 0.809; split
    into A/inverse + W/U kernels 0.794). bf16 products move the error vs the fp32 reference from 4.6e-3 to
    5.3e-3 (fla: 4.8e-3); fp32 inputs never round. Kernel 2 widens its column block BV (32 -> 64 -> 128) while
    R*H*Dv/BV >= 128 programs remain. Session 8, B=4 x 8192 (fla 3.515 ms): kernel 2 BV 128 / 4 warps / 2 stages
    0.517 ms (BV 128 x 8 warps 0.630, BV 64 x 4 x 3 stages 0.570, 64 x 8 x 2 0.897, 32 x 4 x 3 1.030), kernel 1
    2.67 ms: prefill 3.20 ms (1.098x fla; BV 32 3.73). B=1 (BV 32): 8K 0.884 ms (fla 1.112), 32K 3.436 (4.293).
    Session 10 (benches/results/h200-2026-11-30-s10/kda_prefill.json), kernel 1 at B=4 x 8192: BK 64 / BV_INTRA 64
    2.668 ms; BK 32 / BV_INTRA 32 under a 168-register cap 2.553 (A64 1, the 64-row form of _kda_intra64.py) and
    2.554 (A64 0); A64 without the cap 2.92-2.97, caps 128 / BK 16 3.16-3.62. Prefill 3.090 ms: 1.138x fla
    (3.516); B=1 8K 0.864 ms (1.288x fla), 32K 3.324 (1.293x)."""
    D, Dv = key["D"], key["Dv"]
    if str(target).startswith("cpu"):
        return {"BK": D, "BV_INTRA": Dv, "WARPS_INTRA": 4, "STAGES_INTRA": 1, "BV": Dv, "WARPS": 4, "STAGES": 2,
                "SPLIT_INTRA": 0, "LOWP_A": 0, "LOWP_WU": 0}
    bv = min(32, Dv)
    while "R" in key and "H" in key and bv < min(128, Dv) and key["R"] * key["H"] * (Dv // (2 * bv)) >= _WAVE:
        bv *= 2  # kernel 2: wider column blocks while the grid still fills one wave (batches of requests)
    return {"BK": min(32, D), "BV_INTRA": min(32, Dv), "WARPS_INTRA": 4, "STAGES_INTRA": 2, "BV": bv,
            **dict(zip(("WARPS", "STAGES"), _STATE_TILES.get(bv, (4, 3)))), "SPLIT_INTRA": 0, "LOWP_A": 1,
            "LOWP_WU": 1, "A64": 1, "MAXNREG_INTRA": 168}


# kernel 2: programs that fill the H200 (132 SMs) once at one per SM (its shared memory); (WARPS, STAGES) per BV
_WAVE, _STATE_TILES = 128, {32: (4, 3), 64: (4, 3), 128: (4, 2)}


def constraints(config, key, target):
    out = []
    for name, dim in (("BK", "D"), ("BV_INTRA", "Dv"), ("BV", "Dv")):  # the W/U kernel's tiles are clamped to D
        if config[name] > key[dim] or key[dim] % config[name]:
            out.append(f"{name}={config[name]} must divide {dim}={key[dim]}")
    if config.get("A64") and config.get("SPLIT_INTRA"):
        out.append("A64=1 (the 64-row kernel 1) computes W/U itself: SPLIT_INTRA must be 0")
    if config.get("A64") and config.get("STAGES_INTRA", 3) < 2 and not str(target).startswith("cpu"):
        out.append("A64=1 with STAGES_INTRA=1 made an illegal memory access on the H200 (Triton 3.6, session 10)")
    if not str(target).startswith("cpu") and state_kernel_smem(config, key) > _SMEM_BYTES:
        out.append(f"kernel 2 needs {state_kernel_smem(config, key)} B of shared memory with "
                   f"STAGES={config['STAGES']}, BV={config['BV']} (limit {_SMEM_BYTES})")
    return out


def _static_pow2(dim) -> int | None:
    try:
        d = int(dim)
    except TypeError:
        return None
    return d if d >= 16 and d & (d - 1) == 0 else None


def supports(a, attrs, target):
    D, Dv = _static_pow2(a.q.shape[2]), _static_pow2(a.v.shape[2])
    if attrs.get("keep_states"):
        return "per-token states (keep_states, verification) come from the fused kda_decode kernel only"
    if D is None or Dv is None or D > 256 or Dv > 256:
        return f"head dims must be static powers of two in 16..256, got D={a.q.shape[2]}, Dv={a.v.shape[2]}"


def _launch_kda(a, attrs, config):
    if attrs.get("batch_invariant"):  # tuned configs may differ per T bucket; the heuristic does not
        config = heuristic({"D": int(a.q.shape[2]), "Dv": int(a.v.shape[2])}, "cuda" if a.q.is_cuda else "cpu")
    o = kda_prefill(a.q, a.k, a.v, a.g, a.beta, a.state, a.state_slot, a.cu_seqlens, attrs["scale"], config=config)
    return o, a.state


def _launch_gate(a, attrs, config):
    return kda_gate(a.f, a.A_log, a.dt_bias, attrs.get("lower_bound"), block=config["BLOCK"])


TEMPLATES = [
    KernelTemplate(
        family="kda_prefill", backend="triton", ops=("kda",), launch=_launch_kda, key_dims=key_dims,
        heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
        tunables=(Tunable("BK", (16, 32, 64)), Tunable("BV_INTRA", (16, 32, 64)), Tunable("WARPS_INTRA", (2, 4, 8)),
                  Tunable("STAGES_INTRA", (1, 2, 3)), Tunable("BV", (16, 32, 64, 128)), Tunable("WARPS", (4, 8)),
                  Tunable("STAGES", (2, 3, 4)), Tunable("LOWP_A", (0, 1)), Tunable("LOWP_WU", (0, 1)),
                  Tunable("SPLIT_INTRA", (0, 1)), Tunable("BK_WU", (32, 64)), Tunable("WARPS_WU", (4, 8)),
                  Tunable("A64", (0, 1)), Tunable("MAXNREG_INTRA", (0, 168))),
        doc="chunked (64) WY/UT KDA over ragged requests; form recurrent|chunked give the same result"),
    KernelTemplate(
        family="kda_gate", backend="triton", ops=("kda_gate",), launch=_launch_gate,
        key_dims=lambda a, attrs: {"P": _dims(a.f, 1), "T": _dims(a.f, 0)},
        heuristic=lambda key, target: {"BLOCK": 1024}, bucket=lambda key: {**key, "T": pow2_bucket(key["T"])},
        tunables=(Tunable("BLOCK", (256, 512, 1024, 2048)),), batch_invariant=True,
        doc="KDA forget gate in log space, both variants, fp32 output"),
]
