"""Grouped expert GEMMs for IR op `moe_experts` (SPEC §6), MXFP4 weights read exactly as loaded.

    y[t] = Σ_j w[t,j] · W2_e act(W1_e z_t, W3_e z_t),   e = ids[t,j]
    act = SiTU-GLU  β1·tanh(a/β1)·sigmoid(a) · β2·tanh(u/β2)   (β2 absent: · u)   | SwiGLU silu(a)·u

Two paths (config PATH). "gemv" (decode, up to GEMV_MAX_PAIRS routed pairs: _moe_gemv.py): one
program per (pair, row block) for gate-up and per (pair, row block) for down, the slot-order combine done
in the down launch by the last slot of each token to finish, no permutation, two launches; FFMA inner
product on the MXFP4 words (GV=2; session 6's kernels, GV=1 with an MMA-step option, stay callable).
"grouped", below (many tokens per expert; batch-invariant mode always). H200, graph replay, PDL launches,
session 9: T=1 top-2 24.3 us (2.97x the 8.2 us byte floor), T=8 top-2 151.8 us (2.97x); where that time goes:
_moe_gemv.py, _moe_configs.py.

Grouped pipeline (no host sync, deterministic, no atomics):
  1. `permute_tokens` (moe_router.py): routed pairs p = t·k + j grouped by expert (one program up to
     256 pairs, else three kernels).
  2. gate-up kernel: a tile = BM consecutive pairs of one expert × BN columns of I; w1 and w3 tiles are
     read in the same K loop (two accumulators) and act(a, u) is applied in the epilogue;
     h [T·k, I] is written in expert-sorted row order.
  3. down kernel: the same tiling over h and W2_e; per-pair outputs o [T·k, ℓ] stored at row p.
  4. combine kernel (moe_tail.py): y[t] = Σ_j w[t,j]·o[t·k+j] in slot order, fp32 (ids outside [0, E)
     contribute 0: another EP rank holds them).
Tiles exist only for experts with tokens: program `tid` finds its expert from the per-expert tile
counts ceil(count_e / BM) (a cumsum over E in registers). The grid holds max_tiles(P, E, BM) =
floor((P + min(E, P)·(BM-1)) / BM) tiles, the most any routing of P pairs can need (T=1, top-2: exactly
2); programs past the last tile exit at once, so experts with no tokens launch no work.
KU / KU2 > 1 (unsplit K): KU K steps an iteration, their loads issued together (see below); measured slower
at T=64 top-16 on the H200 (1.06-1.18 ms vs 0.997).
Split-K (config SPLIT > 1; SPLIT2 for the down kernel, default SPLIT): program s of a tile reduces K
steps [s·c, (s+1)·c), c = ceil(steps / SPLIT)·BK; gate-up stores fp32 partials [SPLIT, 2, T·k, I] that
`_glu_splits_kernel` sums in split order before act; the down kernel's fp32 partials [SPLIT2, T·k, ℓ]
are summed inside the combine (`combine_pairs`). Without it (the heuristic's choice, measured faster
at T=1 and 64, and always in batch-invariant mode) every output element's reduction runs over K in BK
steps in one program, so with a config fixed independently of T (`batch_invariant`) a token's result
does not depend on the batch. Tiles are computed transposed (weights x tokens, see
_moe_tiles.py): a decode tile of 16 tokens has BN weight rows as the MMA's M side (wgmma from 64 rows
per warpgroup; below that, e.g. BN=64 on 2 warps, Triton issues mma.sync).

Weights (w1, w3 [E, I, l]; w2 [E, l, I]) are float tensors or `PackedMXFP4`, read as stored and
dequantised in registers by the decode that config DEQ names (formats, decodes and their exactness:
_moe_host.py, whose `_kernel_weight` gives the kernels' W_FMT and WIDE; device code: _moe_tiles.py).
Scale bytes are below cp.async's 4 bytes, so they are plain loads in the K loop: SL=1 issues both
weights' at the top of the step (latencies overlap), SL=0 each after its weight tile; PF=1 adds an L1
prefetch of the next step's (CUDA only); SL=2 reads them as int32 words through the cp.async pipeline and
SL=3 loads the next step's bytes a step ahead (_moe_tiles._top_scales). H200, T=64 top-16 (graph replay):
session 8 SL=1 1.111 ms, SL=3 with BK 64 1.048; SL=2 passes the decoded tile through shared memory (1.8x).
SCALE_NO_SPEC below keeps SL=3's decode on the packed tile in Triton 3.6 and 3.7.
TMA (config TMA, the gate-up kernel, sm_90+; _tma_desc): w1 / w3 are host TensorDescriptors of the packed words as
int16 [E·I, l/32, 8] and a K step's [BN, BK/32, 8] block arrives by a bulk tensor copy (cp.async.bulk.tensor, one
issuing thread, mbarrier waits, num_stages deep), no address registers; the decode and the fp32 accumulation are
the pointer path's (bitwise equal in the interpreter). The kernel sees it as SL 5 / 6 (SL 1 / 2 + 4): no new
argument. SL 3 cannot go with it: Triton 3.6 moves the MMA operand's layout onto a TMA tile only when the decode's
inputs come from loads (not loop-carried values), else the decoded tile passes through shared memory (sm_90 TTGIR;
with SL 2, Triton 3.7 does so too). sm_90 SASS of the T=64 gate-up: a K step of 503 instructions vs 474 (the scale
bytes go through shared memory to the decode's layout, two more barriers), 104-116 registers vs 128, 2 TMA issues
instead of 6 LDGSTS; measured 0.632-0.641 ms alone vs 0.660. The down kernel by TMA measured slower (0.353-0.383 ms
vs 0.330 alone, _moe_configs.DECODE_T64): removed.
Gluon gate-up (config GG, _moe_grouped_gluon.py, sm_90+, MXFP4, bf16; the heuristic's at T=64, see `heuristic`): the same tiles'
expert, tokens and epilogue, the weights decoded into the registers of mma.sync's A operand (the per-pair path's K
permutation, no shared memory), the expert's tokens as N (16 a tile, looped). H200 session 15, T=64 top-16: gate-up
alone 0.613-0.657 ms over 8 tilings vs the TMA kernel's 0.608 / 0.616 in the same calls, whole op 0.954-0.993 vs
0.939 / 0.944 (its K loop issues ~3.6 instructions a weight element, as many as the TMA kernel); deeper loads ahead
(registers, or a cp.async shared-memory ring) slower. With the context's L2 fetch granularity at 128 bytes
(benches/results/h200-2026-11-30-s15/moe_t64_gluon_l2fetch.json, one call): GLUON_T64 0.891 ms vs the TMA kernel's
0.942 (which is 0.947 / 0.963 at the default granularity in the same call); the runtime now sets that granularity
(k31c/runtime/l2_fetch.py, measured over the whole rank decode graph) and the heuristic takes GG at T=64. _moe_grouped_gluon.py.
Gluon down (config GD, _moe_down_gluon.py, with GG only: the gate-up then stores h's columns in the down kernel's
operand order; sm_90+, MXFP4, bf16): program (expert, block of W2 rows), the expert's rows of h as N, the words two
K steps ahead. H200 session 16 (benches/results/h200-2026-11-30-s16/moe_t64_down_gluon_call2.json, T=64 top-16): down
alone 0.290 ms vs the Triton kernel's 0.332; with GG's words two steps ahead too (GGU: gate-up alone 0.573 vs 0.641)
the whole op 0.860 ms vs 0.988 / 0.995 (47.0% of read bandwidth; 0.864 vs 0.912 at 128-byte L2 fetches): GLUON_T64.
Config GDO (with GG and GD, in one call; session 23, GLUON_T64's): the down kernel starts on each expert once that
expert's gate-up programs have stored h (per-expert completion counters, `_moe_down_gluon._await_expert`), filling the
gate-up's last wave: the op 0.843 vs 0.860 / 0.863 ms (48.0%); four alternated pairs faster in each.
Host-side operand, storage and target helpers: _moe_host.py;
the heuristic's named configs, the split-K rule and the config constraints: _moe_configs.py.
Decode T=64 (E=112, top-16, l=3584, I=3072, bf16; 1.82 GB of MXFP4 weights): 0.860 ms with the Gluon kernels (47.0%,
session 16, above). Before them: 0.951 ms, 42.5% of the read
ceiling with the gate-up's weights by TMA (session 14; the pointer path 0.996-1.003 in the same run, 40.3-40.7%;
session 10 0.997, session 12 1.000 / 1.009; measured, _moe_configs.py at DECODE_T64). Before TMA: each K step asks L2
for 32 bytes of each of 64-128 weight rows, a pattern that alone reads 2.52 TB/s (4.28 with whole lines); but whole
lines a step (BK 256) measured 1.16-1.82 ms (fewer warps an SM at the same instructions per element), and whole-line
fetches from HBM (L2 fetch granularity 128 B: that pattern at 3.53 TB/s) only 0.989 ms: issue and latency bind.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._moe_configs import (BATCH_INVARIANT_CONFIG, DECODE_MAXNREG, DECODE_T64, GLUON_T64,  # noqa: F401
                                         GEMV_FFMA_S6, GEMV_MAX_PAIRS, GEMV_MMA_S6, GEMV_T1, GEMV_T8, GEMV_TILES,
                                         GPU_SLOTS, constraints, decode_split)
from codegen.triton._moe_host import (DEQ_MODES, _BYTE_DECODE, _TL, _fit_bk, _int16_view,  # noqa: F401
                                      _kernel_weight, _weight, max_tiles, scale_words, storage, target_cc)
from codegen.triton._gemv import tile_counters
from codegen.triton._moe_gemv import gemv_experts, gemv_supported
from codegen.triton._moe_gemv_gluon import GLUON_T1, GLUON_T1_DOWN, GLUON_T8
from codegen.triton import _moe_down_gluon as gd_gluon, _moe_grouped_gluon as gg_gluon
from codegen.triton._moe_splits import _combine_splits_kernel, _glu_splits_kernel, combine_pairs  # noqa: F401
from codegen.triton._moe_tiles import (MX_ASM16, MX_ASM16I, MX_BYTES16, _glu, _k_range, _load_bt, _locate_tile,
                                      _mma_step_t, _mma_step_tma, _top_scales, _swizzle)
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.moe_router import ExpertSegments, permute_tokens


# scale_row_stride: stride_sn again, for SL=3's loads. Whether Triton keeps SL=3's decode on the packed tile or
# passes the decoded tile through shared memory (2x slower on the H200, session 8) turns on the scale rows'
# vectorisation: Triton 3.6 keeps it when the stride is not specialised (divisibility unknown), 3.7 when it is
# (sm_90 TTGIR of both, the decode tiles): so 3.6 does not specialise it. SL != 3 never reads it.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"     # TMA descriptors of CPU tensors: tests only
SCALE_NO_SPEC = ["scale_row_stride"] if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7) else []


@triton.jit(do_not_specialize=SCALE_NO_SPEC)
def _moe_gate_up_kernel(z_ptr, pair_ptr, counts_ptr, offsets_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                        E, ELL, INTER, stride_z, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_hs,
                        up_off, beta1, beta2, N_TILES, scale_row_stride, TOPK: tl.constexpr, E_PAD: tl.constexpr,
                        W_FMT: tl.constexpr, ACT: tl.constexpr, HAS_BETA2: tl.constexpr, IEEE: tl.constexpr,
                        DT: tl.constexpr, WIDE: tl.constexpr, PF: tl.constexpr, SL: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
                        KU: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)      # the tile's expert comes from the permutation's counts: nothing to load before
    TMA: tl.constexpr = SL >= 4     # SL 5 / 6: SL 1 / 2 with the weights read by TMA (w1_ptr, w3_ptr: descriptors)
    SC: tl.constexpr = SL % 4       # how the scale bytes are read (module doc)
    pid = tl.program_id(0)
    sk = pid % SPLIT
    tid, nb = _swizzle(pid // SPLIT, N_TILES, tl.cdiv(INTER, BN), GROUP_M)
    total, e, row0, m0, rows = _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
    if tid >= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < rows
    pos = row0 + rm
    tok = tl.load(pair_ptr + pos, mask=row_ok, other=0) // TOPK
    rn = nb * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    rows_ptr = z_ptr + tok.to(tl.int64)[:, None] * stride_z
    wbase = e.to(tl.int64) * stride_we
    sbase = e.to(tl.int64) * stride_se
    acc1 = tl.zeros([BN, BM], dtype=tl.float32)
    acc3 = tl.zeros([BN, BM], dtype=tl.float32)
    k_lo, k_hi = _k_range(sk, ELL, BK, SPLIT)
    if SC == 3:     # the first step's scale bytes; every step then loads the next step's
        n1 = _top_scales(s1_ptr, sbase, rn, n_ok, k_lo, ELL, scale_row_stride, BN, BK, W_FMT, SC, PF)
        n3 = _top_scales(s3_ptr, sbase, rn, n_ok, k_lo, ELL, scale_row_stride, BN, BK, W_FMT, SC, PF)
    else:
        n1 = tl.zeros([BN, BK // 32], dtype=tl.int32)
        n3 = n1
    for k00 in range(k_lo, k_hi, BK * KU):     # KU steps an iteration: their loads issued together
        for u in tl.static_range(KU):
            k0 = k00 + u * BK
            if SC == 3:     # this step's scale bytes were loaded a step ago; the next step's now (carried)
                s1, s3 = n1, n3
                n1 = _top_scales(s1_ptr, sbase, rn, n_ok, k0 + BK, ELL, scale_row_stride, BN, BK, W_FMT, SC, PF)
                n3 = _top_scales(s3_ptr, sbase, rn, n_ok, k0 + BK, ELL, scale_row_stride, BN, BK, W_FMT, SC, PF)
            elif SC:    # both weights' scale bytes first: their load latencies overlap (SC=2: int32 words)
                s1 = _top_scales(s1_ptr, sbase, rn, n_ok, k0, ELL, stride_sn, BN, BK, W_FMT, SC, PF)
                s3 = _top_scales(s3_ptr, sbase, rn, n_ok, k0, ELL, stride_sn, BN, BK, W_FMT, SC, PF)
            else:       # each read in its step, after its weight tile
                s1 = tl.zeros([BN, BK // 32], dtype=tl.int32)
                s3 = s1
            b0, b1, b2, b3 = _load_bt(rows_ptr, row_ok, k0, ELL, W_FMT, DT, BK)
            if TMA:     # w1_ptr, w3_ptr: TMA descriptors of int16 [E·I, l/32, 8], row e·I + n
                acc1 = _mma_step_tma(acc1, b0, b1, b2, b3, w1_ptr, e * INTER + nb * BN, k0, s1, BN, BK, IEEE, DT, WIDE,
                                     (W_FMT == 5) + 2 * (W_FMT == 6))
                acc3 = _mma_step_tma(acc3, b0, b1, b2, b3, w3_ptr, e * INTER + nb * BN, k0, s3, BN, BK, IEEE, DT, WIDE,
                                     (W_FMT == 5) + 2 * (W_FMT == 6))
            else:
                acc1 = _mma_step_t(acc1, b0, b1, b2, b3, w1_ptr, s1_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn,
                                   stride_sn, s1, BN, BK, W_FMT, IEEE, DT, WIDE, SC, PF)
                acc3 = _mma_step_t(acc3, b0, b1, b2, b3, w3_ptr, s3_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn,
                                   stride_sn, s3, BN, BK, W_FMT, IEEE, DT, WIDE, SC, PF)
    out = h_ptr + pos.to(tl.int64)[None, :] * stride_h + rn[:, None]
    ok = n_ok[:, None] & row_ok[None, :]
    if SPLIT == 1:
        tl.store(out, _glu(acc1, acc3, beta1, beta2, ACT, HAS_BETA2).to(DT), mask=ok)      # h [BN, BM]
    else:           # fp32 partial sums of split sk; _glu_splits_kernel sums them and applies act
        tl.store(out + sk * stride_hs, acc1, mask=ok)
        tl.store(out + sk * stride_hs + up_off, acc3, mask=ok)


@triton.jit(do_not_specialize=SCALE_NO_SPEC)
def _moe_down_kernel(h_ptr, pair_ptr, counts_ptr, offsets_ptr, w2_ptr, s2_ptr, o_ptr,
                     E, ELL, INTER, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o, stride_os, N_TILES,
                     scale_row_stride, E_PAD: tl.constexpr, W_FMT: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                     WIDE: tl.constexpr, PF: tl.constexpr, SL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr, KU: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    sk = pid % SPLIT
    tid, nb = _swizzle(pid // SPLIT, N_TILES, tl.cdiv(ELL, BN), GROUP_M)
    total, e, row0, m0, rows = _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
    if tid >= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < rows
    pos = row0 + rm
    pair = tl.load(pair_ptr + pos, mask=row_ok, other=0)
    rn = nb * BN + tl.arange(0, BN)
    n_ok = rn < ELL
    rows_ptr = h_ptr + pos.to(tl.int64)[:, None] * stride_h
    wbase = e.to(tl.int64) * stride_we
    sbase = e.to(tl.int64) * stride_se
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    k_lo, k_hi = _k_range(sk, INTER, BK, SPLIT)
    if SL == 3:
        n2 = _top_scales(s2_ptr, sbase, rn, n_ok, k_lo, INTER, scale_row_stride, BN, BK, W_FMT, SL, PF)
    else:
        n2 = tl.zeros([BN, BK // 32], dtype=tl.int32)
    for k00 in range(k_lo, k_hi, BK * KU):
        for u in tl.static_range(KU):
            k0 = k00 + u * BK
            if SL == 3:
                s2 = n2
                n2 = _top_scales(s2_ptr, sbase, rn, n_ok, k0 + BK, INTER, scale_row_stride, BN, BK, W_FMT, SL, PF)
            elif SL:
                s2 = _top_scales(s2_ptr, sbase, rn, n_ok, k0, INTER, stride_sn, BN, BK, W_FMT, SL, PF)
            else:
                s2 = tl.zeros([BN, BK // 32], dtype=tl.int32)
            b0, b1, b2, b3 = _load_bt(rows_ptr, row_ok, k0, INTER, W_FMT, DT, BK)
            acc = _mma_step_t(acc, b0, b1, b2, b3, w2_ptr, s2_ptr, wbase, sbase, rn, n_ok, k0, INTER, stride_wn,
                              stride_sn, s2, BN, BK, W_FMT, IEEE, DT, WIDE, SL, PF)
    # SPLIT > 1: o is fp32 [SPLIT, pairs, l], split sk's partial sums at sk·stride_os
    tl.store(o_ptr + sk * stride_os + pair.to(tl.int64)[None, :] * stride_o + rn[:, None],
             acc.to(o_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


# ------------------------------------------------------------------------------------------ host
def expert_pair_outputs(z: torch.Tensor, ids: torch.Tensor, w1, w2, w3, act: str, beta1: float | None = None,
                        beta2: float | None = None, config: dict | None = None,
                        segments: ExpertSegments | None = None, *,
                        kernels: tuple = ("gate_up", "down")) -> tuple[torch.Tensor, ExpertSegments]:
    """o (z's dtype) [T·k, ℓ]: o[t·k+j] = W2_e act(W1_e z_t, W3_e z_t), e = ids[t,j]; or, with the down
    kernel split along K (config SPLIT2 > 1), its fp32 partial sums o [SPLIT2, T·k, ℓ] (combine_pairs
    adds them). Rows of pairs whose expert is outside [0, E) are left unwritten (the combine skips them).
    `kernels`: which launches run, for timing them apart (bench_moe.py); either alone leaves o meaningless."""
    if act not in ("situ", "silu"):
        raise ValueError(f"expert activation must be 'situ' or 'silu', found {act!r}")
    if z.dim() != 2 or ids.dim() != 2 or ids.shape[0] != z.shape[0]:
        raise ValueError(f"experts: z must be [T, l] and ids [T, k], found {tuple(z.shape)} and {tuple(ids.shape)}")
    if z.dtype not in _TL:
        raise ValueError(f"experts: z dtype {z.dtype} is not bf16/fp16/fp32")
    T, ell = z.shape
    E, inter = int(w1.shape[0]), int(w1.shape[1])
    f1, q1, s1 = _weight(w1, "w1", (E, inter, ell))
    f3, q3, s3 = _weight(w3, "w3", (E, inter, ell))
    f2, q2, s2 = _weight(w2, "w2", (E, ell, inter))
    if f1 != f3 or (s1 is None and q1.stride() != q3.stride()) or (s1 is not None and (
            q1.stride() != q3.stride() or s1.stride() != s3.stride())):
        raise ValueError("experts: w1 and w3 must share storage format and strides (read in one pass)")
    K = ids.shape[1]
    cfg = {**heuristic(_key(T, E, K, ell, inter, f1 == "mxfp4", z.dtype, config or {}), None), **(config or {})}
    split, split2 = int(cfg.get("SPLIT", 1)), int(cfg.get("SPLIT2", cfg.get("SPLIT", 1)))
    if split < 1 or split2 < 1:
        raise ValueError(f"experts: SPLIT={split} and SPLIT2={split2} must be >= 1")
    if (cfg.get("KU", 1) > 1 and split > 1) or (cfg.get("KU2", 1) > 1 and split2 > 1):
        raise ValueError(f"experts: K steps unrolled (KU={cfg.get('KU', 1)}, KU2={cfg.get('KU2', 1)}) need an "
                         f"unsplit K (SPLIT={split}, SPLIT2={split2})")
    z = z if z.stride(-1) == 1 else z.contiguous()
    seg = segments or permute_tokens(ids, E)
    P = T * K
    dt = _TL[z.dtype]
    rows = max(P, 1)
    h = torch.empty(rows, inter, dtype=z.dtype, device=z.device)
    # split gate-up: fp32 partials of W1 z and W3 z [SPLIT, 2, rows, I], act applied by _glu_splits_kernel
    part = torch.empty(split, 2, rows, inter, dtype=torch.float32, device=z.device) if split > 1 else h
    o = (torch.empty(split2, rows, ell, dtype=torch.float32, device=z.device) if split2 > 1
         else torch.empty(rows, ell, dtype=z.dtype, device=z.device))
    if P == 0:
        return o[..., :0, :], seg
    h_st = (part.stride(-2), part.stride(0), part.stride(1)) if split > 1 else (h.stride(0), 0, 0)
    e_pad, bm, ieee = triton.next_power_of_2(E), cfg["BM"], z.dtype == torch.float32
    n_tiles = max_tiles(P, E, bm)
    # PF: inline PTX, not in the interpreter
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], SL=int(cfg.get("SL", 0)),
                  PF=int(cfg.get("PF", 0)) if z.is_cuda else 0, **launch_kwargs())
    if cfg.get("MAXNREG") and z.is_cuda:    # a register cap: more programs per SM (the decode tiles take ~220)
        launch["maxnreg"] = int(cfg["MAXNREG"])
    # the down kernel's own warps / stages / register cap (num_warps2, num_stages2, MAXNREG2; 0: no cap)
    launch2 = {k: v for k, v in launch.items() if k != "maxnreg"}
    launch2.update(num_warps=int(cfg.get("num_warps2", cfg["num_warps"])),
                   num_stages=int(cfg.get("num_stages2", cfg["num_stages"])))
    if cfg.get("MAXNREG2", cfg.get("MAXNREG")) and z.is_cuda:
        launch2["maxnreg"] = int(cfg.get("MAXNREG2", cfg.get("MAXNREG")))
    glu = dict(ACT=0 if act == "situ" else 1, HAS_BETA2=act == "situ" and beta2 is not None)
    betas = (1.0 if beta1 is None else float(beta1), 1.0 if beta2 is None else float(beta2))
    c1, a1, b1, st1, wide1 = _kernel_weight(f1, q1, s1, cfg["DEQ"], z.dtype)
    c3, a3, b3, st3, wide3 = _kernel_weight(f3, q3, s3, cfg["DEQ"], z.dtype)
    if (c1, st1) != (c3, st3):      # one kernel reads both weights the same way: the byte decode
        deq = _BYTE_DECODE.get(cfg["DEQ"], cfg["DEQ"])
        c1, a1, b1, st1, wide1 = _kernel_weight(f1, q1, s1, deq, z.dtype)
        c3, a3, b3, st3, wide3 = _kernel_weight(f3, q3, s3, deq, z.dtype)
    sl, b1, st1 = scale_words(launch["SL"], c1, b1, st1)     # SL=2: the scale bytes as int32 words
    if sl == 2:
        b3 = scale_words(2, c3, b3, st3)[1]
    up = "gate_up" in kernels
    d1, d3 = (_tma_desc(a, c1, sl, cfg["BN"], cfg["BK"], z) if cfg.get("TMA") else None for a in (a1, a3))
    if d1 is not None and d3 is not None:   # the kernel's SL 5 / 6: SL 1 / 2 with the weights by TMA descriptors
        a1, a3, sl = d1, d3, sl + 4
    ggu = gg_gluon.usable(z, w1, w3, cfg, split)        # config GG: the Gluon grouped gate-up (_moe_grouped_gluon)
    hp = gd_gluon.h_order(h, w2, cfg, split2) if ggu else 0     # config GD (_moe_down_gluon): h in its operand order
    done = None     # config GDO: the Gluon down kernel starts on each expert as its gate-up programs finish
    if up and hp and "down" in kernels and int(cfg.get("GDO") or 0):
        # 2 per expert, 0 between launches: the kernels before and after on the stream finish their use of the set
        # before these start (the down kernel's early part overlaps only this gate-up)
        done = tile_counters(z.device, 2 * E)
    if up and ggu:
        gg_gluon.gate_up(z, seg, w1, w3, h, glu, betas, cfg, hp, done)
    else:
        _moe_gate_up_kernel[(n_tiles * triton.cdiv(inter, cfg["BN"]) * split * up,)](
            z, seg.pair_ids, seg.counts, seg.offsets, a1, a3, b1, b3, part, E, ell, inter, z.stride(0), *st1, *h_st,
            *betas, n_tiles, st1[3], TOPK=K, E_PAD=e_pad, W_FMT=c1, IEEE=ieee, DT=dt, WIDE=wide1 or wide3, BM=bm,
            BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], SPLIT=split, KU=int(cfg.get("KU", 1)), **glu,
            **{**launch, "SL": sl})
    if split > 1 and up:    # a separate pass: summed inside the down kernel's K loop, the partials were pipelined
        #             through shared memory (2·SPLIT fp32 tiles a stage: 1 program per SM on the H200)
        br, bi = min(16, triton.next_power_of_2(P)), min(1024, triton.next_power_of_2(inter))
        _glu_splits_kernel[(triton.cdiv(P, br), triton.cdiv(inter, bi))](
            part, h, P, inter, *h_st[1:], h_st[0], h.stride(0), *betas, SPLIT=split, BR=br, BI=bi, num_warps=4, **glu,
            **launch_kwargs())
    if hp and "down" in kernels:     # the Gluon grouped down
        gd_gluon.down(h, seg, w2, o, cfg, hp, done, gg_gluon.row_blocks(w1, cfg))
        return o, seg
    c2, a2, b2, st2, wide2 = _kernel_weight(f2, q2, s2, cfg["DEQ"], z.dtype)
    sl2, b2, st2 = scale_words(int(cfg.get("SL2", launch["SL"])), c2, b2, st2)    # SL2: the down kernel's own SL
    _moe_down_kernel[(n_tiles * triton.cdiv(ell, cfg["BN2"]) * split2 * ("down" in kernels),)](
        h, seg.pair_ids, seg.counts, seg.offsets, a2, b2, o, E, ell, inter, h.stride(0), *st2, o.stride(-2),
        o.stride(0) if split2 > 1 else 0, n_tiles, st2[3], E_PAD=e_pad, W_FMT=c2, IEEE=ieee, DT=dt, WIDE=wide2,
        BM=bm, BN=cfg["BN2"], BK=cfg["BK2"], GROUP_M=cfg["GROUP_M"], SPLIT=split2, KU=int(cfg.get("KU2", 1)),
        **{**launch2, "SL": sl2})
    return o, seg


def _tma_desc(q: torch.Tensor, code: int, sl: int, bn: int, bk: int, z: torch.Tensor):
    """TMA descriptor of packed MXFP4 weights read as int16 words q [E, N, K/4] (config TMA, the gate-up kernel,
    CUDA sm_90+): the 3-D view [E·N, K/32, 8] (rows, 32-column blocks, words), one block [BN, BK/32, 8] a K step
    (the shape _mxfp4_quarters loads); None where it does not apply (not CUDA, a byte decode, SL 0 / 3, expert
    rows not back to back, misaligned storage): the kernel then reads the weights through pointers."""
    if not (z.is_cuda or INTERPRET) or code not in (MX_BYTES16, MX_ASM16, MX_ASM16I) or sl not in (1, 2):
        return None
    E, N, kq = q.shape
    if q.stride(0) != N * q.stride(1) or q.stride(2) != 1 or kq % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        return None
    return TensorDescriptor(q, [E * N, kq // 8, 8], [q.stride(1), 8, 1], [bn, bk // 32, 8])


def moe_experts(z, weights, ids, w1, w2, w3, act: str, beta1=None, beta2=None, config: dict | None = None):
    """Drop-in for `ir.ref.moe.moe_experts`: y f32 [T, ℓ] by the config's PATH (heuristic's when absent;
    "gemv" falls back to "grouped" when packed bytes cannot be read as int32 words)."""
    if act not in ("situ", "silu"):
        raise ValueError(f"expert activation must be 'situ' or 'silu', found {act!r}")
    if z.dim() != 2 or ids.dim() != 2 or ids.shape[0] != z.shape[0]:
        raise ValueError(f"experts: z must be [T, l] and ids [T, k], found {tuple(z.shape)} and {tuple(ids.shape)}")
    key = _key(z.shape[0], w1.shape[0], ids.shape[1], z.shape[1], w1.shape[1], storage(w1) == "mxfp4", z.dtype, {})
    cfg = {**heuristic(key, None), **(config or {})}
    if cfg["PATH"] not in ("gemv", "grouped"):
        raise ValueError(f"experts: PATH must be 'gemv' or 'grouped', found {cfg['PATH']!r}")
    if cfg["PATH"] == "gemv" and gemv_supported(w1, w2, w3):
        return gemv_experts(z if z.stride(-1) == 1 else z.contiguous(), weights, ids, w1, w2, w3, act, beta1, beta2,
                            cfg)
    o, seg = expert_pair_outputs(z, ids, w1, w2, w3, act, beta1, beta2, config)
    return combine_pairs(o, weights, ids, seg.num_experts)


# --------------------------------------------------------------------------------------- template
# the heuristic's named configs (GEMV_T1, GEMV_T8, ...), `decode_split` and `constraints`: _moe_configs.py
def _key(T, E, K, ell, inter, mx: bool, dtype, attrs) -> dict:
    return {"T": int(T), "E": int(E), "K": int(K), "L": int(ell), "I": int(inter), "MX": int(mx),
            "BF16": int(dtype == torch.bfloat16), "BI": int(bool(attrs.get("batch_invariant", False)))}


def key_dims(a, attrs) -> dict:
    T, ell = a.z.shape
    E, inter = a.w1.shape[0], a.w1.shape[1]
    return _key(T, E, a.ids.shape[1], ell, inter, storage(a.w1) == "mxfp4",
                torch.bfloat16 if storage(a.z) == "bf16" else torch.float32, attrs)


def bucket(key: dict) -> dict:
    """T to a power of two; in batch-invariant mode T is dropped: one config serves every batch."""
    return {**key, "T": 0 if key.get("BI") else pow2_bucket(key["T"])}


def heuristic(key: dict, target=None) -> dict:
    """Path and tiles measured on the H200 (benches/bench_moe.py). Up to GEMV_MAX_PAIRS routed pairs (T=1
    top-2, T=8 top-2): the per-pair path (_moe_gemv.py GV=2: two launches, FFMA on the MXFP4 words) with the
    GEMV_T1 tiles (T=1: 24.3 us, session 8's tiles 28.1 in the same run; T=8: 151.8 us, session 8's 169.0; see
    _moe_configs.py); from 2 tokens on the gate-up is launched without its programmatic edge (LATE: H200 rank decode
    step, batch 8, 1078.4-1080.5 vs 1096.6-1100.5 us; batch 1 no gain, 555.9-564.2 vs 557.0-564.0,
    benches/results/h200-2026-11-30-s12/runtime_moe_sched.json). On CUDA sm_90+ with MXFP4 weights and bf16
    activations the inner products run on the tensor cores (Gluon, _moe_gemv_gluon.py; session 14, H200, the op
    alone): T=1 the gate-up (GLUON_T1, its tiles and the GV=2 down kernel's chosen inside the rank decode graph in
    session 18, see _moe_gemv_gluon.GLUON_T1), T >= 2 both kernels (GLUON_T8, measured at T=8:
    105.8-107.9 vs 149.8 us; T=2..7 not measured); in the rank decode graph (runtime_gluon.json) batch 1
    552.4-555.7 vs 552.8-554.6 us (the experts are not what bounds it), batch 8 1065.2-1066.9 vs 1068.0-1070.7.
    Dense expert weights run the GV=1 kernels with the
    same tiles. Grouped decode (<= 16 tokens per
    expert): a 16-token tile x 64 weight rows on 2 warps (mma.sync, see the module doc), K steps of 128,
    asm16, scales first (SL); when the routed tiles fill the GPU (T=64, top-16) a register cap (DECODE_MAXNREG),
    and with asm16 DECODE_T64 (_moe_configs.py: the asm16i decode, K steps of 64, the two kernels' stages and
    caps apart, the gate-up's weights by TMA with its scales read in the step, the down kernel's a step ahead):
    session 14 0.951 ms, 42.5% of read bandwidth (without TMA 0.996-1.003 in the same run; session 8's config
    1.055); session 12: BK 256 (whole weight lines a step) on 2-8 warps 1.16-1.82 ms, slower; session 15: the Gluon
    gate-up (GG, _moe_configs.GLUON_T64; `_moe_grouped_gluon.usable` decides at launch, the TMA kernel otherwise)
    is taken: at the L2 fetch granularity the runtime sets (128 bytes, k31c/runtime/l2_fetch.py) the op 0.891 vs
    0.942 ms; in the rank decode graph at batch 64 2231.9 / 2215.3 vs 2270.7 / 2283.0 us in one run, 2221.0 / 2220.0
    vs 2205.2 / 2214.3 in the next (within that graph's noise; graph replay == eager bitwise over 20 replays). At the
    driver's default 64 bytes the op alone is 0.954-0.962 vs 0.944-0.947: benches that call the kernel outside the
    runtime see that. Session 16: GLUON_T64 adds the gate-up's words two steps ahead (GGU) and the Gluon down kernel
    (GD; `_moe_down_gluon.h_order` decides at launch, with GG only): the op 0.860 vs 0.988 / 0.995 ms in one call
    (0.864 vs 0.912 at 128-byte L2 fetches; graph replay == eager bitwise, skewed routing and wide scales checked).
    Split-K when the routed tiles leave the GPU idle (`decode_split`; grouped T=1 top-2: split 4, 69.6 ->
    44.7 us); T=64 top-16 fills the GPU, no split. Prefill: 128 tokens x 64 rows on wgmma, asm.
    Batch-invariant: one fixed grouped tiling, no split.
    MXFP4 with bf16 activations: the PTX decodes on sm_90, tl.dot_scaled from sm_100 on (tcgen05 takes
    no register operand); pure Triton elsewhere."""
    decode = False
    if key.get("BI"):
        cfg = dict(BATCH_INVARIANT_CONFIG)
    else:
        per_expert = key["T"] * key["K"] / max(1, key["E"])
        decode = per_expert <= 16
        if decode:
            cfg = {"BM": 16, "BN": 64, "BK": 128, "BN2": 64, "BK2": 128, "num_warps": 2, "num_stages": 3}
        elif per_expert <= 96:
            cfg = {"BM": 64, "BN": 128, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 4, "num_stages": 3}
        else:                   # prefill: tensor-core bound
            cfg = {"BM": 128, "BN": 64, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 4, "num_stages": 3}
        cfg["GROUP_M"] = 8
    cc = target_cc(target)
    if key["MX"] and key["BF16"] and cc is not None and cc >= 90:
        cfg["DEQ"] = ("asm16" if decode else "asm") if cc < 100 else "dot_scaled"
    else:
        cfg["DEQ"] = "bytes"
    cfg["SL"], cfg["PF"] = int(decode), 0      # SL=3 (scales one K step ahead): below, where measured
    cfg["BK"] = _fit_bk(cfg["BK"], key["L"], key["MX"])
    cfg["BK2"] = _fit_bk(cfg["BK2"], key["I"], key["MX"])
    cfg["SPLIT"] = 1
    cfg.update(GEMV_TILES, GASM=int(cc is not None))     # on both paths, so a tuner flipping PATH has them
    cfg["PATH"] = "gemv" if not key.get("BI") and key["T"] * key["K"] <= GEMV_MAX_PAIRS else "grouped"
    if cfg["PATH"] == "gemv":
        cfg.update(GEMV_T1)
        if cc is None:              # the interpreter pays per program: fewer, taller row blocks
            cfg.update(GN=32, GN2=32)
        elif key["T"] > 1:          # the gate-up not resident while it waits for z (LATE, _moe_gemv_words.py)
            cfg["LATE"] = 1
        if cc is not None and cc >= 90 and key["MX"] and key["BF16"]:   # tensor-core GEMVs (_moe_gemv_gluon.py)
            cfg.update({**GLUON_T1, **GLUON_T1_DOWN} if key["T"] == 1 else GLUON_T8)
        return cfg
    tiles = max_tiles(key["T"] * key["K"], key["E"], cfg["BM"])
    full = tiles * -(-key["I"] // cfg["BN"]) >= 2 * GPU_SLOTS
    if decode and cc is not None and cc < 100 and full:
        cfg["MAXNREG"] = DECODE_MAXNREG
        if cfg["DEQ"] == "asm16":  # T=64 top-16: session 14 0.951 ms (TMA gate-up) vs 0.996-1.003 (_moe_configs.py)
            cfg.update(DECODE_T64, BK=_fit_bk(64, key["L"], True), BK2=_fit_bk(64, key["I"], True))
            cfg.update(GLUON_T64)  # the gate-up in Gluon where it can run, under the runtime's 128-byte L2 fetches
    if decode and cc is not None:  # a GPU: idle SMs take K slices (the interpreter gains nothing from it)
        cfg["SPLIT"] = min(decode_split(tiles * -(-key["I"] // cfg["BN"]), -(-key["L"] // cfg["BK"])),
                           decode_split(tiles * -(-key["L"] // cfg["BN2"]), -(-key["I"] // cfg["BK2"])))
    return cfg


def supports(a, attrs, target=None):
    """Operands may be tensors / PackedMXFP4 (run time) or TensorTypes (compile time)."""
    if attrs.get("act") not in ("situ", "silu"):
        return f"activation {attrs.get('act')!r} is not situ|silu"
    if storage(a.z) not in ("bf16", "f32", "f16"):
        return f"z is {storage(a.z)}, not bf16/f16/f32"
    kinds = {n: storage(getattr(a, n)) for n in ("w1", "w2", "w3")}
    bad = {n: k for n, k in kinds.items() if k not in ("mxfp4", "bf16", "f32", "f16")}
    if bad:
        return f"expert weights {bad} are neither float nor mxfp4"
    if (kinds["w1"] == "mxfp4") != (kinds["w3"] == "mxfp4"):
        return "w1 and w3 must share a storage format (they are read in one pass)"
    return None


def launch(a, attrs, config=None):
    cfg = dict(config or {})
    if attrs.get("batch_invariant"):
        cfg.setdefault("batch_invariant", True)
    cfg = {**heuristic(key_dims(a, {**attrs, **cfg}), None), **{k: v for k, v in cfg.items() if k != "batch_invariant"}}
    return moe_experts(a.z, a.weights, a.ids, a.w1, a.w2, a.w3, attrs["act"], attrs.get("beta1"), attrs.get("beta2"), cfg)


TEMPLATES = [KernelTemplate(
    family="moe_grouped_gemm", backend="triton", ops=("moe_experts",), launch=launch, key_dims=key_dims,
    heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
    tunables=(Tunable("BM", (16, 32, 64, 128)), Tunable("BN", (32, 64, 128)), Tunable("BK", (32, 64, 128)),
              Tunable("BN2", (64, 128, 256)), Tunable("BK2", (64, 128, 256)), Tunable("num_warps", (2, 4, 8)),
              Tunable("num_stages", (2, 3, 4)), Tunable("PATH", ("gemv", "grouped")), Tunable("SL", (0, 1)),
              Tunable("DEQ", ("asm16", "asm", "bytes", "bytes16", "dot_scaled")), Tunable("SPLIT", (1, 2, 4, 8))),
    # 233,280 configs (the tuner enumerates up to 250,000; PATH took GROUP_M's place, now fixed at 8).
    # Explicit-config options: SPLIT2, MAXNREG, PF, the down kernel's num_warps2 / num_stages2 / MAXNREG2 / SL2
    # (grouped; default: the gate-up's), KU / KU2 (K steps an iteration, unsplit K only), TMA (the gate-up's packed
    # weights by TMA descriptors, sm_90+, SL 1 / 2; see the module doc) and the per-pair path's GV, GN, GK, GN2,
    # GK2, GW2,
    # PREF, XV, HX, EARLY, GREG (GV=2), GMMA, GASM, GPROG (GV=1) (heuristic values measured on the H200, session 9)
    doc="routed experts: per-pair GEMVs (decode) or grouped GEMMs with permutation, fused SiTU-GLU/SwiGLU, "
        "fp32 slot-order combine; MXFP4 dequantised in registers (or tl.dot_scaled)")]
