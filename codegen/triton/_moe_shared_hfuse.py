"""The routed experts' decode kernels fused horizontally with the shared expert's GEMVs: two launches whose
programs split by index between two independent jobs, so that the latency-bound routed tiles (MXFP4 words
decoded per FFMA, a few rows per program) run beside bandwidth-bound weight streams instead of alone.

    launch A   programs [0, NA):      routed gate-up tiles   h[p]  = act(W1_e z_t, W3_e z_t)     (_gate_up_v2_tile)
               programs [NA, NA+SA):  shared gate/up tiles    a[t]  = act(x_t Wg^T, x_t Wu^T)     (packed_glu_tile)
    launch B   programs [0, NB):      routed down tiles       y[t]  = Σ_j w[t,j] rnd(W2_e h[tK+j]) (_down_v2_tile)
               programs [NB, NB+SB):  shared down tiles       d[t]  = a[t] Wd^T                   (gemv_tile)

Each program runs one tile of one job with exactly the tile code of that job's own kernel
(`_moe_gemv_words` GV=2 with h in word order, `packed_glu`'s pair tiles, the GEMM's dot-free decode tile), so
a result depends only on its job's tile parameters: the routed output equals `_gemv_v2` with the same GN / GK /
GN2 / GK2 / num_warps, the shared outputs equal `packed_linear_glu` and `gemm` run with BLOCK_M=1 and the same
BLOCK_N / BLOCK_K / stages / num_warps, bit for bit. One `num_warps` serves both jobs of a launch (the shared
GEMV tiles want 4 warps; the routed tiles then carry 4x the rows of GEMV_T1's one-warp tiles).

Routed tiles first: the block scheduler hands out low program ids first, so the latency-bound routed tiles start
at once and the shared tiles fill the remaining slots and the tail. PDL (`_pdl.py`): every program waits once in
its own tile code; the routed down tiles read their expert ids and first weight step before the wait (EARLY
bit 0: launch A sits between them and the ids' writer), the shared tiles their first weight tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.triton import gemm as gm
from codegen.triton._gemv import dot_numerics, gemv_tile, tile_counters
from codegen.triton._moe_gemv_words import _down_v2_tile, _gate_up_v2_tile
from codegen.triton._moe_host import _TL, _step
from codegen.triton._pdl import launch_kwargs
from codegen.triton.glu import ACTS
from codegen.triton.packed_glu import packed_glu_tile


@triton.jit
def _split(pid, NR, N, MIX: tl.constexpr):
    """(is a routed tile, routed tile index, shared tile index) of program pid of N, NR of them routed. MIX=0:
    routed programs first; MIX=1: spread evenly over the launch (Bresenham: program pid is routed iff
    floor((pid+1)·NR/N) > floor(pid·NR/N)), so every wave the scheduler hands out holds both jobs."""
    if MIX:
        before = (pid.to(tl.int64) * NR // N).to(tl.int32)
        upto = ((pid.to(tl.int64) + 1) * NR // N).to(tl.int32)
        return upto > before, before, pid - upto
    return pid < NR, pid, pid - NR


@triton.jit
def _hfuse_gate_up_kernel(z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, INTER, NQ, stride_z, stride_we,
                          stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, NP, NA,
                          x_ptr, wp_ptr, a_ptr, M, IS, KS, G0, U0, stride_xm, stride_wpn, stride_am, sbeta1, sbeta2,
                          TOPK: tl.constexpr, ACT: tl.constexpr, HAS_BETA2: tl.constexpr, GN: tl.constexpr,
                          BQ4: tl.constexpr, ASM: tl.constexpr, PREF: tl.constexpr, XV: tl.constexpr,
                          EVEN: tl.constexpr, DT: tl.constexpr, SACT: tl.constexpr, SHAS_B2: tl.constexpr,
                          ACC_DTYPE: tl.constexpr, S_EVEN_K: tl.constexpr, S_STAGES: tl.constexpr,
                          SBN: tl.constexpr, SBK: tl.constexpr, MIX: tl.constexpr, PDL: tl.constexpr):
    routed, j, k = _split(tl.program_id(0), NA, NA + M * tl.cdiv(IS, SBN // 2), MIX)
    if routed:
        _gate_up_v2_tile(j, z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, INTER, NQ, stride_z, stride_we,
                         stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, NP, TOPK, ACT, HAS_BETA2, GN, BQ4,
                         ASM, PREF, XV, EVEN, 1, DT, PDL)
    else:
        packed_glu_tile(k, x_ptr, wp_ptr, x_ptr, a_ptr, a_ptr, M, 0, IS, KS, G0, U0, stride_xm, 1, stride_wpn,
                        1, 0, stride_am, 0, 0, sbeta1, sbeta2, 0, 1, 1, tl.float32, ACC_DTYPE, 1, "ieee", S_EVEN_K,
                        1, S_STAGES, SACT, SHAS_B2, tl.float32, 0.25, 1, SBN, SBK, PDL)


@triton.jit
def _hfuse_down_kernel(h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, o_ptr, cnt_ptr, y_ptr, E, ELL, NQ, stride_h, stride_we,
                       stride_wn, stride_se, stride_sn, stride_y, NP, NB,
                       a_ptr, wd_ptr, d_ptr, M, N, KD, stride_am, stride_wdn, stride_dm,
                       TOPK: tl.constexpr, DT: tl.constexpr, GN: tl.constexpr, BQ4: tl.constexpr,
                       ASM: tl.constexpr, PREF: tl.constexpr, EVEN: tl.constexpr, ACC_DTYPE: tl.constexpr,
                       D_EVEN_K: tl.constexpr, D_STAGES: tl.constexpr, DBN: tl.constexpr, DBK: tl.constexpr,
                       MIX: tl.constexpr, PDL: tl.constexpr):
    num_n = tl.cdiv(N, DBN)
    routed, j, t = _split(tl.program_id(0), NB, NB + M * num_n, MIX)
    if routed:
        _down_v2_tile(j, h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, o_ptr, cnt_ptr, y_ptr, E, ELL, NQ, stride_h,
                      stride_we, stride_wn, stride_se, stride_sn, stride_y, NP, TOPK, DT, GN, BQ4, ASM, PREF, 2, EVEN,
                      PDL)
    else:
        offs_m = t // num_n + tl.arange(0, 1)
        offs_n = (t % num_n) * DBN + tl.arange(0, DBN)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = gemv_tile(a_ptr, wd_ptr, a_ptr, offs_m, offs_n, m_ok, n_ok, KD, stride_am, 1, stride_wdn, 1, 0, 0,
                        0, 1, 1, ACC_DTYPE, D_EVEN_K, 1, DBN, DBK, D_STAGES, PDL)
        tl.store(d_ptr + offs_m[:, None].to(tl.int64) * stride_dm + offs_n[None, :], acc.to(d_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def supported(z: torch.Tensor, x: torch.Tensor, g1, g3, g2, wg, wu, wd) -> str | None:
    """Why these operands cannot take the fused launches, or None: MXFP4 routed weights as int32 words
    (`_moe_host._gemv_weight`), plain contiguous shared weights of x's dtype, x and z with unit column stride."""
    if not (g1 and g3 and g2 and g1[0] and g3[0] and g2[0]):
        return "the routed experts' weights are not MXFP4 int32 words"
    if g1[3] != g3[3] or g1[4] != g3[4]:
        return "w1 and w3 differ in storage layout"
    for name, w in (("shared gate", wg), ("shared up", wu), ("shared down", wd)):
        if not isinstance(w, torch.Tensor) or w.dtype != x.dtype or w.dim() != 2 or not w.is_contiguous():
            return f"{name} weight is not a contiguous 2-D {x.dtype} tensor"
    if x.stride(-1) != 1 or z.stride(-1) != 1:
        return "x and z need unit column stride"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or z.dtype != x.dtype:
        return f"activations {z.dtype} / {x.dtype}: the fused launches take one of bf16, f16, f32 for both"
    return None


