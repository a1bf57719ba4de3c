"""Gluon grouped down projection of the routed experts for the decode batch (T=64 top-16 of 112 experts; issue 5):
config GD=1 in moe_grouped_gemm.expert_pair_outputs (MXFP4 weights, bf16 h, CUDA sm_90+ only, unsplit K, and the
Gluon gate-up (config GG) writing h: it stores h's columns in this kernel's operand order). o[p] = W2_e h[pos] for
the rows pos of `permute_tokens`' permutation (ExpertSegments: expert e owns rows offsets[e] .. + counts[e] of h, pair
ids in pair_ids), stored in z's dtype at row p = pair_ids[pos] of o [T·k, l], exactly where the Triton down kernel
stores it; the routing weights are applied by the combine that follows (moe_tail.combine), as on the Triton path.

Program (expert e, block of M = 16·MT·W rows of W2_e, i.e. output features), K = I in steps of 32·NWT columns,
two steps an iteration. The A side is GG's, imported: `_moe_grouped_gluon.layouts` / `_row_offsets` / `_a_mul` (the
words decoded into mma.sync's A registers under the per-pair path's K permutation by masks and integer multiplies);
the expert's rows of h are N (BN 16 a tile, tiles looped: an expert holding most of the batch is still correct, its
weights then read again per N tile, from L2). No shared memory.
  - Words two steps ahead: each step's words and scale bytes are loaded right after the step before last used its
    registers (two register sets in turn, no copies; the last two steps load the next N tile's first two). With the
    words one step ahead the kernel held half as many bytes in flight and was slower (below).
  - h in the operand's order (`_moe_grouped_gluon._hp_column`, config GD makes the gate-up store it so): lane t's
    16-byte loads of h, read as int32 words, are the bf16 pairs of its B registers in the order each mma.sync takes
    them (k and k + 32 adjacent), so h goes from the loads into the MMAs with no PRMT or register move. In column
    order the re-pack cost ~60 PRMT / moves a step (sm_90 SASS). h's columns one step ahead, two sets in turn.
No masks on the weights (`fits`); h rows past the expert's count read its first row and are not stored.
  - Config GDO (session 23, GLUON_T64's): the gate-up's 5376 programs fill 528 slots 10.2 times, so its last wave
    leaves most SMs idle while this kernel waits for all of it. Under GDO each gate-up program of an expert with
    tokens counts itself in at done[e] after its h stores (release); this kernel's programs launch as soon as every
    gate-up program has started (PDL), read done[e] until the expert's gate-up is complete (acquire, `_await_expert`),
    compute, and take the PDL wait only before their first store (WAR safety and the wait chain, `_pdl.py`); the last
    of an expert's programs resets its two counters. H200 (benches/results/h200-2026-12-02-s23/moe_t64_gdo.json):
    whole op 0.843 ms vs 0.860 / 0.863 in the same call, rel err as before (0.00234), graph == eager, skewed routing
    and wide scales pass.

H200, session 16 (benches/results/h200-2026-11-30-s16/moe_t64_down_gluon_call1.json, _call2.json; T=64 top-16,
l=3584, I=3072, graph replay; the Triton down kernel (DECODE_T64) alone 0.328 / 0.332 ms in the same calls), down
alone ms [whole op]; every variant's whole op within bf16 rounding of the reference (0.00234), graph replay bitwise
equal to eager, skewed routing 0.00235 vs float64, wide scales 0.00175:
  - words one step ahead, one step an iteration: column-order h MT1 (96 registers) 0.398 [1.055]; h in operand
    order MT1 W4 / W8 (two steps an iteration, 100 regs) 0.424 / 0.428, at an 80 cap 0.414, MT2 (128) 0.332-0.339
    [1.006-1.013], W2 x MT2 0.332; step 0's words before the PDL wait: no change.
  - two steps ahead (this kernel): MT2 W4 (167 regs, 12 warps an SM) 0.290 [0.965; with the two-steps-ahead gate-up
    0.860, the op's best]; MT1 (127) 0.393; four steps ahead MT1 W4 / W2 / W8 (128) 0.399-0.406, NWT 2 x MT2 (128)
    0.310. Its K loop issues 2.8 instructions a weight element (sm_90 SASS, MT2: 353 a warp's step of 32 x 128) vs
    the Triton kernel's 4.5 (286 for 64 x 64 on 2 warps), yet the times follow the weight bytes in flight an SM
    (~32 KB one step ahead at 16 warps, ~48 KB two steps ahead at 12), not the instruction count: latency binds.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from codegen.triton._moe_grouped_gluon import _a_mul, _barrier, _row_offsets, _words, layouts
from codegen.triton._moe_host import _wide_scales
from codegen.triton._pdl import launch_kwargs, pdl_enter


def word_layout(nwt: int, bn: int, w: int) -> gl.DistributedLinearLayout:
    """[4 (t), NWT/2 (j1), 8 (word m = j0 + 2w), 2 (bf16 p of the word), BN (n)] for h's int32 words: the pair, the
    8 words (two 16-byte loads) and j1, n + 8 in registers; t and n % 8 in lanes; every warp the same. Permuted and
    reshaped to [32·NWT, BN] (k = 32j + 8t + 2w + p, j = 2·j1 + j0) it is the B operand's layout with each
    mma.sync's two B registers (k and k + 32: j0 = 0, 1) adjacent words of one load."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]]
        + ([[0, 1, 0, 0, 0]] if nwt == 4 else []) + ([[0, 0, 0, 0, 8]] if bn == 16 else []),
        lane_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0, 0]] * (w.bit_length() - 1), block_bases=[], shape=[4, nwt // 2, 8, 2, bn])


@gluon.jit
def _h_rows(h_ptr, pos0, n_live, stride_h, HL: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr):
    """Pointers [4, NWT/2, 8, BN] to step 0's int32 words of h rows pos0 + n (n >= n_live: row pos0, never stored;
    stride_h in words): lane t's 4·NWT words 4·NWT·t + 8·j1 + m, as the gate-up stored them (module doc)."""
    L4: gl.constexpr = gl.SliceLayout(3, HL)
    t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    j1 = gl.arange(0, NWT // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    row = (pos0 + gl.where(n < n_live, n, 0)).to(gl.int64) * stride_h
    col = gl.expand_dims(gl.expand_dims(4 * NWT * t, 1) + gl.expand_dims(8 * j1, 0), 2) \
        + gl.expand_dims(gl.expand_dims(m, 0), 1)
    return h_ptr + (gl.expand_dims(col, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(row, 0), 1), 2))


@gluon.jit
def _h_operand(x, HL: gl.constexpr, DB: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr):
    """int32 words [4, NWT/2, 8, BN] -> the B operand [32·NWT, BN] (bf16 pairs as loaded, one register each)."""
    shape = gl.zeros([4, NWT // 2, 8, 2, BN], gl.int32, HL)
    x5, shape = gl.broadcast(gl.expand_dims(x, 3), shape)
    v = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [x5], dtype=gl.bfloat16, is_pure=True, pack=2)
    v = gl.permute(gl.reshape(v, [4, NWT // 2, 4, 2, 2, BN]), [1, 3, 0, 2, 4, 5])     # (j1, j0, t, w, p, n)
    return gl.convert_layout(gl.reshape(v, [32 * NWT, BN]), DB)


@gluon.jit
def _w_at(wr, sr, i, STEPS, NWT: gl.constexpr):
    """Step i's words and scale bytes (i >= STEPS: step i - STEPS, the next N tile's)."""
    i = gl.where(i < STEPS, i, i - STEPS)
    return gl.load(wr + i * 4 * NWT), gl.load(sr + i * NWT)


@gluon.jit
def _step(acc, w, s, x, WIDE: gl.constexpr, M: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr,
          A4: gl.constexpr, HL: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr):
    """acc += (a K step's words w, scale bytes s, decoded) @ (its h words x)."""
    return mma_v2(_a_mul(w, s, A4, DA, M, NWT, WIDE), _h_operand(x, HL, DB, NWT, BN), acc)


@gluon.jit
def _await_expert(done_ptr, e, cnt, NRB, NRB_UP):
    """DONE (config GDO): wait, without the PDL wait, until the gate-up's NRB_UP programs of expert e have counted
    themselves in at done_ptr[e] (each after its h stores; acquire), then count this program in at done_ptr[E + e];
    the last of the expert's NRB programs resets both counters for the next launch. Experts without tokens: neither
    kernel counts."""
    if cnt > 0:
        n_e = gl.num_programs(0) // NRB
        c = gl.atomic_add(done_ptr + e, 0, sem="acquire", scope="gpu")
        while c < NRB_UP:
            c = gl.atomic_add(done_ptr + e, 0, sem="acquire", scope="gpu")
        _barrier()
        if gl.atomic_add(done_ptr + n_e + e, 1, sem="acq_rel", scope="gpu") == NRB - 1:
            gl.atomic_xchg(done_ptr + e, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(done_ptr + n_e + e, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _grouped_down_kernel(h_ptr, pair_ptr, counts_ptr, offsets_ptr, w2_ptr, s2_ptr, o_ptr, done_ptr, stride_h,
                         stride_we, stride_wn, stride_se, stride_sn, stride_o, NRB, STEPS, NRB_UP, W: gl.constexpr,
                         MT: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr, WIDE: gl.constexpr, PDL: gl.constexpr,
                         DONE: gl.constexpr,
                         MMA: gl.constexpr, A4: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, HL: gl.constexpr):
    """o[pair_ids[pos], rows] = W2_e h[pos] for expert e = pid // NRB's rows pos (offsets[e] + n) and its weight
    rows (pid % NRB)·M .. +M; two K steps an iteration, words two steps ahead, h one (module doc). DONE: the gate-up
    may still run (`_await_expert`); the PDL wait comes before the first store instead of first."""
    M: gl.constexpr = 16 * MT * W
    XS: gl.constexpr = 16 * NWT      # h's int32 words a step
    e = gl.program_id(0) // NRB
    r0 = (gl.program_id(0) % NRB) * M
    woff, soff = _row_offsets(r0, stride_wn, stride_sn, A4, M, NWT)
    wr = w2_ptr + e.to(gl.int64) * stride_we + woff
    sr = s2_ptr + e.to(gl.int64) * stride_se + soff
    if not DONE:
        pdl_enter(PDL)      # counts, offsets, pair ids and h come from earlier launches
    wa, sa = _w_at(wr, sr, 0, STEPS, NWT)
    wb, sb = _w_at(wr, sr, 1, STEPS, NWT)
    cnt = gl.load(counts_ptr + e)       # DONE: written two launches back (the permutation), so before the wait
    pos0 = gl.load(offsets_ptr + e)
    if DONE:
        _await_expert(done_ptr, e, cnt, NRB, NRB_UP)
    rm = r0 + gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    for n0 in range(0, cnt, BN):
        xr = _h_rows(h_ptr, pos0 + n0, cnt - n0, stride_h, HL, NWT, BN)
        xa = gl.load(xr)
        acc = gl.zeros([M, BN], gl.float32, MMA)
        for st in range(0, STEPS, 2):       # the last step's h load ahead reads step 0 (unused)
            xb = gl.load(xr + (st + 1) * XS)
            acc = _step(acc, wa, sa, xa, WIDE, M, NWT, BN, A4, HL, DA, DB)
            wa, sa = _w_at(wr, sr, st + 2, STEPS, NWT)
            xa = gl.load(xr + gl.where(st + 2 < STEPS, st + 2, 0) * XS)
            acc = _step(acc, wb, sb, xb, WIDE, M, NWT, BN, A4, HL, DA, DB)
            wb, sb = _w_at(wr, sr, st + 3, STEPS, NWT)
        col = n0 + rn
        live = col < cnt
        pair = gl.load(pair_ptr + pos0 + gl.where(live, col, 0))
        out = o_ptr + gl.expand_dims(pair.to(gl.int64) * stride_o, 0) + gl.expand_dims(rm, 1)
        if DONE:
            if n0 == 0:
                pdl_enter(PDL)      # before the first store: the gate-up (and what it overlapped) complete
        gl.store(out, acc.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(live, 0) & gl.expand_dims(rm >= 0, 1))
    if DONE:
        if cnt == 0:
            pdl_enter(PDL)          # every program waits once


def tiles(cfg: dict) -> tuple[int, int, int, int]:
    """(W warps, MT 16-row tiles a warp, NWT words a lane a step, BN rows of h a tile): config GDW, GDM, GDN, GDB
    (defaults: _moe_configs.GLUON_T64's down tiling); GDR a register cap."""
    return int(cfg.get("GDW", 4)), int(cfg.get("GDM", 2)), int(cfg.get("GDN", 4)), int(cfg.get("GDB", 16))


def fits(ell: int, inter: int, t: tuple) -> bool:
    """The row blocks tile l (W2's rows) and pairs of steps tile I, and the tiling is one the layouts allow."""
    w, mt, nwt, bn = t
    return (w in (1, 2, 4, 8) and mt in (1, 2, 4) and nwt in (2, 4) and bn in (8, 16)
            and ell % (16 * mt * w) == 0 and inter % (64 * nwt) == 0)


def h_order(h: torch.Tensor, w2, cfg: dict, split2: int) -> int:
    """Config GD, for a launch whose gate-up is the Gluon one: the NWT in whose operand order the gate-up stores h
    (`_moe_grouped_gluon._hp_column`) and this kernel reads it; 0 (the Triton down kernel, h in column order) unless
    CUDA sm_90+ (never the interpreter), bf16 h with unit column stride, MXFP4 w2 readable as int32 words, an unsplit
    down K and a tiling that covers l and I without masks."""
    if not (int(cfg.get("GD") or 0) and split2 == 1 and h.is_cuda and h.dtype == torch.bfloat16
            and h.stride(-1) == 1 and h.stride(0) % 2 == 0 and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(h.device)[0] >= 9):
        return 0
    t = tiles(cfg)
    return t[2] if _words(w2) is not None and fits(int(w2.shape[1]), h.shape[1], t) else 0


def down(h, seg, w2, o, cfg: dict, hp: int, done=None, nrb_up: int = 0) -> None:
    """o [T·k, l] (z's dtype, rows by pair) = W2_e h (h bf16 [T·k, I], expert-sorted rows, columns in the order the
    Gluon gate-up stored them for NWT = hp = `h_order`'s) by the Gluon kernel; rows of pairs outside [0, E) are left
    unwritten, as by the Triton kernel. done (config GDO, with the gate-up launched just before with the same
    counters and nrb_up programs an expert): the kernel starts on an expert's rows once that expert's gate-up programs
    have stored them, while the gate-up's last programs still run."""
    q2, s2 = _words(w2)
    E, ell, inter = int(q2.shape[0]), int(q2.shape[1]), h.shape[1]
    w, mt, nwt, bn = tiles(cfg)
    assert hp == nwt, (hp, nwt)
    nrb = ell // (16 * mt * w)
    hx = h.view(torch.int32)        # h's bf16 pairs as int32 words
    _grouped_down_kernel[(E * nrb,)](
        hx, seg.pair_ids, seg.counts, seg.offsets, q2, s2, o, done if done is not None else seg.counts, hx.stride(0),
        q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1), o.stride(0), nrb, inter // (32 * nwt), nrb_up, W=w,
        MT=mt, NWT=nwt, BN=bn, WIDE=_wide_scales(s2), DONE=int(done is not None),
        num_warps=w, **({"maxnreg": int(cfg["GDR"])} if cfg.get("GDR") else {}),
        **{k: v for k, v in layouts(w, mt, nwt, bn).items() if k != "XL"}, HL=word_layout(nwt, bn, w),
        **launch_kwargs())
