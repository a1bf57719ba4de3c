"""Gluon grouped gate-up of the routed experts with the weights through a TMA ring (config GGT = S stages, with GG;
issue 5's T=64 decode). Same operands, outputs and numerics as `_moe_grouped_gluon._grouped_gate_up_kernel` (its
GGU form: z read as int32 words, `_z_operand`; words decoded by `_a_mul`, mma.sync m16n8k16 bf16, fp32
accumulation, the same K permutation, so h is bitwise the same for the same tiling); only where the weight words
wait differs.

Why: session 16 found the Gluon MoE kernels' times following the weight bytes in flight an SM (~32 KB with the words
one step ahead in registers at 16 warps, ~48 KB two steps ahead at 12 warps), not their instruction count; registers
cap that. Here the words of the next S - 1 K steps are in flight in shared memory instead: a program's ring of S
slots, each one step's words of w1 and w3 ([M, 4, NWT] int32 boxes, one TMA copy each, one mbarrier a slot), the
slot of step k refilled with step k + S - 1 right after step k's words are read into registers (a proxy fence
first). A program is ONE warp (16·MT rows): nothing waits for another warp, so no CTA barrier in the loop (the
cp.async ring of session 15 had two bar.sync a step and was slower); S x 2 KB x MT of shared memory a program.
The scale bytes (4 a row a step: below TMA's 16-byte box) and z's words stay register loads one step ahead.
Steps run on over N tiles (an expert with more than BN tokens reads its weights again, from L2): the ring's
step counter k counts (tile, step) pairs, so the refill after a tile's last steps fetches the next tile's first.

CUDA sm_90+ only (TMA, mbarriers; never the interpreter): `usable` decides, the launcher falls back to the
register form.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from codegen.triton import _moe_grouped_gluon as gg
from codegen.triton._moe_grouped_gluon import _a_mul, _hp_column, _row_offsets, _z_operand, _z_words
from codegen.triton._moe_host import _wide_scales
from codegen.triton._moe_tiles import _glu
from codegen.triton._pdl import launch_kwargs, pdl_enter

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier      # Triton 3.7 / 3.6 name of the CTA barrier


@gluon.jit
def _fetch(d1, d3, r1, r3, bars, k, total, row, STEPS, S: gl.constexpr, NWT: gl.constexpr, M: gl.constexpr):
    """Step k's words of w1 and w3 (k counts (N tile, step) pairs; nothing at or past `total`) into slot k % S."""
    b = k % S
    ok = k < total
    mbarrier.expect(bars.index(b), 2 * M * 16 * NWT, pred=ok)
    col = ((k % STEPS) * 4).to(gl.int32)
    tma.async_copy_global_to_shared(d1, [row, col, 0], bars.index(b), r1.index(b), pred=ok)
    tma.async_copy_global_to_shared(d3, [row, col, 0], bars.index(b), r3.index(b), pred=ok)