def hfused_experts_shared(z, weights, ids, g1, g3, g2, act_kw: dict, x, wg, wu, wd, shared_kw: dict,
                          cfg: dict, launches: str = "AB", buffers: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y f32 [T, l], d [T, D]) by the two fused launches (module doc). z [T, l] the routed input, weights / ids
    [T, K] the routing, g1 / g3 / g2 the MXFP4 words (`_gemv_weight`), act_kw {betas, ACT, HAS_BETA2} (the
    routed activation, as `_gemv_v2`), x [T, D] the shared expert's input, wg / wu [Is, D], wd [D, Is],
    shared_kw {act, beta1, beta2} (its gated activation). cfg: GN, GK, GN2, GK2, PREF, XV, EARLY (the routed
    tiles, `_gemv_v2`'s meaning), SBN, SBK, SST (the shared gate/up tiles: BLOCK_N, BLOCK_K, stages), DBN, DBK,
    DST (the shared down tiles), MIX (program order, `_split`), GREG (a register cap), num_warps (both launches).
    `launches`: which of the two run (benches time them apart; either alone leaves the results meaningless);
    `buffers`: filled with the intermediates "h" (fp32 [T·K, I], word order) and "a" ([T, Is]) when given."""
    T, ell = z.shape
    K = ids.shape[1]
    ids, weights = ids.contiguous(), weights.contiguous()      # read as flat [T·K] rows
    P, inter = T * K, int(g1[1].shape[1])
    Is, D = int(wg.shape[0]), int(x.shape[1])
    if wu.shape != wg.shape or wg.shape[1] != D or tuple(wd.shape) != (D, Is) or x.shape[0] != T:
        raise ValueError(f"moe shared hfuse: shapes x {tuple(x.shape)}, gate {tuple(wg.shape)}, up {tuple(wu.shape)}, "
                         f"down {tuple(wd.shape)} do not form a gated FFN over {T} tokens")
    gn, gn2 = int(cfg["GN"]), int(cfg["GN2"])
    bq1, bq2 = _step(cfg["GK"], ell, 32) // 32, _step(cfg["GK2"], inter, 32) // 32
    nq1, nq2 = ell // 8, inter // 8
    sbn, sbk, dbn, dbk = int(cfg["SBN"]), int(cfg["SBK"]), int(cfg["DBN"]), int(cfg["DBK"])
    if sbn < 2 or sbn % 2:
        raise ValueError(f"moe shared hfuse: SBN={sbn} must be even (gate/up pairs)")
    h = torch.empty(P, inter, dtype=torch.float32, device=z.device)
    a = torch.empty(T, Is, dtype=x.dtype, device=x.device)
    y = torch.empty(T, ell, dtype=torch.float32, device=z.device)
    d = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if buffers is not None:
        buffers.update(h=h, a=a)
    if T == 0:
        return y, d
    wp = gm.packed_weight([wg, wu])
    acc = dot_numerics(x.dtype, wp.dtype)["ACC_DTYPE"]
    asm = bool(cfg.get("GASM", 0)) and z.is_cuda
    pref, early = int(cfg.get("PREF", 1)), int(cfg.get("EARLY", 0))
    opt = dict(num_warps=int(cfg.get("num_warps", 4)), num_stages=1, **launch_kwargs())
    if cfg.get("GREG") and z.is_cuda:
        opt["maxnreg"] = int(cfg["GREG"])
    na = P * triton.cdiv(inter, gn)
    sa = T * triton.cdiv(Is, sbn // 2)
    if "A" in launches:
        _hfuse_gate_up_kernel[(na + sa,)](
            z, ids, g1[1], g3[1], g1[2], g3[2], h, g1[1].shape[0], inter, nq1, z.stride(0), *g1[3], h.stride(0),
            *act_kw["betas"], P, na, x, wp, a, T, Is, D, 0, Is, x.stride(0), wp.stride(0), a.stride(0),
            1.0 if shared_kw.get("beta1") is None else float(shared_kw["beta1"]),
            1.0 if shared_kw.get("beta2") is None else float(shared_kw["beta2"]),
            TOPK=K, ACT=act_kw["ACT"], HAS_BETA2=act_kw["HAS_BETA2"], GN=gn, BQ4=bq1, ASM=asm,
            PREF=2 if pref and early & 2 else pref, XV=int(cfg.get("XV", 0)), EVEN=nq1 % (4 * bq1) == 0,
            DT=_TL[z.dtype], SACT=ACTS[shared_kw["act"]], SHAS_B2=shared_kw.get("beta2") is not None, ACC_DTYPE=acc,
            S_EVEN_K=D % sbk == 0, S_STAGES=max(1, int(cfg.get("SST", 1))), SBN=sbn, SBK=sbk, MIX=int(cfg.get("MIX", 0)),
            **opt)
    nrb = triton.cdiv(ell, gn2)
    o = torch.empty(P if K > 1 else 1, ell, dtype=torch.float32, device=z.device)
    cnt = tile_counters(z.device, nrb * T) if K > 1 else o
    nb = P * nrb
    sb = T * triton.cdiv(D, dbn)
    if "B" in launches:
        _hfuse_down_kernel[(nb + sb,)](
            h, weights, ids, g2[1], g2[2], o, cnt, y, g2[1].shape[0], ell, nq2, h.stride(0), *g2[3], y.stride(0), P, nb,
            a, wd, d, T, D, Is, a.stride(0), wd.stride(0), d.stride(0),
            TOPK=K, DT=_TL[z.dtype], GN=gn2, BQ4=bq2, ASM=asm, PREF=2 if pref and early & 1 else pref,
            EVEN=nq2 % (4 * bq2) == 0, ACC_DTYPE=acc, D_EVEN_K=Is % dbk == 0, D_STAGES=max(1, int(cfg.get("DST", 1))),
            DBN=dbn, DBK=dbk, MIX=int(cfg.get("MIX", 0)), **opt)
    return y, d