@gluon.jit
def _ring_gate_up_kernel(z_ptr, pair_ptr, counts_ptr, offsets_ptr, d1, d3, s1_ptr, s3_ptr, h_ptr, stride_z,
                         stride_se, stride_sn, stride_h, beta1, beta2, NRB, STEPS, INTER, TOPK: gl.constexpr,
                         ACT: gl.constexpr, HAS_BETA2: gl.constexpr, MT: gl.constexpr, NWT: gl.constexpr,
                         BN: gl.constexpr, S: gl.constexpr, WIDE: gl.constexpr, PDL: gl.constexpr,
                         MMA: gl.constexpr, A4: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, ZL: gl.constexpr,
                         RL: gl.constexpr, HP: gl.constexpr = 0):
    """h[pos, rows] = act(W1_e z_t, W3_e z_t) for expert e = pid // NRB's tokens and weight rows (pid % NRB)·M ..
    + M (module doc; `_grouped_gate_up_kernel`'s contract)."""
    M: gl.constexpr = 16 * MT
    e = gl.program_id(0) // NRB
    r0 = (gl.program_id(0) % NRB) * M
    row = (e * INTER + r0).to(gl.int32)
    r1 = gl.allocate_shared_memory(gl.int32, [S, M, 4, NWT], RL)
    r3 = gl.allocate_shared_memory(gl.int32, [S, M, 4, NWT], RL)
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    pdl_enter(PDL)          # counts, offsets, pair ids and z come from earlier launches
    cnt = gl.load(counts_ptr + e)
    pos0 = gl.load(offsets_ptr + e)
    total = gl.cdiv(cnt, BN) * STEPS
    for i in gl.static_range(S - 1):
        _fetch(d1, d3, r1, r3, bars, i, total, row, STEPS, S, NWT, M)
    soff = _row_offsets(r0, 0, stride_sn, A4, M, NWT)[1]
    s1r = s1_ptr + e.to(gl.int64) * stride_se + soff
    s3r = s3_ptr + e.to(gl.int64) * stride_se + soff
    LW: gl.constexpr = gl.SliceLayout(3, A4)
    rm = r0 + gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    k = 0
    for n0 in range(0, cnt, BN):
        xr = _z_words(z_ptr, pair_ptr, pos0 + n0, cnt - n0, stride_z, TOPK, ZL, NWT, BN)
        xn = gl.load(xr)
        s1n = gl.load(s1r)
        s3n = gl.load(s3r)
        acc1 = gl.zeros([M, BN], gl.float32, MMA)
        acc3 = gl.zeros([M, BN], gl.float32, MMA)
        for st in range(STEPS):
            x, s1, s3 = xn, s1n, s3n
            nx = gl.minimum(st + 1, STEPS - 1)        # the last step reloads its own (cache hits)
            xn = gl.load(xr + nx * 16 * NWT)
            s1n = gl.load(s1r + nx * NWT)
            s3n = gl.load(s3r + nx * NWT)
            slot = k % S
            mbarrier.wait(bars.index(slot), (k // S) & 1)
            w1 = r1.index(slot).permute((0, 2, 1)).load(LW)
            w3 = r3.index(slot).permute((0, 2, 1)).load(LW)
            fence_async_shared()                      # the slot's reads (generic proxy) before the TMA refill
            _fetch(d1, d3, r1, r3, bars, k + S - 1, total, row, STEPS, S, NWT, M)
            zb = _z_operand(x, ZL, DB, NWT, BN)
            acc1 = mma_v2(_a_mul(w1, s1, A4, DA, M, NWT, WIDE), zb, acc1)
            acc3 = mma_v2(_a_mul(w3, s3, A4, DA, M, NWT, WIDE), zb, acc3)
            k += 1
        h = _glu(acc1, acc3, beta1, beta2, ACT, HAS_BETA2).to(gl.bfloat16)
        col = n0 + rn
        rs = _hp_column(rm, HP) if HP else rm
        out = h_ptr + gl.expand_dims((pos0 + col).to(gl.int64) * stride_h, 0) + gl.expand_dims(rs, 1)
        gl.store(out, h, mask=gl.expand_dims(col < cnt, 0) & gl.expand_dims(rm >= 0, 1))
    for i in gl.static_range(S):
        mbarrier.invalidate(bars.index(i))


def stages(cfg: dict) -> int:
    """Config GGT: ring slots (0: the register form)."""
    return int(cfg.get("GGT") or 0)


def usable(z: torch.Tensor, w1, w3, cfg: dict, split: int) -> bool:
    """GGT >= 2 on top of the register form's conditions (`_moe_grouped_gluon.usable`), one warp a program (GGW 1),
    NWT 4 (a 16-byte TMA box row), z's rows of 4-byte aligned pairs, words 16-byte aligned rows (TMA)."""
    if stages(cfg) < 2 or not gg.usable(z, w1, w3, cfg, split):
        return False
    w, mt, nwt, bn = gg.tiles(cfg)
    q1, q3 = gg._words(w1)[0], gg._words(w3)[0]
    aligned = all(q.stride(1) % 4 == 0 and q.stride(0) == q.shape[1] * q.stride(1) and q.data_ptr() % 16 == 0
                  for q in (q1, q3))
    return w == 1 and nwt == 4 and z.stride(0) % 2 == 0 and z.data_ptr() % 4 == 0 and aligned


def gate_up(z, seg, w1, w3, h, glu: dict, betas: tuple, cfg: dict, hp: int = 0) -> None:
    """h [T·k, I] as `_moe_grouped_gluon.gate_up` (`usable` checked first)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    (q1, s1), (q3, s3) = gg._words(w1), gg._words(w3)
    E, inter, ell = int(q1.shape[0]), int(q1.shape[1]), z.shape[1]
    _, mt, nwt, bn = gg.tiles(cfg)
    m, s = 16 * mt, stages(cfg)
    rl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    desc = [TensorDescriptor.from_tensor(q.view(E * inter, q.shape[2] // nwt, nwt), [m, 4, nwt], rl) for q in (q1, q3)]
    zz = z.view(torch.int32)
    lay = gg.layouts(1, mt, nwt, bn)
    _ring_gate_up_kernel[(E * (inter // m),)](
        zz, seg.pair_ids, seg.counts, seg.offsets, *desc, s1, s3, h, zz.stride(0), s1.stride(0), s1.stride(1),
        h.stride(0), *betas, inter // m, ell // (32 * nwt), inter, TOPK=seg.topk, MT=mt, NWT=nwt, BN=bn, S=s,
        WIDE=_wide_scales(s1) or _wide_scales(s3), num_warps=1,
        **({"maxnreg": int(cfg["GGR"])} if cfg.get("GGR") else {}), **glu, MMA=lay["MMA"], A4=lay["A4"],
        DA=lay["DA"], DB=lay["DB"], ZL=gg.zword_layout(nwt, bn, 1), RL=rl, **launch_kwargs(),
        **({"HP": int(hp)} if hp else {}))
